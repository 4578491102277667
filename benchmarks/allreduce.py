"""The all-reduces of one tensor-parallel decode step, alone: their time per step against the step.

A Llama decode step at N ranks runs two all-reduces per layer of [rows, hidden] activations (after
o_proj and down_proj). This replays exactly those, `2 x num_layers` of them back to back, inside
one CUDA graph as the decode graphs hold them, and reports the time per step: with a TPOT measured
at the same rank count (`offline_throughput.py --tensor-parallel-size N`) it gives the all-reduce
share of a decode step. Each size runs through NCCL and through the one-shot all-reduce
(`flexserve/distributed/one_shot_all_reduce.py`, here with a buffer for every size asked, so the
rows show where it stops beating NCCL), each checked against the exact sum first.

    python benchmarks/allreduce.py --tensor-parallel-size 2 --batch-sizes 1 32 128 512 2048 --out
    python benchmarks/allreduce.py --device cpu --tensor-parallel-size 2   # gloo smoke test

Llama-3.1-8B's shape by default (hidden 4096, 32 layers, bf16).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo root (benchmarks/README.md)
from benchmarks import harness  # noqa: E402


def _rank(rank: int, args: argparse.Namespace, port: int, queue) -> None:
    import torch

    from flexserve.distributed.one_shot_all_reduce import OneShotAllReduce
    from flexserve.distributed.parallel_state import destroy_tensor_parallel, init_tensor_parallel

    cuda = args.device == "cuda"
    if cuda:
        torch.cuda.set_device(rank)
    group = init_tensor_parallel(rank, args.tensor_parallel_size, f"tcp://127.0.0.1:{port}",
                                 "nccl" if cuda else "gloo", custom_all_reduce=False)
    device = torch.device(f"cuda:{rank}" if cuda else "cpu")
    dtype = getattr(torch, args.dtype)
    largest = max(args.batch_sizes) * args.hidden_size * dtype.itemsize
    methods = {}
    if "nccl" in args.methods:  # the process group's all-reduce: gloo on the CPU
        methods["nccl" if cuda else "gloo"] = group.all_reduce
    if cuda and "one-shot" in args.methods:
        methods["one-shot"] = OneShotAllReduce(group.group, max_bytes=largest)
    rows = []
    for batch in args.batch_sizes:
        for method, reduce in methods.items():
            # Each rank holds rank + 1 (exact in bf16 for a few ranks): the sum is known.
            x = torch.full((batch, args.hidden_size), rank + 1.0, dtype=dtype, device=device)
            want = args.tensor_parallel_size * (args.tensor_parallel_size + 1) / 2
            got = reduce(x.clone())
            if not bool((got == want).all()):
                raise SystemExit(f"{method} all-reduce of {batch} rows is wrong on rank {rank}")

            def step(x=x, reduce=reduce) -> None:
                for _ in range(2 * args.num_layers):
                    reduce(x)

            if cuda:
                for _ in range(3):
                    step()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    step()
                ms = harness.mean_ms(graph.replay, warmup=5, iters=args.iters)
            else:
                ms = harness.time_ms(step, warmup=2, iters=args.iters, device="cpu")
            rows.append({"method": method, "batch": batch,
                         "allreduces_per_step": 2 * args.num_layers,
                         "bytes_each": batch * args.hidden_size * x.element_size(),
                         "ms_per_step": round(ms, 4),
                         "us_each": round(ms * 1e3 / (2 * args.num_layers), 2)})
    if rank == 0:
        queue.put(rows)
    destroy_tensor_parallel()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tensor-parallel-size", type=int, default=2)
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 32, 128])
    parser.add_argument("--hidden-size", type=int, default=4096)
    parser.add_argument("--num-layers", type=int, default=32)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--methods", nargs="+", choices=["nccl", "one-shot"],
                        default=["nccl", "one-shot"], help="one-shot: CUDA only")
    parser.add_argument("--iters", type=int, default=50)
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    harness.add_out_argument(parser)
    args = parser.parse_args()
    import torch.multiprocessing as mp

    context = mp.get_context("spawn")
    queue = context.Queue()
    from flexserve.distributed.parallel_state import free_port

    port = free_port()
    processes = [context.Process(target=_rank, args=(r, args, port, queue))
                 for r in range(args.tensor_parallel_size)]
    for p in processes:
        p.start()
    rows = queue.get(timeout=600)
    for p in processes:
        p.join()
    writer = harness.JsonlWriter(args.out, __file__, echo=lambda line: print(line, flush=True))
    for row in rows:
        writer.write({"tensor_parallel_size": args.tensor_parallel_size, "device": args.device,
                      "hidden_size": args.hidden_size, "dtype": args.dtype, **row})


if __name__ == "__main__":
    main()
