"""Per-request sampling parameters (vLLM's names and semantics)."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field

_GREEDY_EPS = 1e-5
MAX_LOGPROBS = 20
MAX_LOGIT_BIAS = 100.0  # OpenAI's range: [-100, 100]


@dataclass(frozen=True, slots=True)
class StructuredOutputsParams:
    """A constraint on the generated text (vLLM's names): exactly one field is set. The worker
    compiles it into a grammar and masks, at every step, the tokens the grammar forbids."""

    json: str | None = None  # a JSON schema, as JSON text: the output is a matching document
    json_object: bool = False  # the output is any JSON object
    regex: str | None = None  # the output matches this regular expression
    choice: tuple[str, ...] | None = None  # the output is one of these strings
    grammar: str | None = None  # the output is a sentence of this EBNF (GBNF) grammar
    strict: bool = True  # json: no properties beyond those the schema lists

    def __post_init__(self) -> None:
        if self.choice is not None:
            object.__setattr__(self, "choice", tuple(self.choice))
        kinds = [name for name in ("json", "regex", "choice", "grammar")
                 if getattr(self, name) is not None]
        kinds += ["json_object"] if self.json_object else []
        if len(kinds) != 1:
            raise ValueError("structured outputs take exactly one of json, json_object, regex, "
                             f"choice or grammar; got {kinds or 'none'}")
        if self.json is not None:
            if not isinstance(self.json, str):
                raise ValueError("structured outputs: json must be a schema as JSON text")
            try:
                schema = json.loads(self.json)
            except json.JSONDecodeError as e:
                raise ValueError(f"the JSON schema is not valid JSON: {e}") from None
            except RecursionError:
                raise ValueError("the JSON schema is nested too deeply") from None
            if not isinstance(schema, (dict, bool)):
                raise ValueError("a JSON schema must be an object")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"structured outputs: {name} must be a non-empty string")
        if self.choice is not None and (
                not self.choice or not all(isinstance(c, str) and c for c in self.choice)):
            raise ValueError("structured outputs: choice must be a non-empty list of "
                             "non-empty strings")


@dataclass(slots=True)
class SamplingParams:
    """How to pick tokens and when to stop. Invalid values raise `ValueError` on construction."""

    n: int = 1  # completions per prompt; they share the prompt's KV blocks
    temperature: float = 1.0  # 0 means greedy
    top_p: float = 1.0  # nucleus mass in (0, 1]
    top_k: int = 0  # 0 or -1: disabled
    min_p: float = 0.0  # drop tokens with p < min_p * p_max
    presence_penalty: float = 0.0  # OpenAI: subtract once per generated token present
    frequency_penalty: float = 0.0  # OpenAI: subtract per occurrence in generated tokens
    repetition_penalty: float = 1.0  # CTRL-style over prompt and generated tokens
    seed: int | None = None  # per-request seed: same seed, same tokens
    stop: list[str] = field(default_factory=list)  # stop strings (not included in the text)
    stop_token_ids: list[int] = field(default_factory=list)  # extra stop tokens (kept in ids)
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False  # keep generating past EOS
    max_tokens: int | None = 16  # None: up to the context length
    min_tokens: int = 0  # EOS and stop tokens are masked until this many are generated
    logprobs: int | None = None  # top-k alternatives per generated token (0: only the chosen)
    prompt_logprobs: int | None = None  # likewise for prompt tokens
    skip_special_tokens: bool = True  # in the detokenized text
    # token id -> value added to its logit before sampling, in [-100, 100] (OpenAI's logit_bias)
    logit_bias: dict[int, float] | None = None
    structured_outputs: StructuredOutputsParams | None = None  # constrain the output's form

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        _int_at_least("n", self.n, 1)
        _number("temperature", self.temperature)
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        _number("top_p", self.top_p)
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        _int_at_least("top_k", self.top_k, -1)
        _number("min_p", self.min_p)
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            _number(name, value)
            if not -2.0 <= value <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {value}")
        _number("repetition_penalty", self.repetition_penalty)
        if self.repetition_penalty <= 0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        if self.seed is not None:
            _int_at_least("seed", self.seed, -(2**63))
            if self.seed >= 2**63:
                raise ValueError(f"seed must be < 2**63, got {self.seed}")
        if not all(isinstance(s, str) and s for s in self.stop):
            raise ValueError("stop must be non-empty strings")
        if not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0
                   for t in self.stop_token_ids):
            raise ValueError("stop_token_ids must be non-negative integers")
        if self.max_tokens is not None:
            _int_at_least("max_tokens", self.max_tokens, 1)
        _int_at_least("min_tokens", self.min_tokens, 0)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})"
            )
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None:
                _int_at_least(name, value, 0)
                if value > MAX_LOGPROBS:
                    raise ValueError(f"{name} must be at most {MAX_LOGPROBS}, got {value}")
        if self.logit_bias:
            for token_id, bias in self.logit_bias.items():
                _int_at_least("logit_bias token id", token_id, 0)
                _number("logit_bias value", bias)
                if not -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS:
                    raise ValueError(f"logit_bias values must be in [-{MAX_LOGIT_BIAS:g}, "
                                     f"{MAX_LOGIT_BIAS:g}], got {bias} for token {token_id}")
        if self.structured_outputs is not None and not isinstance(
                self.structured_outputs, StructuredOutputsParams):
            raise ValueError("structured_outputs must be a StructuredOutputsParams")

    @property
    def greedy(self) -> bool:
        """Temperature 0: argmax, no randomness."""
        return self.temperature < _GREEDY_EPS

    @property
    def has_penalties(self) -> bool:
        return (
            self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or self.repetition_penalty != 1.0
        )


def _number(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name} must be a number, got {value!r}")
    if not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value}")


def _int_at_least(name: str, value: object, low: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    if value < low:
        raise ValueError(f"{name} must be >= {low}, got {value}")
