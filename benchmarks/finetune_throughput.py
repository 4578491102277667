"""Token-level fine-tuning alone: trained tokens/s and peak extra memory, per sequence length and
LoRA target set, on a dummy-weight model (FlexLLM's setup: LoRA r=16, AdamW, batch 1).

    python benchmarks/finetune_throughput.py --model llama-3.1-8b --seq-lens 1024 4096 8192 \
        --targets down_proj all --out

One job per (targets, length) trains `--num-sequences` random-token sequences (one optimizer step
each, every token in the loss) after one warm-up step. The budget per iteration is
--max-num-batched-tokens: a sequence's forward is one window when it fits. Peak memory is
max_memory_allocated during the timed steps minus what was allocated before the job (weights and
the preallocated KV cache excluded): activations kept for the backward, the backward's buffers,
gradients, fp32 master weights and AdamW state. "plan_activation_gb" is the activation store of
one sequence (every layer's plan, `job.layer_plans`); `--finetune-activation-budget GIB` mixes
the plans to fit (each job's max_seq_len is its sequence length, so the budget is sized for it):

    python benchmarks/finetune_throughput.py --seq-lens 4096 --targets down_proj \
        --finetune-activation-budget 5.5
    python benchmarks/finetune_throughput.py --seq-lens 4096 --tensor-parallel-size 2
    python benchmarks/finetune_throughput.py --length-range 1024 8192 --num-sequences 16 \
        --targets down_proj      # coserve.py's job mix, offline

`--backends hf-peft` runs the baseline first in the same process: HF transformers (SDPA attention)
with a PEFT LoRA of the same rank, alpha and targets, fused AdamW, bf16 autocast, one sequence per
step, as a user of HF + PEFT trains; `--hf-gradient-checkpointing` adds its gradient checkpointing
(non-reentrant). Its peak extra memory is the same measure (peak during the timed steps minus what
was allocated after the model was built: activations, gradients and AdamW state):

    python benchmarks/finetune_throughput.py --seq-lens 4096 --targets down_proj \
        --backends hf-peft flexserve --hf-gradient-checkpointing off on

`--window-attention flash|cudnn-buckets` sets FLEXSERVE_WINDOW_ATTENTION (what whole-prefix
backward windows run on, `backward_ops.window_attention`); the engine's start-up warm-up builds
the cuDNN plans of their buckets up to the longest length, so the timed steps build none.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo root (benchmarks/README.md)
from benchmarks import harness  # noqa: E402

ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="llama-3.1-8b")
    parser.add_argument("--load-format", default="dummy")
    parser.add_argument("--seq-lens", type=int, nargs="+", default=[1024, 4096, 8192])
    parser.add_argument("--length-range", type=int, nargs=2, metavar=("MIN", "MAX"),
                        default=None,
                        help="instead of --seq-lens: each case trains --num-sequences sequences "
                             "of lengths uniform in [MIN, MAX] (seeded), the mix of "
                             "`coserve.py`'s job (its --finetune-lengths), so the server's "
                             "finetune-only run has an offline counterpart")
    parser.add_argument("--targets", nargs="+", default=["down_proj", "all"])
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--num-sequences", type=int, default=2)
    parser.add_argument("--lora-dropouts", type=float, nargs="+", default=[0.0])
    parser.add_argument("--lora-backward", nargs="+", choices=["kernels", "torch"], default=["kernels"],
                        help="torch: the adapters' backward and the dropout masks as torch ops (no "
                             "fused LoRA kernels; the masks' int64 reference hash, applied as tensors "
                             "in the forward and regenerated in the backward since plans keep no "
                             "mask); several values run each case once per value")
    parser.add_argument("--lora-forward", nargs="+", choices=["fused", "sgmv"], default=["fused"],
                        help="sgmv: the forward's LoRA of prefill-sized windows as the SGMV shrink and "
                             "expand instead of LoRAFusion's kernels 1 and 2 "
                             "(FLEXSERVE_LORA_PREFILL_BACKEND=sgmv); several values run each case once "
                             "per value")
    parser.add_argument("--backends", nargs="+", choices=["flexserve", "hf-peft"],
                        default=["flexserve"],
                        help="hf-peft: HF transformers + PEFT + AdamW on the same cases, run first")
    parser.add_argument("--hf-gradient-checkpointing", nargs="+", choices=["off", "on"],
                        default=["off"], help="hf-peft's gradient checkpointing; several values "
                                              "run each case once per value")
    parser.add_argument("--tensor-parallel-size", type=int, default=1,
                        help="ranks (one GPU each) that train each job together; above 1 the "
                             "memory reported is each GPU's in use after the timed steps over "
                             "before the job (device-wide, not a peak), and the plan fields "
                             "are left out (the ranks hold the job)")
    parser.add_argument("--max-num-batched-tokens", type=int, default=8192)
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.6)
    parser.add_argument("--remat-threshold", type=float, default=None,
                        help="graph pruning's recompute threshold [its default]")
    parser.add_argument("--remat-chains", action="store_true",
                        help="graph pruning's chains beyond algorithm 1 (less memory)")
    parser.add_argument("--finetune-activation-budget", type=float, default=None, metavar="GIB",
                        help="activation budget per sequence: the lowest layers get remat chains "
                             "until the store fits [off]")
    parser.add_argument("--finetune-activation-offload", action="store_true",
                        help="under the budget, every other layer's activations go to pinned "
                             "host memory before any layer gets remat chains [off]")
    parser.add_argument("--loss-chunk-rows", type=int, default=1024,
                        help="rows of full-vocabulary logits at once in the window loss "
                             "[%(default)s]")
    parser.add_argument("--breakdown", action="store_true",
                        help="also time forward steps, backward steps, attention backward, "
                             "rematerialization, loss and optimizer (synchronizing timers)")
    parser.add_argument("--memory-phases", action="store_true",
                        help="also record the peak extra memory of each part: forward steps, the "
                             "window loss, and the backward windows of each layer (GB)")
    parser.add_argument("--profile", action="store_true",
                        help="profile the timed steps (torch.profiler) and print the GPU time by kernel")
    parser.add_argument("--profile-ops", action="store_true",
                        help="with --profile: also record the host's operators and their input "
                             "shapes, and print the device time of each (operator, shapes); the "
                             "wall time then includes the recording")
    parser.add_argument("--window-attention", choices=["flash", "cudnn-buckets"], default=None,
                        help="FLEXSERVE_WINDOW_ATTENTION for this run [the variable, else "
                             "backward_ops' default]")
    harness.add_out_argument(parser)
    args = parser.parse_args()
    if args.window_attention is not None:
        os.environ["FLEXSERVE_WINDOW_ATTENTION"] = args.window_attention
    timers = install_timers() if args.breakdown else None
    phases = install_memory_phases() if args.memory_phases else None

    from flexserve import LLM
    from flexserve.envs import window_attention
    from flexserve.finetune.data import TrainingData, TrainingExample
    from flexserve.finetune.hyperparameters import Hyperparameters
    from flexserve.worker.finetune import activation_store, layer_backward
    from flexserve_kernels.lora.serve import ops as lora_ops

    lora_kernel_dtypes, mask_dispatch = layer_backward.LORA_KERNEL_DTYPES, activation_store.use_triton
    capture = activation_store.FinetuneCapture
    keeps_dropout_tensors = capture._keeps_dropout_tensors

    def use_lora_backward(backend: str) -> None:
        torch_path = backend == "torch"
        layer_backward.LORA_KERNEL_DTYPES = () if torch_path else lora_kernel_dtypes
        # only the dropout masks ask activation_store's dispatch
        activation_store.use_triton = (lambda device: False) if torch_path else mask_dispatch
        # and the forward applies them as tensors
        capture._keeps_dropout_tensors = (lambda *_: True) if torch_path else keeps_dropout_tensors

    if args.length_range is not None:
        lo, hi = args.length_range
        if not 2 <= lo <= hi:
            parser.error(f"--length-range needs 2 <= MIN <= MAX, got {lo} {hi}")
        args.seq_lens = [hi]  # one case per target set; its sequences' lengths vary
    writer = harness.JsonlWriter(args.out, __file__, echo=lambda line: print(line, flush=True))
    if "hf-peft" in args.backends:
        run_hf_peft(args, writer)
    if "flexserve" not in args.backends:
        return
    max_len = max(args.seq_lens)
    llm = LLM(args.model, load_format=args.load_format, dtype="bfloat16",
              max_model_len=max_len + 16, enable_lora=True, max_lora_rank=args.rank,
              max_num_batched_tokens=args.max_num_batched_tokens, max_num_seqs=16,
              gpu_memory_utilization=args.gpu_memory_utilization, enforce_eager=True,
              remat_threshold=args.remat_threshold, remat_chains=args.remat_chains,
              activation_budget_gib=args.finetune_activation_budget,
              activation_offload=args.finetune_activation_offload,
              loss_chunk_rows=args.loss_chunk_rows,
              tensor_parallel_size=args.tensor_parallel_size)
    engine = llm.engine
    distributed = args.tensor_parallel_size > 1

    def gpus_in_use() -> list[int]:
        """Bytes in use on each of the ranks' GPUs, whoever holds them."""
        return [total - free for free, total in (torch.cuda.mem_get_info(i)
                                                 for i in range(args.tensor_parallel_size))]

    vocab = engine.info.vocab_size
    cases = [(t, n, p, b, f) for t in args.targets for n in args.seq_lens for p in args.lora_dropouts
             for b in args.lora_backward for f in args.lora_forward]
    for targets, seq_len, lora_dropout, lora_backward, lora_forward in tqdm(cases, desc="fine-tuning cases"):
        use_lora_backward(lora_backward)
        lora_ops._FUSED_PREFILL = lora_forward == "fused"  # read per batch (`fuses_batch`); eager steps
        g = torch.Generator().manual_seed(seq_len)
        lengths = case_lengths(args, seq_len)
        examples = [TrainingExample(i + 1, torch.randint(100, vocab - 100, (n,),
                                                         generator=g).tolist(),
                                    [False] + [True] * (n - 1))
                    for i, n in enumerate(lengths)]
        data = TrainingData("text", examples, [], sum(lengths), sum(n - 1 for n in lengths))
        num_timed_tokens = sum(lengths[1:])
        hp = Hyperparameters.from_dict({
            "batch_size": 1, "n_epochs": 1, "shuffle": False, "learning_rate": 1e-4,
            "max_seq_len": seq_len,  # what the activation budget is sized for
            "lora": {"r": args.rank, "alpha": 2 * args.rank, "dropout": lora_dropout,
                     "target_modules": ALL if targets == "all" else targets.split(",")}})
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        before_gpus = gpus_in_use() if distributed else None
        try:
            job = engine.add_finetune_job(data, hp)
        except ValueError as e:  # an activation budget that cannot hold this case
            print(json.dumps({"model": args.model, "targets": targets, "seq_len": seq_len,
                              "error": str(e)}), flush=True)
            continue
        while job.step_index < 1:  # warm-up step (kernel compiles, allocator)
            engine.step()
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        if phases is not None:
            phases.clear()
            phases["(before)"] = before
        if timers is not None:
            timers.clear()
        profiler = _start_profiler(args.profile_ops) if args.profile else None
        start = time.perf_counter()
        while not job.finished:
            engine.step()
        torch.cuda.synchronize()
        elapsed = time.perf_counter() - start
        kernel_table = _stop_profiler(profiler, elapsed, args.num_sequences,
                                      args.profile_ops) if profiler else None
        if distributed:
            writer.write({
                "backend": "flexserve", "model": args.model, "targets": targets,
                "rank": args.rank, "seq_len": seq_len, "length_range": args.length_range,
                "tensor_parallel_size": args.tensor_parallel_size,
                "lora_dropout": lora_dropout, "status": job.status.value,
                "tokens_per_s": round(num_timed_tokens / elapsed, 1),
                "seconds_per_sequence": round(elapsed / args.num_sequences, 3),
                "extra_memory_in_use_gb_per_gpu": [
                    round((after - b) / 1e9, 3) for after, b in zip(gpus_in_use(), before_gpus)],
                "losses": [round(x, 4) for x in job.losses]})
            engine.executor.remove_finetune_job(job.job_id)
            engine.scheduler.finetune.remove_job(job.job_id)
            continue
        peak = torch.cuda.max_memory_allocated() - before
        if phases is not None:  # each part reset the peak: the run's is the largest part's
            phases.pop("(before)")
            peak = max([peak, *(v for v in phases.values())])
        runner = engine.executor.finetune_runner
        layers = runner.jobs[job.job_id].layer_plans
        plan = layers.plans[-1]
        row = {
            "backend": "flexserve", "model": args.model, "targets": targets, "rank": args.rank,
            "seq_len": seq_len, "length_range": args.length_range,
            "remat_threshold": plan.remat_threshold, "remat_chains": plan.chains,
            "stored": sorted(plan.stored),
            "activation_budget_gib": args.finetune_activation_budget,
            "lean_layers": list(layers.lean_layers),
            "lean_stored": sorted(layers.plans[layers.lean_layers[0]].stored)
            if layers.lean_layers else None,
            "offload_layers": list(layers.offload_layers),
            "loss_chunk_rows": args.loss_chunk_rows,
            "lora_dropout": lora_dropout,
            "lora_backward": lora_backward,
            "lora_forward": lora_forward,
            "window_attention": window_attention(),
            "status": job.status.value, "tokens_per_s": round(num_timed_tokens / elapsed, 1),
            "seconds_per_sequence": round(elapsed / args.num_sequences, 3),
            "peak_extra_memory_gb": round(peak / 1e9, 3),
            "plan_activation_gb": round(layers.bytes_per_token * seq_len / 1e9, 3),
            "plan_device_gb": round(layers.device_bytes_per_token * seq_len / 1e9, 3),
            "plan_host_gb": round(layers.host_bytes_per_token * seq_len / 1e9, 3),
            "losses": [round(x, 4) for x in job.losses],
        }
        if kernel_table is not None:
            row["gpu_ms_per_sequence_by_kernel"] = kernel_table
        if phases is not None:
            row["peak_extra_memory_gb_by_part"] = {k: round(v / 1e9, 3) for k, v in phases.items()}
        if timers is not None:
            row["seconds_per_sequence_by_part"] = {
                k: round(v / args.num_sequences, 4) for k, v in sorted(timers.items())}
        writer.write(row)
        engine.executor.remove_finetune_job(job.job_id)
        engine.scheduler.finetune.remove_job(job.job_id)
        torch.cuda.empty_cache()


