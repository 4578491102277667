"""AsyncLLMEngine: the real LLMEngine (scheduler, outputs) over a fake executor, no torch.

The executor's next token is a function of the context, so expected outputs are known exactly;
it can sleep per step (to show the event loop stays free) or raise (to show failures propagate).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time

import pytest

from flexserve.config import CacheConfig, EngineConfig, SchedulerConfig
from flexserve.engine.async_engine import AsyncLLMEngine, EngineDeadError
from flexserve.engine.llm_engine import LLMEngine
from flexserve.engine.model_info import ModelInfo
from flexserve.engine.plan import BatchPlan, StepResult
from flexserve.engine.serving_stats import IterationStats, LoggingStatLogger
from flexserve.sampling_params import SamplingParams

VOCAB = 97


def next_token(context: list[int]) -> int:
    return (sum(context) * 7 + len(context)) % (VOCAB - 1) + 1  # never 0 (EOS)


def expected_tokens(prompt: list[int], max_tokens: int) -> list[int]:
    context = list(prompt)
    for _ in range(max_tokens):
        context.append(next_token(context))
    return context[len(prompt):]


class FakeExecutor:
    """Samples next_token(context) for every row that needs a sample."""

    def __init__(self, step_sleep_s: float = 0.0, fail_at_step: int | None = None) -> None:
        self.step_sleep_s = step_sleep_s
        self.fail_at_step = fail_at_step
        self.num_steps = 0

    def execute(self, plan: BatchPlan) -> StepResult:
        self.num_steps += 1
        if self.fail_at_step is not None and self.num_steps >= self.fail_at_step:
            raise RuntimeError("simulated device failure")
        if self.step_sleep_s:
            time.sleep(self.step_sleep_s)
        result = StepResult()
        for row in plan.sequences:
            if row.needs_sample:
                context = row.prompt_token_ids + row.output_token_ids
                result.sampled_token_ids[row.request_id] = next_token(context)
        return result


class RecordingStatLogger:
    def __init__(self) -> None:
        self.stats: list[IterationStats] = []
        self.lock = threading.Lock()

    def record(self, stats: IterationStats) -> None:
        with self.lock:
            self.stats.append(stats)


def make_engine(num_blocks: int = 64, **executor_kwargs) -> tuple[AsyncLLMEngine, FakeExecutor]:
    config = EngineConfig(cache=CacheConfig(block_size=4),
                          scheduler=SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=64))
    info = ModelInfo(name="fake", vocab_size=VOCAB, max_model_len=128, eos_token_id=0,
                     num_blocks=num_blocks, block_size=4, device="cpu", dtype="float32")
    executor = FakeExecutor(**executor_kwargs)
    engine = AsyncLLMEngine(LLMEngine(config, executor, None, info), log_stats=False)
    engine.start()
    return engine, executor


@pytest.fixture
def engine_and_executor():
    engine, executor = make_engine()
    yield engine, executor
    engine.shutdown()


def wait_until(predicate, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.005)


async def collect(engine: AsyncLLMEngine, request_id: str, prompt: list[int], **params):
    prepared = engine.prepare(request_id, prompt, SamplingParams(temperature=0.0, **params))
    return [output async for output in engine.generate(prepared)]


def test_generate_yields_cumulative_outputs_until_finished(engine_and_executor):
    engine, _ = engine_and_executor
    outputs = asyncio.run(collect(engine, "a", [5, 6, 7], max_tokens=6))
    final = outputs[-1]
    assert final.finished and final.outputs[0].finish_reason == "length"
    assert final.outputs[0].token_ids == expected_tokens([5, 6, 7], 6)
    lengths = [len(o.outputs[0].token_ids) for o in outputs]
    assert lengths == sorted(lengths) and not any(o.finished for o in outputs[:-1])


def test_32_concurrent_requests_get_their_own_tokens(engine_and_executor):
    engine, _ = engine_and_executor

    async def main():
        prompts = [[i + 1, 2 * i + 3] for i in range(32)]
        results = await asyncio.gather(*[
            collect(engine, f"r{i}", p, max_tokens=5 + i % 3, n=1 + i % 2)
            for i, p in enumerate(prompts)
        ])
        for i, (prompt, outputs) in enumerate(zip(prompts, results)):
            final = outputs[-1]
            assert final.finished
            assert len(final.outputs) == 1 + i % 2
            for completion in final.outputs:  # greedy: every choice is the same
                assert completion.token_ids == expected_tokens(prompt, 5 + i % 3)

    asyncio.run(main())
    wait_until(lambda: not engine.engine.has_unfinished_requests())
    assert engine.engine.scheduler.kv_cache_usage == 0.0


def test_closing_the_stream_aborts_and_frees_kv_blocks():
    engine, _ = make_engine(step_sleep_s=0.01)
    recorder = RecordingStatLogger()
    engine.add_stat_logger(recorder)
    try:
        async def main():
            prepared = engine.prepare("x", [1, 2, 3], SamplingParams(max_tokens=100, n=2))
            stream = engine.generate(prepared)
            outputs = [await stream.__anext__(), await stream.__anext__()]
            await stream.aclose()
            assert not outputs[-1].finished

        asyncio.run(main())
        scheduler = engine.engine.scheduler
        wait_until(lambda: scheduler.num_running == 0 and scheduler.num_waiting == 0)
        assert scheduler.kv_cache_usage == 0.0
        wait_until(lambda: any(s.finished_requests for s in recorder.stats))
        with recorder.lock:
            finished = [f for s in recorder.stats for f in s.finished_requests]
        assert len(finished) == 1 and finished[0].aborted
        assert finished[0].finish_reasons == ["abort", "abort"]
    finally:
        engine.shutdown()


def test_abort_from_elsewhere_ends_the_stream_without_a_final_output():
    engine, _ = make_engine(step_sleep_s=0.01)
    try:
        async def main():
            prepared = engine.prepare("y", [4, 4], SamplingParams(max_tokens=100))
            outputs = []
            async for output in engine.generate(prepared):
                outputs.append(output)
                if len(outputs) == 1:
                    engine.abort("y")
            return outputs

        outputs = asyncio.run(main())
        assert outputs and not outputs[-1].finished and len(outputs) < 100
        wait_until(lambda: engine.engine.scheduler.kv_cache_usage == 0.0)
    finally:
        engine.shutdown()


def test_engine_failure_fails_every_request_and_marks_unhealthy():
    engine, _ = make_engine(fail_at_step=3)
    try:
        async def main():
            results = await asyncio.wait_for(asyncio.gather(
                *[collect(engine, f"f{i}", [i + 1], max_tokens=50) for i in range(4)],
                return_exceptions=True), timeout=10)
            return results

        results = asyncio.run(main())
        assert all(isinstance(r, EngineDeadError) for r in results), results
        assert "simulated device failure" in str(results[0])
        assert not engine.is_healthy and engine.dead_error is not None
        with pytest.raises(EngineDeadError):
            asyncio.run(collect(engine, "late", [1], max_tokens=2))
    finally:
        engine.shutdown()


def test_shutdown_fails_in_flight_requests():
    engine, _ = make_engine(step_sleep_s=0.02)

    async def main():
        task = asyncio.create_task(collect(engine, "s", [3], max_tokens=1000))
        await asyncio.sleep(0.1)
        await asyncio.to_thread(engine.shutdown)
        with pytest.raises(EngineDeadError):
            await asyncio.wait_for(task, timeout=5)

    asyncio.run(main())
    assert not engine.is_healthy


def test_a_rejected_request_fails_alone():
    engine, _ = make_engine(step_sleep_s=0.01)
    try:
        async def main():
            prepared = engine.prepare("dup", [1, 2], SamplingParams(temperature=0.0, max_tokens=20))
            stream = engine.generate(prepared)
            outputs = [await stream.__anext__()]  # "dup" is now in flight
            with pytest.raises(ValueError, match="already in use"):
                await collect(engine, "dup", [3, 4], max_tokens=2)
            outputs += [output async for output in stream]
            assert outputs[-1].outputs[0].token_ids == expected_tokens([1, 2], 20)

        asyncio.run(main())
        assert engine.is_healthy
    finally:
        engine.shutdown()


def test_event_loop_stays_responsive_while_steps_run():
    engine, executor = make_engine(step_sleep_s=0.05)
    try:
        async def main():
            gaps = []
            done = asyncio.Event()

            async def ticker():
                last = time.monotonic()
                while not done.is_set():
                    await asyncio.sleep(0.005)
                    now = time.monotonic()
                    gaps.append(now - last)
                    last = now

            tick = asyncio.create_task(ticker())
            await collect(engine, "t", [9], max_tokens=10)
            done.set()
            await tick
            return gaps

        gaps = asyncio.run(main())
        assert executor.num_steps >= 10
        # Ten 50 ms steps ran on the engine thread while the loop kept ticking every ~5 ms.
        assert len(gaps) > 20 and max(gaps) < 0.045, max(gaps)
    finally:
        engine.shutdown()


def test_iteration_stats_account_for_every_token(engine_and_executor):
    engine, _ = engine_and_executor
    recorder = RecordingStatLogger()
    engine.add_stat_logger(recorder)

    async def main():
        return await asyncio.gather(
            collect(engine, "p", [1, 2, 3], max_tokens=4, n=2),
            collect(engine, "q", [7, 8], max_tokens=3),
        )

    asyncio.run(main())
    wait_until(lambda: sum(len(s.finished_requests) for s in recorder.stats) == 2)
    with recorder.lock:
        stats = list(recorder.stats)
    assert sum(s.num_generation_tokens for s in stats) == 4 * 2 + 3
    assert sum(s.num_prompt_tokens for s in stats) == 3 + 2
    assert len([t for s in stats for t in s.time_to_first_tokens]) == 2
    # One latency per token after each completion's first: (4 - 1) * 2 + (3 - 1).
    assert len([t for s in stats for t in s.inter_token_latencies]) == 8
    finished = sorted((f for s in stats for f in s.finished_requests),
                      key=lambda f: f.num_prompt_tokens)
    assert [f.finish_reasons for f in finished] == [["length"], ["length", "length"]]
    assert all(f.queue_time is not None and 0 <= f.queue_time <= f.e2e_latency for f in finished)
    assert [f.num_generation_tokens for f in finished] == [3, 8]
    assert stats[-1].kv_cache_usage == 0.0 or not engine.engine.has_unfinished_requests()


def test_logging_stat_logger_writes_one_line_per_interval(caplog):
    stat_logger = LoggingStatLogger(interval_s=5.0)
    with caplog.at_level(logging.INFO, logger="flexserve.stats"):
        stat_logger.record(IterationStats(now=50.0))
        stat_logger.record(IterationStats(now=100.0))  # idle until here: the window starts now
        stat_logger.record(IterationStats(now=101.0, num_running=2, num_prompt_tokens=40,
                                          num_generation_tokens=10, kv_cache_usage=0.25))
        stat_logger.record(IterationStats(now=105.0, num_running=2, num_generation_tokens=10,
                                          num_preemptions=1, kv_cache_usage=0.5))
        stat_logger.record(IterationStats(now=107.0, num_running=2))
        stat_logger.record(IterationStats(now=120.0))  # no tokens since the last line: no line
        stat_logger.record(IterationStats(now=130.0))
    lines = [r.getMessage() for r in caplog.records]
    assert lines == [
        "running: 2 reqs, waiting: 0 reqs, KV cache usage: 50.0%, prompt throughput: 8.0 tok/s, "
        "generation throughput: 4.0 tok/s, preemptions: 1 (total 1), prefix cache hit rate: 0.0%",
    ]


class PreparingExecutor(FakeExecutor):
    """Records which thread ran its per-thread start-up, and can fail there."""

    def __init__(self, fail: bool = False) -> None:
        super().__init__()
        self.fail = fail
        self.prepared_on: list[str] = []

    def prepare_thread(self) -> None:
        self.prepared_on.append(threading.current_thread().name)
        if self.fail:
            raise RuntimeError("simulated start-up failure")


@pytest.mark.parametrize("fail", [False, True])
def test_engine_thread_runs_the_executors_per_thread_start_up_once(fail, caplog):
    # cuDNN keeps attention plans per thread: the engine thread builds its own before any step;
    # a failure there only costs speed, so requests are still served.
    config = EngineConfig(cache=CacheConfig(block_size=4),
                          scheduler=SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=64))
    info = ModelInfo(name="fake", vocab_size=VOCAB, max_model_len=128, eos_token_id=0,
                     num_blocks=64, block_size=4, device="cpu", dtype="float32")
    executor = PreparingExecutor(fail=fail)
    engine = AsyncLLMEngine(LLMEngine(config, executor, None, info), log_stats=False)
    with caplog.at_level(logging.ERROR, logger="flexserve.engine.async_engine"):
        engine.start()
        try:
            outputs = asyncio.run(collect(engine, "a", [5, 6, 7], max_tokens=3))
        finally:
            engine.shutdown()
    assert outputs[-1].outputs[0].token_ids == expected_tokens([5, 6, 7], 3)
    assert executor.prepared_on == ["flexserve-engine"]
    assert any("per-thread engine start-up failed" in r.getMessage() for r in caplog.records) is fail
