"""Preference pairs for DPO: OpenAI's preference format, one pair per JSONL line.

```
{"input": {"messages": [...]},
 "preferred_output": [{"role": "assistant", "content": "..."}],
 "non_preferred_output": [{"role": "assistant", "content": "..."}]}
```

Each side is the conversation `input.messages + [its output message]`, tokenized with the chat
template exactly as a supervised `messages` example (`flexserve.finetune.chat`); its loss tokens
are the output's assistant turn only (assistant turns inside `input` are context, weight 0). The
two sides of a pair share the prompt, so their ids agree up to where the outputs start.
"""

from __future__ import annotations

from typing import Any

from flexserve.finetune.chat import encode_chat

PREFERENCE_KEYS = frozenset({"input", "preferred_output", "non_preferred_output"})
PREFERENCE_SIDES = ("preferred_output", "non_preferred_output")  # chosen, rejected


def _input_messages(record: dict[str, Any]) -> list[dict[str, Any]]:
    value = record["input"]
    if not isinstance(value, dict):
        raise ValueError(f'"input" must be an object with "messages", got {type(value).__name__}')
    unknown = sorted(str(k) for k in value if k != "messages")
    if unknown:
        raise ValueError(f'"input" has unsupported key(s) {", ".join(unknown)}; it holds '
                         '"messages" only')
    messages = value.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ValueError('"input.messages" must be a non-empty list of messages')
    context = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise ValueError(f"input.messages[{i}] must be an object, got "
                             f"{type(message).__name__}")
        if "weight" in message:
            raise ValueError(f"input.messages[{i}]: weight is not allowed in the input: only the "
                             "outputs are trained on")
        if message.get("role") == "assistant":
            message = dict(message, weight=0)  # context, not a trained turn
        context.append(message)
    return context


def _output_message(record: dict[str, Any], side: str) -> dict[str, Any]:
    value = record[side]
    if not isinstance(value, list) or len(value) != 1:
        raise ValueError(f'"{side}" must be a list of exactly one assistant message')
    message = value[0]
    if not isinstance(message, dict):
        raise ValueError(f"{side}[0] must be an object, got {type(message).__name__}")
    unknown = sorted(str(k) for k in message if k not in ("role", "content"))
    if unknown:
        raise ValueError(f"{side}[0] has unsupported key(s) {', '.join(unknown)}; an output "
                         "message has role and content")
    if message.get("role") != "assistant":
        raise ValueError(f"{side}[0] has role {message.get('role')!r}; an output message is "
                         "the assistant's")
    content = message.get("content")
    if not isinstance(content, str):
        raise ValueError(f"{side}[0] content must be a string, got {type(content).__name__}")
    if not content:
        raise ValueError(f"{side}[0]: empty content")
    return {"role": "assistant", "content": content}


def encode_preference(record: dict[str, Any], tokenizer: Any
                      ) -> tuple[tuple[list[int], list[bool]], tuple[list[int], list[bool]]]:
    """(ids, loss mask) of the chosen side, then of the rejected side, of one validated pair;
    ValueError naming the field otherwise."""
    context = _input_messages(record)
    sides = []
    for side in PREFERENCE_SIDES:
        output = _output_message(record, side)
        try:
            sides.append(encode_chat(context + [output], tokenizer))
        except ValueError as e:
            raise ValueError(f"{side}: {e}".replace("messages[", "input.messages[")) from None
    return sides[0], sides[1]
