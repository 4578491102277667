"""Many fine-tuning jobs on one backbone (CPU, fp32, tiny random Llamas).

- Three jobs with different ranks, target modules, lengths and hyper-parameters, trained
  concurrently (their sequences packed into shared bins, their windows in the same iterations),
  each end with the adapter the same job trains alone. Bound, as the fine-tuning exactness tests'
  (tests/test_finetune_packing.py): relative error of the weight change <= 1e-4; the runs differ
  only in float rounding (GEMM batch shapes, gradient summation order). A job that fails (NaN
  loss) leaves the other two with the same adapters.
- Fine-tuning slots are the jobs' own: a job waits for one (FinetuneCapacityError naming why),
  never for a serving slot, and one whose training state exceeds the budget is refused.
- Over HTTP with default flags, eight jobs submitted at once all run, at least four of them in
  the same iterations, and all succeed; with one fine-tuning slot the second job stays `queued`
  with an event saying why, then runs.
"""

from __future__ import annotations

import json
import time

import openai
import pytest
import torch
from safetensors.torch import load_file

from flexserve import LLM
from flexserve import config as cfg
from flexserve.engine.finetune_capacity import FinetuneCapacityError
from flexserve.entrypoints.engine_builder import build_async_engine
from flexserve.entrypoints.openai.api_server import ServerThread, build_app
from flexserve.finetune.hyperparameters import Hyperparameters

from _tokenizer import tiny_byte_level_tokenizer
from _training_data import random_training_data

MAX_RELATIVE_ERROR = 1e-4


@pytest.fixture(scope="module")
def model_dir(tiny_config, tiny_checkpoint):
    config = tiny_config("llama", vocab_size=320, hidden_size=128, intermediate_size=256,
                         max_position_embeddings=128)
    path = tiny_checkpoint(config, seed=5)
    tiny_byte_level_tokenizer().save_pretrained(path)
    return path


JOBS = {  # different ranks, targets, lengths, batch sizes, schedules, clipping and dropout
    "a": (random_training_data([5, 9, 3, 12, 7, 4, 6, 11], seed=1), Hyperparameters.from_dict({
        "batch_size": 4, "n_epochs": 1, "shuffle": False, "learning_rate": 1e-3,
        "lr_scheduler": "constant", "max_grad_norm": None,
        "lora": {"r": 8, "alpha": 16, "target_modules": ["q_proj", "v_proj", "down_proj"]}})),
    "b": (random_training_data([14, 6, 9, 4, 13, 8], seed=2), Hyperparameters.from_dict({
        "batch_size": 3, "n_epochs": 1, "shuffle": True, "seed": 7, "learning_rate": 3e-3,
        "lr_scheduler": "linear", "max_grad_norm": 0.5,
        "lora": {"r": 4, "alpha": 8, "dropout": 0.1,
                 "target_modules": ["k_proj", "o_proj", "gate_proj", "up_proj"]}})),
    "c": (random_training_data([20, 17, 22, 18], seed=3), Hyperparameters.from_dict({
        "batch_size": 2, "n_epochs": 2, "shuffle": False, "learning_rate": 2e-3,
        "lr_scheduler": "cosine", "max_grad_norm": 1.0,
        "lora": {"r": 2, "alpha": 4, "target_modules": ["q_proj", "up_proj", "down_proj"]}})),
}


def new_llm(model_dir: str, **kwargs) -> LLM:
    return LLM(model_dir, enable_lora=True, max_lora_rank=8, max_loras=2, max_model_len=64,
               max_num_batched_tokens=64, **kwargs)


def train(llm: LLM, names: list[str], path, fail: str | None = None):
    """Run these jobs together to the end; returns each one's (initial, final) adapter (None
    for the job made to fail) and the plans' sets of jobs with windows and sequence starts."""
    engine = llm.engine
    states = {name: engine.add_finetune_job(*JOBS[name]) for name in names}
    initial = {}
    for name, state in states.items():
        engine.save_finetune_adapter(state.job_id, str(path / f"{name}-initial"))
        initial[name] = load_file(str(path / f"{name}-initial" / "adapter_model.safetensors"))
    scheduler = engine.scheduler
    schedule, schedule_continuation = scheduler.schedule, scheduler.schedule_continuation
    windows, starts = [], []

    def record(plan):
        if plan is not None:
            windows.append({w.job_id for w in plan.finetune_windows + plan.backward_windows})
            starts.append({s.job_id for s in plan.finetune_starts})
        return plan

    # Plans come from both (asynchronous scheduling plans steps ahead).
    scheduler.schedule = lambda: record(schedule())
    scheduler.schedule_continuation = lambda previous: record(schedule_continuation(previous))
    num_steps = 0
    while not all(state.finished for state in states.values()):
        if fail is not None and num_steps == 3:
            engine.executor.finetune_runner.inject_fault(states[fail].job_id, "nan_loss")
        engine.step()
        num_steps += 1
    adapters = {}
    for name, state in states.items():
        if name == fail:
            assert state.status.value == "failed" and "loss" in state.error
            continue
        assert state.status.value == "succeeded", state.error
        engine.save_finetune_adapter(state.job_id, str(path / name))
        adapters[name] = (initial[name],
                          load_file(str(path / name / "adapter_model.safetensors")))
    assert engine.scheduler.kv_cache_usage == 0.0
    return adapters, windows, starts


