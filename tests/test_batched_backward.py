"""Backward windows of several fine-tuning jobs run as one (MuxTune's batched backward): the
frozen GEMMs of a layer once over every job's rows, each row's LoRA math on its own job's
adapter (`StagedLoRA`), each job's gradients the sums over its own rows.

On the CPU the pieces run eagerly, padded to their buckets, as the CUDA graphs replay them; a
tiny Llama in fp32 trains three jobs of one plan together (their windows grouped, as the engine
groups the jobs of one plan on CUDA) and each must train what it trains alone."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from flexserve.finetune.data import TrainingData, TrainingExample
from flexserve.finetune.hyperparameters import Hyperparameters
from flexserve.worker.finetune.backward_graphs import MAX_BATCHED_JOBS
from flexserve.worker.finetune.staged_lora import StagedLoRA
from test_mixed_graphs import _llm, _setup

from _hf_training import save_random_peft_adapter


def test_staged_rows_keep_their_own_block():
    from flexserve.layers.lora_linear import LoRALinear

    rank, rows = 2, 5
    st = StagedLoRA(4, rank, {"q_proj": (3, 4)}, 8, torch.float32, torch.device("cpu"))
    # rows 0-1: block 1 (slot 2), rows 2-4: block 0 (slot 0), 5-7: padding
    st.load([0, 2], [(1, 2), (0, 3)], 8)
    assert st.slots.tolist() == [0, 2, 0, 0]  # spare blocks repeat the first slot
    wide = torch.arange(8 * 8, dtype=torch.float32).view(8, 8)
    wide[0, 0] = float("nan")  # another block's value of row 0: gone exactly
    kept = st.keep(wide)
    assert torch.equal(kept[0], torch.tensor([0, 0, 2, 3, 0, 0, 0, 0.]))
    assert torch.equal(kept[3], torch.tensor([24, 25, 0, 0, 0, 0, 0, 0.]))
    assert not kept[5:].any()
    assert torch.equal(st.expand(torch.ones(rows, rank))[:rows].sum(dim=1),
                       torch.full((rows,), 2.0))
    # the fused LoRA kernels' routing: each job's rows one segment in row order (spare ones past
    # every row, so token_segments' binary search over the starts holds), S and dS rank r
    assert st.segments.tolist() == [[0, 2, 8, 8], [2, 3, 0, 0], [1, 0, 0, 0]]
    assert st.token_blocks.tolist() == [1, 1, 0, 0, 0, -1, -1, -1]
    from flexserve_kernels.lora.train.fused import token_segments
    assert token_segments(st.kernel_meta(8)).tolist() == [0, 0, 1, 1, 1, -1, -1, -1]
    assert torch.equal(st.own_block(wide)[:rows], torch.stack([wide[0, 2:4], wide[1, 2:4], wide[2, :2],
                                                               wide[3, :2], wide[4, :2]]))
    assert not st.own_block(wide)[rows:].any()
    meta = st.kernel_meta(8)
    assert (meta.num_segments, meta.max_seg_len, meta.covers_all_tokens) == (4, 8, False)
    with pytest.raises(ValueError, match="not contiguous"):
        st.load([0, 2], [(0, 1), (1, 1), (0, 1)], 4)
    linear = LoRALinear(torch.nn.Linear(3, 4, bias=False), max_loras=3, max_rank=4)
    with torch.no_grad():
        linear.lora_a.copy_(torch.randn(linear.lora_a.shape))
        linear.lora_b.copy_(torch.randn(linear.lora_b.shape))
        linear.scaling.copy_(torch.tensor([0.5, 1.0, 2.0]))
        linear.lora_a[2, 0, 0] = float("inf")
    st.gather({"q_proj": linear})
    assert torch.equal(st.a["q_proj"][2:4, 1:], linear.lora_a[2, :rank, 1:])  # block 1: slot 2
    assert st.a["q_proj"][2, 0] == 0  # non-finite: zero
    assert torch.equal(st.b["q_proj"][:, :rank], linear.lora_b[0, :, :rank])
    assert torch.equal(st.b["q_proj"][:, rank:2 * rank], linear.lora_b[2, :, :rank])
    assert st.scale["q_proj"].tolist() == [0.5, 0.5, 2.0, 2.0, 0.5, 0.5, 0.5, 0.5]
    assert st.block_scale["q_proj"].tolist() == [0.5, 2.0, 0.5, 0.5]
    assert torch.equal(st.blocks_b("q_proj")[1], linear.lora_b[2, :, :rank])
    assert torch.equal(st.blocks_a("q_proj")[1, :, 1:], linear.lora_a[2, :rank, 1:])
    bad = torch.zeros(8, 3)
    bad[3, 1] = float("inf")  # a row of block 0
    st.mark_nonfinite(bad)
    assert st.poison[0].isnan() and not st.poison[1:].isnan().any()
    st.grad_a["q_proj"].fill_(1.0)
    st.add_grad_b("q_proj", torch.arange(4 * 8, dtype=torch.float32).view(4, 8))
    st.seal()
    grads = [{"q_proj": (torch.zeros(rank, 3), torch.zeros(4, rank))} for _ in range(2)]
    st.unstage(grads)
    assert grads[0]["q_proj"][0].isnan().sum() == 1  # the marked job fails its step
    assert torch.equal(grads[1]["q_proj"][0], torch.ones(rank, 3))
    assert torch.equal(grads[1]["q_proj"][1],
                       torch.arange(4 * 8, dtype=torch.float32).view(4, 8)[:, rank:2 * rank])
    assert not st.grad_a["q_proj"].any() and not st.grad_b_blocks["q_proj"].any()


def _short(examples):
    """The examples cut to 7-14 tokens: three jobs' windows of a layer fit one 64-row bucket."""
    cut = [TrainingExample(e.line_number, e.input_ids[:n], e.loss_mask[:n])
           for e, n in zip(examples, (9, 14, 7, 12))]
    return TrainingData("text", cut, [], sum(len(e.input_ids) for e in cut),
                        sum(sum(e.loss_mask) for e in cut))