def case_lengths(args, seq_len: int) -> list[int]:
    """The warm-up sequence's length, then the timed ones'."""
    lengths = [seq_len] * (args.num_sequences + 1)
    if args.length_range is not None:  # the warm-up sequence is the longest
        rng = random.Random(f"finetune-lengths-{args.length_range}")
        lengths = [args.length_range[1]] + [rng.randint(*args.length_range)
                                            for _ in range(args.num_sequences)]
    return lengths


def run_hf_peft(args, writer) -> None:
    """The HF + PEFT baseline on every (targets, length, checkpointing) case: a fresh model and
    adapter per case, one optimizer step per sequence, every token in the loss."""
    import gc

    from flexserve.model.registry import resolve_model

    hf_config = resolve_model(args.model, args.load_format).hf_config
    hf_config._attn_implementation = "sdpa"
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    cases = [(t, n, c) for t in args.targets for n in args.seq_lens
             for c in args.hf_gradient_checkpointing]
    for targets, seq_len, checkpointing in tqdm(cases, desc="hf-peft cases"):
        row = {"backend": "hf-peft", "model": args.model, "targets": targets, "rank": args.rank,
               "seq_len": seq_len, "length_range": args.length_range,
               "gradient_checkpointing": checkpointing, "attention": "sdpa"}
        try:
            row.update(_hf_peft_case(args, hf_config, device, targets, seq_len,
                                     checkpointing == "on"))
        except torch.cuda.OutOfMemoryError as e:
            row["error"] = f"out of memory: {str(e)[:200]}"
        writer.write(row)
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()


