"""What a step's plan carries to the ranks of a distributed executor: each request's prompt once.

Every `ScheduledSequence` of a plan holds its request's whole prompt (for penalties and prompt
logprobs), so a plan of 128 decode rows with 512-token prompts and 64 output tokens pickles to
314 KB: 1.3-1.6 ms to pickle, per rank, and 2.0-2.5 ms to unpickle on each rank (development
CPU), every step, on the critical path. The engine side (`PlanSender`) pickles a plan once for
all ranks, sends a request's prompt only in the first plan that schedules it, and of its output
tokens (which only grow) only those the ranks do not hold yet (`OutputDelta`): the same plan,
after its first step, is 44 KB, 0.7-0.8 ms to encode and 0.6 ms to decode; the rank side
(`PromptCache`) keeps each request's prompt and outputs and puts them back into the rows. Both
follow the same plan stream in order and forget a request at the same plan (the one that
finishes or preempts it), so they always agree on what the ranks hold.
"""

from __future__ import annotations

import copy
import pickle
from dataclasses import dataclass
from typing import Any

from flexserve.engine.plan import BatchPlan


@dataclass(slots=True)
class OutputDelta:
    """A row's output tokens on the wire: the ranks hold the first `start` already."""

    start: int
    tokens: list[int]


class PlanSender:
    """The engine side: a plan's bytes for every rank, what the ranks hold left out."""

    def __init__(self) -> None:
        self._sent: dict[str, int] = {}  # request -> output tokens the ranks hold (and its prompt)

    def encode(self, message: Any) -> bytes:
        """`message` pickled once for every rank; a `BatchPlan`'s rows of requests sent before
        go without their prompt (None)."""
        if isinstance(message, BatchPlan):
            message = self._strip(message)
        return pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)

    def _strip(self, plan: BatchPlan) -> BatchPlan:
        rows = []
        for row in plan.sequences:
            held = self._sent.get(row.request_id)
            num_outputs = len(row.output_token_ids)
            if held is not None:
                row = copy.copy(row)
                row.prompt_token_ids = None
                row.output_token_ids = OutputDelta(held, row.output_token_ids[held:num_outputs])
            self._sent[row.request_id] = num_outputs
            rows.append(row)
        for request_id in (*plan.finished_request_ids, *plan.preempted_request_ids):
            self._sent.pop(request_id, None)
        wire = copy.copy(plan)
        wire.sequences = rows
        return wire


class PromptCache:
    """The rank side: the prompts and output tokens of the requests sent so far, put back into
    plans' rows."""

    def __init__(self) -> None:
        self._prompts: dict[str, list[int]] = {}
        self._outputs: dict[str, list[int]] = {}

    def decode(self, payload: bytes) -> Any:
        """The message `PlanSender.encode` made, with every row's prompt and outputs back in
        place (a row's lists are its own: a later plan's never change them)."""
        message = pickle.loads(payload)
        if isinstance(message, BatchPlan):
            for row in message.sequences:
                request_id = row.request_id
                if row.prompt_token_ids is None:
                    row.prompt_token_ids = self._prompts[request_id]
                else:
                    self._prompts[request_id] = row.prompt_token_ids
                delta = row.output_token_ids
                if isinstance(delta, OutputDelta):
                    held = self._outputs[request_id]
                    if len(held) != delta.start:
                        raise ValueError(f"request {request_id}: the rank holds {len(held)} "
                                         f"output tokens, the plan continues from {delta.start}")
                    row.output_token_ids = held + delta.tokens
                self._outputs[request_id] = row.output_token_ids
            for request_id in (*message.finished_request_ids, *message.preempted_request_ids):
                self._prompts.pop(request_id, None)
                self._outputs.pop(request_id, None)
        return message
