"""Turns per-step scheduler updates into `RequestOutput`s: text, logprobs and stop strings.

A prompt with n > 1 is a parent whose n children are separate scheduler `Request`s; callers see
one `RequestOutput` per parent, cumulative (every output carries the whole text so far).

An exception while processing one prompt's step (a tokenizer that cannot decode its tokens, a
stop string that breaks matching) fails that prompt alone: it ends at once with finish reason
"abort", its unfinished children are handed back to be finished in the scheduler (freeing their
KV blocks), and `pop_failed_requests` names it with the reason; every other prompt goes on.
"""

from __future__ import annotations

import logging
from typing import Any

from flexserve.engine.detokenizer import IncrementalDetokenizer, decode_token
from flexserve.engine.plan import StepResult, TokenLogprobs
from flexserve.engine.request import Request, RequestStatus
from flexserve.outputs import CompletionOutput, Logprob, PositionLogprobs, RequestOutput
from flexserve.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


def find_stop_string(text: str, num_new_chars: int, stop: list[str]) -> tuple[int, str] | None:
    """The first stop-string match that ends within the last `num_new_chars` of `text`.

    Returns (start index, stop string). Only the new text plus len(longest stop) - 1 earlier
    characters can hold a new match. Among several, the one that ends first wins (ties: the one
    that starts first), so the cut does not depend on how the text was split into tokens.
    """
    if num_new_chars <= 0 or not stop:
        return None
    start = max(len(text) - num_new_chars - max(map(len, stop)) + 1, 0)
    best: tuple[int, int, str] | None = None
    for s in stop:
        index = text.find(s, start)
        if index >= 0 and (best is None or (index + len(s), index) < best[:2]):
            best = (index + len(s), index, s)
    return None if best is None else (best[1], best[2])


class _Completion:
    """One child's accumulated output."""

    __slots__ = ("request_id", "index", "detokenizer", "text", "token_ids", "logprobs",
                 "cumulative_logprob", "finish_reason", "stop_reason", "holdback")

    def __init__(self, request_id: str, index: int, params: SamplingParams,
                 detokenizer: IncrementalDetokenizer | None) -> None:
        self.request_id = request_id
        self.index = index
        self.detokenizer = detokenizer
        self.text = ""  # detokenized output, cut at the stop string once one matched
        self.token_ids: list[int] = []
        wants_logprobs = params.logprobs is not None
        self.logprobs: list[PositionLogprobs] | None = [] if wants_logprobs else None
        self.cumulative_logprob: float | None = 0.0 if wants_logprobs else None
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        # Characters that may yet turn out to start a stop string; hidden while running. When the
        # stop string is kept in the output the cut is always past exposed text: nothing to hide.
        self.holdback = 0
        if detokenizer is not None and params.stop and not params.include_stop_str_in_output:
            self.holdback = max(map(len, params.stop)) - 1

    def to_output(self) -> CompletionOutput:
        text = self.text
        if self.finish_reason is None and self.holdback:
            text = text[:max(len(text) - self.holdback, 0)]
        return CompletionOutput(
            index=self.index,
            text=text,
            token_ids=list(self.token_ids),
            cumulative_logprob=self.cumulative_logprob,
            logprobs=None if self.logprobs is None else list(self.logprobs),
            finish_reason=self.finish_reason,
            stop_reason=self.stop_reason,
        )


class _Parent:
    """One user prompt and its n completions."""

    __slots__ = ("request_id", "prompt", "prompt_token_ids", "params", "completions",
                 "prompt_logprobs", "prompt_logprobs_source", "num_cached_tokens",
                 "final_output_only")

    def __init__(self, request_id: str, prompt: str | None, prompt_token_ids: list[int],
                 params: SamplingParams, completions: list[_Completion],
                 final_output_only: bool = False) -> None:
        self.request_id = request_id
        # The caller wants the finished output alone (offline `LLM.generate`): no per-step
        # output objects are built for it.
        self.final_output_only = final_output_only
        self.prompt = prompt
        self.prompt_token_ids = list(prompt_token_ids)
        self.params = params
        self.completions = completions
        wants_prompt_logprobs = params.prompt_logprobs is not None
        self.prompt_logprobs: list[PositionLogprobs | None] | None = (
            [] if wants_prompt_logprobs else None)
        self.prompt_logprobs_source: str | None = None  # the child whose prompt logprobs we keep
        self.num_cached_tokens = 0

    @property
    def finished(self) -> bool:
        return all(c.finish_reason is not None for c in self.completions)

    def to_output(self) -> RequestOutput:
        return RequestOutput(
            request_id=self.request_id,
            prompt=self.prompt,
            prompt_token_ids=self.prompt_token_ids,
            prompt_logprobs=None if self.prompt_logprobs is None else list(self.prompt_logprobs),
            outputs=[c.to_output() for c in self.completions],
            finished=self.finished,
            num_cached_tokens=self.num_cached_tokens,
        )


