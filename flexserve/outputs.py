"""What generation returns to callers (offline `LLM` and the HTTP server), vLLM's shapes."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class Logprob:
    """One token's log-probability at one position."""

    logprob: float  # natural log, from the raw logits
    rank: int  # 1-based rank in the vocabulary
    decoded_token: str | None = None  # the token's text


# One dict per position: token id -> Logprob, the chosen token first, then the top-k alternatives.
PositionLogprobs = dict[int, Logprob]


@dataclass(slots=True)
class CompletionOutput:
    """One of the `n` completions of a prompt."""

    index: int  # 0..n-1
    text: str  # detokenized output (stop string removed unless asked to include it)
    token_ids: list[int]  # generated token ids
    cumulative_logprob: float | None  # sum of chosen-token logprobs when logprobs were requested
    logprobs: list[PositionLogprobs] | None  # one entry per generated token, when requested
    finish_reason: str | None = None  # "stop", "length", "abort" or None while running
    stop_reason: int | str | None = None  # the stop token id or string that ended it

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(slots=True)
class RequestOutput:
    """The state of one prompt's generation; streamed as it grows, final when `finished`."""

    request_id: str
    prompt: str | None  # the prompt text when given as text
    prompt_token_ids: list[int]
    prompt_logprobs: list[PositionLogprobs | None] | None  # per prompt token; the first is None
    outputs: list[CompletionOutput] = field(default_factory=list)
    finished: bool = False
    num_cached_tokens: int = 0  # prompt tokens served by the prefix cache
