"""Requests' output constraints as `StructuredOutputsParams`: OpenAI's `response_format`, vLLM's
`guided_*` fields, and the JSON shapes that `tool_choice` "required" and a named function force.

Every constraint is parsed here (fast, no vocabulary compile), so a bad schema, regex or grammar,
or a server without xgrammar, is a 400 naming the field, never a failure in the engine.
"""

from __future__ import annotations

import json
from typing import Any

from flexserve.entrypoints.openai.errors import bad_request
from flexserve.entrypoints.openai.protocol import ChatTool, ResponseFormat, SamplingFields
from flexserve.sampling_params import StructuredOutputsParams
from flexserve.worker.structured_outputs import check_structured_outputs

_GUIDED_FIELDS = ("guided_json", "guided_regex", "guided_choice", "guided_grammar")


def request_structured_outputs(request: SamplingFields,
                               response_format: ResponseFormat | None = None
                               ) -> StructuredOutputsParams | None:
    """The constraint a request asks for (None: free text); a 400 for conflicting or bad ones."""
    given = [name for name in _GUIDED_FIELDS if getattr(request, name) is not None]
    if response_format is not None and response_format.type != "text":
        given.append("response_format")
    if len(given) > 1:
        raise bad_request(f"give at most one of {', '.join(given)}", param=given[1])
    if not given:
        return None
    param = given[0]
    try:
        if param == "response_format":
            params = _response_format_params(response_format)
        elif param == "guided_json":
            value = request.guided_json
            params = StructuredOutputsParams(
                json=value if isinstance(value, str) else json.dumps(value))
        elif param == "guided_regex":
            params = StructuredOutputsParams(regex=request.guided_regex)
        elif param == "guided_choice":
            params = StructuredOutputsParams(choice=tuple(request.guided_choice))
        else:
            params = StructuredOutputsParams(grammar=request.guided_grammar)
    except RecursionError:
        raise bad_request("the constraint is nested too deeply", param=param) from None
    except ValueError as e:
        raise bad_request(str(e), param=param) from e
    check(params, param)
    return params


def _response_format_params(response_format: ResponseFormat) -> StructuredOutputsParams:
    if response_format.type == "json_object":
        return StructuredOutputsParams(json_object=True)
    spec = response_format.json_schema
    if spec is None or spec.json_schema is None:
        raise ValueError("response_format of type 'json_schema' needs json_schema.schema")
    return StructuredOutputsParams(json=json.dumps(spec.json_schema), strict=bool(spec.strict))


def check(params: StructuredOutputsParams, param: str) -> None:
    """400 when the constraint does not parse or xgrammar is missing."""
    try:
        check_structured_outputs(params)
    except ValueError as e:
        raise bad_request(str(e), param=param) from e


def tool_parameters_schema(tool: ChatTool) -> dict[str, Any]:
    """The JSON schema of a tool's arguments (an object of anything when it gives none)."""
    return tool.function.parameters or {"type": "object"}


def required_tools_params(tools: list[ChatTool], parallel: bool) -> StructuredOutputsParams:
    """`tool_choice: "required"`: a JSON array of `{"name", "parameters"}` calls of the given
    tools (one call when `parallel` is false), each with arguments matching its schema."""
    calls = [{
        "type": "object",
        "properties": {"name": {"type": "string", "enum": [tool.function.name]},
                       "parameters": tool_parameters_schema(tool)},
        "required": ["name", "parameters"],
    } for tool in tools]
    schema: dict[str, Any] = {"type": "array", "minItems": 1,
                              "items": calls[0] if len(calls) == 1 else {"anyOf": calls}}
    if not parallel:
        schema["maxItems"] = 1
    return _tool_params(schema, strict=False)


def named_tool_params(tool: ChatTool) -> StructuredOutputsParams:
    """A named `tool_choice`: the output is that function's arguments object."""
    return _tool_params(tool_parameters_schema(tool), strict=bool(tool.function.strict))


def _tool_params(schema: dict[str, Any], strict: bool) -> StructuredOutputsParams:
    try:
        params = StructuredOutputsParams(json=json.dumps(schema), strict=strict)
    except RecursionError:
        raise bad_request("a tool's parameters schema is nested too deeply",
                          param="tools") from None
    check(params, "tools")
    return params
