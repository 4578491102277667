"""A real engine (scheduler, KV blocks, async bridge, HTTP app) over a fake executor: every row
samples token 5, so the server runs with no model and starts in milliseconds. Tests of limits,
auth and timeouts use it; `gate` holds the engine thread inside a step, so requests stay in
flight exactly as long as a test wants."""

from __future__ import annotations

import threading
import time

from flexserve.config import CacheConfig, EngineConfig, SchedulerConfig
from flexserve.engine.async_engine import AsyncLLMEngine
from flexserve.engine.llm_engine import LLMEngine
from flexserve.engine.model_info import ModelInfo
from flexserve.engine.plan import BatchPlan, StepResult, TokenLogprobs

MODEL = "fake"
TOKEN = 5


class FakeExecutor:
    """Samples TOKEN for every row that needs a sample; `step_s` per step; waits on `gate`."""

    def __init__(self, step_s: float = 0.0) -> None:
        self.step_s = step_s
        self.gate = threading.Event()
        self.gate.set()
        self.scheduler = None  # set by `fake_engine`: lets tests see each request's tenant
        self.tenants: dict[str, str] = {}  # request id -> tenant, of every scheduled row

    def execute(self, plan: BatchPlan) -> StepResult:
        self.gate.wait()
        if self.step_s:
            time.sleep(self.step_s)
        result = StepResult()
        for row in plan.sequences:
            request = self.scheduler.requests.get(row.request_id)
            if request is not None:
                self.tenants[row.request_id] = request.tenant
            if row.needs_sample:
                result.sampled_token_ids[row.request_id] = TOKEN
                result.logprobs[row.request_id] = TokenLogprobs([TOKEN], [0.0], [1])
        return result


def fake_engine(executor: FakeExecutor, max_model_len: int = 2048, num_blocks: int = 600,
                max_num_seqs: int = 256, tokenizer=None, **kwargs) -> AsyncLLMEngine:
    """An `AsyncLLMEngine` over `executor`; without a tokenizer prompts are token ids."""
    vocab_size = 50 if tokenizer is None else len(tokenizer)
    info = ModelInfo(name=MODEL, vocab_size=vocab_size, max_model_len=max_model_len,
                     eos_token_id=0, num_blocks=num_blocks, block_size=4, device="cpu",
                     dtype="float32")
    config = EngineConfig(cache=CacheConfig(block_size=4),
                          scheduler=SchedulerConfig(max_num_seqs=max_num_seqs))
    llm = LLMEngine(config, executor, tokenizer, info)
    executor.scheduler = llm.scheduler
    return AsyncLLMEngine(llm, log_stats=False, **kwargs)


def wait_until(predicate, timeout: float = 30.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"{what} not reached in {timeout} s"
        time.sleep(0.01)
