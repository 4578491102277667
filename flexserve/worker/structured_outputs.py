"""Grammar-constrained decoding (structured outputs) with xgrammar, on the worker.

Each request's constraint is compiled once (cached by its parameters) when the request is
prepared, off the engine thread in a server (`ModelRunner.prepare_structured_outputs`); a
matcher per request follows the tokens it generated, on the host, and fills that row of the
step's token bitmask,
which reaches the sampler as an input tensor (`SamplingMetadata.token_bitmask`). Under
asynchronous scheduling a row's last token is still on the device when its plan is built: the
matcher takes it from the previous step's sampled tokens, which the device produced before this
step's forward, so the host fills the bitmask while the forward runs.

xgrammar is an optional dependency (`pip install 'flexserve[structured]'`): without it a
constrained request is refused with a clear error, never run unconstrained.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import re
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from flexserve.engine.plan import ScheduledSequence
from flexserve.layers.device_copy import to_device
from flexserve.sampling_params import StructuredOutputsParams

logger = logging.getLogger(__name__)

MISSING_XGRAMMAR = ("structured outputs (response_format, guided_*, tool_choice 'required' or a "
                    "named function) need the xgrammar package, which this server does not have: "
                    "pip install 'flexserve[structured]'")
# Compiled grammars kept per worker (a JSON schema's grammar is a few hundred KB at most).
MAX_COMPILED_GRAMMARS = 256


def xgrammar_available() -> bool:
    return importlib.util.find_spec("xgrammar") is not None


def _xgrammar() -> Any:
    if not xgrammar_available():
        raise ValueError(MISSING_XGRAMMAR)
    import xgrammar

    return xgrammar


def choice_ebnf(choices: Sequence[str]) -> str:
    """An EBNF grammar whose sentences are exactly `choices` (JSON string escapes are EBNF's)."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


def check_structured_outputs(params: StructuredOutputsParams) -> None:
    """Parse the constraint without compiling it against a vocabulary (fast): ValueError with
    the parser's reason for a bad schema, regex or grammar, or when xgrammar is missing."""
    xgr = _xgrammar()
    try:
        if params.json is not None:
            xgr.Grammar.from_json_schema(params.json, any_whitespace=False,
                                         strict_mode=params.strict)
        elif params.regex is not None:
            xgr.Grammar.from_regex(params.regex)
        elif params.choice is not None:
            xgr.Grammar.from_ebnf(choice_ebnf(params.choice))
        elif params.grammar is not None:
            xgr.Grammar.from_ebnf(params.grammar)
    except RecursionError:
        raise ValueError("the constraint is nested too deeply for structured outputs") from None
    except Exception as e:  # xgrammar raises RuntimeError or its own types with the reason
        kind = next(k for k in ("json", "regex", "choice", "grammar") if getattr(params, k))
        what = {"json": "JSON schema", "regex": "regular expression", "choice": "choice list",
                "grammar": "grammar"}[kind]
        raise ValueError(f"invalid {what} for structured outputs: {_first_line(e)}") from None


def _first_line(error: Exception) -> str:
    """The reason without xgrammar's log prefix (`[hh:mm:ss] /path/file.cc:123: `)."""
    text = str(error).strip()
    line = text.splitlines()[0] if text else type(error).__name__
    return re.sub(r"^\[[\d:]+\] \S+:\d+: ", "", line)


@dataclass
class _RequestGrammar:
    matcher: Any | None  # xgrammar.GrammarMatcher; None: the grammar failed to compile
    num_accepted: int = 0  # generated tokens the matcher has consumed
    broken: bool = False  # a generated token the grammar refused: the row goes unconstrained


class GrammarManager:
    """Matchers of the running constrained requests and the per-step bitmask."""

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: Iterable[int]) -> None:
        xgr = _xgrammar()
        self._xgr = xgr
        # The matchers know the tokenizer's own ids only: the embedding rows past them (padding
        # of the model's vocabulary) have no text, are never allowed in a constrained row, and
        # would cost xgrammar a per-token check on every mask (79K of them made a mask of
        # SmolLM2's tokenizer over Llama 3's vocabulary 20x slower, 100 us a row on the CPU).
        self.vocab_size = vocab_size
        self.grammar_vocab_size = min(vocab_size, len(tokenizer))
        stops = sorted(t for t in set(stop_token_ids) if t < self.grammar_vocab_size)
        info = xgr.TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=self.grammar_vocab_size, stop_token_ids=stops or None)
        self.compiler = xgr.GrammarCompiler(info)
        self._compiled: OrderedDict[StructuredOutputsParams, Any] = OrderedDict()
        self._lock = threading.Lock()
        self._requests: dict[str, _RequestGrammar] = {}

    @property
    def num_requests(self) -> int:
        return len(self._requests)

    def release(self, request_ids: Iterable[str]) -> None:
        """Forget finished requests' matchers."""
        for request_id in request_ids:
            self._requests.pop(request_id, None)

    def bitmask(self, rows: Sequence[ScheduledSequence], device: torch.device,
                previous_tokens: Callable[[], list[int]] | None = None) -> torch.Tensor | None:
        """The [len(rows), ceil(V / 32)] int32 bitmask of this step's sampled `rows` on `device`
        (None when no row is constrained). `previous_tokens()`: the tokens the previous plan
        sampled, row for row (a continuation plan's rows fed them without the host knowing)."""
        if not any(row.sampling_params.structured_outputs is not None for row in rows):
            return None
        bitmask = self._xgr.allocate_token_bitmask(len(rows), self.vocab_size)  # all allowed
        # the matchers fill masks of their own width (the same tensor when nothing is padded)
        masks = (bitmask if self.grammar_vocab_size == self.vocab_size
                 else self._xgr.allocate_token_bitmask(len(rows), self.grammar_vocab_size))
        constrained: list[int] = []
        previous: list[int] | None = None
        for i, row in enumerate(rows):
            params = row.sampling_params.structured_outputs
            if params is None:
                continue
            state = self._requests.get(row.request_id)
            if state is None:
                state = self._requests[row.request_id] = _RequestGrammar(self._matcher(params))
            num_generated = (row.num_computed_tokens + row.num_scheduled_tokens
                             - len(row.prompt_token_ids))
            tokens = list(row.output_token_ids[state.num_accepted:num_generated])
            if state.num_accepted + len(tokens) < num_generated:
                if previous_tokens is None:
                    raise RuntimeError(f"request {row.request_id}: {num_generated} generated "
                                       f"tokens, {len(row.output_token_ids)} known")
                if previous is None:
                    previous = previous_tokens()
                tokens.append(previous[i])
            self._advance(row.request_id, state, tokens)
            matcher = state.matcher
            if matcher is not None and not state.broken and not matcher.is_terminated():
                matcher.fill_next_token_bitmask(masks, i)
                constrained.append(i)
        if masks is not bitmask and constrained:
            self._widen(masks, bitmask, constrained)
        return to_device(bitmask, device)

    def _widen(self, masks: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> None:
        """Copy the constrained `rows` of the matchers' masks into the model-wide bitmask, with
        every id past the tokenizer's disallowed."""
        index = torch.tensor(rows)
        width = masks.shape[1]
        wide = torch.zeros((len(rows), bitmask.shape[1]), dtype=bitmask.dtype)
        wide[:, :width] = masks[index]
        tail = self.grammar_vocab_size % 32
        if tail:  # the last word's bits past the tokenizer's ids
            wide[:, width - 1] &= (1 << tail) - 1
        bitmask[index] = wide

    def _advance(self, request_id: str, state: _RequestGrammar, tokens: list[int]) -> None:
        state.num_accepted += len(tokens)
        matcher = state.matcher
        if matcher is None or state.broken:
            return
        for token_id in tokens:
            if matcher.is_terminated():
                return  # tokens after the grammar's stop token (ignore_eos): nothing to check
            if not matcher.accept_token(token_id):
                logger.error("request %s: generated token %d is not allowed by its grammar; "
                             "the rest of its output is unconstrained", request_id, token_id)
                state.broken = True
                return

    def compile(self, params: StructuredOutputsParams) -> Any:
        """The compiled grammar of `params`, from the cache or compiled now; ValueError when it
        does not compile. Thread-safe: requests are prepared on server threads while the engine
        thread fills masks (two threads compiling one new constraint both get a valid grammar)."""
        with self._lock:
            compiled = self._compiled.get(params)
            if compiled is not None:
                self._compiled.move_to_end(params)
                return compiled
        try:
            compiled = self._compile(params)
        except Exception as e:  # xgrammar raises RuntimeError or its own types
            raise ValueError(f"cannot compile the structured outputs constraint: "
                             f"{_first_line(e)}") from None
        with self._lock:
            self._compiled[params] = compiled
            if len(self._compiled) > MAX_COMPILED_GRAMMARS:
                self._compiled.popitem(last=False)
        return compiled

    def _matcher(self, params: StructuredOutputsParams) -> Any | None:
        try:
            compiled = self.compile(params)  # compiled when the request was prepared, normally
        except ValueError as e:  # checked at the API already; a worker never crashes on it
            logger.error("%s (%s)", e, params)
            return None
        return self._xgr.GrammarMatcher(compiled)

    def _compile(self, params: StructuredOutputsParams) -> Any:
        compiler = self.compiler
        if params.json is not None:
            # Compact JSON: free whitespace lets small models loop on blanks forever.
            return compiler.compile_json_schema(params.json, any_whitespace=False,
                                                strict_mode=params.strict)
        if params.json_object:  # OpenAI's json_object: any JSON object
            return compiler.compile_json_schema('{"type": "object"}', any_whitespace=False,
                                                strict_mode=False)
        if params.regex is not None:
            return compiler.compile_regex(params.regex)
        if params.choice is not None:
            return compiler.compile_grammar(choice_ebnf(params.choice))
        return compiler.compile_grammar(params.grammar)
