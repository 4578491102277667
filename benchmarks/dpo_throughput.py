"""DPO fine-tuning throughput, alone and co-served, against supervised fine-tuning of the same
lengths, on a dummy-weight model (random bf16 weights, LoRA r=16).

    python benchmarks/dpo_throughput.py --model llama-3.1-8b --seq-len 1024 --rates 0 4 --out

For each method (supervised, dpo) and each arrival rate (0: the job alone) one job trains
`--num-pairs` pairs of random-token sides of `--seq-len` tokens each (the first half a shared
prompt, the second half the side's loss tokens); the supervised job trains the same 2 x
`--num-pairs` sequences with the same loss masks, so both run the same forward and backward
tokens and DPO adds its reference pass. At a rate > 0, inference requests (`--prompt-len` random
tokens, `--output-len` generated, EOS ignored) arrive as a seeded Poisson process in the same
engine while the job runs, with the TPOT SLO `--slo-tpot-ms` steering the hybrid scheduler.
A one-pair job of each method runs first as a warm-up (kernel builds, allocator).

Per run (one JSON line): the job's wall time; its tokens/s counted separately: policy forward
tokens (both sides), reference forward tokens, backward token-layers / layers; the reference
pass's wall time and its share of the job's; the inference tokens generated meanwhile. The
supervised row of the same rate is the baseline.
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo root (benchmarks/README.md)
from benchmarks import harness  # noqa: E402


def make_data(num_pairs: int, seq_len: int, vocab: int, dpo: bool, seed: int):
    """TrainingData of `num_pairs` pairs (dpo) or of their 2 x num_pairs sides (supervised)."""
    from flexserve.finetune.data import TrainingData, TrainingExample

    g = torch.Generator().manual_seed(seed)
    prompt_len = seq_len // 2
    mask = [False] * prompt_len + [True] * (seq_len - prompt_len)
    examples = []
    for i in range(num_pairs):
        prompt = torch.randint(100, vocab - 100, (prompt_len,), generator=g).tolist()
        for _ in range(2):
            side = torch.randint(100, vocab - 100, (seq_len - prompt_len,), generator=g).tolist()
            examples.append(TrainingExample(i + 1, prompt + side, list(mask)))
    return TrainingData("preference" if dpo else "text", examples, [],
                        seq_len * len(examples), (seq_len - prompt_len) * len(examples))


def run_job(engine, data, hp, rate: float, args, vocab: int) -> dict:
    """Train one job to its end, with inference arrivals at `rate` req/s; the measurements."""
    from flexserve import SamplingParams

    params = SamplingParams(max_tokens=args.output_len, ignore_eos=True, temperature=0.0)
    arrivals = random.Random(args.seed)
    job = engine.add_finetune_job(data, hp)
    start = time.perf_counter()
    next_arrival = start + (arrivals.expovariate(rate) if rate > 0 else float("inf"))
    reference_end = None
    num_requests = 0
    num_generated = 0
    while not job.finished:
        now = time.perf_counter()
        while now >= next_arrival:
            prompt = [arrivals.randrange(100, vocab - 100) for _ in range(args.prompt_len)]
            engine.add_request(f"bench-{num_requests}", prompt, params)
            num_requests += 1
            next_arrival += arrivals.expovariate(rate)
        for output in engine.step():
            if output.finished:
                num_generated += len(output.outputs[0].token_ids)
        if reference_end is None and not job.in_reference_pass:
            reference_end = time.perf_counter()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    elapsed = time.perf_counter() - start
    while engine.has_unfinished_requests():  # drain, outside the timed window
        engine.step()
    engine.remove_finetune_job(job.job_id)  # its adapter masters and AdamW state
    layers = engine.info.num_layers
    reference_s = (reference_end - start) if hp.method == "dpo" else 0.0
    return {
        "status": job.status.value, "seconds": round(elapsed, 3),
        "policy_tokens_per_s": round(job.num_forward_tokens / elapsed, 1),
        "reference_tokens_per_s": round(job.num_reference_tokens / elapsed, 1),
        "backward_tokens_per_s": round(job.num_backward_tokens / layers / elapsed, 1),
        "reference_pass_seconds": round(reference_s, 3),
        "reference_share": round(reference_s / elapsed, 4),
        "inference_requests": num_requests, "inference_tokens_generated": num_generated,
        "losses": [round(x, 4) for x in job.losses],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="llama-3.1-8b")
    parser.add_argument("--load-format", default="dummy")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--seq-len", type=int, default=1024, help="tokens of each side")
    parser.add_argument("--num-pairs", type=int, default=8)
    parser.add_argument("--batch-size", type=int, default=4, help="pairs per optimizer step")
    parser.add_argument("--rates", type=float, nargs="+", default=[0.0, 4.0],
                        help="inference arrivals per second; 0: the job alone")
    parser.add_argument("--methods", nargs="+", choices=["supervised", "dpo"],
                        default=["supervised", "dpo"])
    parser.add_argument("--targets", default="down_proj", help="comma-separated LoRA targets")
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--slo-tpot-ms", type=float, default=50.0)
    parser.add_argument("--max-num-batched-tokens", type=int, default=8192)
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.6)
    parser.add_argument("--seed", type=int, default=0)
    harness.add_out_argument(parser)
    args = parser.parse_args()

    from flexserve import LLM
    from flexserve.finetune.hyperparameters import Hyperparameters

    llm = LLM(args.model, load_format=args.load_format, dtype=args.dtype,
              max_model_len=max(args.seq_len, args.prompt_len + args.output_len) + 16,
              enable_lora=True, max_lora_rank=args.rank,
              max_num_batched_tokens=args.max_num_batched_tokens, max_num_seqs=64,
              gpu_memory_utilization=args.gpu_memory_utilization,
              slo_tpot_ms=args.slo_tpot_ms)
    engine = llm.engine
    vocab = engine.info.vocab_size
    writer = harness.JsonlWriter(args.out, __file__, echo=lambda line: print(line, flush=True))

    def hyperparameters(method: str, batch_size: int) -> Hyperparameters:
        values = {"batch_size": batch_size, "n_epochs": 1, "shuffle": False,
                  "learning_rate": 1e-5, "max_seq_len": args.seq_len, "method": method,
                  "lora": {"r": args.rank, "alpha": 2 * args.rank,
                           "target_modules": args.targets.split(",")}}
        return Hyperparameters.from_dict(values)

    for method in args.methods:
        dpo = method == "dpo"
        batch = args.batch_size if dpo else 2 * args.batch_size  # the same sequences per step
        run_job(engine, make_data(1, args.seq_len, vocab, dpo, args.seed + 1),
                hyperparameters(method, batch), 0.0, args, vocab)  # warm-up
        for rate in args.rates:
            data = make_data(args.num_pairs, args.seq_len, vocab, dpo, args.seed)
            row = {"model": args.model, "method": method, "rate": rate, "seq_len": args.seq_len,
                   "num_pairs": args.num_pairs, "batch_size_pairs": args.batch_size,
                   "targets": args.targets, "rank": args.rank, "slo_tpot_ms": args.slo_tpot_ms}
            row.update(run_job(engine, data, hyperparameters(method, batch), rate, args, vocab))
            writer.write(row)


if __name__ == "__main__":
    main()
