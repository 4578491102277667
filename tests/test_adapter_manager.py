"""Adapter residency: device slots, LRU reuse, pins that never let an in-use slot change, unload
while running, the scheduler's per-batch adapter limit, and the worker's host-memory LRU.

Everything but the last section is pure Python: a fake executor plays the worker and checks that
every row's slot holds the row's adapter, using the plan's `lora_slot_loads` as its only input.
"""

from __future__ import annotations

import random

import pytest

from flexserve.config import CacheConfig, EngineConfig, LoRAConfig, SchedulerConfig
from flexserve.engine.adapter_manager import (
    AdapterExistsError,
    AdapterManager,
    AdapterNotFoundError,
)
from flexserve.engine.llm_engine import LLMEngine
from flexserve.engine.lora_request import LoRARequest
from flexserve.engine.model_info import ModelInfo
from flexserve.engine.plan import BatchPlan, StepResult
from flexserve.engine.request import Request
from flexserve.engine.scheduler import Scheduler
from flexserve.sampling_params import SamplingParams

VOCAB = 50


def lora(name: str, lora_int_id: int) -> LoRARequest:
    return LoRARequest(name, lora_int_id, f"/adapters/{name}")


# ------------------------------------------------------------------------------ AdapterManager
def test_slots_fill_then_reuse_the_least_recently_used_unpinned_one():
    m = AdapterManager(max_loras=2)
    for i, name in enumerate("abc", start=1):
        m.register(lora(name, i))
        m.add_request(f"r{name}", i)
    assert m.pin("ra", 1) == (0, True)
    assert m.pin("rb", 2) == (1, True)
    assert not m.can_pin(3)  # both slots pinned
    m.unpin("rb")
    m.unpin("ra")  # a is now the most recently used idle slot
    assert m.can_pin(3)
    assert m.pin("rc", 3) == (1, True)  # b's slot: least recently used
    assert m.slot_of(2) == -1 and m.slot_of(1) == 0
    m.add_request("ra2", 1)
    assert m.pin("ra2", 1) == (0, False)  # still resident: no copy
    m.check_invariants()
    assert m.num_resident == 2


def test_names_ids_and_unknown_adapters():
    m = AdapterManager(max_loras=1)
    m.register(lora("a", 1))
    with pytest.raises(AdapterExistsError, match="already been loaded"):
        m.register(lora("a", 2))
    with pytest.raises(ValueError, match="lora_int_id 1"):
        m.register(lora("b", 1))
    with pytest.raises(AdapterNotFoundError, match="'zz' cannot be found"):
        m.lookup("zz")
    with pytest.raises(AdapterNotFoundError):
        m.unregister("zz")
    assert m.names == ("a",) and m.lookup("a").lora_int_id == 1
    with pytest.raises(ValueError):
        AdapterManager(0)


def test_unload_in_use_stops_new_requests_and_frees_after_the_last_one():
    m = AdapterManager(max_loras=1)
    m.register(lora("a", 1))
    m.add_request("r1", 1)
    m.add_request("r2", 1)  # accepted, still waiting
    m.pin("r1", 1)
    assert m.unregister("a") == 2
    assert m.names == () and m.pop_freed_ids() == []
    with pytest.raises(AdapterNotFoundError):
        m.lookup("a")
    with pytest.raises(AdapterNotFoundError):
        m.add_request("r3", 1)
    m.register(lora("a", 2))  # the name is free again; the old registration keeps draining
    assert m.slot_of(1) == 0 and not m.can_pin(2)
    m.finish_request("r1")
    m.add_request("r4", 2)
    assert m.pin("r4", 2) == (0, True)  # the draining adapter's slot was unpinned: reused
    assert not m.can_pin(1)  # r2 waits: the only slot is pinned by r4
    m.finish_request("r4")
    m.pin("r2", 1)
    m.finish_request("r2")
    assert m.pop_freed_ids() == [1]
    assert m.get(1) is None and m.get(2) is not None
    assert m.num_running_by_name() == {"a": 0}
    m.check_invariants()


