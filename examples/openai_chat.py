"""Chat completions with the official `openai` client against a running `flexserve serve`.

    make serve                      # in another terminal (or: flexserve serve)
    python examples/openai_chat.py

FLEXSERVE_BASE_URL (default http://localhost:8000/v1) and FLEXSERVE_API_KEY select the server.
"""

from __future__ import annotations

import os

import openai

client = openai.OpenAI(
    base_url=os.environ.get("FLEXSERVE_BASE_URL", "http://localhost:8000/v1"),
    api_key=os.environ.get("FLEXSERVE_API_KEY", "EMPTY"),
)
model = client.models.list().data[0].id

messages = [
    {"role": "system", "content": "You are a concise assistant."},
    {"role": "user", "content": "Name three primary colors."},
]
response = client.chat.completions.create(
    model=model, messages=messages, max_completion_tokens=48, temperature=0.7, seed=7
)
reply = response.choices[0].message.content
print(f"assistant: {reply}")
print("usage:", response.usage.model_dump(exclude_none=True))

# A second turn, with the most likely alternatives for the first few tokens.
messages += [{"role": "assistant", "content": reply},
             {"role": "user", "content": "Which one is your favourite?"}]
response = client.chat.completions.create(
    model=model, messages=messages, max_completion_tokens=32, temperature=0,
    logprobs=True, top_logprobs=3,
)
print(f"assistant: {response.choices[0].message.content}")
for entry in response.choices[0].logprobs.content[:5]:
    alternatives = ", ".join(f"{t.token!r} {t.logprob:.2f}" for t in entry.top_logprobs)
    print(f"  {entry.token!r:>12} {entry.logprob:7.3f}   [{alternatives}]")
