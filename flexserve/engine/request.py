"""A generation request as the scheduler sees it: token ids and progress, no tensors."""

from __future__ import annotations

import enum
import time

from flexserve.engine.lora_request import LoRARequest
from flexserve.sampling_params import SamplingParams


class RequestStatus(enum.IntEnum):
    WAITING = 0  # not admitted, or preempted and waiting to recompute
    RUNNING = 1  # holds KV blocks and is scheduled each step
    FINISHED_STOPPED = 2  # EOS, a stop token or a stop string
    FINISHED_LENGTH = 3  # max_tokens or the context length
    FINISHED_ABORTED = 4  # cancelled by the caller

    @property
    def finished(self) -> bool:
        return self >= RequestStatus.FINISHED_STOPPED

    @property
    def finish_reason(self) -> str | None:
        return _FINISH_REASONS.get(self)


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
}


class Request:
    """One sequence being generated. `num_computed_tokens` catches up to `num_tokens` each step."""

    __slots__ = (
        "request_id", "prompt_token_ids", "sampling_params", "eos_token_id", "arrival_time",
        "max_tokens", "output_token_ids", "all_token_ids", "num_computed_tokens",
        "num_cached_tokens", "status", "stop_reason", "num_preemptions", "block_hashes",
        "seed", "first_scheduled_time", "lora_request", "tenant",
    )

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        eos_token_id: int | None,
        max_tokens: int,
        arrival_time: float | None = None,
        seed: int | None = None,
        lora_request: LoRARequest | None = None,
        tenant: str = "default",
    ) -> None:
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.sampling_params = sampling_params
        self.eos_token_id = eos_token_id  # None when the tokenizer has none
        self.max_tokens = max_tokens  # resolved limit: params.max_tokens or what the context allows
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        self.seed = seed  # effective sampling seed (params.seed, offset per child when n > 1)
        self.output_token_ids: list[int] = []
        self.all_token_ids: list[int] = list(prompt_token_ids)  # prompt + output
        self.num_computed_tokens = 0  # tokens whose KV is in the cache
        self.num_cached_tokens = 0  # prompt tokens served by the prefix cache at admission
        self.status = RequestStatus.WAITING
        self.stop_reason: int | str | None = None  # the stop token id or stop string that ended it
        self.num_preemptions = 0
        self.block_hashes: list[int] = []  # hashes of this request's full blocks, in order
        self.first_scheduled_time: float | None = None
        self.lora_request = lora_request  # the adapter its tokens use; None: the base model
        self.tenant = tenant  # who is served (fair scheduling charges its virtual token counter)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def lora_int_id(self) -> int:
        """The adapter's id, 0 for the base model."""
        return 0 if self.lora_request is None else self.lora_request.lora_int_id

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    def append_output_token_id(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, status={self.status.name}, "
            f"prompt={self.num_prompt_tokens}, output={self.num_output_tokens}, "
            f"computed={self.num_computed_tokens})"
        )
