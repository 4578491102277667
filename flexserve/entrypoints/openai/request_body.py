"""Reading a JSON request body into its pydantic model: strict JSON, finite numbers only.

JSON has no NaN or Infinity, yet parsers accept `NaN`, `Infinity` and numbers such as `1e400`
that overflow to infinity; a sampling temperature or penalty of NaN would then produce garbage
with a 200. Every number anywhere in a body must be finite, and every integer must fit in 64 bits
(what SQLite, numpy and torch hold), whatever field holds it: 400 otherwise. An integral number
written as a float (`2.0`) is the integer it equals, as in JSON Schema. Lone surrogates
(`"\\ud800"`) are refused by the parser itself (invalid JSON, 400).

Bodies larger than `INLINE_PARSE_BYTES` are parsed on the app's `Offload` workers, so a 10 MB
body does not hold the event loop.
"""

from __future__ import annotations

import math
from typing import Any, TypeVar

import pydantic_core
from pydantic import BaseModel
from starlette.requests import Request

from flexserve.entrypoints.openai.errors import bad_request

M = TypeVar("M", bound=BaseModel)
INLINE_PARSE_BYTES = 64 * 1024  # smaller bodies parse in well under a millisecond
_MIN_INT64, _MAX_INT64 = -(2**63), 2**63 - 1
_NON_FINITE = ("numbers must be finite (NaN, Infinity and overflowing numbers such as 1e400 "
               "are refused)")
_HUGE_INT = "integers must fit in 64 bits"


async def read_json(model: type[M], request: Request) -> M:
    """The request's body as `model`; 400 in OpenAI's shape when it is not valid."""
    raw = await request.body()
    if len(raw) <= INLINE_PARSE_BYTES:
        return parse_json(model, raw)
    return await request.app.state.offload.run(parse_json, model, raw)


def parse_json(model: type[M], raw: bytes) -> M:
    """`raw` as `model` (pydantic's ValidationError for what the model refuses, which the app
    turns into a 400), after refusing non-finite numbers anywhere in it."""
    try:
        value = pydantic_core.from_json(raw)  # NaN and Infinity parse here, to be found
    except ValueError:
        value = None  # not JSON: pydantic names the problem below
    else:
        found = _bad_number_at(value, "")
        if found is not None:
            where, problem = found
            raise bad_request(f"Invalid value for '{where}': {problem}.", param=where or None,
                              code="invalid_value")
        normalized = _integral_floats_as_ints(value)
        if normalized is not value:
            raw = pydantic_core.to_json(normalized)
    return model.model_validate_json(raw)


def _integral_floats_as_ints(value: Any) -> Any:
    """`value` with every integral float in the 64-bit range as an int (JSON does not tell 2.0
    from 2, so an integer field takes either, as JSON Schema's `integer` does); the same object
    when it has none."""
    if isinstance(value, float):
        return int(value) if value.is_integer() and _MIN_INT64 <= value < 2.0**63 else value
    if isinstance(value, dict):
        items = {k: _integral_floats_as_ints(v) for k, v in value.items()}
        return value if all(items[k] is v for k, v in value.items()) else items
    if isinstance(value, list):
        items = [_integral_floats_as_ints(v) for v in value]
        return value if all(a is b for a, b in zip(items, value)) else items
    return value


def _bad_number_at(value: Any, path: str) -> tuple[str, str] | None:
    """(dotted path, problem) of the first non-finite float or over-64-bit integer in a parsed
    JSON value, else None."""
    if isinstance(value, float):
        return None if math.isfinite(value) else (path, _NON_FINITE)
    if isinstance(value, int) and not isinstance(value, bool):
        return None if _MIN_INT64 <= value <= _MAX_INT64 else (path, _HUGE_INT)
    if isinstance(value, dict):
        items = value.items()
    elif isinstance(value, list):
        items = enumerate(value)
    else:
        return None
    for key, item in items:
        if isinstance(item, (str, bool)) or item is None:
            continue
        found = _bad_number_at(item, f"{path}.{key}" if path else str(key))
        if found is not None:
            return found
    return None
