"""Chat examples: the tokenizer's chat template, with the loss on assistant turns only.

The ids are exactly what `tokenizer.apply_chat_template(messages, tokenize=True)` gives: the
rendered text tokenized with `add_special_tokens=False` (the template writes its own BOS).

Assistant turns are located in the rendered text by rendering prefixes of the conversation. For
assistant message i the turn is the characters [begin, end) of the whole rendering, with

    begin = len(render(messages[:i], add_generation_prompt=True))
    end   = len(render(messages[:i + 1]))

Both renderings must be string prefixes of the whole one; a template that renders a message
differently depending on what follows it (Qwen3 dropping earlier reasoning, say) has no fixed
place for the turn, and the example is refused with a ValueError rather than trained on a wrong
mask. A token counts in the loss when it holds a character of a turn, found with the
tokenizer's offsets, so a token straddling the boundary (`"\\n "` when a reply starts with a space
right after `"assistant\\n"`) counts as the reply's first token. Working on characters rather
than tokenizing each prefix keeps BPE merges across the boundary from breaking the split.

The turn holds the reply and everything the template writes after it for that turn, so the
end-of-turn tokens (`<|im_end|>` and its newline in ChatML, `<|eot_id|>` in Llama 3, `</s>` in
Mistral) count and the model learns to stop. A template that ignores `add_generation_prompt` but
writes a header before each reply would put that header in the turn (Mistral's writes none).

Tool use (OpenAI's fine-tuning format for function calling): the example's `tools` go to the
template (`tools=`), assistant messages may carry `tool_calls` (their JSON-text `arguments` reach
the template as objects, as at inference) and `tool` messages carry the results. The calls are
part of the assistant turn, so they are learned; tool results are not.
"""

from __future__ import annotations

import json
from typing import Any

CHAT_ROLES = ("system", "user", "assistant", "tool")
_MESSAGE_KEYS = ("role", "content", "weight", "tool_calls", "tool_call_id", "name")


def check_tools(tools: object) -> list[dict[str, Any]]:
    """Validate an example's `tools`: OpenAI's `[{"type": "function", "function": {...}}]`."""
    if not isinstance(tools, list):
        raise ValueError(f'"tools" must be a list, got {type(tools).__name__}')
    for i, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, dict) else None
        if (not isinstance(tool, dict) or tool.get("type") != "function"
                or not isinstance(function, dict) or not isinstance(function.get("name"), str)
                or not function["name"]):
            raise ValueError(f'tools[{i}] must be {{"type": "function", "function": '
                             '{"name": ..., "parameters": ...}}')
        if not isinstance(function.get("parameters", {}), dict):
            raise ValueError(f"tools[{i}].function.parameters must be a JSON schema object")
    return tools


def _check_tool_calls(calls: object, where: str) -> list[dict[str, Any]]:
    """An assistant message's `tool_calls`, with `arguments` parsed into objects."""
    if not isinstance(calls, list) or not calls:
        raise ValueError(f"{where}: tool_calls must be a non-empty list")
    result = []
    for j, call in enumerate(calls):
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise ValueError(f"{where}.tool_calls[{j}] must be {{\"type\": \"function\", "
                             '"function": {"name": ..., "arguments": ...}}')
        arguments = function.get("arguments", "{}")
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments)
            except json.JSONDecodeError as e:
                raise ValueError(f"{where}.tool_calls[{j}]: arguments are not valid JSON "
                                 f"({e.msg})") from None
        if not isinstance(arguments, dict):
            raise ValueError(f"{where}.tool_calls[{j}]: arguments must be a JSON object")
        result.append({**call, "type": "function",
                       "function": {"name": function["name"], "arguments": arguments}})
    return result


