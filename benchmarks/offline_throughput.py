"""Offline generation throughput: flexserve's `LLM.generate` vs HF transformers `generate`,
against the physical floors measured in the same run.

Fixed-length random prompts, greedy, EOS ignored, so both backends produce exactly
batch x output_len tokens. Backends: `flexserve` (the defaults: CUDA graphs for decode, LoRA
slots reserved), `flexserve-eager` (--enforce-eager), `flexserve-no-lora` (--no-enable-lora),
`flexserve-nccl` (--disable-custom-all-reduce: above one rank, every all-reduce through NCCL),
`hf`. Also times one prefill of --prefill-len tokens. Floors: a decode step must read every
weight it uses (all parameters but the embedding table) and each row's K/V once, at the measured
copy bandwidth; a prefill must do 2 x params x tokens + causal attention FLOPs at the
measured matmul peak. Prints one JSON line per measurement and a table at the end.

    python benchmarks/offline_throughput.py --model llama-3.1-8b --load-format dummy \
        --input-len 512 --output-len 128 --batch-sizes 1 32 --backends flexserve flexserve-eager hf
    python benchmarks/offline_throughput.py --backends flexserve-no-lora --batch-sizes 1 32 128 \
        --tensor-parallel-size 2         # the model sharded over two GPUs of this host
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
from pathlib import Path

import torch
from tqdm.auto import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo root (benchmarks/README.md)
from benchmarks import harness  # noqa: E402


def random_prompts(batch: int, input_len: int, vocab_size: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(100, vocab_size - 100, (batch, input_len), generator=g).tolist()


def measure_peaks(device: torch.device) -> dict[str, float]:
    """The two ceilings: device copy bandwidth (read + write) and bf16 matmul rate."""
    def timer_us(fn) -> float:
        return harness.time_ms(fn, iters=20, warmup=3, device=device) * 1e3

    return {"copy_tb_s": harness.copy_bandwidth(timer_us, device) / 1e12,
            "matmul_tflop_s": harness.matmul_peak(timer_us, device) / 1e12}


def run_flexserve(args, prompts_by_batch: dict[int, list[list[int]]], backend: str,
                  prefill_prompt: list[int] | None) -> list[dict]:
    """backend: "flexserve" (the defaults: CUDA graphs, LoRA slots reserved but empty),
    "flexserve-eager" (no CUDA graphs), "flexserve-no-lora" (no LoRA slots) or "flexserve-nccl"
    (above one rank: every all-reduce through NCCL, no one-shot all-reduce)."""
    from flexserve import LLM, SamplingParams

    ranks = args.tensor_parallel_size * args.pipeline_parallel_size
    llm = LLM(
        args.model,
        load_format=args.load_format,
        dtype=args.dtype,
        max_model_len=max(args.input_len + args.output_len, args.prefill_len) + 16,
        max_num_batched_tokens=max(args.max_num_batched_tokens, args.prefill_len),
        max_num_seqs=max(prompts_by_batch),
        gpu_memory_utilization=args.gpu_memory_utilization,
        enable_prefix_caching=False,  # repeated prompts must not be served from the cache
        enforce_eager=backend == "flexserve-eager",
        # LoRA is off by default above one device (docs/scaling_out.md)
        enable_lora=backend != "flexserve-no-lora" and ranks == 1,
        async_scheduling=args.async_scheduling,
        tensor_parallel_size=args.tensor_parallel_size,
        pipeline_parallel_size=args.pipeline_parallel_size,
        disable_custom_all_reduce=backend == "flexserve-nccl",
    )
    results = []
    if prefill_prompt is not None:
        one = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
        llm.generate([prefill_prompt], one, use_tqdm=False)  # warm-up (kernel compiles)
        times = []
        for _ in range(3):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            llm.generate([prefill_prompt], one, use_tqdm=False)
            times.append(time.perf_counter() - t0)
        results.append({"backend": backend, "async_scheduling": args.async_scheduling,
                        "tensor_parallel_size": args.tensor_parallel_size,
                        "pipeline_parallel_size": args.pipeline_parallel_size,
                        "prefill_tokens": len(prefill_prompt),
                        "prefill_s": round(sorted(times)[1], 5)})
    for batch, prompts in prompts_by_batch.items():
        prefill_params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
        params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
        # Warm-up with the whole batch: its mixed prefill + decode steps compile Triton variants
        # that a one-prompt run never uses (a cold cache would otherwise bill them to the TPOT).
        llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True),
                     use_tqdm=False)
        t0 = time.perf_counter()
        llm.generate(prompts, prefill_params, use_tqdm=False)
        prefill_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        total_s = time.perf_counter() - t0
        num_out = sum(len(o.outputs[0].token_ids) for o in outputs)
        results.append({**_row(backend, batch, args, prefill_s, total_s, num_out),
                        "async_scheduling": args.async_scheduling,
                        "tensor_parallel_size": args.tensor_parallel_size,
                        "pipeline_parallel_size": args.pipeline_parallel_size})
    del llm
    gc.collect()
    torch.cuda.empty_cache()
    return results


def run_hf(args, prompts_by_batch: dict[int, list[list[int]]], hf_config,
           prefill_prompt: list[int] | None) -> list[dict]:
    from transformers import AutoModelForCausalLM

    dtype = getattr(torch, args.dtype)
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(hf_config, dtype=dtype).eval()
    results = []
    if prefill_prompt is not None:
        ids = torch.tensor([prefill_prompt], device="cuda")
        with torch.inference_mode():
            model(ids)
            times = []
            for _ in range(3):
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                model(ids, logits_to_keep=1)
                torch.cuda.synchronize()
                times.append(time.perf_counter() - t0)
        results.append({"backend": "hf", "prefill_tokens": len(prefill_prompt),
                        "prefill_s": round(sorted(times)[1], 5)})
    for batch, prompts in prompts_by_batch.items():
        ids = torch.tensor(prompts, device="cuda")
        mask = torch.ones_like(ids)

        def gen(n: int, model=model, ids=ids, mask=mask) -> torch.Tensor:
            return model.generate(
                input_ids=ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n,
                do_sample=False, pad_token_id=0,
            )

        with torch.inference_mode():
            gen(2)  # warm-up
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            gen(1)
            torch.cuda.synchronize()
            prefill_s = time.perf_counter() - t0
            t0 = time.perf_counter()
            out = gen(args.output_len)
            torch.cuda.synchronize()
            total_s = time.perf_counter() - t0
        num_out = (out.shape[1] - ids.shape[1]) * batch
        results.append(_row("hf", batch, args, prefill_s, total_s, num_out))
    del model
    gc.collect()
    torch.cuda.empty_cache()
    return results


def _row(backend: str, batch: int, args, prefill_s: float, total_s: float, num_out: int) -> dict:
    tpot = (total_s - prefill_s) / max(args.output_len - 1, 1)
    return {
        "backend": backend,
        "batch": batch,
        "input_len": args.input_len,
        "output_len": args.output_len,
        "prefill_s": round(prefill_s, 4),
        "total_s": round(total_s, 4),
        "tpot_ms": round(tpot * 1e3, 3),
        "output_tok_s": round(num_out / total_s, 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="llama-3.1-8b")
    parser.add_argument("--load-format", default="dummy")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--input-len", type=int, default=512)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--backends", nargs="+", default=["flexserve", "flexserve-eager", "hf"],
                        choices=["flexserve", "flexserve-eager", "flexserve-no-lora",
                                 "flexserve-nccl", "hf"])
    parser.add_argument("--prefill-len", type=int, default=4096,
                        help="also time one prefill of this many tokens (0: skip)")
    parser.add_argument("--max-num-batched-tokens", type=int, default=8192)
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.85)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tensor-parallel-size", type=int, default=1,
                        help="GPUs of this host the flexserve backends shard the model over "
                             "(LoRA off above 1) [%(default)s]")
    parser.add_argument("--pipeline-parallel-size", type=int, default=1,
                        help="pipeline stages of --tensor-parallel-size GPUs each (LoRA off "
                             "above 1 GPU; the floors divide by the tensor-parallel ranks "
                             "only, as a step crosses the stages one after another) [%(default)s]")
    parser.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=True,
                        help="flexserve: launch each decode step before the previous one's "
                             "tokens reach the host [on]")
    harness.add_out_argument(parser)
    args = parser.parse_args()

    from flexserve.model.registry import resolve_model

    hf_config = resolve_model(args.model, args.load_format).hf_config
    prompts = {b: random_prompts(b, args.input_len, hf_config.vocab_size, args.seed) for b in args.batch_sizes}
    prefill_prompt = None
    if args.prefill_len > 0:
        prefill_prompt = random_prompts(1, args.prefill_len, hf_config.vocab_size, args.seed + 1)[0]
    device = torch.device("cuda")
    peaks = measure_peaks(device)
    writer = harness.JsonlWriter(args.out, __file__, echo=lambda line: print(line, flush=True))
    results = [{"peaks": peaks, "floors": floors(hf_config, args, peaks)}]
    writer.write(results[0])
    for backend in tqdm(args.backends, desc="backends"):
        if backend == "hf":
            rows = run_hf(args, prompts, hf_config, prefill_prompt)
        else:
            rows = run_flexserve(args, prompts, backend, prefill_prompt)
        for row in rows:
            writer.write(row)
        results.extend(rows)
    fl = results[0]["floors"]
    print(f"{'backend':16} {'batch':>5} {'prefill s':>10} {'total s':>9} {'TPOT ms':>8} "
          f"{'floor ms':>8} {'x floor':>7} {'out tok/s':>10}")
    for r in results[1:]:
        if "batch" not in r:
            continue
        floor_ms = fl["decode_step_ms"][str(r["batch"])]
        print(f"{r['backend']:16} {r['batch']:>5} {r['prefill_s']:>10} {r['total_s']:>9} "
              f"{r['tpot_ms']:>8} {floor_ms:>8.2f} {r['tpot_ms'] / floor_ms:>7.2f} "
              f"{r['output_tok_s']:>10}")
    for r in results[1:]:
        if "prefill_tokens" in r:
            tflops = fl["prefill_flop"] / r["prefill_s"] / 1e12
            peak = peaks["matmul_tflop_s"] * args.tensor_parallel_size  # every GPU's
            print(f"{r['backend']:16} prefill {r['prefill_tokens']} tokens: {r['prefill_s'] * 1e3:.1f} ms"
                  f" = {tflops:.0f} TFLOP/s = {tflops / peak:.0%} of the "
                  f"measured matmul peak of {args.tensor_parallel_size} GPU(s) "
                  f"({r['prefill_tokens'] / r['prefill_s']:.0f} tok/s)")


def floors(hf_config, args, peaks: dict[str, float]) -> dict:
    """Decode-step floor per batch size (weights read once + every row's K/V at the average
    context of the run, at the copy bandwidth, split over --tensor-parallel-size GPUs) and the
    FLOPs of one prefill of --prefill-len."""
    from flexserve.model.llama import head_dim_of

    hidden, inter, layers = hf_config.hidden_size, hf_config.intermediate_size, hf_config.num_hidden_layers
    head_dim = head_dim_of(hf_config)
    q_dim, kv_dim = hf_config.num_attention_heads * head_dim, hf_config.num_key_value_heads * head_dim
    layer_params = hidden * (q_dim + 2 * kv_dim) + q_dim * hidden + 3 * hidden * inter + 2 * hidden
    read_params = layers * layer_params + hidden + hf_config.vocab_size * hidden  # + norm, lm_head
    elt = torch.finfo(getattr(torch, args.dtype)).bits // 8
    bandwidth = peaks["copy_tb_s"] * 1e12
    avg_context = args.input_len + args.output_len / 2
    kv_bytes_per_row = 2 * layers * kv_dim * elt * avg_context
    # Under tensor parallelism each GPU reads its share at the same time: the floor divides.
    tp = args.tensor_parallel_size
    steps = {str(b): (read_params * elt + b * kv_bytes_per_row) / bandwidth * 1e3 / tp
             for b in args.batch_sizes}
    t = args.prefill_len
    prefill_flop = 2 * (read_params - hf_config.vocab_size * hidden) * t + 2 * hidden * hf_config.vocab_size \
        + 2 * layers * q_dim * t * t  # QK^T and PV over the causal half: 2 * 2 * T^2/2 * q_dim
    return {"weight_bytes_read": read_params * elt, "kv_bytes_per_row": kv_bytes_per_row,
            "decode_step_ms": steps, "prefill_flop": prefill_flop}


if __name__ == "__main__":
    main()
