"""LoRA shrink + expand on Llama-3.1-8B's projections: Triton SGMV/BGMV vs torch, with the bytes floor.

For each batch (decode 1/16/64 one-token rows, one 2048-token prefill), number of adapters and
projection, times shrink + expand (triton.testing.do_bench, median, L2 flushed between runs) for
the automatic choice, each variant forced, and a torch baseline: per-segment matmuls for prefill,
gathered bmm for decode (as a framework without these kernels does). The floor is the bytes that
must move (x rows and y rows of tokens with an adapter, the touched adapters' A and B, s) over the
device's measured copy bandwidth. `wall` is back-to-back calls with the host in the loop: at decode
sizes it shows launch overhead, which do_bench hides behind its L2 flush.

    python benchmarks/lora_kernels.py --out
    python benchmarks/lora_kernels.py --smoke   # tiny shapes, CPU, Triton's interpreter: checks the script

Rows are interleaved over adapters (row i has adapter i % n), so decode batches with 8 adapters
are one-token segments (BGMV) and with one adapter a single segment.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch
from tqdm.auto import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo root (benchmarks/README.md)
from benchmarks import harness  # noqa: E402

# (in, out) of each projection.
LLAMA8B_PROJECTIONS = {
    "q": (4096, 4096), "k": (4096, 1024), "v": (4096, 1024), "o": (4096, 4096),
    "gate": (4096, 14336), "up": (4096, 14336), "down": (14336, 4096),
}
SMOKE_PROJECTIONS = {"q": (64, 64), "k": (64, 16), "v": (64, 16), "o": (64, 64),
                     "gate": (64, 160), "up": (64, 160), "down": (160, 64)}
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--decode-batches", type=int, nargs="*", default=[1, 16, 64])
    p.add_argument("--prefill-tokens", type=int, nargs="*", default=[2048])
    p.add_argument("--adapters", type=int, nargs="+", default=[1, 8])
    p.add_argument("--projections", nargs="+", choices=sorted(LLAMA8B_PROJECTIONS), default=list(LLAMA8B_PROJECTIONS))
    p.add_argument("--layers", type=int, default=32, help="layers in the per-step estimate (Llama-3.1-8B: 32)")
    harness.add_out_argument(p)
    p.add_argument("--smoke", action="store_true", help="tiny shapes on CPU under TRITON_INTERPRET=1")
    return p.parse_args()


def make_batch(kind: str, tokens: int, num_adapters: int) -> tuple[list[int], list[int]]:
    """Row lengths and slots: one-token rows for decode, equal prefill rows (one per adapter)."""
    if kind == "decode":
        return [1] * tokens, [i % num_adapters for i in range(tokens)]
    base, extra = divmod(tokens, num_adapters)
    return [base + (i < extra) for i in range(num_adapters)], list(range(num_adapters))


def torch_lora(x, lora_a, lora_b, y, scaling, meta, seg_lists, kind):
    """The baseline: per-segment matmuls (prefill) or gathered per-token bmm (decode), in x's dtype."""
    if kind == "prefill":
        for start, length, slot in seg_lists:
            s = x[start : start + length] @ lora_a[slot].T
            y[start : start + length] += (s @ lora_b[slot].T) * scaling[slot].to(x.dtype)
        return y
    slots = meta.token_slots.long()
    keep = (slots >= 0).to(x.dtype)[:, None]
    idx = slots.clamp(min=0)
    s = torch.bmm(x[:, None, :], lora_a[idx].transpose(1, 2))[:, 0] * keep
    y += torch.bmm(s[:, None, :], lora_b[idx].transpose(1, 2))[:, 0] * (scaling[idx].to(x.dtype)[:, None] * keep)
    return y


def floor_bytes(meta, in_size: int, out_size: int, rank: int, elem: int) -> int:
    """Bytes shrink + expand must move: adapter tokens' x and y rows, touched adapters' A and B, s."""
    slots = meta.token_slots.tolist()
    lora_tokens = sum(1 for s in slots if s >= 0)
    touched = len({s for s in slots if s >= 0})
    shrink = lora_tokens * in_size * elem + touched * rank * in_size * elem + len(slots) * rank * 4
    expand = lora_tokens * rank * 4 + touched * out_size * rank * elem + 2 * lora_tokens * out_size * elem
    return shrink + expand


def make_timers(device: torch.device):
    """(device_us, wall_us): do_bench's median, and back-to-back calls with the host in the loop
    (on the CPU, under the interpreter, both are one timed call)."""
    def device_us(fn):
        return harness.do_bench_us(fn, device=device)

    if device.type != "cuda":
        return device_us, device_us

    def wall_us(fn):
        return harness.wall_us(fn, iters=200, warmup=10).drained_us

    return device_us, wall_us


