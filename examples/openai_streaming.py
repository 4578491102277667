"""Streaming chat and completions (server-sent events) with the official `openai` client.

    make serve                      # in another terminal (or: flexserve serve)
    python examples/openai_streaming.py

FLEXSERVE_BASE_URL (default http://localhost:8000/v1) and FLEXSERVE_API_KEY select the server.
"""

from __future__ import annotations

import os
import time

import openai

client = openai.OpenAI(
    base_url=os.environ.get("FLEXSERVE_BASE_URL", "http://localhost:8000/v1"),
    api_key=os.environ.get("FLEXSERVE_API_KEY", "EMPTY"),
)
model = client.models.list().data[0].id

# Chat: the first chunk carries the role, then content deltas, then the finish reason; with
# include_usage a last chunk (no choices) carries the token counts.
start = time.perf_counter()
first_token_at = None
stream = client.chat.completions.create(
    model=model,
    messages=[{"role": "user", "content": "Write a haiku about autumn."}],
    max_completion_tokens=64, temperature=0.7, stream=True,
    stream_options={"include_usage": True},
)
print("assistant: ", end="", flush=True)
for chunk in stream:
    if chunk.usage is not None:
        usage = chunk.usage
        continue
    delta = chunk.choices[0].delta.content
    if delta:
        first_token_at = first_token_at or time.perf_counter()
        print(delta, end="", flush=True)
elapsed = time.perf_counter() - start
print(f"\n[{usage.completion_tokens} tokens in {elapsed:.2f} s, "
      f"first after {(first_token_at or start) - start:.2f} s]")

# Completions stream too; closing a stream early aborts the request on the server at once.
stream = client.completions.create(model=model, prompt="1, 2, 3,", max_tokens=200, stream=True,
                                   temperature=0)
received = ""
for chunk in stream:
    received += chunk.choices[0].text
    if len(received) > 20:
        stream.close()  # the server frees this request's KV cache now
        break
print(f"completion (stopped early): {received!r}")