def test_pinned_slots_never_change_under_random_operations():
    rng = random.Random(0)
    m = AdapterManager(max_loras=3)
    next_id = 1
    names: dict[str, int] = {}
    requests: dict[str, int] = {}  # request id -> adapter id
    pinned: dict[str, tuple[int, int]] = {}  # request id -> (adapter id, slot it saw)
    for step in range(4000):
        op = rng.random()
        if op < 0.08:
            name = rng.choice("abcdefg")
            if name not in names:
                m.register(lora(name, next_id))
                names[name] = next_id
                next_id += 1
        elif op < 0.12 and names:
            name = rng.choice(sorted(names))
            m.unregister(name)
            del names[name]
        elif op < 0.4 and names:
            request_id = f"r{step}"
            m.add_request(request_id, names[rng.choice(sorted(names))])
            requests[request_id] = m._users[request_id]
        elif op < 0.7 and requests:
            request_id = rng.choice(sorted(set(requests) - set(pinned)) or [None])
            if request_id is not None and m.can_pin(requests[request_id]):
                slot, _ = m.pin(request_id, requests[request_id])
                pinned[request_id] = (requests[request_id], slot)
        elif op < 0.85 and pinned:
            request_id = rng.choice(sorted(pinned))
            m.unpin(request_id)
            del pinned[request_id]
        elif requests:
            request_id = rng.choice(sorted(requests))
            m.finish_request(request_id)
            del requests[request_id]
            pinned.pop(request_id, None)
        for adapter_id, slot in pinned.values():
            assert m.slot_of(adapter_id) == slot  # never evicted or moved while in use
        assert len({slot for _, slot in pinned.values()}) <= 3
        m.check_invariants()


# ------------------------------------------------------------------------------ scheduler
def next_token(context: list[int], adapter_id: int) -> int:
    return (sum(context) * 7 + len(context) + 13 * adapter_id) % (VOCAB - 1) + 1


class SlotCheckingExecutor:
    """Keeps the 'device slots' as the plans say and checks every row against them."""

    def __init__(self, scheduler_of, max_loras: int) -> None:
        self.scheduler_of = scheduler_of  # () -> Scheduler (the engine builds it after us)
        self.slots: list[int] = [0] * max_loras  # lora_int_id in each slot
        self.cpu: set[int] = set()
        self.removed: list[int] = []
        self.distinct_per_step: list[int] = []
        self.fail_ids: set[int] = set()
        self.loads: list[tuple[int, str]] = []

    def add_lora(self, lora_request: LoRARequest) -> None:
        if lora_request.lora_path.endswith("broken-on-disk"):
            raise ValueError("adapter_config.json is missing")
        self.cpu.add(lora_request.lora_int_id)

    def remove_lora(self, lora_int_id: int) -> None:
        self.removed.append(lora_int_id)
        self.cpu.discard(lora_int_id)

    @property
    def num_cpu_loras(self) -> int:
        return len(self.cpu)

    def execute(self, plan: BatchPlan) -> StepResult:
        result = StepResult()
        for slot, lora_request in plan.lora_slot_loads.items():
            self.loads.append((slot, lora_request.lora_name))
            if lora_request.lora_int_id in self.fail_ids:
                result.lora_load_errors[lora_request.lora_int_id] = "files vanished"
                self.slots[slot] = 0
            else:
                self.slots[slot] = lora_request.lora_int_id
        requests = self.scheduler_of().requests
        used = set()
        for row in plan.sequences:
            adapter_id = requests[row.request_id].lora_int_id
            if adapter_id:
                assert row.lora_slot >= 0 and self.slots[row.lora_slot] in (adapter_id, 0)
                used.add(row.lora_slot)
            else:
                assert row.lora_slot == -1
            if row.needs_sample:
                context = row.prompt_token_ids + row.output_token_ids
                result.sampled_token_ids[row.request_id] = next_token(context, adapter_id)
        self.distinct_per_step.append(len(used))
        return result


def make_engine(max_loras: int = 2, num_blocks: int = 256, max_num_seqs: int = 64,
                **lora_kwargs) -> tuple[LLMEngine, SlotCheckingExecutor]:
    config = EngineConfig(
        cache=CacheConfig(block_size=4),
        scheduler=SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=max_num_seqs),
        lora=LoRAConfig(max_loras=max_loras, **lora_kwargs),
    )
    info = ModelInfo(name="fake", vocab_size=VOCAB, max_model_len=128, eos_token_id=0,
                     num_blocks=num_blocks, block_size=4, device="cpu", dtype="float32")
    holder: list[LLMEngine] = []
    executor = SlotCheckingExecutor(lambda: holder[0].scheduler, max_loras)
    engine = LLMEngine(config, executor, None, info)
    holder.append(engine)
    return engine, executor


def expected(prompt: list[int], max_tokens: int, adapter_id: int) -> list[int]:
    context = list(prompt)
    for _ in range(max_tokens):
        context.append(next_token(context, adapter_id))
    return context[len(prompt):]