def _hf_peft_case(args, hf_config, device: torch.device, targets: str, seq_len: int,
                  checkpointing: bool) -> dict:
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    cuda = device.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    with device:
        model = AutoModelForCausalLM.from_config(hf_config, dtype=torch.bfloat16)
    model.config.use_cache = False
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.enable_input_require_grads()
    lora = LoraConfig(r=args.rank, lora_alpha=2 * args.rank, lora_dropout=0.0,
                      target_modules=ALL if targets == "all" else targets.split(","),
                      task_type="CAUSAL_LM")
    model = get_peft_model(model, lora)  # adapters in fp32 (PEFT's autocast_adapter_dtype)
    model.train()
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad],
                                  lr=1e-4, fused=cuda)
    g = torch.Generator().manual_seed(seq_len)
    sequences = [torch.randint(100, hf_config.vocab_size - 100, (n,), generator=g)
                 for n in case_lengths(args, seq_len)]

    def step(ids: torch.Tensor) -> float:
        ids = ids.to(device)[None]
        with torch.autocast(device.type, dtype=torch.bfloat16):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.item()

    sync()
    before = torch.cuda.memory_allocated() if cuda else 0
    losses = [step(sequences[0])]  # warm-up step (AdamW state, allocator)
    sync()
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    for ids in sequences[1:]:
        losses.append(step(ids))
    sync()
    elapsed = time.perf_counter() - start
    timed_tokens = sum(len(ids) for ids in sequences[1:])
    return {"tokens_per_s": round(timed_tokens / elapsed, 1),
            "seconds_per_sequence": round(elapsed / args.num_sequences, 3),
            "peak_extra_memory_gb": round((torch.cuda.max_memory_allocated() - before) / 1e9, 3)
            if cuda else None,
            "losses": [round(x, 4) for x in losses]}


