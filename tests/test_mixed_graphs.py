"""Mixed-iteration CUDA graphs: buckets, static LoRA segments, the activation arena, and the padded
forward that the graphs capture.

On the CPU `MixedGraphRunner.run` runs the same padded forward without a graph (static buffers,
padding tokens and rows, LoRA segments from the static buffers, fine-tuning activations written
by index into the arena), so its bookkeeping is checked here against the eager path: a tiny
Llama in fp32 trains the same adapter as HF transformers + peft + AdamW (fp64 truth, the bound of
tests/test_gpu_finetune.py) and decodes the same tokens as without it. The tile-map kernels are
checked against their references in test_attention_kernels.py and test_lora_kernels.py; on CUDA,
test_gpu_finetune.py runs the graphs themselves.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from flexserve import LLM, SamplingParams
from flexserve.finetune.data import TrainingData, TrainingExample
from flexserve.finetune.hyperparameters import Hyperparameters
from flexserve.worker.finetune.activation_arena import ActivationArena
from flexserve.worker.mixed_graphs import (
    _padded_segments,
    _segments,
    bucket,
    row_buckets,
    token_buckets,
)
from flexserve_kernels.lora.serve.meta import LoRAKernelMeta

from _hf_training import save_random_peft_adapter, train_hf_peft

TARGETS = ["q_proj", "v_proj", "down_proj"]
ALL_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def test_buckets():
    assert token_buckets(1000) == [64, 128, 256, 384, 512, 640, 768, 896, 1000]
    assert token_buckets(8192)[8:] == [1024, 1280, 1536, 1792, 2048, 2560, 3072, 3584, 4096,
                                       5120, 6144, 7168, 8192]
    assert token_buckets(64) == [64]
    assert token_buckets(16) == [16]
    assert row_buckets(40) == [8, 32, 40]
    assert row_buckets(8) == [8]
    assert bucket(65, token_buckets(1000)) == 128
    assert bucket(1100, token_buckets(8192)) == 1280
    assert bucket(1001, token_buckets(1000)) is None


@pytest.mark.parametrize("seed", range(5))
def test_segments_match_meta_build(seed):
    rng = np.random.default_rng(seed)
    num_rows = int(rng.integers(1, 12))
    lens = rng.integers(1, 9, num_rows)
    slots = rng.integers(-1, 3, num_rows).tolist()
    starts, seg_lens, seg_slots, token_slots = _segments(lens, slots)
    meta = LoRAKernelMeta.build(lens.tolist(), slots, "cpu")
    assert starts.tolist() == meta.seg_starts.tolist()
    assert seg_lens.tolist() == meta.seg_lens.tolist()
    assert seg_slots.tolist() == meta.seg_slots.tolist()
    assert token_slots.tolist() == meta.token_slots.tolist()


@pytest.mark.parametrize("seed", range(5))
def test_padded_segments_keep_each_token_in_its_segment(seed):
    """A graph's segment arrays padded to its rows: every real token still finds its segment by
    the binary search of `token_segments` (the fused LoRA kernels' mixed tiles), padding tokens
    none."""
    from flexserve_kernels.lora.train.fused import token_segments

    rng = np.random.default_rng(seed)
    num_rows = int(rng.integers(2, 12))
    lens = rng.integers(1, 9, num_rows)
    slots = rng.integers(-1, 3, num_rows).tolist()
    rows, tokens = num_rows + 4, int(lens.sum()) + 5
    starts, seg_lens, seg_slots, token_slots = _padded_segments(lens, slots, rows, tokens)
    as_int = lambda v: torch.tensor(np.asarray(v), dtype=torch.int32)  # noqa: E731
    padded = LoRAKernelMeta(
        token_slots=as_int(np.concatenate([token_slots, np.full(tokens - len(token_slots), -1)])),
        seg_starts=as_int(starts), seg_lens=as_int(seg_lens), seg_slots=as_int(seg_slots),
        num_tokens=tokens, max_seg_len=tokens, decode_only=False)
    compact = LoRAKernelMeta.build(lens.tolist(), slots, "cpu")
    want = token_segments(compact).tolist() + [-1] * (tokens - int(lens.sum()))
    assert len(starts) == rows and token_segments(padded).tolist() == want


def test_arena_allocates_first_fit_and_clears():
    arena = ActivationArena(10, torch.device("cpu"))
    assert arena.allocate(4) == 0 and arena.allocate(4) == 4
    assert arena.allocate(3) is None  # 2 rows left
    arena.release(0)
    assert arena.allocate(3) == 0 and arena.allocate(2) == 8
    t = arena.tensor(0, "x", 5, torch.float32)
    assert t.shape == (11, 5) and arena.dump_row == 10
    with pytest.raises(ValueError, match="asked for"):
        arena.tensor(0, "x", 6, torch.float32)
    with pytest.raises(RuntimeError, match="still hold"):
        arena.clear()
    for base in (0, 4, 8):
        arena.release(base)
    arena.clear()
    assert not arena.has(0, "x")


def _setup(tiny_config, tiny_checkpoint, tmp_path, targets=TARGETS):
    config = tiny_config("llama", hidden_size=64, intermediate_size=128, num_attention_heads=4,
                         num_key_value_heads=2, max_position_embeddings=128)
    model_dir = tiny_checkpoint(config, seed=3)
    g = torch.Generator().manual_seed(0)
    adapter_dir = save_random_peft_adapter(model_dir, tmp_path / "init", targets, g, 0.1)
    examples = []
    for i, n in enumerate((23, 37, 16, 41)):
        ids = torch.randint(0, config.vocab_size, (n,), generator=g).tolist()
        examples.append(TrainingExample(i + 1, ids, [False] + [True] * (n - 1)))
    data = TrainingData("text", examples, [], sum(len(e.input_ids) for e in examples),
                        sum(sum(e.loss_mask) for e in examples))
    hp = Hyperparameters.from_dict({
        "batch_size": 2, "n_epochs": 1, "shuffle": False, "learning_rate": 1e-3,
        "lr_scheduler": "constant", "max_grad_norm": None,
        "lora": {"r": 8, "alpha": 16, "target_modules": targets}})
    return model_dir, adapter_dir, examples, data, hp


def _llm(model_dir, graphs: bool, max_num_batched_tokens: int = 16) -> LLM:
    llm = LLM(model_dir, device="cpu", dtype="float32", enable_lora=True, max_lora_rank=8,
              max_model_len=64, max_num_batched_tokens=max_num_batched_tokens)
    if graphs:
        llm.engine.executor.enable_mixed_graphs(64)
        llm.engine.executor.mixed_graphs.precapture()  # as the CUDA start-up does
    return llm


def test_padded_forward_trains_what_hf_peft_trains(tiny_config, tiny_checkpoint, tmp_path):
    from safetensors.torch import load_file

    model_dir, adapter_dir, examples, data, hp = _setup(tiny_config, tiny_checkpoint, tmp_path)
    llm = _llm(model_dir, graphs=True)
    engine = llm.engine
    job = engine.add_finetune_job(data, hp, init_adapter_path=adapter_dir)
    # The job's start captured its windows' graphs (on the CPU: ran their padded forward).
    precaptured = set(engine.executor.mixed_graphs.graphs)
    assert any(key[3] is not None for key in precaptured)
    # Inference rows ride in the same iterations as the windows.
    requests = [engine.add_request(f"r{i}", prompt, SamplingParams(max_tokens=6, temperature=0))
                for i, prompt in enumerate(([5, 6, 7], [9] * 11))]
    del requests
    while not job.finished or engine.has_unfinished_requests():
        engine.step()
    assert job.status.value == "succeeded", job.error
    graphs = engine.executor.mixed_graphs
    assert graphs.num_replays_by_kind["capture"] > 0, "no window went through the padded path"
    assert set(graphs.graphs) == precaptured  # serving captured nothing new
    # Every backward window ran as the padded pieces around an eager attention.
    windows = engine.executor.finetune_runner.num_backward_windows
    assert windows["graphs"] > 0 and windows["eager"] == 0, windows
    out = str(tmp_path / "tuned")
    engine.save_finetune_adapter(job.job_id, out)
    ours = {k: v.double() for k, v in load_file(f"{out}/adapter_model.safetensors").items()}
    initial = {k: v.double() for k, v in
               load_file(f"{adapter_dir}/adapter_model.safetensors").items()}
    steps = [[0, 1], [2, 3]]
    truth = train_hf_peft(model_dir, adapter_dir, examples, steps, 1e-3, torch.float64)
    hf32 = train_hf_peft(model_dir, adapter_dir, examples, steps, 1e-3, torch.float32)

    def change_error(weights):
        keys = sorted(truth)
        a = torch.cat([(weights[k] - initial[k]).flatten() for k in keys])
        b = torch.cat([(truth[k] - initial[k]).flatten() for k in keys])
        return float((a - b).norm() / b.norm())

    ours_error, hf_error = change_error(ours), change_error(hf32)
    assert ours_error <= 1e-4 and ours_error <= max(4 * hf_error, 1e-5), (ours_error, hf_error)


def test_padded_forward_generates_what_the_eager_path_generates(tiny_config, tiny_checkpoint,
                                                                tmp_path):
    model_dir, *_ = _setup(tiny_config, tiny_checkpoint, tmp_path)
    prompts = [[3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21], [7, 8], [30]]
    params = SamplingParams(max_tokens=8, temperature=0)
    outputs = {}
    for graphs in (False, True):
        llm = _llm(model_dir, graphs)
        results = llm.generate(prompts, params)
        outputs[graphs] = [r.outputs[0].token_ids for r in results]
        if graphs:
            assert llm.engine.executor.mixed_graphs.graphs  # prefill chunks took the padded path
    assert outputs[True] == outputs[False]


def _train(model_dir, adapter_dir, data, hp, out: str, max_num_batched_tokens: int = 16
           ) -> dict:
    from safetensors.torch import load_file

    llm = _llm(model_dir, graphs=True, max_num_batched_tokens=max_num_batched_tokens)
    engine = llm.engine
    job = engine.add_finetune_job(data, hp, init_adapter_path=adapter_dir)
    for i, prompt in enumerate(([5, 6, 7], [9] * 11, [3] * 5)):
        engine.add_request(f"r{i}", prompt, SamplingParams(max_tokens=5, temperature=0))
    while not job.finished or engine.has_unfinished_requests():
        engine.step()
    assert job.status.value == "succeeded", job.error
    engine.save_finetune_adapter(job.job_id, out)
    windows = dict(engine.executor.finetune_runner.num_backward_windows)
    return load_file(f"{out}/adapter_model.safetensors"), windows


@pytest.mark.parametrize("targets", [TARGETS, ALL_TARGETS], ids=["q-v-down", "all"])
def test_backward_pieces_train_what_eager_windows_train(targets, tiny_config, tiny_checkpoint,
                                                        tmp_path, monkeypatch):
    """The backward windows as padded pieces around an eager attention (what the CUDA graphs
    capture) give the eager windows' adapter: the padding rows add exactly zero, and only the
    GEMMs' row count differs (fp32 rounding: within 1e-6 of each tensor's norm)."""
    from flexserve.worker.finetune.runner import FinetuneRunner

    model_dir, adapter_dir, _, data, hp = _setup(tiny_config, tiny_checkpoint, tmp_path, targets)
    pieces, by_pieces = _train(model_dir, adapter_dir, data, hp, str(tmp_path / "pieces"))
    monkeypatch.setattr(FinetuneRunner, "_backward_graphs", lambda self, job: None)
    eager, by_eager = _train(model_dir, adapter_dir, data, hp, str(tmp_path / "eager"))
    assert by_pieces["eager"] == 0 and by_pieces["graphs"] > 0
    assert by_eager["graphs"] == 0 and by_eager["eager"] == by_pieces["graphs"]
    assert by_eager["together"] == 0
    assert pieces.keys() == eager.keys()
    # Per tensor, relative to its norm (a single entry whose gradient is near zero moves with
    # Adam's normalization of a rounding difference, so no entry-wise bound).
    for key in pieces:
        assert float((pieces[key] - eager[key]).norm() / eager[key].norm()) <= 1e-6, key


def test_backward_buffers_pad_and_clear_the_tail():
    from flexserve.worker.finetune.backward_graphs import BackwardBuffers, backward_buckets

    assert backward_buckets(64) == (32, 64)
    assert backward_buckets(100) == (32, 64, 100)
    assert backward_buckets(10) == (10,)
    assert backward_buckets(10_000)[-1] == 4096
    b = BackwardBuffers(8, 3, torch.device("cpu"))
    b.grad("q", 2)
    b.load_windows([(10, 4, torch.ones(5, 3))], 8)
    assert b.index.tolist() == [10, 11, 12, 13, 14, 14, 14, 14]  # padding repeats the last row
    assert b.positions.tolist() == [4, 5, 6, 7, 8, 8, 8, 8]
    b.load_gradient("q", torch.ones(5, 2, dtype=torch.bfloat16), 0, 5)
    b.load_windows([(0, 0, torch.full((3, 3), 2.0))], 4)
    b.load_gradient("q", torch.full((3, 2), 2.0), 0, 3)
    # rows 3-4 held the longer window's values: zeroed, so padding rows read zero gradients
    assert b.rows[:, 0].tolist() == [2, 2, 2, 0, 0, 0, 0, 0]
    assert b.grad("q", 2)[:, 1].tolist() == [2, 2, 2, 0, 0, 0, 0, 0]
    # windows of two sequences stacked: each at its arena rows and positions
    b.load_windows([(20, 6, torch.full((2, 3), 3.0)), (40, 0, torch.full((3, 3), 4.0))], 8)
    assert b.index.tolist() == [20, 21, 40, 41, 42, 42, 42, 42]
    assert b.positions.tolist() == [6, 7, 0, 1, 2, 2, 2, 2]
    assert b.rows[:, 0].tolist() == [3, 3, 4, 4, 4, 0, 0, 0]
    b.load_gradient("q", torch.full((2, 2), 3.0), 0, 5)
    b.load_gradient("q", torch.full((3, 2), 4.0), 2, 5)
    assert b.grad("q", 2)[:, 0].tolist() == [3, 3, 4, 4, 4, 0, 0, 0]
    with pytest.raises(ValueError, match="wide"):
        b.grad("q", 3)


def test_backward_windows_of_several_sequences_run_together(tiny_config, tiny_checkpoint,
                                                            tmp_path, monkeypatch):
    """Sequences of a step go through their backward in lockstep, and the windows of one layer
    on several sequences run as one (rows stacked; attention per sequence): the adapter equals
    the one of windows run one by one (eagerly), to fp32 rounding."""
    from flexserve.worker.finetune.runner import FinetuneRunner

    model_dir, adapter_dir, _, _, hp = _setup(tiny_config, tiny_checkpoint, tmp_path)
    g = torch.Generator().manual_seed(1)
    examples = []
    for i, n in enumerate((9, 12, 7, 10, 11, 8)):
        ids = torch.randint(0, 256, (n,), generator=g).tolist()
        examples.append(TrainingExample(i + 1, ids, [False] + [True] * (n - 1)))
    data = TrainingData("text", examples, [], sum(len(e.input_ids) for e in examples),
                        sum(sum(e.loss_mask) for e in examples))
    hp = Hyperparameters.from_dict({**hp.to_dict(), "batch_size": 3})
    together, by_together = _train(model_dir, adapter_dir, data, hp, str(tmp_path / "t"), 256)
    monkeypatch.setattr(FinetuneRunner, "_backward_graphs", lambda self, job: None)
    alone, by_alone = _train(model_dir, adapter_dir, data, hp, str(tmp_path / "a"), 256)
    assert by_together["together"] > 0, by_together
    assert by_alone["together"] == 0 and by_alone["eager"] == by_together["graphs"]
    for key in together:
        scale = alone[key].abs().max().item()
        assert (together[key] - alone[key]).abs().max().item() <= 1e-6 * scale, key


def test_the_next_job_with_the_same_plan_reuses_the_arena_and_its_graphs(
        tiny_config, tiny_checkpoint, tmp_path):
    """The arena and the graphs that write it outlive the job: a second job with the same plan
    starts without capturing anything; one with another plan, alone, replaces the arena and
    drops the old plan's graphs."""
    model_dir, adapter_dir, _, data, hp = _setup(tiny_config, tiny_checkpoint, tmp_path)
    llm = _llm(model_dir, graphs=True)
    engine = llm.engine
    runner = engine.executor

    graphs = runner.mixed_graphs
    forward, padded = graphs._forward, []

    def counted(tokens, rows, step, capture):  # a capture's run (on the CPU: its forward)
        padded.append(step.capture is not None)
        return forward(tokens, rows, step, capture)

    graphs._forward = counted

    def train_one(data, hp):
        padded.clear()
        job = engine.add_finetune_job(data, hp, init_adapter_path=adapter_dir)
        keys = set(runner.mixed_graphs.graphs), any(padded)
        while not job.finished:
            engine.step()
        assert job.status.value == "succeeded", job.error
        engine.remove_finetune_job(job.job_id)
        return keys

    first, captured = train_one(data, hp)
    arena = {key: t.data_ptr() for key, t in runner._arena._tensors.items()}
    assert arena and captured and any(key[3] is not None for key in first)
    second, captured = train_one(data, hp)
    assert second == first and not captured  # nothing captured for the second job
    assert {key: t.data_ptr() for key, t in runner._arena._tensors.items()} == arena
    # Another plan (every projection, so other tensors are kept): the arena follows it.
    _, all_dir, _, all_data, all_hp = _setup(tiny_config, tiny_checkpoint, tmp_path / "all",
                                             ALL_TARGETS)
    job = engine.add_finetune_job(all_data, all_hp, init_adapter_path=all_dir)
    kept = {key[3] for key in runner.mixed_graphs.graphs if key[3] is not None}
    assert len(kept) == 1 and kept.isdisjoint({key[3] for key in first})
    assert {key: t.data_ptr() for key, t in runner._arena._tensors.items()} != arena
    while not job.finished:
        engine.step()
    assert job.status.value == "succeeded", job.error


