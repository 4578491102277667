"""Offline generation throughput: flexserve's `LLM.generate` vs HF transformers `generate`.

Fixed-length random prompts, greedy, EOS ignored, so both backends produce exactly
batch x output_len tokens. Prints one JSON line per (backend, batch) and a table at the end.

    python benchmarks/offline_throughput.py --model llama-3.1-8b --load-format dummy \
        --input-len 512 --output-len 128 --batch-sizes 1 32 --backends flexserve hf
"""

from __future__ import annotations

import argparse
import gc
import json
import time

import torch
from tqdm.auto import tqdm


def random_prompts(batch: int, input_len: int, vocab_size: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(100, vocab_size - 100, (batch, input_len), generator=g).tolist()


def measure_peaks(device: torch.device) -> dict[str, float]:
    """The two ceilings: device copy bandwidth (read + write) and bf16 matmul rate."""
    n = 1 << 28  # 256 Mi bf16 elements = 512 MiB
    src = torch.randn(n, device=device, dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    a = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)

    def timed(fn, reps: int) -> float:
        for _ in range(3):
            fn()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        times = []
        for _ in range(reps):
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        return sorted(times)[len(times) // 2]

    copy_s = timed(lambda: dst.copy_(src), 20)
    mm_s = timed(lambda: a @ b, 20)
    return {"copy_tb_s": 2 * n * 2 / copy_s / 1e12, "matmul_tflop_s": 2 * 8192**3 / mm_s / 1e12}


def run_flexserve(args, prompts_by_batch: dict[int, list[list[int]]]) -> list[dict]:
    from flexserve import LLM, SamplingParams

    llm = LLM(
        args.model,
        load_format=args.load_format,
        dtype=args.dtype,
        max_model_len=args.input_len + args.output_len + 16,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_num_seqs=max(prompts_by_batch),
        gpu_memory_utilization=args.gpu_memory_utilization,
    )
    results = []
    for batch, prompts in prompts_by_batch.items():
        prefill_params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
        params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
        llm.generate(prompts[:1], params, use_tqdm=False)  # warm-up
        t0 = time.perf_counter()
        llm.generate(prompts, prefill_params, use_tqdm=False)
        prefill_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        total_s = time.perf_counter() - t0
        num_out = sum(len(o.outputs[0].token_ids) for o in outputs)
        results.append(_row("flexserve", batch, args, prefill_s, total_s, num_out))
    del llm
    gc.collect()
    torch.cuda.empty_cache()
    return results


def run_hf(args, prompts_by_batch: dict[int, list[list[int]]], hf_config) -> list[dict]:
    from transformers import AutoModelForCausalLM

    dtype = getattr(torch, args.dtype)
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(hf_config, dtype=dtype).eval()
    results = []
    for batch, prompts in prompts_by_batch.items():
        ids = torch.tensor(prompts, device="cuda")
        mask = torch.ones_like(ids)

        def gen(n: int) -> torch.Tensor:
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
    parser.add_argument("--backends", nargs="+", default=["flexserve", "hf"])
    parser.add_argument("--max-num-batched-tokens", type=int, default=8192)
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.85)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=None, help="append JSON lines here")
    args = parser.parse_args()

    from flexserve.model.registry import resolve_model

    hf_config = resolve_model(args.model, args.load_format).hf_config
    prompts = {b: random_prompts(b, args.input_len, hf_config.vocab_size, args.seed) for b in args.batch_sizes}
    device = torch.device("cuda")
    results = [{"peaks": measure_peaks(device), "gpu": torch.cuda.get_device_name(device)}]
    print(json.dumps(results[0]), flush=True)
    for backend in tqdm(args.backends, desc="backends"):
        rows = run_flexserve(args, prompts) if backend == "flexserve" else run_hf(args, prompts, hf_config)
        for row in rows:
            print(json.dumps(row), flush=True)
        results.extend(rows)
    if args.out:
        with open(args.out, "a") as f:
            for row in results:
                f.write(json.dumps(row) + "\n")
    print(f"{'backend':10} {'batch':>5} {'prefill s':>10} {'total s':>9} {'TPOT ms':>8} {'out tok/s':>10}")
    for r in results[1:]:
        print(f"{r['backend']:10} {r['batch']:>5} {r['prefill_s']:>10} {r['total_s']:>9} {r['tpot_ms']:>8} {r['output_tok_s']:>10}")


if __name__ == "__main__":
    main()
