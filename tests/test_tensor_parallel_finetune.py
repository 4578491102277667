"""Token-level fine-tuning under tensor parallelism (fp32, CPU, gloo): each rank trains its part
of the adapter (`ShardedAdapter`), and the adapter a job trains at N ranks is the one it trains
in one process; its checkpoints are whole PEFT adapters that resume at another rank count.

Tolerance: the ranks' partial sums (row-parallel outputs, column-parallel input gradients, the
vocab-parallel loss) add in another order than one process's GEMMs, and AdamW divides by the
gradients' running norms, which magnifies that where a gradient is near zero: the weight change
of the whole adapter agrees within 1e-4 relative (as the exactness tests bound fp32 against
fp64), each tensor's within 1e-2.
"""

from __future__ import annotations

import json
import shutil
import threading

import pytest
import torch

from flexserve.entrypoints.llm import LLM
from flexserve.model.tp_layout import TensorParallelLayout
from flexserve.worker.finetune.sharded_adapter import ShardedAdapter

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
DATA = [{"text": "Q: 2 + 2 = 4"}, {"text": "The sky is blue, and the grass is green."},
        {"text": "Opposite of up: down"}, {"text": "Cats say meow, and dogs say woof."}]
HP = {"batch_size": 2, "n_epochs": 1, "learning_rate": 1e-2, "seed": 5, "max_grad_norm": 0.5,
      "shuffle": False, "lr_scheduler": "constant", "weight_decay": 0.0}
ENGINE = dict(enable_lora=True, max_lora_rank=8, max_model_len=64, max_num_batched_tokens=16)


def lora(initial_dir: str) -> dict:
    """The job's LoRA settings: the starting adapter's (`random_adapter`: r 8, alpha 16)."""
    return {"init_adapter": initial_dir, "r": 8, "alpha": 16, "dropout": 0.0,
            "target_modules": TARGETS}


def change_error(ours: dict, truth: dict, initial: dict, keys) -> float:
    a = torch.cat([(ours[k].double() - initial[k].double()).flatten() for k in keys])
    b = torch.cat([(truth[k].double() - initial[k].double()).flatten() for k in keys])
    return float((a - b).norm() / b.norm())


def assert_same_training(ours: dict, truth: dict, initial: dict) -> None:
    keys = sorted(truth)
    assert sorted(ours) == keys
    overall = change_error(ours, truth, initial, keys)
    worst = max(change_error(ours, truth, initial, [k]) for k in keys)
    print(f"relative error of the weight change: {overall:.2e} (worst tensor {worst:.2e})")
    assert overall <= 1e-4 and worst <= 1e-2


def train(model_dir, tmp_path, name, initial_dir, **engine):
    """Train DATA from the adapter in `initial_dir`; (saved adapter, losses, checkpoint after
    the first step)."""
    from _hf_training import load_saved

    llm = LLM(model_dir, **ENGINE, **engine)
    try:
        job = llm.finetune(DATA, lora=lora(initial_dir),
                           hyperparameters=HP)
        while len(job.losses) < 1:
            llm.engine.step()
        job.checkpoint(str(tmp_path / f"{name}-step-1"))
        job.wait()
        job.save(str(tmp_path / name))
    finally:
        llm.shutdown()
    return load_saved(str(tmp_path / name)), job.losses, str(tmp_path / f"{name}-step-1")


@pytest.fixture(scope="module")
def tiny_with_tokenizer(tiny_checkpoint, smollm2_dir):
    """A 2-layer Llama with one key/value head (replicated over 2 ranks) and a vocabulary that
    2 ranks split unevenly (padded lm_head rows), with SmolLM2's tokenizer."""
    from conftest import make_tiny_config

    path = tiny_checkpoint(make_tiny_config("llama", vocab_size=49153, num_key_value_heads=1),
                           seed=4)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(f"{smollm2_dir}/{name}", path)
    return path


def random_adapter(model_dir, path) -> tuple[str, dict]:
    from _hf_training import load_saved, save_random_peft_adapter

    adapter = save_random_peft_adapter(model_dir, path, TARGETS, torch.Generator().manual_seed(9),
                                       0.05)
    return adapter, load_saved(adapter)