def test_a_later_job_in_the_same_slot_reuses_the_backward_pieces_and_trains_the_same(
        tiny_config, tiny_checkpoint, tmp_path):
    """A job that starts in an ended job's slot with its plan takes over its backward pieces
    (captured graphs on CUDA) and the gradient buffers they write, and trains exactly what a
    fresh engine trains; removing the ended job, whose slot it now holds, leaves its adapter
    alone."""
    from safetensors.torch import load_file

    model_dir, adapter_dir, _, data, hp = _setup(tiny_config, tiny_checkpoint, tmp_path)

    def train(engine, name, remove_first=None):
        job = engine.add_finetune_job(data, hp, init_adapter_path=adapter_dir)
        if remove_first is not None:
            engine.remove_finetune_job(remove_first.job_id)
        while not job.finished:
            engine.step()
        assert job.status.value == "succeeded", job.error
        engine.save_finetune_adapter(job.job_id, str(tmp_path / name))
        return job, load_file(str(tmp_path / name / "adapter_model.safetensors"))

    fresh_job, fresh = train(_llm(model_dir, graphs=True).engine, "fresh")
    engine = _llm(model_dir, graphs=True).engine
    runner = engine.executor
    first, _ = train(engine, "first")
    pieces = runner.finetune_runner.jobs[first.job_id].backward_graphs
    # The first job ended (its slot is free) but is not removed yet: the second takes the slot,
    # then the first is removed.
    second, adapter = train(engine, "second", remove_first=first)
    assert second.lora_slot == first.lora_slot
    job = runner.finetune_runner.jobs[second.job_id]
    assert job.backward_graphs is pieces
    assert all(torch.equal(adapter[k], fresh[k]) for k in fresh)