def _start_profiler(ops: bool = False):
    activities = [torch.profiler.ProfilerActivity.CUDA]
    if ops:
        activities.append(torch.profiler.ProfilerActivity.CPU)
    profiler = torch.profiler.profile(activities=activities, record_shapes=ops)
    profiler.__enter__()
    return profiler


def _stop_profiler(profiler, elapsed: float, num_sequences: int, ops: bool = False,
                   top: int = 25) -> dict[str, Any]:
    """Exit the profiler; print and return the GPU milliseconds per sequence of the `top`
    kernels (and the busy total against the wall time; the profiler adds little at this size).
    `ops`: also the device time of the top 2 x `top` (operator, input shapes), printed and under
    the table's "(by operator)"."""
    profiler.__exit__(None, None, None)
    kernels = [e for e in profiler.key_averages()
               if e.device_type == torch.autograd.DeviceType.CUDA and e.device_time_total > 0]
    kernels.sort(key=lambda e: e.device_time_total, reverse=True)
    busy = sum(e.device_time_total for e in kernels) / 1e3 / num_sequences
    table = {"(GPU busy)": round(busy, 2), "(wall)": round(elapsed * 1e3 / num_sequences, 2)}
    for e in kernels[:top]:
        table[e.key[:90]] = round(e.device_time_total / 1e3 / num_sequences, 2)
    width = max(len(k) for k in table)
    print("GPU ms per sequence by kernel:")
    for key, ms in table.items():
        print(f"  {key:<{width}} {ms:9.2f}")
    if ops:
        by_op = [e for e in profiler.key_averages(group_by_input_shape=True)
                 if e.device_type == torch.autograd.DeviceType.CPU and e.self_device_time_total > 0]
        by_op.sort(key=lambda e: e.self_device_time_total, reverse=True)
        print("GPU ms per sequence by operator and input shapes (self):")
        operators = {}
        for e in by_op[:2 * top]:
            ms = round(e.self_device_time_total / 1e3 / num_sequences, 2)
            operators[f"{e.key} {str(e.input_shapes)[:120]}"] = ms
            print(f"  {ms:8.2f}  {e.count:6d}x  {e.key:<36} {str(e.input_shapes)[:120]}")
        table["(by operator)"] = operators
    return table


