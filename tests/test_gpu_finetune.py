"""On CUDA: token-level fine-tuning through the engine (Triton forward kernels, the layer-wise
backward with SDPA's fused attention backward, CUDA-side optimizer) trains the same adapter as
HF transformers + peft + torch.optim.AdamW.

A tiny random Llama (2 layers, GQA 4:2, head_dim 32) in fp32 on the GPU, 2 optimizer steps of 2
random-token sequences each, windows cut by a 16-token budget; the truth is the HF loop in fp64 on
the CPU. Bound: relative error of the weight change (all adapter tensors) <= 1e-4, and no worse
than 4x the fp32 HF loop's own error. Measured on an H200 with CUDA graphs for mixed iterations
and backward windows (2026-11-28): flexserve 2.51e-6, the fp32 HF loop 2.59e-6.
"""

from __future__ import annotations

import pytest
import torch

from flexserve import LLM
from flexserve.finetune.data import TrainingData, TrainingExample
from flexserve.finetune.hyperparameters import Hyperparameters

from _hf_training import save_random_peft_adapter, train_hf_peft

pytestmark = [pytest.mark.gpu]

TARGETS = ["q_proj", "v_proj", "down_proj"]


def _job_setup(tiny_config, tiny_checkpoint, tmp_path):
    """(model_dir, adapter_dir, examples, data, hp, steps, lr): a tiny Llama, a PEFT
    init adapter with non-zero B on TARGETS, four random sequences, two steps of two."""
    config = tiny_config("llama", hidden_size=128, intermediate_size=256, num_attention_heads=4,
                         num_key_value_heads=2, max_position_embeddings=128)
    model_dir = tiny_checkpoint(config, seed=5)
    g = torch.Generator().manual_seed(0)
    adapter_dir = save_random_peft_adapter(model_dir, tmp_path / "init", TARGETS, g, 0.1)

    examples = []
    for i, n in enumerate((23, 37, 16, 41)):
        ids = torch.randint(0, config.vocab_size, (n,), generator=g).tolist()
        examples.append(TrainingExample(i + 1, ids, [False] + [True] * (n - 1)))
    data = TrainingData("text", examples, [], sum(len(e.input_ids) for e in examples),
                        sum(sum(e.loss_mask) for e in examples))
    lr = 1e-3
    hp = Hyperparameters.from_dict({
        "batch_size": 2, "n_epochs": 1, "shuffle": False, "learning_rate": lr,
        "lr_scheduler": "constant", "max_grad_norm": None,
        "lora": {"r": 8, "alpha": 16, "target_modules": TARGETS}})
    return model_dir, adapter_dir, examples, data, hp, [[0, 1], [2, 3]], lr


def _train(model_dir, adapter_dir, data, hp, dtype, out_dir):
    """Run the job on CUDA in `dtype`; the tuned adapter's tensors (fp64), the KV cache's
    usage after the job and the backward windows by how they ran (CUDA graphs or eagerly). The
    engine is freed before it returns (a second one may follow)."""
    import gc

    from safetensors.torch import load_file

    llm = LLM(model_dir, device="cuda", dtype=dtype, enable_lora=True, max_lora_rank=8,
              max_model_len=64, max_num_batched_tokens=16, gpu_memory_utilization=0.3)
    engine = llm.engine
    job = engine.add_finetune_job(data, hp, init_adapter_path=adapter_dir)
    while not job.finished:
        engine.step()
    assert job.status.value == "succeeded", job.error
    engine.save_finetune_adapter(job.job_id, out_dir)
    tuned = {k: v.double() for k, v in load_file(f"{out_dir}/adapter_model.safetensors").items()}
    usage = engine.scheduler.kv_cache_usage
    runner = engine.executor.finetune_runner
    windows = dict(runner.num_backward_windows) if runner is not None else {}
    del llm, engine, job, runner
    gc.collect()
    torch.cuda.empty_cache()
    return tuned, usage, windows


def _relative_change_error(weights, truth, initial) -> float:
    keys = sorted(truth)
    a = torch.cat([(weights[k] - initial[k]).flatten() for k in keys])
    b = torch.cat([(truth[k] - initial[k]).flatten() for k in keys])
    return float((a - b).norm() / b.norm())