def main() -> None:
    args = parse_args()
    if args.smoke:
        # Before anything imports triton: the interpreter is chosen when functions are decorated.
        os.environ["TRITON_INTERPRET"] = "1"
    device = torch.device("cpu" if args.smoke else "cuda")
    # The interpreter multiplies bfloat16 bit patterns in tl.dot (triton-lang/triton#11584).
    dtype = torch.float16 if args.smoke else DTYPES[args.dtype]
    projections = SMOKE_PROJECTIONS if args.smoke else LLAMA8B_PROJECTIONS
    timers = make_timers(device)
    bandwidth = None if args.smoke else harness.copy_bandwidth(timers[0], device)
    batches = [("decode", b) for b in args.decode_batches] + [("prefill", t) for t in args.prefill_tokens]
    if args.smoke:
        batches = [(kind, min(tokens, 20)) for kind, tokens in batches]
    # Projections sharing a shape are timed once and counted for each name.
    shapes: dict[tuple[int, int], list[str]] = {}
    for name in args.projections:
        shapes.setdefault(projections[name], []).append(name)

    writer = harness.JsonlWriter(args.out, __file__, echo=None)
    results = []
    todo = [(kind, tokens, n, shape) for kind, tokens in batches for n in args.adapters for shape in shapes]
    for kind, tokens, num_adapters, shape in tqdm(todo, desc="lora kernels"):
        row = measure(kind, tokens, num_adapters, shape, args.rank, dtype, device, timers)
        row.update(
            projections="/".join(shapes[shape]),
            floor_us=None if bandwidth is None else round(row["floor_bytes"] / bandwidth * 1e6, 2),
            copy_gb_s=None if bandwidth is None else round(bandwidth / 1e9, 1),
            device="cpu-interpreter" if args.smoke else harness.gpu_name(),
        )
        results.append(row)
        writer.write(row)
    print_table(results, args.layers)


def measure(kind: str, tokens: int, num_adapters: int, shape: tuple[int, int], rank: int, dtype: torch.dtype,
            device: torch.device, timers) -> dict:
    """Times of one (batch, adapters, projection shape): ours auto/sgmv/bgmv and torch, in us."""
    from flexserve_kernels.lora.serve.meta import LoRAKernelMeta
    from flexserve_kernels.lora.serve.ops import BGMV_MAX_TOKENS, lora_expand, lora_shrink

    device_us, wall_us = timers
    in_size, out_size = shape
    g = torch.Generator().manual_seed(tokens * 1000 + num_adapters)
    row_lens, row_slots = make_batch(kind, tokens, num_adapters)
    meta = LoRAKernelMeta.build(row_lens, row_slots, device)
    seg_lists = list(zip(meta.seg_starts.tolist(), meta.seg_lens.tolist(), meta.seg_slots.tolist()))
    x = torch.randn(tokens, in_size, generator=g).to(device, dtype)
    lora_a = (torch.randn(num_adapters, rank, in_size, generator=g) / in_size**0.5).to(device, dtype)
    lora_b = (torch.randn(num_adapters, out_size, rank, generator=g) / rank**0.5).to(device, dtype)
    y = torch.randn(tokens, out_size, generator=g).to(device, dtype)
    scaling = torch.full((num_adapters,), 2.0, device=device)

    def ours(variant=None):
        def run():
            s = lora_shrink(x, lora_a, meta, variant=variant)
            return lora_expand(s, lora_b, meta, y, scaling, variant=variant)
        return run

    def baseline():
        return torch_lora(x, lora_a, lora_b, y, scaling, meta, seg_lists, kind)

    times = {
        "auto": device_us(ours()), "sgmv": device_us(ours("sgmv")), "bgmv": device_us(ours("bgmv")),
        "torch": device_us(baseline), "auto_wall": wall_us(ours()), "torch_wall": wall_us(baseline),
    }
    nbytes = floor_bytes(meta, in_size, out_size, rank, x.element_size())
    return dict(
        batch=f"{kind}-{tokens}", adapters=num_adapters, in_size=in_size, out_size=out_size, rank=rank,
        dtype=str(dtype).removeprefix("torch."),
        auto_variant="bgmv" if meta.decode_only or meta.num_tokens <= BGMV_MAX_TOKENS else "sgmv",
        **{f"{k}_us": round(v, 2) for k, v in times.items()},
        floor_bytes=nbytes, achieved_gb_s=round(nbytes / times["auto"] / 1e3, 1),
    )


def print_table(results: list[dict], layers: int) -> None:
    cols = ["batch", "adapters", "projections", "auto_variant", "auto_us", "sgmv_us", "bgmv_us", "torch_us",
            "floor_us", "achieved_gb_s", "auto_wall_us", "torch_wall_us"]
    widths = [max(len(c), *(len(str(r[c])) for r in results)) for c in cols]
    print("  ".join(c.ljust(w) for c, w in zip(cols, widths)))
    for r in results:
        print("  ".join(str(r[c]).ljust(w) for c, w in zip(cols, widths)))
    # Per decode step: every projection of every layer, each shape counted once per projection name.
    print(f"\nper step ({layers} layers, all listed projections), device time and wall time:")
    by_batch: dict[tuple[str, int], dict[str, float]] = {}
    for r in results:
        count = len(r["projections"].split("/"))
        acc = by_batch.setdefault((r["batch"], r["adapters"]), {})
        for key in ("auto_us", "torch_us", "auto_wall_us", "torch_wall_us"):
            acc[key] = acc.get(key, 0.0) + count * layers * r[key]
    for (batch, adapters), acc in by_batch.items():
        print(f"  {batch:>14} x {adapters} adapters: ours {acc['auto_us'] / 1e3:.2f} ms "
              f"(wall {acc['auto_wall_us'] / 1e3:.2f}), torch {acc['torch_us'] / 1e3:.2f} ms "
              f"(wall {acc['torch_wall_us'] / 1e3:.2f})")


if __name__ == "__main__":
    main()