def install_memory_phases() -> dict[str, int]:
    """Wrap forward steps, the window loss and backward windows so that each records the peak
    memory allocated while it ran, minus `phases["(before)"]` (bytes, the largest per part;
    backward windows by layer)."""
    import functools

    from flexserve.worker import model_runner
    from flexserve.worker.finetune import layer_backward
    from flexserve.worker.finetune import runner as finetune_runner

    phases: dict[str, int] = {}
    running: list[int] = []  # the peak so far of each part in progress (a part may nest another)

    def record(name, fn):
        @functools.wraps(fn)
        def wrapper(*a, **k):
            torch.cuda.synchronize()
            if running:  # the enclosing part keeps what it reached before this reset
                running[-1] = max(running[-1], torch.cuda.max_memory_allocated())
            torch.cuda.reset_peak_memory_stats()
            running.append(0)
            try:
                return fn(*a, **k)
            finally:
                torch.cuda.synchronize()
                peak = max(running.pop(), torch.cuda.max_memory_allocated())
                if running:
                    running[-1] = max(running[-1], peak)
                if "(before)" in phases:
                    key = name if isinstance(name, str) else name(*a, **k)
                    phases[key] = max(phases.get(key, 0), peak - phases["(before)"])
        return wrapper

    runner = model_runner.ModelRunner
    original = runner._execute

    def execute(self, plan, finetune):
        if plan.finetune_windows:
            return record("forward step", original)(self, plan, finetune)
        return original(self, plan, finetune)

    runner._execute = execute
    finetune_runner.window_loss = record("window loss", finetune_runner.window_loss)
    seq = layer_backward.SequenceBackward
    seq.backward_window = record(lambda self, layer, start, end: f"backward layer {layer:02d}",
                                 seq.backward_window)
    return phases


