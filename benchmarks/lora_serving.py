"""Decode cost of multi-LoRA serving: TPOT and throughput with 0, 1 and N distinct adapters.

Random PEFT adapters (rank 16, all seven linear targets, non-zero B) are written to a temporary
directory; requests are spread round-robin over the adapters. Greedy, EOS ignored, fixed lengths.

    python benchmarks/lora_serving.py --model llama-3.1-8b --load-format dummy \
        --batch-sizes 1 16 64 --num-adapters 0 1 8 --rank 16
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import save_file
from tqdm.auto import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo root (benchmarks/README.md)
from benchmarks import harness  # noqa: E402

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def write_random_adapter(path: str, hf_config, rank: int, seed: int) -> None:
    """A PEFT-format LoRA adapter (as `peft` writes it) with random A and B."""
    g = torch.Generator().manual_seed(seed)
    hidden = hf_config.hidden_size
    head_dim = getattr(hf_config, "head_dim", None) or hidden // hf_config.num_attention_heads
    q_out = hf_config.num_attention_heads * head_dim
    kv_out = hf_config.num_key_value_heads * head_dim
    inter = hf_config.intermediate_size
    shapes = {
        "self_attn.q_proj": (hidden, q_out), "self_attn.k_proj": (hidden, kv_out),
        "self_attn.v_proj": (hidden, kv_out), "self_attn.o_proj": (q_out, hidden),
        "mlp.gate_proj": (hidden, inter), "mlp.up_proj": (hidden, inter),
        "mlp.down_proj": (inter, hidden),
    }
    tensors = {}
    for layer in range(hf_config.num_hidden_layers):
        for name, (fan_in, fan_out) in shapes.items():
            prefix = f"base_model.model.model.layers.{layer}.{name}"
            lora_a = torch.randn(rank, fan_in, generator=g) / fan_in**0.5
            tensors[f"{prefix}.lora_A.weight"] = lora_a.to(torch.bfloat16)
            tensors[f"{prefix}.lora_B.weight"] = (torch.randn(fan_out, rank, generator=g) * 0.01).to(torch.bfloat16)
    os.makedirs(path, exist_ok=True)
    save_file(tensors, os.path.join(path, "adapter_model.safetensors"), metadata={"format": "pt"})
    config = {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": 2 * rank,
        "lora_dropout": 0.0, "target_modules": list(TARGETS), "bias": "none",
        "use_rslora": False, "use_dora": False, "base_model_name_or_path": None,
        "fan_in_fan_out": False, "modules_to_save": None,
    }
    with open(os.path.join(path, "adapter_config.json"), "w") as f:
        json.dump(config, f)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="llama-3.1-8b")
    parser.add_argument("--load-format", default="dummy")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--num-adapters", type=int, nargs="+", default=[0, 1, 8])
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.85)
    parser.add_argument("--repeats", type=int, default=3, help="round-robin repetitions (median)")
    harness.add_out_argument(parser)
    args = parser.parse_args()

    from flexserve import LLM, SamplingParams
    from flexserve.engine.lora_request import LoRARequest
    from flexserve.model.registry import resolve_model

    hf_config = resolve_model(args.model, args.load_format).hf_config
    max_adapters = max(args.num_adapters)
    workdir = tempfile.mkdtemp(prefix="flexserve-lora-bench-")
    adapters = []
    for i in tqdm(range(max_adapters), desc="writing adapters"):
        path = os.path.join(workdir, f"adapter{i}")
        write_random_adapter(path, hf_config, args.rank, seed=i)
        adapters.append(LoRARequest(f"adapter{i}", i + 1, path))

    llm = LLM(
        args.model, load_format=args.load_format, dtype=args.dtype,
        max_model_len=args.input_len + args.output_len + 16,
        max_num_seqs=max(args.batch_sizes), max_num_batched_tokens=8192,
        gpu_memory_utilization=args.gpu_memory_utilization,
        enable_lora=max_adapters > 0,
        **({"max_loras": max_adapters, "max_lora_rank": args.rank} if max_adapters else {}),
    )
    g = torch.Generator().manual_seed(0)
    writer = harness.JsonlWriter(args.out, __file__, echo=lambda line: print(line, flush=True))
    results = []
    for batch in tqdm(args.batch_sizes, desc="batch sizes"):
        prompts = torch.randint(100, hf_config.vocab_size - 100, (batch, args.input_len), generator=g).tolist()
        params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
        one = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
        loras_for = {
            n: [adapters[i % n] if n else None for i in range(batch)] for n in args.num_adapters
        }
        for loras in loras_for.values():
            llm.generate(prompts, one, lora_request=loras, use_tqdm=False)  # warm-up, loads slots
        # Decode here is bound by host-side launches, whose speed drifts over seconds: measure the
        # configurations round-robin, several times, and keep each one's median.
        samples: dict[int, list[tuple[float, float]]] = {n: [] for n in args.num_adapters}
        for _ in range(args.repeats):
            for n, loras in loras_for.items():
                t0 = time.perf_counter()
                llm.generate(prompts, one, lora_request=loras, use_tqdm=False)
                prefill_s = time.perf_counter() - t0
                t0 = time.perf_counter()
                llm.generate(prompts, params, lora_request=loras, use_tqdm=False)
                samples[n].append((prefill_s, time.perf_counter() - t0))
        for n, runs in samples.items():
            tpots = sorted((total - prefill) / (args.output_len - 1) for prefill, total in runs)
            totals = sorted(total for _, total in runs)
            row = {
                "batch": batch, "num_adapters": n, "rank": args.rank, "repeats": args.repeats,
                "input_len": args.input_len, "output_len": args.output_len,
                "tpot_ms": round(tpots[len(tpots) // 2] * 1e3, 3),
                "tpot_ms_min": round(tpots[0] * 1e3, 3), "tpot_ms_max": round(tpots[-1] * 1e3, 3),
                "output_tok_s": round(batch * args.output_len / totals[len(totals) // 2], 1),
            }
            writer.write(row)
            results.append(row)
    base = {r["batch"]: r["tpot_ms"] for r in results if r["num_adapters"] == 0}
    print(f"{'batch':>5} {'adapters':>8} {'TPOT ms':>8} {'min-max':>15} {'vs base':>8} {'out tok/s':>10}")
    for r in results:
        overhead = f"{r['tpot_ms'] / base[r['batch']] - 1:+.1%}" if r["batch"] in base else "-"
        spread = f"{r['tpot_ms_min']}-{r['tpot_ms_max']}"
        print(f"{r['batch']:>5} {r['num_adapters']:>8} {r['tpot_ms']:>8} {spread:>15} {overhead:>8} "
              f"{r['output_tok_s']:>10}")


if __name__ == "__main__":
    main()
