"""Completions with the official `openai` client against a running `flexserve serve`.

    make serve                      # in another terminal (or: flexserve serve)
    python examples/openai_completion.py

FLEXSERVE_BASE_URL (default http://localhost:8000/v1) and FLEXSERVE_API_KEY select the server.
"""

from __future__ import annotations

import os

import openai

client = openai.OpenAI(
    base_url=os.environ.get("FLEXSERVE_BASE_URL", "http://localhost:8000/v1"),
    api_key=os.environ.get("FLEXSERVE_API_KEY", "EMPTY"),  # any string when no key is set
)
model = client.models.list().data[0].id

# Greedy, with the two best alternatives per token.
response = client.completions.create(
    model=model, prompt="The capital of France is", max_tokens=16, temperature=0, logprobs=2
)
choice = response.choices[0]
print(f"{model}: {choice.text!r} ({choice.finish_reason})")
for token, logprob, top in zip(choice.logprobs.tokens, choice.logprobs.token_logprobs,
                               choice.logprobs.top_logprobs):
    print(f"  {token!r:>14} {logprob:7.3f}   alternatives {top}")
print("usage:", response.usage.model_dump(exclude_none=True))

# Several prompts, two sampled completions each: choices are indexed prompt_index * n + i.
response = client.completions.create(
    model=model,
    prompt=["Once upon a time", "def fibonacci(n):"],
    n=2, max_tokens=24, temperature=0.8, top_p=0.95, seed=1234, stop=["\n\n"],
    extra_body={"top_k": 50, "repetition_penalty": 1.1},  # vLLM's extra sampling fields
)
for choice in response.choices:
    print(f"[{choice.index}] {choice.text!r} ({choice.finish_reason})")