def _check_messages(messages: object) -> list[dict[str, Any]]:
    """Validate OpenAI's chat fine-tuning messages; return them as the template takes them
    (no `weight`, tool-call arguments as objects)."""
    if not isinstance(messages, list):
        raise ValueError(f'"messages" must be a list, got {type(messages).__name__}')
    if not messages:
        raise ValueError('"messages" is empty')
    plain = []
    num_trained = 0
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, dict):
            raise ValueError(f"{where} must be an object, got {type(message).__name__}")
        unknown = sorted(str(k) for k in message if k not in _MESSAGE_KEYS)
        if unknown:
            raise ValueError(
                f"{where} has unsupported key(s) {', '.join(unknown)}; a message has role, "
                "content, (assistant only) weight and tool_calls, (tool only) tool_call_id"
            )
        role = message.get("role")
        if role not in CHAT_ROLES:
            raise ValueError(
                f"{where} has role {role!r}; supported roles: {', '.join(CHAT_ROLES)}")
        content = message.get("content")
        tool_calls = None
        if "tool_calls" in message:
            if role != "assistant":
                raise ValueError(f"{where}: tool_calls are only allowed on assistant messages")
            tool_calls = _check_tool_calls(message["tool_calls"], where)
            content = "" if content is None else content
        if "tool_call_id" in message and role != "tool":
            raise ValueError(f"{where}: tool_call_id is only allowed on tool messages")
        if not isinstance(content, str):
            raise ValueError(
                f"{where} ({role}) content must be a string, got {type(content).__name__}")
        if "weight" in message:
            weight = message["weight"]
            if role != "assistant":
                raise ValueError(f"{where}: weight is only allowed on assistant messages")
            if type(weight) is not int or weight not in (0, 1):
                raise ValueError(f"{where}: weight must be 0 or 1, got {weight!r}")
        if role == "assistant":
            if not content and not tool_calls:
                raise ValueError(f"{where}: empty assistant content")
            num_trained += message.get("weight", 1)
        entry: dict[str, Any] = {"role": role, "content": content}
        if tool_calls is not None:
            entry["tool_calls"] = tool_calls
        for key in ("tool_call_id", "name"):
            if key in message:
                if not isinstance(message[key], str):
                    raise ValueError(f"{where}: {key} must be a string")
                entry[key] = message[key]
        plain.append(entry)
    if not any(m["role"] == "assistant" for m in plain):
        raise ValueError('"messages" has no assistant message to learn from')
    if num_trained == 0:
        raise ValueError('every assistant message has weight 0: nothing to learn from')
    return plain


def _render(tokenizer: Any, messages: list[dict[str, Any]], generation_prompt: bool,
            tools: list[dict[str, Any]] | None) -> str:
    try:
        return tokenizer.apply_chat_template(
            messages, tools=tools, tokenize=False, add_generation_prompt=generation_prompt)
    except Exception as e:  # jinja2 errors, raise_exception() in the template
        raise ValueError(f"the chat template failed on these messages: {e}") from e


def encode_chat(messages: object, tokenizer: Any, tools: object = None
                ) -> tuple[list[int], list[bool]]:
    """Token ids and loss mask of a chat example (see the module docstring for the spans).

    `messages`: OpenAI's chat fine-tuning format, a list of {"role", "content"} with roles
    system, user, assistant, tool; an assistant message may carry `"weight": 0` to exclude it
    from the loss, and `tool_calls`. `tools`: the functions the template lists (None: none).
    Raises ValueError naming the problem.
    """
    plain = _check_messages(messages)
    tools = None if tools is None else check_tools(tools)
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("the model's tokenizer has no chat template; use text or "
                         "prompt/completion examples")
    if not getattr(tokenizer, "is_fast", False):  # only Rust tokenizers report offsets
        raise ValueError("chat examples need a tokenizer with offsets (a tokenizer.json)")
    text = _render(tokenizer, plain, False, tools)
    encoding = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    input_ids = list(encoding.input_ids)
    turns = []  # [begin, end) character spans of the trained assistant turns, in order
    for i, message in enumerate(messages):
        if message["role"] != "assistant" or message.get("weight", 1) == 0:
            continue
        span = []
        for prefix in (_render(tokenizer, plain[:i], True, tools),
                       _render(tokenizer, plain[:i + 1], False, tools)):
            if not text.startswith(prefix):
                raise ValueError(
                    f"cannot locate messages[{i}] (assistant): the chat template renders the "
                    "conversation before it differently when later messages follow, so its "
                    "turn has no fixed place in the text"
                )
            span.append(len(prefix))
        if span[1] <= span[0]:
            raise ValueError(f"messages[{i}] (assistant) renders to no text")
        turns.append(span)
    loss_mask = [False] * len(input_ids)
    turn = 0
    for p, (a, b) in enumerate(encoding.offset_mapping):
        while turn < len(turns) and turns[turn][1] <= a:
            turn += 1
        if turn == len(turns):
            break
        begin, end = turns[turn]
        # A token counts when it holds a character of the turn: one that straddles the start
        # (e.g. "\n " when the reply begins with a space after "assistant\n") is predicted as
        # part of the reply. A zero-width offset (trimmed whitespace) counts inside the turn.
        loss_mask[p] = p > 0 and (b > begin if b > a else a >= begin)
    return input_ids, loss_mask