def test_gpu_finetuning_equals_hf_peft(tiny_config, tiny_checkpoint, tmp_path):
    from safetensors.torch import load_file

    model_dir, adapter_dir, examples, data, hp, steps, lr = _job_setup(
        tiny_config, tiny_checkpoint, tmp_path)
    ours, kv_usage, windows = _train(model_dir, adapter_dir, data, hp, "float32",
                                     str(tmp_path / "tuned"))
    initial = {k: v.double() for k, v in load_file(f"{adapter_dir}/adapter_model.safetensors").items()}
    truth = train_hf_peft(model_dir, adapter_dir, examples, steps, lr, torch.float64)
    hf32 = train_hf_peft(model_dir, adapter_dir, examples, steps, lr, torch.float32)
    ours_error = _relative_change_error(ours, truth, initial)
    hf_error = _relative_change_error(hf32, truth, initial)
    print(f"relative error of the weight change vs fp64: flexserve on CUDA {ours_error:.2e}, "
          f"HF fp32 on CPU {hf_error:.2e}")
    assert ours_error <= 1e-4 and ours_error <= max(4 * hf_error, 1e-5)
    assert kv_usage == 0.0
    # Backward graphs on, as served (a sequence that finds the activation arena taken by
    # another runs its windows eagerly).
    assert windows["graphs"] > 0, windows


def test_gpu_bf16_finetuning_fused_path_is_as_accurate_as_torch_path(
        tiny_config, tiny_checkpoint, tmp_path, monkeypatch):
    """bf16 on CUDA: the fused backward (Triton elementwise kernels, LoRA products as 16-bit
    GEMMs with fp32 outputs and dS split in two bf16 terms) against the torch path
    (FLEXSERVE_KERNELS=torch: Triton off everywhere, the torch ops), both against the fp64 truth.
    bf16 weights and activations dominate both errors (measured on an H200, 2026-11-21: fused
    8.93e-2, torch path 9.08e-2 relative error of the weight change after two steps at lr 1e-3);
    the fused path may not be worse than 1.25x the torch path's."""
    from safetensors.torch import load_file

    from flexserve.worker.finetune import layer_backward

    # Every window takes the 16-bit LoRA GEMMs (the 16-token windows are otherwise too narrow).
    monkeypatch.setattr(layer_backward, "WIDE_LORA_GEMM_ROWS", 1)
    model_dir, adapter_dir, examples, data, hp, steps, lr = _job_setup(
        tiny_config, tiny_checkpoint, tmp_path)
    initial = {k: v.double() for k, v in load_file(f"{adapter_dir}/adapter_model.safetensors").items()}
    truth = train_hf_peft(model_dir, adapter_dir, examples, steps, lr, torch.float64)
    fused, _, _ = _train(model_dir, adapter_dir, data, hp, "bfloat16", str(tmp_path / "fused"))
    monkeypatch.setenv("FLEXSERVE_KERNELS", "torch")
    plain, _, _ = _train(model_dir, adapter_dir, data, hp, "bfloat16", str(tmp_path / "torch"))
    fused_error = _relative_change_error(fused, truth, initial)
    plain_error = _relative_change_error(plain, truth, initial)
    print(f"bf16 relative error of the weight change vs fp64: fused {fused_error:.2e}, "
          f"torch path {plain_error:.2e}")
    assert fused_error <= 1.25 * plain_error and fused_error <= 0.2