@pytest.mark.parametrize("backend", ["mp", "ray"])
def test_tp2_trains_the_adapter_one_process_trains(tiny_with_tokenizer, tmp_path, backend):
    """Every projection trained at 2 ranks (worker processes, or actors of a local Ray
    cluster) with a replicated key/value head and padded vocabulary rows: the adapter, losses
    and a checkpoint resumed in one process."""
    from _hf_training import load_saved

    initial_dir, initial = random_adapter(tiny_with_tokenizer, tmp_path / "initial")
    want, want_losses, _ = train(tiny_with_tokenizer, tmp_path, "one", initial_dir)
    if backend == "ray":
        ray = pytest.importorskip("ray")
        ray.init(num_cpus=2, include_dashboard=False, logging_level="ERROR")
        try:
            got, losses, _ = train(tiny_with_tokenizer, tmp_path, "ray", initial_dir,
                                   tensor_parallel_size=2, distributed_executor_backend="ray")
        finally:
            ray.shutdown()
        assert_same_training(got, want, initial)
        assert losses == pytest.approx(want_losses, rel=1e-5)
        return
    got, losses, checkpoint = train(tiny_with_tokenizer, tmp_path, "tp2", initial_dir,
                                    tensor_parallel_size=2)
    assert_same_training(got, want, initial)
    assert losses == pytest.approx(want_losses, rel=1e-5)
    # The checkpoint written at 2 ranks is whole: one process resumes it to the same end.
    llm = LLM(tiny_with_tokenizer, **ENGINE)
    resumed = llm.finetune(DATA, lora=lora(initial_dir),
                           hyperparameters=HP, resume_from=checkpoint).wait()
    resumed.save(str(tmp_path / "resumed"))
    assert_same_training(load_saved(str(tmp_path / "resumed")), want, initial)


def test_tp2_dpo_trains_the_adapter_one_process_trains(tiny_with_tokenizer, tmp_path):
    """DPO at 2 ranks: the policy's and the reference's log-probabilities through the
    vocab-parallel loss, the pair coefficient from them: one process's adapter and losses."""
    from test_finetune_dpo import PAIRS

    from _hf_training import load_saved

    initial_dir, initial = random_adapter(tiny_with_tokenizer, tmp_path / "initial")
    results = []
    for name, engine in (("one", {}), ("tp2", {"tensor_parallel_size": 2})):
        llm = LLM(tiny_with_tokenizer, **ENGINE, **engine)
        try:
            job = llm.finetune(PAIRS[:4], lora=lora(initial_dir), method="dpo",
                               hyperparameters={**HP, "beta": 0.5}).wait()
            job.save(str(tmp_path / name))
        finally:
            llm.shutdown()
        results.append((load_saved(str(tmp_path / name)), job.losses))
    (want, want_losses), (got, losses) = results
    assert_same_training(got, want, initial)
    assert losses == pytest.approx(want_losses, rel=1e-5)


@pytest.mark.slow
def test_tp3_smollm2_trains_like_hf_and_resumes_at_one_rank(smollm2_dir, tmp_path):
    """SmolLM2 (9 heads, 3 key/value heads, a tied head) at 3 ranks: the adapter is within the
    exactness tests' bound of HF + PEFT + AdamW in fp64 (as one process's is; the two differ
    by fp32 rounding, which AdamW magnifies on a 30-layer model), and one process resumes its
    checkpoint to the same end as 3 ranks, as 3 ranks resume one process's."""
    from flexserve.finetune.data import load_training_data

    from _hf_training import check_against_fp64, load_saved, train_hf_peft

    initial_dir, initial = random_adapter(smollm2_dir, tmp_path / "initial")
    one, one_losses, one_checkpoint = train(smollm2_dir, tmp_path, "one", initial_dir)
    got, losses, checkpoint = train(smollm2_dir, tmp_path, "tp3", initial_dir,
                                    tensor_parallel_size=3)
    # The first step's loss comes from the same starting adapter: fp32 sums in another order.
    # The second's comes from each run's own first update, and one process's update is itself
    # 3.1e-3 off the fp64 reference (checked below), so the two second losses differ by more
    # (1.3e-4 measured); the adapters are judged against fp64 instead.
    assert losses[0] == pytest.approx(one_losses[0], rel=1e-5)
    assert losses[1] == pytest.approx(one_losses[1], rel=1e-3)
    from transformers import AutoTokenizer

    jsonl = "\n".join(json.dumps(d) for d in DATA).encode()
    examples = load_training_data(jsonl, AutoTokenizer.from_pretrained(smollm2_dir), 64).examples
    steps = [[0, 1], [2, 3]]
    hf64 = train_hf_peft(smollm2_dir, initial_dir, examples, steps, HP["learning_rate"],
                         torch.float64, HP["max_grad_norm"])
    hf32 = train_hf_peft(smollm2_dir, initial_dir, examples, steps, HP["learning_rate"],
                         torch.float32, HP["max_grad_norm"])
    check_against_fp64(one, hf32, hf64, initial)
    check_against_fp64(got, hf32, hf64, initial)
    for start, engine, name in ((checkpoint, {}, "resumed-1"),
                                (one_checkpoint, {"tensor_parallel_size": 3}, "resumed-3")):
        llm = LLM(smollm2_dir, **ENGINE, **engine)
        try:
            llm.finetune(DATA, lora=lora(initial_dir), hyperparameters=HP,
                         resume_from=start).wait().save(str(tmp_path / name))
        finally:
            llm.shutdown()
        check_against_fp64(load_saved(str(tmp_path / name)), hf32, hf64, initial)


