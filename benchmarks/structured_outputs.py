"""Structured outputs' cost in decode: throughput at batch 32 with 0%, 50% and 100% of the rows
constrained by a JSON schema, and TPOT at batch 1 free and constrained (target: at most 5% slower
at 100%, as xgrammar's per-token mask is reported near free).

Random prompts, greedy, EOS ignored, so every run generates batch x output_len tokens. The schema
is one open string field, so random weights keep the grammar active for the whole run (a
completed grammar would leave its rows unconstrained); `grammar_active` reports the share of
constrained outputs still inside the string at the end. With `--load-format dummy` the tokenizer
is SmolLM2's (the default model's, materialized offline): xgrammar masks by its token strings.

    python benchmarks/structured_outputs.py --model llama-3.1-8b --load-format dummy --out
    python benchmarks/structured_outputs.py --smoke      # CPU, SmolLM2, a few tokens: runs, untimed
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo root (benchmarks/README.md)
from benchmarks import harness  # noqa: E402

SCHEMA = {"type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"]}


def random_prompts(batch: int, input_len: int, vocab_size: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(100, min(vocab_size, 49152) - 100, (batch, input_len),
                         generator=g).tolist()


def run(llm, prompts: list[list[int]], fraction: float, output_len: int) -> dict:
    from flexserve import SamplingParams, StructuredOutputsParams

    constrained = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True,
                                 structured_outputs=StructuredOutputsParams(
                                     json=json.dumps(SCHEMA), strict=False))
    free = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    num_constrained = round(fraction * len(prompts))
    params = [constrained] * num_constrained + [free] * (len(prompts) - num_constrained)
    first = [SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True,
                            structured_outputs=p.structured_outputs) for p in params]
    llm.generate(prompts, [SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True,
                                          structured_outputs=p.structured_outputs)
                           for p in params], use_tqdm=False)  # warm-up, grammar compiled
    _sync()
    t0 = time.perf_counter()
    llm.generate(prompts, first, use_tqdm=False)
    _sync()
    prefill_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    _sync()
    total_s = time.perf_counter() - t0
    num_out = sum(len(o.outputs[0].token_ids) for o in outputs)
    texts = [o.outputs[0].text for o in outputs[:num_constrained]]
    active = sum(t.startswith('{"text": "') and not t.rstrip().endswith("}") for t in texts)
    return {
        "batch": len(prompts),
        "constrained_fraction": fraction,
        "output_len": output_len,
        "prefill_s": round(prefill_s, 4),
        "total_s": round(total_s, 4),
        "tpot_ms": round((total_s - prefill_s) / max(output_len - 1, 1) * 1e3, 3),
        "output_tok_s": round(num_out / total_s, 1),
        "grammar_active": round(active / num_constrained, 3) if num_constrained else None,
    }


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="llama-3.1-8b")
    parser.add_argument("--load-format", default="dummy")
    parser.add_argument("--tokenizer", default=None,
                        help="tokenizer directory [the model's; SmolLM2's with dummy weights]")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--input-len", type=int, default=512)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--fractions", type=float, nargs="+", default=[0.0, 0.5, 1.0])
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.85)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--smoke", action="store_true",
                        help="CPU check: SmolLM2 fp32, batch 4, 8 tokens (times mean nothing)")
    harness.add_out_argument(parser)
    args = parser.parse_args()

    from flexserve import LLM
    from flexserve.model import default_model

    kwargs = {}
    if args.smoke:
        args.model, args.load_format, args.dtype = default_model.materialize(), "auto", "float32"
        args.input_len, args.output_len, args.batch = 16, 8, 4
        kwargs["kv_cache_gib"] = 0.1
    else:
        kwargs["gpu_memory_utilization"] = args.gpu_memory_utilization
    tokenizer = args.tokenizer
    if tokenizer is None and args.load_format == "dummy":
        tokenizer = default_model.materialize()
    llm = LLM(args.model, load_format=args.load_format, dtype=args.dtype, tokenizer=tokenizer,
              max_model_len=args.input_len + args.output_len + 16, max_num_seqs=args.batch,
              enable_prefix_caching=False, **kwargs)
    vocab_size = llm.engine.info.vocab_size
    writer = harness.JsonlWriter(args.out, __file__, echo=lambda line: print(line, flush=True))
    rows = []
    for batch, fractions in ((args.batch, args.fractions), (1, [0.0, 1.0])):
        prompts = random_prompts(batch, args.input_len, vocab_size, args.seed)
        for fraction in fractions:
            rows.append(writer.write({"model": args.model, **run(llm, prompts, fraction,
                                                                  args.output_len)}))
    print(f"\n{'batch':>5} {'constrained':>11} {'tok/s':>9} {'tpot ms':>8} {'vs free':>8}")
    for row in rows:
        free = next(r for r in rows if r["batch"] == row["batch"]
                    and r["constrained_fraction"] == 0.0)
        slowdown = row["tpot_ms"] / free["tpot_ms"] - 1 if free["tpot_ms"] else 0.0
        print(f"{row['batch']:>5} {row['constrained_fraction']:>11.0%} "
              f"{row['output_tok_s']:>9.1f} {row['tpot_ms']:>8.2f} {slowdown:>+8.1%}")


if __name__ == "__main__":
    main()