def test_gpu_dropout_fused_lora_kernels_equal_torch_path(tiny_config, tiny_checkpoint, tmp_path,
                                                         monkeypatch):
    """LoRA dropout 0.3 in fp32 on CUDA: the fused path (the masks hashed in registers by fused LoRA
    kernel 1 in the forward's and the rematerialized shrinks, and by kernels 5 and 4's term in LoRA
    A's backward) trains the same adapter as the torch path (FLEXSERVE_KERNELS=torch: the masks'
    torch reference and torch ops), which the CPU tests check against HF + PEFT. Only summation orders differ: relative
    difference of the weight change <= 1e-5."""
    from safetensors.torch import load_file

    model_dir, adapter_dir, _, data, hp, _, _ = _job_setup(tiny_config, tiny_checkpoint, tmp_path)
    hp = Hyperparameters.from_dict({**hp.to_dict(), "lora": {**hp.to_dict()["lora"], "dropout": 0.3}})
    initial = {k: v.double() for k, v in load_file(f"{adapter_dir}/adapter_model.safetensors").items()}
    fused, _, _ = _train(model_dir, adapter_dir, data, hp, "float32", str(tmp_path / "fused"))
    monkeypatch.setenv("FLEXSERVE_KERNELS", "torch")
    plain, _, _ = _train(model_dir, adapter_dir, data, hp, "float32", str(tmp_path / "torch"))
    difference = _relative_change_error(fused, plain, initial)
    print(f"dropout 0.3, fp32: fused LoRA kernels vs torch path, weight change differs by {difference:.2e}")
    assert difference <= 1e-5


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_gpu_backward_graphs_equal_eager_windows(dtype, tiny_config, tiny_checkpoint, tmp_path,
                                                 monkeypatch):
    """The backward windows replayed from CUDA graphs (two pieces per layer and row bucket around
    an eager attention, windows padded to the bucket) train the adapter the eager windows train:
    only the GEMMs' row counts differ. Relative difference of the weight change <= 1e-5 in fp32,
    <= 2e-2 in bf16 (where one rounding of a 16-bit GEMM product differs)."""
    from safetensors.torch import load_file

    from flexserve.worker.finetune.runner import FinetuneRunner

    model_dir, adapter_dir, _, data, hp, _, _ = _job_setup(tiny_config, tiny_checkpoint, tmp_path)
    initial = {k: v.double() for k, v in load_file(f"{adapter_dir}/adapter_model.safetensors").items()}
    graphed, _, by_graphs = _train(model_dir, adapter_dir, data, hp, dtype, str(tmp_path / "g"))
    monkeypatch.setattr(FinetuneRunner, "_backward_graphs", lambda self, job: None)
    eager, _, by_eager = _train(model_dir, adapter_dir, data, hp, dtype, str(tmp_path / "e"))
    difference = _relative_change_error(graphed, eager, initial)
    print(f"{dtype}: backward graphs vs eager windows, weight change differs by {difference:.2e}")
    assert by_graphs["graphs"] > 0, by_graphs
    assert by_eager["graphs"] == 0 and by_eager["eager"] == sum(by_graphs.values())
    assert difference <= (1e-5 if dtype == "float32" else 2e-2)


def test_gpu_jobs_of_one_plan_run_their_backward_windows_as_one(tiny_config, tiny_checkpoint,
                                                                tmp_path):
    """Three jobs of one plan (other initial adapters and learning rates) trained together on
    CUDA, their backward windows replayed as one from the captured pieces of a job width
    (`StagedLoRA`), train what each trains alone, in fp32: <= 1e-4 of the weight change."""
    import gc

    from safetensors.torch import load_file

    from test_batched_backward import _jobs, _relative_change, _short

    model_dir, _, examples, _, hp, _, _ = _job_setup(tiny_config, tiny_checkpoint, tmp_path)
    data = _short(examples)
    jobs = _jobs(tmp_path, model_dir, hp, 3)

    def train(subset, tag):
        llm = LLM(model_dir, device="cuda", dtype="float32", enable_lora=True, max_lora_rank=8,
                  max_model_len=64, max_num_batched_tokens=256, gpu_memory_utilization=0.3,
                  batched_backward=True)
        engine = llm.engine
        states = [engine.add_finetune_job(data, job_hp, init_adapter_path=adapter)
                  for adapter, job_hp in subset]
        while not all(state.finished for state in states):
            engine.step()
        out = []
        for i, state in enumerate(states):
            assert state.status.value == "succeeded", state.error
            engine.save_finetune_adapter(state.job_id, str(tmp_path / f"{tag}{i}"))
            out.append(load_file(str(tmp_path / f"{tag}{i}" / "adapter_model.safetensors")))
        windows = dict(engine.executor.finetune_runner.num_backward_windows)
        del llm, engine, states
        gc.collect()
        torch.cuda.empty_cache()
        return out, windows

    alone = [train([job], f"alone{i}")[0][0] for i, job in enumerate(jobs)]
    together, windows = train(jobs, "together")
    assert windows["across_jobs"] > 0, windows
    for i, (adapter, (init, _)) in enumerate(zip(together, jobs)):
        initial = load_file(f"{init}/adapter_model.safetensors")
        error = _relative_change(adapter, alone[i], initial)
        print(f"job {i}: together vs alone, weight change differs by {error:.2e}")
        assert error <= 1e-4, i