def run_all(engine: LLMEngine) -> dict[str, list[int]]:
    finished = {}
    for _ in range(1000):
        if not engine.has_unfinished_requests():
            break
        for output in engine.step():
            if output.finished:
                finished[output.request_id] = output.outputs[0].token_ids
    assert not engine.has_unfinished_requests()
    return finished


GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


def test_batches_never_mix_more_adapters_than_slots_and_outputs_follow_each_adapter():
    engine, executor = make_engine(max_loras=2)
    ids = {name: engine.add_lora(name, f"/adapters/{name}").lora_int_id for name in "abcd"}
    prompts = {}
    for i in range(16):
        name = "abcd"[i % 4] if i % 5 else None  # every fifth request uses the base model
        prompt = [1 + i, 2 + i, 3]
        engine.add_request(f"q{i}", prompt, GREEDY, lora_name=name)
        prompts[f"q{i}"] = (prompt, ids[name] if name else 0)
    finished = run_all(engine)
    assert max(executor.distinct_per_step) == 2
    for request_id, (prompt, adapter_id) in prompts.items():
        assert finished[request_id] == expected(prompt, 6, adapter_id)
    adapters = engine.scheduler.adapter_manager
    adapters.check_invariants()
    assert engine.lora_stats() == ({"a": 0, "b": 0, "c": 0, "d": 0}, 2, 4)
    assert engine.scheduler.kv_cache_usage == 0.0


def test_a_request_without_a_slot_is_skipped_not_blocking_those_behind():
    engine, executor = make_engine(max_loras=1)
    engine.add_lora("a", "/adapters/a")
    engine.add_lora("b", "/adapters/b")
    long = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    engine.add_request("a0", [1, 2], long, lora_name="a")
    engine.step()  # a0 pins the only slot
    engine.add_request("b0", [3, 4], GREEDY, lora_name="b")
    engine.add_request("base", [5, 6], GREEDY)
    engine.step()
    scheduler = engine.scheduler
    running = {r.request_id for r in scheduler.running}
    assert running == {"a0", "base"}  # b0 waits for the slot; base went past it
    assert [r.request_id for r in scheduler.waiting] == ["b0"]
    finished = run_all(engine)
    assert set(finished) == {"a0", "b0", "base"}


def test_a_skipped_request_is_not_starved_by_traffic_on_resident_adapters():
    engine, executor = make_engine(max_loras=1)
    engine.add_lora("a", "/adapters/a")
    engine.add_lora("b", "/adapters/b")
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    engine.add_request("a0", [1], params, lora_name="a")
    engine.step()
    engine.add_request("b0", [2], params, lora_name="b")
    for step in range(40):  # a new request for the resident adapter every step
        engine.add_request(f"a{step + 1}", [3 + step], params, lora_name="a")
        for output in engine.step():
            if output.request_id == "b0" and output.finished:
                break
        else:
            continue
        break
    else:
        pytest.fail("b0 never ran while adapter a kept getting requests")
    assert step < 10
    run_all(engine)


def test_unload_while_running_lets_accepted_requests_finish_then_frees():
    engine, executor = make_engine(max_loras=2)
    first = engine.add_lora("a", "/adapters/a")
    engine.add_request("r1", [1, 2, 3], GREEDY, lora_name="a")
    engine.step()
    engine.add_request("r2", [4, 5], GREEDY, lora_name="a")  # accepted before the unload
    assert engine.remove_lora("a") == 2
    with pytest.raises(AdapterNotFoundError):
        engine.add_request("r3", [1], GREEDY, lora_name="a")
    with pytest.raises(AdapterNotFoundError):
        engine.remove_lora("a")
    second = engine.add_lora("a", "/adapters/a-v2")  # reload under the same name at once
    assert second.lora_int_id != first.lora_int_id
    engine.add_request("r4", [1, 2, 3], GREEDY, lora_name="a")
    finished = run_all(engine)
    assert finished["r1"] == expected([1, 2, 3], 6, first.lora_int_id)
    assert finished["r2"] == expected([4, 5], 6, first.lora_int_id)
    assert finished["r4"] == expected([1, 2, 3], 6, second.lora_int_id)
    assert first.lora_int_id in executor.removed and second.lora_int_id not in executor.removed
    assert [r.lora_name for r in engine.list_loras()] == ["a"]
    engine.scheduler.adapter_manager.check_invariants()