def _engine(model_dir, remat=False):
    # A budget that takes a bin's forward in one iteration: its sequences then run their
    # backward in lockstep, every layer's windows of all jobs in one plan.
    engine = _llm(model_dir, graphs=True, max_num_batched_tokens=256).engine
    engine.executor.config.finetune.batched_backward = True  # before the first job
    engine.scheduler.finetune.lockstep_jobs = True
    if remat:  # a plan that rematerializes the LoRA shrinks and deltas instead of storing them
        ft = engine.executor.config.finetune
        ft.remat_threshold, ft.remat_chains = 1.0, True
    return engine


def _jobs(tmp_path, model_dir, hp, count):
    """`count` jobs of one plan that differ: their initial adapters and learning rates."""
    out = []
    for i in range(count):
        adapter = save_random_peft_adapter(model_dir, tmp_path / f"init{i}", hp.lora.target_modules,
                                           torch.Generator().manual_seed(10 + i), 0.1)
        job_hp = Hyperparameters.from_dict({**hp.to_dict(), "learning_rate": 1e-3 * (i + 1)})
        out.append((adapter, job_hp))
    return out


def _train(engine, data, jobs, tmp_path, tag, group=True, fail=None):
    states = [engine.add_finetune_job(data, hp, init_adapter_path=adapter) for adapter, hp in jobs]
    if group:  # as the engine groups the jobs of one plan on CUDA
        for state in states:
            state.window_group = ("plan",)
    if fail is not None:
        # Its rows go non-finite in its first backward windows, which run with the other's.
        runner = engine.executor.finetune_runner
        run_backward, bad = runner.run_backward, states[fail].job_id

        def poisoned(windows, errors, grad_scales=()):
            if any(w.job_id == bad for w in windows) and not poisoned.done:
                poisoned.done = True
                for w in windows:
                    if w.job_id == bad:
                        runner._sequence(bad, w.sequence_id).backward.residual_grad.fill_(
                            float("nan"))
            return run_backward(windows, errors, grad_scales)

        poisoned.done = False
        runner.run_backward = poisoned
    while not all(state.finished for state in states):
        engine.step()
    adapters = []
    for i, state in enumerate(states):
        if i == fail:
            assert state.status.value == "failed"
            adapters.append(None)
            continue
        assert state.status.value == "succeeded", state.error
        path = str(tmp_path / f"{tag}-{i}")
        engine.save_finetune_adapter(state.job_id, path)
        adapters.append(load_file(f"{path}/adapter_model.safetensors"))
    return adapters