def test_jobs_of_one_plan_share_the_backward_pieces_in_any_slot(tiny_config, tiny_checkpoint,
                                                                tmp_path):
    """Two jobs of one plan running together hold two slots and one set of backward pieces
    (captured graphs on CUDA), which run on the staging slot with each window's job's weights
    copied in and its gradients added back: each trains what it trains alone."""
    from safetensors.torch import load_file

    model_dir, adapter_dir, _, data, hp = _setup(tiny_config, tiny_checkpoint, tmp_path)

    def adapters(engine, count):
        jobs = [engine.add_finetune_job(data, hp, init_adapter_path=adapter_dir)
                for _ in range(count)]
        while not all(job.finished for job in jobs):
            engine.step()
        out = []
        for job in jobs:
            assert job.status.value == "succeeded", job.error
            path = str(tmp_path / job.job_id / str(count))
            engine.save_finetune_adapter(job.job_id, path)
            out.append(load_file(f"{path}/adapter_model.safetensors"))
        return jobs, out

    _, (alone,) = adapters(_llm(model_dir, graphs=True).engine, 1)
    engine = _llm(model_dir, graphs=True).engine
    staging = engine.executor.lora_manager.staging_slot
    (a, b), together = adapters(engine, 2)
    runner = engine.executor.finetune_runner
    assert len({a.lora_slot, b.lora_slot, staging}) == 3
    assert runner.jobs[a.job_id].backward_graphs is runner.jobs[b.job_id].backward_graphs
    assert runner.num_backward_windows["graphs"] > 0
    initial = load_file(f"{adapter_dir}/adapter_model.safetensors")
    change = torch.cat([(alone[k] - initial[k]).flatten() for k in sorted(alone)])
    for adapter in together:
        # The two jobs' rows share the frozen GEMMs of their steps (other row counts, so other
        # float rounding, which AdamW amplifies where a gradient is tiny): the bound that
        # tests/test_finetune_many_jobs.py holds concurrent jobs to, relative to the change.
        diff = torch.cat([(adapter[k] - alone[k]).flatten() for k in sorted(alone)])
        assert float(diff.norm() / change.norm()) <= 1e-4