def change_error(ours: dict, alone: dict, initial: dict) -> float:
    assert sorted(ours) == sorted(alone) == sorted(initial)
    keys = sorted(alone)
    a = torch.cat([(ours[k] - initial[k]).double().flatten() for k in keys])
    b = torch.cat([(alone[k] - initial[k]).double().flatten() for k in keys])
    assert b.norm() > 0
    return float((a - b).norm() / b.norm())


def test_three_concurrent_jobs_each_train_the_adapter_they_train_alone(model_dir, tmp_path):
    alone = {}
    for name in JOBS:
        adapters, _, _ = train(new_llm(model_dir), [name], tmp_path / f"alone-{name}")
        alone[name] = adapters[name][1]
    llm = new_llm(model_dir)
    together, windows, starts = train(llm, list(JOBS), tmp_path / "together")
    # They shared bins (sequences of several jobs started in one plan) and iterations.
    assert sum(len(jobs) == 3 for jobs in starts) >= 1
    assert sum(len(jobs) == 3 for jobs in windows) >= 2
    assert llm.engine.scheduler.finetune.num_rounds >= 2
    for name, (initial, final) in together.items():
        error = change_error(final, alone[name], initial)
        print(f"job {name}: concurrent vs alone, relative difference of the weight change "
              f"{error:.2e}")
        assert error <= MAX_RELATIVE_ERROR, (name, error)
    # One job failing mid-run (a NaN loss) changes nothing for the other two.
    survivors, _, _ = train(new_llm(model_dir), list(JOBS), tmp_path / "failing", fail="b")
    assert sorted(survivors) == ["a", "c"]
    for name, (initial, final) in survivors.items():
        assert change_error(final, alone[name], initial) <= MAX_RELATIVE_ERROR, name


def test_jobs_wait_for_their_own_slots_and_memory(model_dir):
    llm = new_llm(model_dir, max_finetune_loras=1)
    engine = llm.engine
    capacity = engine.finetune_capacity
    assert (capacity.first_slot, capacity.num_slots) == (2, 1)
    first = engine.add_finetune_job(*JOBS["a"])
    assert first.lora_slot == 2  # after the two serving slots, which stay free for adapters
    with pytest.raises(FinetuneCapacityError, match="all 1 fine-tuning slots are held"):
        engine.add_finetune_job(*JOBS["b"])
    engine.cancel_finetune_job(first.job_id)  # its slot goes back when it ends
    second = engine.add_finetune_job(*JOBS["b"])
    assert second.lora_slot == 2
    engine.cancel_finetune_job(second.job_id)
    # Memory: 16 bytes per adapter parameter; a budget below a job's state refuses it at once.
    data, hp = JOBS["a"]
    need = capacity.state_bytes(hp.lora.r, hp.lora.target_modules)
    # rank 8 on q (128 -> 128), v (128 -> 64 with GQA 4:2) and down (256 -> 128), 2 layers
    assert need == 16 * 2 * 8 * ((128 + 128) + (128 + 64) + (256 + 128))
    small = new_llm(model_dir, job_memory_gib=need / (1 << 30) / 2, max_finetune_loras=1)
    with pytest.raises(ValueError, match="exceeds the .* MiB fine-tuning jobs have"):
        small.engine.add_finetune_job(data, hp)


# ------------------------------------------------------------------------------------ HTTP
TEXTS = ["the quick brown fox jumps", "over the lazy dog", "héllo wörld café",
         "café au lait", "quick brown dogs", "the dog jumps over the fox"]


def serve(model_dir: str, state_dir: str, job_memory_gib: float | None = None, **lora):
    from flexserve.finetune.service import FinetuneServiceConfig

    config = cfg.EngineConfig(model=cfg.ModelConfig(model=model_dir, max_model_len=128),
                              cache=cfg.CacheConfig(kv_cache_gib=0.02),
                              lora=cfg.LoRAConfig(max_lora_rank=4, **lora),
                              finetune=cfg.FinetuneConfig(job_memory_gib=job_memory_gib),
                              coserve=cfg.CoserveConfig(slo_tpot_ms=None))
    engine = build_async_engine(config, log_stats=False)
    thread = ServerThread(build_app(engine, served_model_name="tiny",
                                    finetune=FinetuneServiceConfig(state_dir=state_dir)))
    url = thread.start()
    return engine, thread, openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)