def test_prefix_cache_is_shared_only_within_one_adapter_registration():
    engine, _ = make_engine(max_loras=2)
    engine.add_lora("a", "/adapters/a")
    engine.add_lora("b", "/adapters/b")
    prompt = list(range(1, 14))  # three full blocks of 4
    engine.add_request("a1", prompt, GREEDY, lora_name="a")
    run_all(engine)
    hits = []
    for request_id, name in (("b1", "b"), ("base", None), ("a2", "a")):
        engine.add_request(request_id, prompt, GREEDY, lora_name=name)
        engine.step()
        hits.append(engine.scheduler.requests[request_id].num_cached_tokens)
        run_all(engine)
    assert hits == [0, 0, 12]


def test_a_failed_slot_load_ends_its_requests_and_the_adapter_only():
    engine, executor = make_engine(max_loras=2)
    bad = engine.add_lora("bad", "/adapters/bad")
    engine.add_lora("good", "/adapters/good")
    executor.fail_ids.add(bad.lora_int_id)
    engine.add_request("x", [1, 2], GREEDY, lora_name="bad")
    engine.add_request("y", [3, 4], GREEDY, lora_name="good")
    engine.add_request("z", [5, 6], GREEDY)
    outputs = engine.step()
    assert {o.request_id for o in outputs} == {"y", "z"}  # x's token was dropped
    failed = engine.pop_failed_requests()
    assert list(failed) == ["x"] and "'bad' could not be loaded: files vanished" in failed["x"]
    assert [r.lora_name for r in engine.list_loras()] == ["good"]
    with pytest.raises(AdapterNotFoundError):
        engine.add_request("x2", [1], GREEDY, lora_name="bad")
    finished = run_all(engine)
    assert set(finished) == {"y", "z"}
    engine.scheduler.adapter_manager.check_invariants()
    assert engine.scheduler.kv_cache_usage == 0.0


def test_loading_errors_and_disabled_lora():
    engine, executor = make_engine()
    with pytest.raises(ValueError, match="adapter_config.json is missing"):
        engine.add_lora("x", "/adapters/broken-on-disk")
    assert engine.list_loras() == ()
    engine.add_lora("x", "/adapters/x")
    with pytest.raises(AdapterExistsError):
        engine.add_lora("x", "/adapters/x")
    config = EngineConfig()
    info = ModelInfo(name="fake", vocab_size=VOCAB, max_model_len=128, eos_token_id=0,
                     num_blocks=8, block_size=16, device="cpu", dtype="float32")
    plain = LLMEngine(config, executor, None, info)
    assert not plain.lora_enabled and plain.list_loras() == ()
    with pytest.raises(ValueError, match="LoRA is not enabled"):
        plain.add_request("r", [1], GREEDY, lora_name="x")
    with pytest.raises(ValueError, match="LoRA is not enabled"):
        plain.add_lora("x", "/adapters/x")


def test_scheduler_rejects_adapters_when_lora_is_disabled():
    scheduler = Scheduler(SchedulerConfig(), CacheConfig(), 16, 64)
    request = Request("r", [1, 2], GREEDY, None, 4, lora_request=lora("a", 1))
    with pytest.raises(ValueError, match="LoRA is not enabled"):
        scheduler.add_request(request)


def test_lora_config_validates_itself(tmp_path):
    assert LoRAConfig().max_cpu_loras == 8
    assert LoRAConfig(max_loras=12).max_cpu_loras == 12
    with pytest.raises(ValueError, match="max_cpu_loras"):
        LoRAConfig(max_loras=4, max_cpu_loras=2)
    with pytest.raises(ValueError, match="max_lora_rank"):
        LoRAConfig(max_lora_rank=0)
    with pytest.raises(ValueError, match="max_loras"):
        LoRAConfig(max_loras=True)
    with pytest.raises(ValueError, match="not a directory"):
        LoRAConfig(allowed_adapter_dir=str(tmp_path / "nope"))
    assert LoRAConfig(allowed_adapter_dir=str(tmp_path / ".")).allowed_adapter_dir == str(tmp_path)
    with pytest.raises(ValueError, match="needs a path"):
        LoRAConfig(lora_modules={"a": ""})
    with pytest.raises(ValueError):
        LoRARequest("a", 0, "/p")


