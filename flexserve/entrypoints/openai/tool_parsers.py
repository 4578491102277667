"""Tool calls out of model text: the parsers `--tool-call-parser` selects for `tool_choice: "auto"`
(the shipped families' formats), the readers of the JSON that "required" and a named function
force, and the streaming of either as OpenAI's `tool_calls` deltas.

- `hermes` (Qwen2.5, Hermes): `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, after
  optional text, one tag per call.
- `llama3_json` (Llama 3.1-3.3): the whole reply is `{"name": ..., "parameters": {...}}`,
  optionally after `<|python_tag|>`, several calls separated by `;`.

Text that does not parse as tool calls is returned as content, as vLLM does.
"""

from __future__ import annotations

import abc
import json
import re
import uuid
from typing import Any

from flexserve.entrypoints.openai.protocol import (
    DeltaFunctionCall,
    DeltaToolCall,
    FunctionCall,
    ToolCall,
)


def tool_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def make_tool_call(name: Any, arguments: Any) -> ToolCall:
    """A call from parsed JSON; ValueError when the name or arguments have the wrong type."""
    if not isinstance(name, str) or not name:
        raise ValueError("a tool call needs a function name")
    if isinstance(arguments, str):
        arguments = json.loads(arguments)
    if not isinstance(arguments, dict):
        raise ValueError("tool call arguments must be a JSON object")
    return ToolCall(id=tool_call_id(), function=FunctionCall(
        name=name, arguments=json.dumps(arguments, ensure_ascii=False)))


def _held_back(text: str, marker: str) -> int:
    """Length of the longest suffix of `text` that could be the start of `marker`."""
    for k in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-k:]):
            return k
    return 0


class ToolParser(abc.ABC):
    """Reads a finished reply as (content, tool calls); says how much of a partial reply is
    certainly content, so a stream can send it before the calls are known."""

    name = ""

    @abc.abstractmethod
    def extract(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """(content, tool calls) of a finished reply."""

    @abc.abstractmethod
    def content_end(self, text: str, finished: bool) -> int:
        """Characters of `text` that are content whatever comes next."""


class HermesToolParser(ToolParser):
    name = "hermes"
    start, end = "<tool_call>", "</tool_call>"
    _calls = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.DOTALL)

    def extract(self, text: str) -> tuple[str | None, list[ToolCall]]:
        first = text.find(self.start)
        if first < 0:
            return text, []
        try:
            calls = []
            for body in self._calls.findall(text[first:]):
                call = json.loads(body)
                if not isinstance(call, dict):
                    raise ValueError("a tool call must be a JSON object")
                calls.append(make_tool_call(call.get("name"), call.get("arguments", {})))
        except ValueError:  # json.JSONDecodeError is a ValueError
            return text, []
        content = text[:first]
        return (content if content.strip() else None), calls

    def content_end(self, text: str, finished: bool) -> int:
        first = text.find(self.start)
        if first >= 0:
            return first
        return len(text) if finished else len(text) - _held_back(text, self.start)


class Llama3JsonToolParser(ToolParser):
    name = "llama3_json"
    python_tag = "<|python_tag|>"

    def extract(self, text: str) -> tuple[str | None, list[ToolCall]]:
        body = text.strip().removeprefix(self.python_tag).lstrip()
        if not body.startswith("{"):
            return text, []
        decoder = json.JSONDecoder()
        calls, position = [], 0
        try:
            while position < len(body):
                call, position = decoder.raw_decode(body, position)
                if not isinstance(call, dict):
                    raise ValueError("a tool call must be a JSON object")
                arguments = call.get("parameters", call.get("arguments", {}))
                calls.append(make_tool_call(call.get("name"), arguments))
                while position < len(body) and body[position] in " \t\r\n;":
                    position += 1
        except ValueError:
            return text, []
        return None, calls

    def content_end(self, text: str, finished: bool) -> int:
        body = text.lstrip()
        if finished:
            return 0 if body.startswith(("{", self.python_tag)) else len(text)
        if not body or body.startswith("{") or self.python_tag.startswith(body[:14]):
            return 0  # undecided, or a call: nothing is content yet
        return len(text)


TOOL_PARSERS: dict[str, type[ToolParser]] = {
    parser.name: parser for parser in (HermesToolParser, Llama3JsonToolParser)}


class RequiredToolCalls(ToolParser):
    """`tool_choice: "required"`: the grammar made the reply a JSON array of
    `{"name", "parameters"}` objects."""

    def extract(self, text: str) -> tuple[str | None, list[ToolCall]]:
        try:
            calls = json.loads(text)
            if not isinstance(calls, list):
                raise ValueError("not a list")
            return None, [make_tool_call(c.get("name"), c.get("parameters", {}))
                          for c in calls if isinstance(c, dict)]
        except ValueError:  # cut short by max_tokens: what came is content
            return text, []

    def content_end(self, text: str, finished: bool) -> int:
        return 0


class NamedToolCall(ToolParser):
    """A named `tool_choice`: the grammar made the reply that function's arguments object."""

    def __init__(self, function_name: str) -> None:
        self.function_name = function_name

    def extract(self, text: str) -> tuple[str | None, list[ToolCall]]:
        # As OpenAI, the arguments are returned as generated, even if cut short by max_tokens.
        return None, [ToolCall(id=tool_call_id(),
                               function=FunctionCall(name=self.function_name, arguments=text))]

    def content_end(self, text: str, finished: bool) -> int:
        return 0


class ToolCallStream:
    """One choice's stream: content deltas while the reply is certainly content, then its tool
    calls. A named function's arguments stream as they are generated; other calls are sent
    whole once the reply is finished (a delta per call: id, name and arguments)."""

    def __init__(self, parser: ToolParser) -> None:
        self.parser = parser
        self.num_sent = 0  # characters of the text sent (as content, or as named arguments)
        self.num_calls = 0  # tool calls sent

    def update(self, text: str, finished: bool) -> tuple[str | None, list[DeltaToolCall]]:
        """(content delta or None, tool-call deltas) for the reply's text so far."""
        parser = self.parser
        if isinstance(parser, NamedToolCall):
            calls = []
            if self.num_calls == 0:
                self.num_calls = 1
                calls.append(DeltaToolCall(index=0, id=tool_call_id(), type="function",
                                           function=DeltaFunctionCall(
                                               name=parser.function_name, arguments="")))
            if len(text) > self.num_sent:
                calls.append(DeltaToolCall(index=0, function=DeltaFunctionCall(
                    arguments=text[self.num_sent:])))
                self.num_sent = len(text)
            return None, calls
        content = None
        end = parser.content_end(text, finished)
        if end > self.num_sent:
            content, self.num_sent = text[self.num_sent:end], end
        if not finished:
            return content, []
        extracted, calls = parser.extract(text)
        if not calls:
            rest = text[self.num_sent:]
            self.num_sent = len(text)
            return (content or "") + rest or None, []
        if extracted is not None and len(extracted) > self.num_sent:
            content = (content or "") + extracted[self.num_sent:]
        deltas = [DeltaToolCall(index=i, id=call.id, type="function",
                                function=DeltaFunctionCall(name=call.function.name,
                                                           arguments=call.function.arguments))
                  for i, call in enumerate(calls)]
        self.num_calls = len(calls)
        return content, deltas