def submit(client, num_jobs: int) -> list:
    jobs = []
    for i in range(num_jobs):
        texts = TEXTS[i % len(TEXTS):] + TEXTS[:i % len(TEXTS)]
        file_id = client.files.create(file=(f"{i}.jsonl", "".join(
            json.dumps({"text": t}) + "\n" for t in texts[:4]).encode()),
            purpose="fine-tune").id
        jobs.append(client.fine_tuning.jobs.create(
            model="tiny", training_file=file_id, seed=i, suffix=f"j{i}",
            hyperparameters={"n_epochs": 2, "batch_size": 2, "learning_rate": 1e-3},
            extra_body={"lora": {"r": 4, "alpha": 8,
                                 "target_modules": ["q_proj", "v_proj"]}}))
    return jobs


def wait_all(client, jobs, timeout: float = 120.0) -> list:
    deadline = time.monotonic() + timeout
    while True:
        done = [client.fine_tuning.jobs.retrieve(job.id) for job in jobs]
        if all(job.status in ("succeeded", "failed", "cancelled") for job in done):
            return done
        assert time.monotonic() < deadline, [job.status for job in done]
        time.sleep(0.05)


class JobsPerIteration:
    def __init__(self) -> None:
        self.iterations: list[frozenset[str]] = []

    def record(self, stats) -> None:
        self.iterations.append(frozenset(stats.finetune_forward_tokens)
                               | frozenset(stats.finetune_backward_tokens))


def test_eight_jobs_at_once_over_http_with_default_flags(model_dir, tmp_path):
    engine, thread, client = serve(model_dir, str(tmp_path))
    recorder = JobsPerIteration()
    engine.add_stat_logger(recorder)
    try:
        jobs = wait_all(client, submit(client, 8))
        assert [job.status for job in jobs] == ["succeeded"] * 8, [j.error for j in jobs]
        # Nobody waited for a slot: every job started at once and trained beside the others.
        for job in jobs:
            messages = [e.message for e in client.fine_tuning.jobs.list_events(job.id).data]
            assert not any(m.startswith("Queued: waiting") for m in messages)
        assert max(len(jobs) for jobs in recorder.iterations) >= 4
    finally:
        thread.stop()
        engine.shutdown()


def test_a_job_without_room_stays_queued_and_says_why(model_dir, tmp_path):
    engine, thread, client = serve(model_dir, str(tmp_path), max_finetune_loras=1)
    try:
        first, second = submit(client, 2)
        deadline = time.monotonic() + 60
        while True:
            events = client.fine_tuning.jobs.list_events(second.id).data
            waiting = [e.message for e in events if e.message.startswith("Queued: waiting")]
            if waiting:
                break
            assert time.monotonic() < deadline, "no waiting event"
            time.sleep(0.02)
        assert waiting == ["Queued: waiting for room on the engine: all 1 fine-tuning slots "
                           "are held by running jobs."]
        assert client.fine_tuning.jobs.retrieve(second.id).status in ("queued", "running")
        assert [job.status for job in wait_all(client, [first, second])] == ["succeeded"] * 2
    finally:
        thread.stop()
        engine.shutdown()


def test_a_job_whose_state_can_never_fit_is_a_400(model_dir, tmp_path):
    # One rank-4 fp32 slot over the 7 projections of 2 layers (in + out: 2048) is 64 KiB; with
    # 192 KiB in all, 128 KiB are left for states: rank 4 on q and v (56 KiB) fits, rank 4 on
    # all seven projections (256 KiB) never will.
    engine, thread, client = serve(model_dir, str(tmp_path), job_memory_gib=192 / (1 << 20),
                                   max_finetune_loras=1)
    try:
        file_id = client.files.create(file=("a.jsonl", "".join(
            json.dumps({"text": t}) + "\n" for t in TEXTS[:2]).encode()),
            purpose="fine-tune").id
        with pytest.raises(openai.BadRequestError) as e:
            client.fine_tuning.jobs.create(model="tiny", training_file=file_id, extra_body={
                "lora": {"r": 4, "alpha": 8, "target_modules": ["q_proj", "k_proj", "v_proj",
                                                                "o_proj", "gate_proj",
                                                                "up_proj", "down_proj"]}})
        assert e.value.body["param"] == "lora.r" and e.value.body["code"] == "invalid_value"
        assert "exceeds the 0.1 MiB fine-tuning jobs have" in e.value.body["message"]
        job = client.fine_tuning.jobs.create(model="tiny", training_file=file_id, extra_body={
            "lora": {"r": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj"]}})
        assert wait_all(client, [job])[0].status == "succeeded"
    finally:
        thread.stop()
        engine.shutdown()