def test_a_variant_warms_up_once_where_plain_graphs_exist(tiny_config, tiny_checkpoint, tmp_path):
    """Warm-up forwards run where a capture's shapes are new: every bucket of the plain
    variant (start-up), then only the first bucket of a job's variant (its LoRA and capture
    kernels), whose other buckets share their shapes with plain graphs."""
    import types

    model_dir, *_ = _setup(tiny_config, tiny_checkpoint, tmp_path)
    graphs = _llm(model_dir, graphs=True).engine.executor.mixed_graphs
    plain = set(graphs.graphs)
    captured: list[tuple[tuple, int]] = []

    def capture(key, step, log=True, warmups=2):
        captured.append((key, warmups))
        graphs.graphs[key] = (None, None, None)

    graphs._capture = capture
    graphs.device = types.SimpleNamespace(type="cuda")  # precapture's CUDA branch
    graphs.graphs = {}
    graphs._warm_variants = set()
    assert graphs.precapture() == len(plain)
    assert all(warmups == 2 for _, warmups in captured)  # no plain graph existed yet
    captured.clear()
    lora_key = (True,) * 4
    assert graphs.precapture(lora_key, frozenset({0})) == len(plain)
    assert [w for _, w in captured] == [2] + [0] * (len(plain) - 1)
    captured.clear()
    # A bucket with no plain graph warms up even in a warm variant.
    del graphs.graphs[sorted(plain)[-1]]
    graphs.graphs = {k: v for k, v in graphs.graphs.items() if k[2] is None}
    graphs.precapture(lora_key, frozenset({0}))
    missing = sorted(plain)[-1][:2]
    assert [w for key, w in captured if key[:2] == missing] == [2]
    assert all(w == 0 for key, w in captured if key[:2] != missing)