def install_timers() -> dict[str, float]:
    """Wrap the parts of a fine-tuning step with synchronizing timers (seconds, summed)."""
    import functools

    from flexserve.finetune.optimizer import AdapterOptimizer
    from flexserve.worker import model_runner
    from flexserve.worker.finetune import layer_backward
    from flexserve.worker.finetune import runner as finetune_runner

    totals: dict[str, float] = {}
    depth = {"n": 0}
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)

    def timed(name, fn, outermost=False):
        @functools.wraps(fn)
        def wrapper(*a, **k):
            if outermost and depth["n"]:
                return fn(*a, **k)
            depth["n"] += outermost
            sync()
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                sync()
                totals[name] = totals.get(name, 0.0) + time.perf_counter() - t0
                depth["n"] -= outermost
        return wrapper

    runner = model_runner.ModelRunner
    original = runner._execute

    def execute(self, plan, finetune):
        part = ("forward step" if plan.finetune_windows else
                "backward step" if plan.backward_windows else "other step")
        return timed(part, original)(self, plan, finetune)

    runner._execute = execute
    seq = layer_backward.SequenceBackward
    seq._attention_backward = timed("  attention backward", seq._attention_backward)
    window = layer_backward._Window
    window.attention_graph = timed("    attention forward recompute", window.attention_graph)
    finetune_runner.FinetuneRunner.start_sequences = timed(
        "  sequence start", finetune_runner.FinetuneRunner.start_sequences)
    window._load = timed("  rematerialization + loads", window._load, outermost=True)
    finetune_runner.window_loss = timed("  window loss", finetune_runner.window_loss)
    AdapterOptimizer.step = timed("  optimizer", AdapterOptimizer.step)
    return totals


if __name__ == "__main__":
    main()