# ------------------------------------------------------------------------------ worker LRU
def test_worker_host_cache_is_an_lru_bounded_by_max_cpu_loras(tmp_path, tiny_config):
    import torch

    from flexserve.model.llama import LlamaForCausalLM
    from flexserve.peft.bypass import target_shapes
    from flexserve.peft.lora import LoRAAdapter
    from flexserve.peft.peft_io import save_peft_adapter
    from flexserve.worker.lora_manager import LoRAManager

    config = tiny_config("llama")
    model = LlamaForCausalLM(config)
    manager = LoRAManager(model, LoRAConfig(max_loras=1, max_cpu_loras=2, max_lora_rank=8),
                          config, torch.device("cpu"), torch.float32)
    requests = []
    for i in range(3):
        adapter = LoRAAdapter.create(target_shapes(config), 2, 4, 8.0, ["q_proj"],
                                     generator=torch.Generator().manual_seed(i))
        path = tmp_path / f"a{i}"
        save_peft_adapter(adapter, str(path))
        requests.append(LoRARequest(f"a{i}", i + 1, str(path)))
    for request in requests:
        manager.add(request)
    assert manager.num_cpu_loras == 2 and list(manager._cache) == [2, 3]
    manager.get(requests[1])  # touch: a1 becomes the most recent
    manager.get(requests[0])  # a0 was evicted: read again from disk, evicting a2
    assert list(manager._cache) == [2, 1]
    assert manager.load_slots({0: requests[0]}) == {}
    assert manager.slot_ids == [1]
    q = manager.modules[(0, "q_proj")]
    assert torch.equal(q.lora_a[0, :4], manager._cache[1].weights[(0, "q_proj")][0])
    assert q.lora_a[0, 4:].abs().sum() == 0  # rank 4 in a rank-8 slot: zero padded
    assert manager.modules[(0, "k_proj")].lora_a[0].abs().sum() == 0  # not a target: cleared
    manager.remove(1)
    (tmp_path / "a0" / "adapter_config.json").unlink()
    errors = manager.load_slots({0: requests[0]})  # evicted and gone from disk
    assert "adapter_config.json is missing" in errors[1]
    assert manager.slot_ids == [0] and q.lora_a[0].abs().sum() == 0 and q.scaling[0] == 0


def test_async_engine_fails_only_the_requests_of_an_adapter_that_cannot_load():
    import asyncio

    from flexserve.engine.adapter_manager import AdapterLoadError
    from flexserve.engine.async_engine import AsyncLLMEngine

    engine, executor = make_engine(max_loras=2)
    async_engine = AsyncLLMEngine(engine, log_stats=False)
    async_engine.start()

    async def scenario() -> None:
        bad = await async_engine.add_lora("bad", "/adapters/bad")
        await async_engine.add_lora("good", "/adapters/good")
        with pytest.raises(AdapterExistsError):
            await async_engine.add_lora("good", "/adapters/good")
        with pytest.raises(ValueError, match="adapter_config.json is missing"):
            await async_engine.add_lora("broken", "/adapters/broken-on-disk")
        executor.fail_ids.add(bad.lora_int_id)

        async def run(request_id: str, lora_name: str | None) -> list[int]:
            prepared = async_engine.prepare(request_id, [1, 2, 3], GREEDY, lora_name=lora_name)
            final = None
            async for output in async_engine.generate(prepared):
                final = output
            return final.outputs[0].token_ids

        results = await asyncio.gather(run("b", "bad"), run("g", "good"), run("n", None),
                                       return_exceptions=True)
        assert isinstance(results[0], AdapterLoadError)
        assert "'bad' could not be loaded: files vanished" in str(results[0])
        assert results[1] == expected([1, 2, 3], 6, 2) and results[2] == expected([1, 2, 3], 6, 0)
        assert await async_engine.remove_lora("good") == 0
        with pytest.raises(AdapterNotFoundError):
            await async_engine.remove_lora("good")
        assert async_engine.list_loras() == ()

    try:
        asyncio.run(scenario())
        assert async_engine.is_healthy
    finally:
        async_engine.shutdown()


def test_a_bad_startup_adapter_fails_the_engine_with_its_name():
    with pytest.raises(ValueError, match="LoRA adapter x=/adapters/broken-on-disk: adapter_config"):
        make_engine(lora_modules={"x": "/adapters/broken-on-disk"})
    engine, executor = make_engine(lora_modules={"a": "/adapters/a", "b": "/adapters/b"})
    assert [r.lora_name for r in engine.list_loras()] == ["a", "b"] and executor.num_cpu_loras == 2


def test_llm_refuses_lora_options_with_lora_turned_off():
    from flexserve import LLM

    with pytest.raises(ValueError, match="enable_lora=False turns LoRA off, so max_loras"):
        LLM("unused", enable_lora=False, max_loras=2)  # refused before any model is read