def test_jobs_of_different_ranks_run_together(tiny_config, tiny_checkpoint, tmp_path):
    """A job whose LoRA rank differs from the running job's (its `*_s` tensors have another
    width) cannot share the activation arena: it starts with private stores, its windows run
    without graphs, and both jobs train what each trains alone."""
    from safetensors.torch import load_file

    model_dir, adapter_dir, _, data, hp = _setup(tiny_config, tiny_checkpoint, tmp_path)
    rank4 = Hyperparameters.from_dict({
        "batch_size": 2, "n_epochs": 1, "shuffle": False, "learning_rate": 1e-3,
        "lr_scheduler": "constant", "max_grad_norm": None,
        "lora": {"r": 4, "alpha": 8, "target_modules": TARGETS}})

    def adapters(graphs: bool, specs) -> list[dict]:
        engine = _llm(model_dir, graphs=graphs).engine
        jobs = [engine.add_finetune_job(data, h) for h in specs]
        while not all(job.finished for job in jobs):
            engine.step()
        out = []
        for i, job in enumerate(jobs):
            assert job.status.value == "succeeded", job.error
            path = str(tmp_path / f"{graphs}-{len(specs)}-{i}")
            engine.save_finetune_adapter(job.job_id, path)
            out.append(load_file(f"{path}/adapter_model.safetensors"))
        if graphs:
            runner = engine.executor.finetune_runner
            assert runner.arena.holds(0, "down_proj_s", 8, torch.float32)
        return out

    together = adapters(True, [hp, rank4])
    alone = adapters(False, [hp])[0], adapters(False, [rank4])[0]
    for got, want in zip(together, alone):
        assert got.keys() == want.keys()
        for key in want:
            torch.testing.assert_close(got[key], want[key], rtol=1e-4, atol=1e-6)