def _relative_change(adapter, alone, initial):
    change = torch.cat([(alone[k] - initial[k]).flatten() for k in sorted(alone)])
    diff = torch.cat([(adapter[k] - alone[k]).flatten() for k in sorted(alone)])
    return float(diff.norm() / change.norm())


@pytest.mark.parametrize("remat", [False, True], ids=["stored", "rematerialized"])
def test_jobs_of_one_plan_run_their_backward_windows_as_one(remat, tiny_config, tiny_checkpoint,
                                                            tmp_path):
    model_dir, _, examples, _, hp = _setup(tiny_config, tiny_checkpoint, tmp_path)
    data = _short(examples)
    jobs = _jobs(tmp_path, model_dir, hp, 3)
    alone = [_train(_engine(model_dir, remat), data, [job], tmp_path, f"alone{i}")[0]
             for i, job in enumerate(jobs)]
    engine = _engine(model_dir, remat)
    together = _train(engine, data, jobs, tmp_path, "together")
    runner = engine.executor.finetune_runner
    graphs = {id(job.backward_graphs) for job in runner.jobs.values()}
    assert len(graphs) == 1
    pieces = next(iter(runner.jobs.values())).backward_graphs
    assert pieces.max_jobs == MAX_BATCHED_JOBS  # prepared at the second job's start
    assert runner.num_backward_windows["across_jobs"] > 0
    for i, (adapter, (init, _)) in enumerate(zip(together, jobs)):
        initial = load_file(f"{init}/adapter_model.safetensors")
        # Another summation order of the same fp32 sums (rows of other jobs add exact zeros),
        # which AdamW amplifies where a gradient is tiny: the bound of concurrent jobs.
        assert _relative_change(adapter, alone[i], initial) <= 1e-4, i


def test_a_job_that_goes_nan_leaves_the_others_it_ran_with_exact(tiny_config, tiny_checkpoint,
                                                                tmp_path):
    model_dir, _, examples, _, hp = _setup(tiny_config, tiny_checkpoint, tmp_path)
    data = _short(examples)
    jobs = _jobs(tmp_path, model_dir, hp, 2)
    alone = _train(_engine(model_dir), data, jobs[1:], tmp_path, "alone")[0]
    engine = _engine(model_dir)
    _, survivor = _train(engine, data, jobs, tmp_path, "together", fail=0)
    assert engine.executor.finetune_runner.num_backward_windows["across_jobs"] > 0
    initial = load_file(f"{jobs[1][0]}/adapter_model.safetensors")
    assert _relative_change(survivor, alone, initial) <= 1e-4


def test_by_default_each_jobs_backward_windows_run_on_their_own(tiny_config, tiny_checkpoint,
                                                                tmp_path):
    model_dir, _, examples, _, hp = _setup(tiny_config, tiny_checkpoint, tmp_path)
    engine = _llm(model_dir, graphs=True, max_num_batched_tokens=256).engine
    _train(engine, _short(examples), _jobs(tmp_path, model_dir, hp, 2), tmp_path, "default")
    runner = engine.executor.finetune_runner
    assert runner.num_backward_windows["across_jobs"] == 0
    assert all(job.backward_graphs.max_jobs == 1 for job in runner.jobs.values())
