"""Decode LoRA with 8 adapters: the CUDA C++ BGMV kernels vs Triton BGMV vs the fused Triton kernel.

Part 1 (kernels): per Llama-3.1-8B decoder layer (rank 16, 8 adapters, rows use slots 0..7 in
turn, bf16), 32 layers with their own weights captured in one CUDA graph and replayed, timed with
CUDA events; microseconds per layer for each way of running the layer's 4 LoRA groups
(q/k/v on the normed hidden state, o, gate/up, down):

    triton_bgmv        Triton shrink + expand per projection (14 launches)
    cuda_bgmv          the extension's shrink + expand per projection (14 launches)
    fused              the fused Triton kernel per group (4 launches)
    fused_triton_down  fused q/k/v, o, gate/up; Triton BGMV down (the path before the extension)
    fused_cuda_down    fused q/k/v, o, gate/up; CUDA BGMV down (FLEXSERVE_LORA_DECODE_BACKEND=auto)
    down_triton_bgmv   down_proj alone, Triton BGMV (2 launches)
    down_cuda_bgmv     down_proj alone, CUDA BGMV (2 launches)

Part 2 (e2e): decode TPOT through flexserve with 8 adapters (random weights, dummy base model, CUDA
graphs on, no hub access), one engine per FLEXSERVE_LORA_DECODE_BACKEND value (--backends: triton,
auto, cuda), each in its own process (graphs are captured with the backend of their process), at
batches 1, 16 and 64 unless --batches says otherwise. TPOT = (generate N tokens - generate 1
token) / (N - 1), median of --repeats. Each JSON line also says what ran down_proj's LoRA in that
engine's decode steps (`down_proj_decode`: folded, cuda or triton; with auto, a down_proj group whose
shrinks are folded into its GEMM stays folded: max_loras x max_rank over 12.5% of hidden_size,
e.g. --rank 128, unfolds it). A table of TPOT per backend follows the JSON lines.

    python benchmarks/kernels/lora_bgmv_cuda.py --out
    python benchmarks/kernels/lora_bgmv_cuda.py --part kernels --batches 1 16 64
    python benchmarks/kernels/lora_bgmv_cuda.py --part e2e --out lora_bgmv_e2e.jsonl
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from tqdm.auto import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root (benchmarks/README.md)
from benchmarks import harness  # noqa: E402

# (in, outs) of each LoRA group of a Llama-3.1-8B layer: hidden 4096, q 4096, k/v 1024, MLP 14336.
LLAMA8B_GROUPS = {"qkv": (4096, (4096, 1024, 1024)), "o": (4096, (4096,)), "gate_up": (4096, (14336, 14336)),
                  "down": (14336, (4096,))}
# path -> {group: "triton" | "cuda" | "fused"}; groups left out are not run
PATHS = {
    "triton_bgmv": dict.fromkeys(LLAMA8B_GROUPS, "triton"),
    "cuda_bgmv": dict.fromkeys(LLAMA8B_GROUPS, "cuda"),
    "fused": dict.fromkeys(LLAMA8B_GROUPS, "fused"),
    "fused_triton_down": {"qkv": "fused", "o": "fused", "gate_up": "fused", "down": "triton"},
    "fused_cuda_down": {"qkv": "fused", "o": "fused", "gate_up": "fused", "down": "cuda"},
    "down_triton_bgmv": {"down": "triton"},
    "down_cuda_bgmv": {"down": "cuda"},
}
BACKENDS = ("triton", "auto", "cuda")
KERNEL_BATCHES = [1, 2, 4, 8, 16, 32, 64]  # --part kernels without --batches
E2E_BATCHES = [1, 16, 64]  # --part e2e without --batches


def bench_kernels(batch: int, *, num_layers: int, rank: int, num_slots: int, replays: int) -> dict:
    """Microseconds per layer of each path in PATHS (CUDA-graph replay of num_layers layers)."""
    from flexserve_kernels.lora.serve.cuda_ext import load_lora_bgmv
    from flexserve_kernels.lora.serve.expand import lora_expand_bgmv
    from flexserve_kernels.lora.serve.fused import lora_fused_bgmv
    from flexserve_kernels.lora.serve.meta import LoRAKernelMeta
    from flexserve_kernels.lora.serve.shrink import lora_shrink_bgmv

    ops = load_lora_bgmv()
    device, dtype = torch.device("cuda"), torch.bfloat16
    g = torch.Generator().manual_seed(batch)

    def rand(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g) * scale).to(device, dtype)

    token_slots = (torch.arange(batch, dtype=torch.int32) % num_slots).to(device)
    empty = token_slots[:0]
    # The decode-only metadata CUDAGraphRunner builds: BGMV reads token_slots only.
    meta = LoRAKernelMeta(token_slots=token_slots, seg_starts=empty, seg_lens=empty, seg_slots=empty,
                          num_tokens=batch, max_seg_len=1, decode_only=True)
    xs = {name: rand(batch, in_size) for name, (in_size, _) in LLAMA8B_GROUPS.items()}
    wides = {name: rand(batch, sum(outs)) for name, (_, outs) in LLAMA8B_GROUPS.items()}
    ys = {name: list(wides[name].split(list(LLAMA8B_GROUPS[name][1]), dim=1)) for name in LLAMA8B_GROUPS}
    s = torch.empty(batch, rank, device=device)  # the CUDA shrink's output, reused (as in a graph)
    layers = [
        {name: [(rand(num_slots, rank, in_size, scale=in_size**-0.5), rand(num_slots, n, rank, scale=1e-3),
                 torch.full((num_slots,), 2.0, device=device)) for n in outs]
         for name, (in_size, outs) in LLAMA8B_GROUPS.items()}
        for _ in range(num_layers)
    ]

    def run(path: str) -> None:
        for layer in layers:
            for name, impl in PATHS[path].items():
                x, weights = xs[name], layer[name]
                if impl == "fused":
                    lora_fused_bgmv(x, [(a, b, sc, y) for (a, b, sc), y in zip(weights, ys[name])], token_slots)
                    continue
                for (a, b, sc), y in zip(weights, ys[name]):
                    if impl == "cuda":
                        ops.shrink(x, a, token_slots, s)
                        ops.expand(s, b, token_slots, sc, y)
                    else:
                        lora_expand_bgmv(lora_shrink_bgmv(x, a, meta), b, meta, y, sc)

    # The CUDA and Triton BGMV paths from the same outputs must agree to about one rounding of y.
    start_values = {name: w.clone() for name, w in wides.items()}
    results = {}
    for path in ("triton_bgmv", "cuda_bgmv"):
        run(path)
        results[path] = torch.cat([wides[name].float() for name in LLAMA8B_GROUPS], dim=1)
        for name, w in wides.items():
            w.copy_(start_values[name])
    row = dict(part="kernels", batch=batch, rank=rank, num_adapters=num_slots, layers=num_layers, dtype="bfloat16",
               device=harness.gpu_name(),
               cuda_vs_triton_max_abs_diff=(results["cuda_bgmv"] - results["triton_bgmv"]).abs().max().item())
    for path in PATHS:
        graph = harness.cuda_graph(functools.partial(run, path))  # the Triton kernels compile outside the capture
        us_per_layer = harness.mean_ms(graph.replay, iters=replays, warmup=3) * 1e3 / num_layers
        row[f"{path}_us_per_layer"] = round(us_per_layer, 2)
        del graph
    return row


def bench_e2e_one(args: argparse.Namespace) -> None:
    """Decode TPOT with args.num_adapters adapters in this process's backend; prints JSON lines."""
    from benchmarks.lora_serving import write_random_adapter
    from flexserve import LLM, SamplingParams
    from flexserve.engine.lora_request import LoRARequest
    from flexserve.envs import lora_decode_backend
    from flexserve.model.registry import resolve_model

    hf_config = resolve_model(args.model, "dummy").hf_config
    workdir = tempfile.mkdtemp(prefix="flexserve-bgmv-bench-")
    adapters = []
    for i in range(args.num_adapters):
        path = os.path.join(workdir, f"adapter{i}")
        write_random_adapter(path, hf_config, args.rank, seed=i)
        adapters.append(LoRARequest(f"adapter{i}", i + 1, path))
    # warmup=False: the fine-tuning kernels' start-up compile is not needed for decode.
    llm = LLM(args.model, load_format="dummy", dtype="bfloat16", max_model_len=args.input_len + args.output_len + 16,
              max_num_seqs=max(args.batches), gpu_memory_utilization=args.gpu_memory_utilization,
              enable_lora=True, max_loras=args.num_adapters, max_lora_rank=args.rank, warmup=False)
    runner = llm.engine.executor
    backend = lora_decode_backend()
    g = torch.Generator().manual_seed(0)
    for batch in args.batches:
        prompts = torch.randint(100, hf_config.vocab_size - 100, (batch, args.input_len), generator=g).tolist()
        loras = [adapters[i % args.num_adapters] for i in range(batch)]
        one = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
        params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
        llm.generate(prompts, params, lora_request=loras, use_tqdm=False)  # warm-up, loads slots
        tpots = []
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            llm.generate(prompts, one, lora_request=loras, use_tqdm=False)
            prefill_s = time.perf_counter() - t0
            t0 = time.perf_counter()
            llm.generate(prompts, params, lora_request=loras, use_tqdm=False)
            tpots.append((time.perf_counter() - t0 - prefill_s) / (args.output_len - 1))
        tpots.sort()
        print(json.dumps(dict(part="e2e", backend=backend, batch=batch, num_adapters=args.num_adapters,
                              rank=args.rank, model=args.model, input_len=args.input_len,
                              output_len=args.output_len, repeats=args.repeats,
                              tpot_ms=round(tpots[len(tpots) // 2] * 1e3, 3),
                              tpot_ms_min=round(tpots[0] * 1e3, 3), tpot_ms_max=round(tpots[-1] * 1e3, 3),
                              down_proj_decode=down_proj_decode(runner, batch),
                              cuda_graphs=runner.graph_runner is not None,
                              device=harness.gpu_name())),
              flush=True)


def down_proj_decode(runner, batch: int) -> str:
    """What runs down_proj's LoRA in a decode step of `batch` rows on `runner` (a ModelRunner): "folded"
    (its shrinks in the GEMM, a Triton expand), "cuda" (the extension's BGMV pair) or "triton"
    (Triton's BGMV pair); asked of the same functions the layers ask, for the graph's padded size."""
    from flexserve.worker.cuda_graphs import padded_batch_size
    from flexserve_kernels.lora.serve.cuda_ext import cuda_decode_replaces_fused, cuda_decode_wanted
    from flexserve_kernels.lora.serve.meta import LoRAKernelMeta

    graphs = runner.graph_runner
    rows = (padded_batch_size(batch, graphs.batch_sizes) if graphs is not None else None) or batch
    empty = torch.empty(0, dtype=torch.int32)
    meta = LoRAKernelMeta(token_slots=torch.zeros(rows, dtype=torch.int32), seg_starts=empty, seg_lens=empty,
                          seg_slots=empty, num_tokens=rows, max_seg_len=1, decode_only=True)
    if cuda_decode_replaces_fused(runner.device, meta):
        return "cuda"
    if runner.model.model.layers[0].mlp.down.folded is not None:
        return "folded"
    return "cuda" if cuda_decode_wanted(runner.device, meta) else "triton"


def run_e2e(args: argparse.Namespace, batches: list[int]) -> list[dict]:
    """One child process (`--part e2e-one`) per backend; their JSON lines, as they come."""
    child = [sys.executable, __file__, "--part", "e2e-one", "--batches", *map(str, batches),
             "--rank", str(args.rank), "--num-adapters", str(args.num_adapters), "--model", args.model,
             "--input-len", str(args.input_len), "--output-len", str(args.output_len),
             "--repeats", str(args.repeats), "--gpu-memory-utilization", str(args.gpu_memory_utilization)]
    rows = []
    with tqdm(total=len(args.backends) * len(batches), desc="e2e decode TPOT", unit="batch") as bar:
        writer = harness.JsonlWriter(args.out, __file__, echo=bar.write)
        for backend in args.backends:
            bar.set_postfix(backend=backend)
            env = dict(os.environ, FLEXSERVE_LORA_DECODE_BACKEND=backend)
            with tempfile.TemporaryFile(mode="w+") as log:
                proc = subprocess.Popen(child, env=env, stdout=subprocess.PIPE, stderr=log, text=True)
                for line in proc.stdout:
                    if line.startswith("{"):
                        row = json.loads(line)
                        rows.append(row)
                        writer.write(row)
                        bar.update()
                if proc.wait() != 0:
                    log.seek(0)
                    sys.exit(f"e2e with backend {backend} failed:\n{log.read()[-4000:]}")
    return rows


def print_e2e_table(rows: list[dict]) -> None:
    """TPOT per batch (rows) and backend (columns), each against triton's, and down_proj's path."""
    if not rows:
        return
    backends = list(dict.fromkeys(r["backend"] for r in rows))
    by_key = {(r["batch"], r["backend"]): r for r in rows}
    first = rows[0]
    print(f"\ndecode TPOT, ms (median of {first['repeats']}): {first['model']}, {first['num_adapters']} adapters "
          f"of rank {first['rank']}, prompt {first['input_len']}, {first['output_len']} new tokens, {first['device']}")
    header = ["batch", *backends, *(f"{b} vs triton" for b in backends if b != "triton" and "triton" in backends),
              *(f"down_proj ({b})" for b in backends)]
    lines = [header]
    for batch in dict.fromkeys(r["batch"] for r in rows):
        got = {b: by_key.get((batch, b)) for b in backends}
        base = got.get("triton")
        cells = [str(batch), *(f"{got[b]['tpot_ms']:.3f}" if got[b] else "-" for b in backends)]
        cells += [f"{(got[b]['tpot_ms'] / base['tpot_ms'] - 1) * 100:+.1f}%" if got[b] and base else "-"
                  for b in backends if b != "triton" and "triton" in backends]
        cells += [got[b]["down_proj_decode"] if got[b] else "-" for b in backends]
        lines.append(cells)
    widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
    for line in lines:
        print("  ".join(cell.rjust(width) for cell, width in zip(line, widths)))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--part", choices=("all", "kernels", "e2e", "e2e-one"), default="all",
                   help="e2e-one: one engine in this process's FLEXSERVE_LORA_DECODE_BACKEND (used by e2e)")
    p.add_argument("--batches", type=int, nargs="+",
                   help=f"batch sizes (default: {KERNEL_BATCHES} for kernels, {E2E_BATCHES} for e2e)")
    p.add_argument("--backends", nargs="+", choices=BACKENDS, default=list(BACKENDS),
                   help="e2e: FLEXSERVE_LORA_DECODE_BACKEND values, one engine each")
    p.add_argument("--layers", type=int, default=32, help="layers captured in one graph (Llama-3.1-8B: 32)")
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--num-adapters", type=int, default=8)
    p.add_argument("--replays", type=int, default=20)
    p.add_argument("--model", default="llama-3.1-8b")
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3, help="e2e: timed runs per batch (median)")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.85)
    harness.add_out_argument(p)
    args = p.parse_args()
    if args.output_len < 2:
        p.error("--output-len must be at least 2 (TPOT needs two tokens)")
    if args.part == "e2e-one":
        args.batches = args.batches or E2E_BATCHES
        bench_e2e_one(args)
        return
    from flexserve_kernels.lora.serve.cuda_ext import load_lora_bgmv, unavailable_reason

    if load_lora_bgmv() is None:  # also builds it once here, before the e2e processes start
        sys.exit(f"the CUDA BGMV extension is unavailable: {unavailable_reason() or 'its build failed (see log)'}")
    if args.part in ("all", "kernels"):
        writer = harness.JsonlWriter(args.out, __file__, echo=lambda line: print(line, flush=True))
        for batch in args.batches or KERNEL_BATCHES:
            writer.write(bench_kernels(batch, num_layers=args.layers, rank=args.rank, num_slots=args.num_adapters,
                                       replays=args.replays))
    if args.part in ("all", "e2e"):
        torch.cuda.empty_cache()  # the engines below size their KV cache from the free memory
        print_e2e_table(run_e2e(args, args.batches or E2E_BATCHES))


if __name__ == "__main__":
    main()