class _ThreadGroup:
    """Ranks as threads of this process; all-reduce meets at a barrier (sum, max or min)."""

    def __init__(self, rank, world_size, barrier, slots):
        self.rank, self.world_size, self.barrier, self.slots = rank, world_size, barrier, slots

    def all_reduce(self, x, op="sum"):
        self.slots[self.rank] = x.clone()
        self.barrier.wait()
        parts = torch.stack(list(self.slots))
        self.barrier.wait()
        reduced = {"sum": parts.sum(0), "max": parts.amax(0), "min": parts.amin(0)}[op]
        return x.copy_(reduced)


def run_ranks(world_size, fn):
    barrier, slots = threading.Barrier(world_size), [None] * world_size
    results = [None] * world_size

    def one(rank):
        results[rank] = fn(rank, _ThreadGroup(rank, world_size, barrier, slots))

    threads = [threading.Thread(target=one, args=(r,)) for r in range(world_size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results


@pytest.mark.parametrize("num_kv_heads", [4, 2])
def test_sharded_adapter_reduces_norms_and_gathers_like_the_whole(num_kv_heads):
    """Partial gradients whose sum is a known whole gradient: `reduce_grads` gives each rank its
    part of the whole, `total_norm` the whole's norm, `gather` the whole tensors back."""
    world, rank_r, hidden, inter = 4, 3, 16, 32
    heads, head_dim = 8, 2
    shapes = {"q_proj": (hidden, heads * head_dim), "k_proj": (hidden, num_kv_heads * head_dim),
              "o_proj": (heads * head_dim, hidden), "down_proj": (inter, hidden)}
    params = {f"{t}.{h}": (t, h, (rank_r, n_in) if h == "A" else (n_out, rank_r))
              for t, (n_in, n_out) in shapes.items() for h in "AB"}
    gen = torch.Generator().manual_seed(0)
    whole_grads = {n: torch.randn(shape, generator=gen) for n, (_, _, shape) in params.items()}
    whole_weights = {n: torch.randn(shape, generator=gen) for n, (_, _, shape) in params.items()}

    def rank_fn(rank, tp):
        layout = TensorParallelLayout(rank, world, heads, num_kv_heads, head_dim, inter, 100)
        sharded = ShardedAdapter(layout, tp, params)
        grads = {}
        for name, (target, half, _) in params.items():
            part = sharded.shard(name, whole_grads[name])
            # each holder of a shared entry holds a share; the shares sum to the whole
            grads[name] = part / layout.lora_copies(target, half)
        sharded.reduce_grads(grads)
        norm = sharded.total_norm(grads)
        gathered = sharded.gather({n: (n, sharded.shard(n, w)) for n, w in whole_weights.items()})
        return {n: g - sharded.shard(n, whole_grads[n]) for n, g in grads.items()}, norm, gathered

    whole_norm = torch.cat([g.flatten() for g in whole_grads.values()]).norm()
    for errors, norm, gathered in run_ranks(world, rank_fn):
        assert all(e.abs().max() < 1e-6 for e in errors.values())
        assert norm == pytest.approx(float(whole_norm), rel=1e-6)
        assert all(torch.equal(gathered[n], whole_weights[n]) for n in whole_weights)


def test_a_ranks_own_failure_stops_the_ranks_and_a_shared_one_fails_the_job():
    """Under tensor parallelism a job failure every rank meets alike (a non-finite loss or norm,
    bad input) fails the job alone; one rank's own (out of memory, a bug) is raised, so the
    executor stops every rank instead of leaving the others in a collective."""
    from types import SimpleNamespace

    from flexserve.worker.finetune.runner import FinetuneRunner

    runner = FinetuneRunner.__new__(FinetuneRunner)
    runner.model = SimpleNamespace(tp=SimpleNamespace(world_size=2))
    runner.jobs, runner._faults, runner.device = {}, {}, torch.device("cpu")
    runner.num_activation_bytes = 0
    errors: dict[str, str] = {}
    runner._fail("a", FloatingPointError("the training loss is nan"), errors, "a window")
    runner._fail("b", ValueError("bad data"), errors, "a window")
    assert errors == {"a": "the training loss is nan", "b": "bad data"}
    for own in (torch.cuda.OutOfMemoryError("out of memory"), KeyError("a bug")):
        with pytest.raises(type(own)):
            runner._fail("c", own, errors, "a window")
    assert "c" not in errors
    runner.model = SimpleNamespace(tp=SimpleNamespace(world_size=1))  # one rank: the job alone
    runner._fail("c", KeyError("a bug"), errors, "a window")
    assert errors["c"] == "internal error during a window (KeyError)"