class OutputProcessor:
    """Owns the caller-facing state of every unfinished prompt.

    Without a tokenizer, texts stay "" (token ids only) and stop strings cannot match.
    """

    def __init__(self, tokenizer: Any | None) -> None:
        self.tokenizer = tokenizer
        self._parents: dict[str, _Parent] = {}
        self._children: dict[str, tuple[_Parent, _Completion]] = {}
        self._token_texts: dict[int, str] = {}  # decode_token cache for logprob entries
        self._failed: dict[str, str] = {}  # parent id -> why its processing failed (unpopped)

    @property
    def num_unfinished_requests(self) -> int:
        return len(self._parents)

    def add_request(self, parent_id: str, prompt: str | None, prompt_token_ids: list[int],
                    params: SamplingParams, child_ids: list[str],
                    final_output_only: bool = False) -> None:
        """Track a prompt whose completions are the scheduler requests `child_ids` (in order).

        `final_output_only`: `process` returns an output for it only once it finished (its text
        is still detokenized incrementally, so stop strings end it on the same token).
        """
        if parent_id in self._parents:
            raise ValueError(f"request {parent_id!r} is already being processed")
        completions = []
        for index, child_id in enumerate(child_ids):
            detokenizer = None
            if self.tokenizer is not None:
                detokenizer = IncrementalDetokenizer(
                    self.tokenizer, prompt_token_ids, params.skip_special_tokens)
            completions.append(_Completion(child_id, index, params, detokenizer))
        parent = _Parent(parent_id, prompt, prompt_token_ids, params, completions,
                         final_output_only)
        self._parents[parent_id] = parent
        for completion in completions:
            self._children[completion.request_id] = (parent, completion)

    def process(self, updated: list[Request],
                result: StepResult) -> tuple[list[RequestOutput], list[str]]:
        """Fold one step into the outputs.

        `updated` are the child requests that got tokens (or finished) this step, with the new
        tokens already appended. Returns one output per changed parent, and the child ids that
        matched a stop string while still running: the engine must finish them in the scheduler.
        Finished parents are dropped after their final output.
        """
        changed: dict[str, _Parent] = {}
        stopped: list[str] = []
        failed: dict[str, _Parent] = {}
        # Every row that covered prompt positions reports their logprobs, also a prefill chunk
        # that sampled nothing (so its request is not in `updated`).
        for child_id, prompt_entries in result.prompt_logprobs.items():
            entry = self._children.get(child_id)
            if entry is not None and entry[0].request_id not in failed:
                try:
                    self._add_prompt_logprobs(entry[0], child_id, prompt_entries)
                except Exception as e:  # this prompt's failure only
                    self._fail(entry[0], e, failed, changed)
        for request in updated:
            entry = self._children.get(request.request_id)
            if entry is None:
                continue  # aborted
            parent, completion = entry
            if parent.request_id in failed:
                continue
            changed[parent.request_id] = parent
            parent.num_cached_tokens = max(parent.num_cached_tokens, request.num_cached_tokens)
            if completion.finish_reason is None:
                try:
                    matched_stop = self._update(completion, parent.params, request, result)
                except Exception as e:  # this prompt's failure only
                    self._fail(parent, e, failed, changed)
                    continue
                if matched_stop and not request.status.finished:
                    stopped.append(request.request_id)
        outputs = []
        for parent in changed.values():
            if parent.final_output_only and not parent.finished:
                continue
            try:
                output = parent.to_output()
            except Exception as e:  # this prompt's failure only
                self._fail(parent, e, failed, changed)
                output = parent.to_output()
            outputs.append(output)
            if parent.finished:
                self._drop(parent)
        for parent in failed.values():
            stopped.extend(c.request_id for c in parent.completions
                           if c.request_id not in stopped)
        return outputs, stopped

    def pop_failed_requests(self) -> dict[str, str]:
        """Prompts whose processing failed since the last call (parent id -> reason). Each got
        a final output with finish reason "abort"; a server should send its client an error."""
        failed, self._failed = self._failed, {}
        return failed

    def _fail(self, parent: _Parent, error: Exception, failed: dict[str, _Parent],
              changed: dict[str, _Parent]) -> None:
        """End `parent` now: every unfinished completion is aborted (its scheduler requests are
        finished by the engine through `stopped`)."""
        logger.exception("request %s: processing its output failed; aborting it alone",
                         parent.request_id)
        failed[parent.request_id] = parent
        changed[parent.request_id] = parent
        self._failed[parent.request_id] = (
            f"processing the request's output failed ({type(error).__name__})")
        parent.prompt_logprobs = None  # logprob entries may be what broke: the final output
        for completion in parent.completions:  # is built from plain fields only
            completion.logprobs = None
            if completion.finish_reason is None:
                completion.finish_reason = "abort"
                completion.stop_reason = None
                completion.holdback = 0

    def abort(self, parent_id: str) -> list[str]:
        """Forget a prompt; returns its children that had not finished."""
        self._failed.pop(parent_id, None)
        parent = self._parents.get(parent_id)
        if parent is None:
            return []
        self._drop(parent)
        return [c.request_id for c in parent.completions if c.finish_reason is None]

    def get_output(self, parent_id: str) -> RequestOutput | None:
        """The current output of an unfinished prompt (None once finished or unknown)."""
        parent = self._parents.get(parent_id)
        return None if parent is None else parent.to_output()

    def _drop(self, parent: _Parent) -> None:
        del self._parents[parent.request_id]
        for completion in parent.completions:
            self._children.pop(completion.request_id, None)

    def _update(self, completion: _Completion, params: SamplingParams, request: Request,
                result: StepResult) -> bool:
        """Fold in the request's new tokens; True when a stop string ended the completion."""
        new_ids = request.output_token_ids[len(completion.token_ids):]
        completion.token_ids.extend(new_ids)
        token_logprobs = result.logprobs.get(request.request_id)
        if token_logprobs is not None and completion.logprobs is not None:
            completion.logprobs.append(self._position_logprobs(token_logprobs))
            completion.cumulative_logprob += token_logprobs.logprobs[0]
        status = request.status
        if completion.detokenizer is not None:
            # A stop token (EOS or stop_token_ids) stays in the ids but not in the text.
            stop_token_ended = (status == RequestStatus.FINISHED_STOPPED
                                and not isinstance(request.stop_reason, str))
            if new_ids and stop_token_ended and not params.include_stop_str_in_output:
                new_ids = new_ids[:-1]
            new_text = completion.detokenizer.add_token_ids(new_ids)
            if status.finished:
                new_text += completion.detokenizer.flush()
            completion.text += new_text
            match = find_stop_string(completion.text, len(new_text), params.stop)
            if match is not None:
                index, stop = match
                end = index + len(stop) if params.include_stop_str_in_output else index
                completion.text = completion.text[:end]
                completion.finish_reason = "stop"
                completion.stop_reason = stop
                return True
        if status.finished:
            completion.finish_reason = status.finish_reason
            completion.stop_reason = request.stop_reason
        return False

    def _add_prompt_logprobs(self, parent: _Parent, child_id: str,
                             entries: list[TokenLogprobs | None]) -> None:
        if parent.prompt_logprobs is None:
            return
        # Children share the prompt: keep one child's report.
        if parent.prompt_logprobs_source is None:
            parent.prompt_logprobs_source = child_id
        elif parent.prompt_logprobs_source != child_id:
            return
        if entries and entries[0] is None:
            parent.prompt_logprobs.clear()  # position 0 again: the prompt is (re)computed
        elif not parent.prompt_logprobs:
            parent.prompt_logprobs.append(None)  # position 0 has no logprob
        for entry in entries:
            if len(parent.prompt_logprobs) >= len(parent.prompt_token_ids):
                break
            parent.prompt_logprobs.append(
                None if entry is None else self._position_logprobs(entry))

    def _position_logprobs(self, entry: TokenLogprobs) -> PositionLogprobs:
        position: PositionLogprobs = {}
        for token_id, logprob, rank in zip(entry.token_ids, entry.logprobs, entry.ranks):
            if token_id not in position:  # the chosen token may also be among the top-k
                position[token_id] = Logprob(logprob, rank, self._token_text(token_id))
        return position

    def _token_text(self, token_id: int) -> str | None:
        if self.tokenizer is None:
            return None
        text = self._token_texts.get(token_id)
        if text is None:
            text = self._token_texts[token_id] = decode_token(self.tokenizer, token_id)
        return text
