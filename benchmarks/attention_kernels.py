"""Paged attention and fused small-op kernels on Llama-3.1-8B shapes vs torch, against measured peaks.

Shapes: 32 query heads, 8 kv heads, head_dim 128, bf16, 16-token blocks with shuffled block
tables. Times are triton.testing.do_bench medians (L2 flushed between runs).

  prefill   one 4096-token prompt, and a 2048-token chunk after 2048 cached tokens: causal
            attention TFLOP/s (useful FLOPs only: 4 * D * H per visible query-key pair) vs the
            bf16 matmul peak measured in the same run (8192^3 torch.matmul).
  decode    batch 1 and 32, every row at context 512 or 4096: GB/s of K/V read (the bytes floor)
            vs the device copy bandwidth measured in the same run (1 GiB copy, read + write).
  fused     KV-cache write, RMSNorm + residual, rotary, SiLU-and-mul at 1, 32 and 4096 tokens:
            GB/s of their reads + writes vs the copy bandwidth, and torch eager for comparison.

The baseline for attention is torch SDPA on the same data, unpaged: K/V contiguous per row, the
faster of enable_gqa=True and K/V pre-expanded to 32 heads (expansion not timed). `--sweep` also
times alternative block configurations of the two attention kernels (the defaults were chosen
offline, without a GPU) and reports the best.

    python benchmarks/attention_kernels.py --out
    python benchmarks/attention_kernels.py --sweep
    python benchmarks/attention_kernels.py --smoke   # tiny shapes, CPU, Triton's interpreter
    python benchmarks/attention_kernels.py --compile-check   # no GPU needed, see below

`--compile-check` compiles every kernel at its Llama-3.1-8B bf16 configuration for sm_90 (H100 /
H200) without a GPU (Triton's bundled ptxas) and prints registers, spill bytes and shared memory
per kernel; it exits 1 if any kernel spills. tests/test_attention_kernels.py runs it.
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo root (benchmarks/README.md)
from benchmarks import harness  # noqa: E402

LLAMA8B = dict(num_heads=32, num_kv_heads=8, head_dim=128, hidden=4096, intermediate=14336)
SMOKE = dict(num_heads=4, num_kv_heads=2, head_dim=64, hidden=128, intermediate=192)
BLOCK_SIZE = 16


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prefill", nargs="*", default=["4096", "2048+2048"],
                   help="prefill cases: N (a fresh N-token prompt) or C+N (N new after C cached)")
    p.add_argument("--decode-batches", type=int, nargs="*", default=[1, 32])
    p.add_argument("--decode-contexts", type=int, nargs="*", default=[512, 4096])
    p.add_argument("--fused-tokens", type=int, nargs="*", default=[1, 32, 4096])
    p.add_argument("--sweep", action="store_true", help="also time alternative block configurations")
    harness.add_out_argument(p)
    p.add_argument("--smoke", action="store_true", help="tiny shapes on CPU under TRITON_INTERPRET=1")
    p.add_argument("--compile-check", action="store_true",
                   help="compile for sm_90 without a GPU; report registers, spills, shared memory")
    return p.parse_args()


# ---------------------------------------------------------------------------------- batches


def paged_batch(rows, shape, dtype, device, seed=0):
    """Query, paged caches and metadata for rows of (context_len, query_len), plus the same K/V
    unpaged ([B, KV, seq_len, D], rows of equal length only) for SDPA."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    heads, kv_heads, head_dim = shape["num_heads"], shape["num_kv_heads"], shape["head_dim"]
    seq_lens = [c + q for c, q in rows]
    needed = [-(-n // BLOCK_SIZE) for n in seq_lens]
    num_blocks = sum(needed)
    perm = torch.randperm(num_blocks, generator=g)
    tables, start = [], 0
    for n in needed:
        tables.append(perm[start : start + n])
        start += n
    width = max(needed)
    block_tables = torch.zeros(len(rows), width, dtype=torch.int32)
    for b, t in enumerate(tables):
        block_tables[b, : len(t)] = t
    key_cache = torch.randn(num_blocks, BLOCK_SIZE, kv_heads, head_dim, device=device, dtype=dtype)
    value_cache = torch.randn_like(key_cache)
    q_lens = torch.tensor([q for _, q in rows])
    query_start_loc = torch.zeros(len(rows) + 1, dtype=torch.int32)
    query_start_loc[1:] = torch.cumsum(q_lens, 0)
    query = torch.randn(int(q_lens.sum()), heads, head_dim, device=device, dtype=dtype)
    batch = dict(query=query, key_cache=key_cache, value_cache=value_cache,
                 query_start_loc=query_start_loc.to(device),
                 seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
                 block_tables=block_tables.to(device), max_query_len=int(q_lens.max()))
    unpaged = None
    if len(set(seq_lens)) == 1:
        pos = torch.arange(seq_lens[0], device=device)
        bt = block_tables.to(device).long()
        k = torch.stack([key_cache[bt[b, pos // BLOCK_SIZE], pos % BLOCK_SIZE] for b in range(len(rows))])
        v = torch.stack([value_cache[bt[b, pos // BLOCK_SIZE], pos % BLOCK_SIZE] for b in range(len(rows))])
        unpaged = (k.transpose(1, 2).contiguous(), v.transpose(1, 2).contiguous())
    return batch, unpaged


def sdpa_baseline(query, unpaged, rows, shape, timer) -> float | None:
    """Faster of SDPA with enable_gqa and SDPA on K/V expanded to all query heads (us)."""
    if unpaged is None:
        return None
    k, v = unpaged
    num_rows = len(rows)
    ctx, q_len = rows[0]
    q = query.view(num_rows, q_len, shape["num_heads"], shape["head_dim"]).transpose(1, 2)
    group = shape["num_heads"] // shape["num_kv_heads"]
    mask = None
    if q_len > 1 and ctx > 0:  # causal with an offset: an explicit bool mask
        q_pos = torch.arange(ctx, ctx + q_len, device=q.device)
        mask = torch.arange(ctx + q_len, device=q.device)[None, :] <= q_pos[:, None]
    causal = q_len > 1 and ctx == 0
    times = []
    ke, ve = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    for kk, vv, gqa in ((k, v, True), (ke, ve, False)):
        try:
            times.append(timer(lambda: F.scaled_dot_product_attention(
                q, kk, vv, attn_mask=mask, is_causal=causal, enable_gqa=gqa)))
        except RuntimeError:
            pass
    return min(times) if times else None


# -------------------------------------------------------------------------------- attention


def causal_flops(rows, shape) -> int:
    """4 * D * H per visible (query, key) pair: QK^T and PV, 2 FLOPs per multiply-add."""
    pairs = sum(q * ctx + q * (q + 1) // 2 for ctx, q in rows)
    return 4 * shape["head_dim"] * shape["num_heads"] * pairs


def kv_bytes(rows, shape, elem) -> int:
    return sum(ctx + q for ctx, q in rows) * 2 * shape["num_kv_heads"] * shape["head_dim"] * elem


def bench_prefill(case, shape, dtype, device, timer, sweep, kernels):
    pa = kernels["paged_attention"]
    if "+" in case:
        ctx, new = map(int, case.split("+"))
    else:
        ctx, new = 0, int(case)
    rows = [(ctx, new)]
    batch, unpaged = paged_batch(rows, shape, dtype, device)
    scale = shape["head_dim"] ** -0.5
    args = (batch["query"], batch["key_cache"], batch["value_cache"], batch["query_start_loc"],
            batch["seq_lens"], batch["block_tables"], batch["max_query_len"], scale)
    results = [dict(config="default", us=timer(lambda: pa.paged_attention(*args)))]
    if sweep:
        for bm, bn, warps, stages in itertools.product((64, 128), (32, 64, 128), (4, 8), (2, 3)):
            try:
                us = timer(lambda: pa.paged_prefill_attention(*args, block_m=bm, block_n=bn,
                                                              num_warps=warps, num_stages=stages))
            except Exception as e:  # noqa: BLE001  (out of shared memory / registers: skip)
                if "OutOfResources" not in type(e).__name__ and "out of resource" not in str(e):
                    raise
                continue
            results.append(dict(config=f"m{bm}-n{bn}-w{warps}-s{stages}", us=us))
    sdpa_us = sdpa_baseline(batch["query"], unpaged, rows, shape, timer)
    flops = causal_flops(rows, shape)
    return [dict(kind="prefill", case=case, sdpa_us=sdpa_us, flops=flops, **r) for r in results]


def bench_decode(batch_size, context, shape, dtype, device, timer, sweep, kernels):
    da = kernels["decode_attention"]
    rows = [(context - 1, 1)] * batch_size
    batch, unpaged = paged_batch(rows, shape, dtype, device)
    scale = shape["head_dim"] ** -0.5
    args = (batch["query"], batch["key_cache"], batch["value_cache"], batch["seq_lens"],
            batch["block_tables"], scale)
    default_splits = da.decode_num_splits(batch_size, shape["num_kv_heads"],
                                          batch["block_tables"].shape[1] * BLOCK_SIZE, device)
    results = [dict(config=f"default(splits={default_splits})", us=timer(lambda: da.decode_attention(*args)))]
    if sweep:
        # Tiles at the default split count, then split counts at the default tiles (each
        # NUM_SPLITS is a compile): about 25 compiles per case instead of hundreds.
        tiles = [(bn, w, st, default_splits) for bn, w, st in itertools.product((32, 64, 128), (4, 8), (2, 3, 4))]
        splits = sorted({1, max(1, default_splits // 2), default_splits * 2, 4 * default_splits} - {default_splits})
        for bn, warps, stages, s in tiles + [(None, None, None, s) for s in splits]:
            try:
                us = timer(lambda: da.decode_attention(*args, num_splits=s, block_n=bn, num_warps=warps,
                                                       num_stages=stages))
            except Exception as e:  # noqa: BLE001
                if "OutOfResources" not in type(e).__name__ and "out of resource" not in str(e):
                    raise
                continue
            name = f"n{bn}-w{warps}-s{stages}-splits{s}" if bn else f"default-tiles-splits{s}"
            results.append(dict(config=name, us=us))
    sdpa_us = sdpa_baseline(batch["query"], unpaged, rows, shape, timer)
    nbytes = kv_bytes(rows, shape, batch["query"].element_size())
    return [dict(kind="decode", case=f"batch{batch_size}-ctx{context}", sdpa_us=sdpa_us, bytes=nbytes, **r)
            for r in results]


# ------------------------------------------------------------------------------------ fused


def bench_fused(num_tokens, shape, dtype, device, timer, kernels):
    from flexserve.layers.rmsnorm import RMSNorm
    from flexserve.layers.rotary import RotaryEmbedding, compute_inv_freq, get_rope_parameters, rotate

    hidden, inter = shape["hidden"], shape["intermediate"]
    heads, kv_heads, head_dim = shape["num_heads"], shape["num_kv_heads"], shape["head_dim"]
    elem = torch.finfo(dtype).bits // 8
    out = []

    x = torch.randn(num_tokens, hidden, device=device, dtype=dtype)
    residual = torch.randn_like(x)
    norm = RMSNorm(hidden, 1e-5).to(device=device, dtype=dtype)
    rms = kernels["rmsnorm"]
    with torch.no_grad():
        out.append(dict(case="rmsnorm+residual", bytes=5 * num_tokens * hidden * elem,
                        us=timer(lambda: rms.rmsnorm(x, norm.weight, 1e-5, residual)),
                        torch_us=timer(lambda: norm(x, residual))))

    class Cfg:
        rope_theta = 500000.0
        rope_scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                        "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}

    inv_freq, scaling = compute_inv_freq(get_rope_parameters(Cfg), head_dim, 8192)
    with torch.device(device):
        rope = RotaryEmbedding(head_dim, 8192, inv_freq, scaling)
    positions = torch.randint(0, 8192, (num_tokens,), device=device)
    q = torch.randn(num_tokens, heads * head_dim, device=device, dtype=dtype)
    k = torch.randn(num_tokens, kv_heads * head_dim, device=device, dtype=dtype)
    ro = kernels["rotary"]

    def rope_torch():
        cos, sin = rope.get_cos_sin(positions, dtype)
        return rotate(q, cos, sin, head_dim), rotate(k, cos, sin, head_dim)

    out.append(dict(case="rotary q+k", bytes=2 * num_tokens * (heads + kv_heads) * head_dim * elem,
                    us=timer(lambda: ro.rotary_embedding(positions, q, k, rope.cos_sin_cache, head_dim)),
                    torch_us=timer(rope_torch)))

    gate = torch.randn(num_tokens, inter, device=device, dtype=dtype)
    up = torch.randn_like(gate)
    act = kernels["activation"]
    out.append(dict(case="silu_and_mul", bytes=3 * num_tokens * inter * elem,
                    us=timer(lambda: act.silu_and_mul(gate, up)),
                    torch_us=timer(lambda: F.silu(gate) * up)))

    kvw = kernels["kv_cache_write"]
    num_blocks = max(64, -(-num_tokens // BLOCK_SIZE) * 2)
    cache = torch.zeros(2, num_blocks, BLOCK_SIZE, kv_heads, head_dim, device=device, dtype=dtype)
    slots = torch.randperm(num_blocks * BLOCK_SIZE, device=device)[:num_tokens]
    key = torch.randn(num_tokens, kv_heads, head_dim, device=device, dtype=dtype)
    value = torch.randn_like(key)
    out.append(dict(case="kv_cache_write", bytes=4 * num_tokens * kv_heads * head_dim * elem,
                    us=timer(lambda: kvw.kv_cache_write(key, value, cache, slots)),
                    torch_us=timer(lambda: kvw.kv_cache_write_ref(key, value, cache, slots))))
    return [dict(kind="fused", tokens=num_tokens, **r) for r in out]


# ---------------------------------------------------------------------------- compile check


def compile_check(arch: int = 90) -> list[dict]:
    """Compile each kernel's Llama-3.1-8B bf16 configuration for `arch`; resources per kernel.

    Integer arguments named stride_* and all pointers get the divisibility-by-16 hint that the
    launcher's specialization gives them at run time (Llama's strides are multiples of 16), so the
    loads vectorize as they will on the GPU.
    """
    import subprocess

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from flexserve_kernels import activation
    from flexserve_kernels.attention import decode as decode_attention
    from flexserve_kernels.attention import kv_cache_write
    from flexserve_kernels.attention import paged as paged_attention
    from flexserve_kernels.norm_rope import rmsnorm, rotary

    cuobjdump = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    # Strides that are not multiples of 16 in general (they scale with num_splits).
    unaligned = {"stride_ph", "stride_pb", "stride_lb", "stride_lh"}

    def build(name, fn, pointers, constexprs, floats=(), num_warps=4, num_stages=3):
        sig, attrs = {}, {}
        for i, arg in enumerate(fn.arg_names):
            if arg in constexprs:
                sig[arg] = "constexpr"
            elif arg in pointers:
                sig[arg] = "*" + pointers[arg]
                attrs[(i,)] = [["tt.divisibility", 16]]
            elif arg in floats:
                sig[arg] = "fp32"
            else:
                sig[arg] = "i32"
                if arg.startswith("stride_") and arg not in unaligned:
                    attrs[(i,)] = [["tt.divisibility", 16]]
        compiled = triton.compile(ASTSource(fn, sig, constexprs=constexprs, attrs=attrs),
                                  target=GPUTarget("cuda", arch, 32),
                                  options={"num_warps": num_warps, "num_stages": num_stages})
        row = dict(kernel=name, warps=num_warps, stages=num_stages, shared_bytes=compiled.metadata.shared)
        if os.path.exists(cuobjdump):
            import tempfile

            with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
                f.write(compiled.asm["cubin"])
                f.flush()
                usage = subprocess.run([cuobjdump, "-res-usage", f.name], capture_output=True, text=True).stdout
            fields = dict(tok.split(":", 1) for line in usage.splitlines() if "REG:" in line
                          for tok in line.split() if ":" in tok)
            row.update(registers=int(fields["REG"]), spill_bytes=int(fields["STACK"]))
        return row

    shape, bf16 = LLAMA8B, torch.bfloat16
    d = shape["head_dim"]
    group = shape["num_heads"] // shape["num_kv_heads"]
    attn_ptrs = dict(q_ptr="bf16", k_cache_ptr="bf16", v_cache_ptr="bf16", out_ptr="bf16",
                     query_start_loc_ptr="i32", seq_lens_ptr="i32", block_tables_ptr="i32",
                     tile_map_ptr="i32", part_out_ptr="fp32", part_lse_ptr="fp32")
    rows = []
    for head_dim in (64, 128, 256):
        bm, bn, warps, stages = paged_attention._prefill_config(head_dim, bf16, 4096)
        for tile_map in (False, True):  # the grid of eager steps and of CUDA-graph buckets
            rows.append(build(f"prefill d{head_dim} m{bm} n{bn}{' tile-map' if tile_map else ''}",
                              paged_attention._paged_attention_kernel, attn_ptrs,
                              dict(QUERIES_PER_KV=group, HEAD_DIM=head_dim, BLOCK_SIZE=BLOCK_SIZE,
                                   SKIP_DECODE_ROWS=True, USE_TILE_MAP=tile_map, BLOCK_M=bm,
                                   BLOCK_N=bn, BLOCK_D=head_dim),
                              floats=("scale_log2",), num_warps=warps, num_stages=stages))
        bn, warps, stages = decode_attention._decode_config(head_dim, bf16)
        for splits in (1, 16):
            rows.append(build(f"decode d{head_dim} n{bn} splits{splits}", decode_attention._decode_attention_kernel,
                              attn_ptrs, dict(HAS_QUERY_START_LOC=True, QUERIES_PER_KV=group, HEAD_DIM=head_dim,
                                              BLOCK_SIZE=BLOCK_SIZE, NUM_SPLITS=splits, BLOCK_G=16, BLOCK_N=bn,
                                              BLOCK_D=head_dim),
                              floats=("scale_log2",), num_warps=warps, num_stages=stages))
    rows.append(build("decode reduce", decode_attention._decode_attention_reduce_kernel, attn_ptrs,
                      dict(HAS_QUERY_START_LOC=True, HEAD_DIM=d, NUM_SPLITS=16, BLOCK_S=16, BLOCK_N=64,
                           BLOCK_D=d)))
    rows.append(build("kv_cache_write", kv_cache_write._kv_cache_write_kernel,
                      dict(key_ptr="bf16", value_ptr="bf16", cache_ptr="bf16", slot_mapping_ptr="i64"),
                      dict(HEAD_DIM=d, BLOCK_H=shape["num_kv_heads"], BLOCK_D=d)))
    rows.append(build("rmsnorm", rmsnorm._rmsnorm_kernel,
                      dict(x_ptr="bf16", residual_ptr="bf16", weight_ptr="bf16", out_ptr="bf16",
                           residual_out_ptr="bf16"),
                      dict(HAS_RESIDUAL=True, BLOCK=shape["hidden"]), floats=("eps",), num_warps=8))
    rows.append(build("rotary", rotary._rotary_embedding_kernel,
                      dict(q_ptr="bf16", k_ptr="bf16", cos_sin_ptr="fp32", positions_ptr="i64"),
                      dict(HALF=d // 2, BLOCK_HALF=d // 2, BLOCK_H=shape["num_heads"])))
    no_lora = dict(s_ptr=None, b_ptr=None, scaling_ptr=None, token_slots_ptr=None, HAS_LORA=False, RANK_PAD=1)
    rows.append(build("silu_and_mul", activation._silu_and_mul_kernel,
                      dict(gate_ptr="bf16", up_ptr="bf16", out_ptr="bf16"), dict(BLOCK=1024, **no_lora)))
    lora = dict(s_ptr="bf16", b_ptr="bf16", scaling_ptr="fp32", token_slots_ptr="i32")
    rows.append(build("silu_and_mul + folded LoRA", activation._silu_and_mul_kernel,
                      dict(gate_ptr="bf16", up_ptr="bf16", out_ptr="bf16", **lora),
                      dict(BLOCK=128, HAS_LORA=True, RANK_PAD=16)))

    for r in rows:
        r["arch"] = f"sm_{arch}"
        r["triton"] = triton.__version__
    return rows


# ------------------------------------------------------------------------------------- main


def main() -> None:
    args = parse_args()
    writer = harness.JsonlWriter(args.out, __file__, echo=None)
    if args.compile_check:
        rows = compile_check()
        _table(rows, ["kernel", "warps", "stages", "registers", "spill_bytes", "shared_bytes", "arch", "triton"])
        for r in rows:
            writer.write(r)
        raise SystemExit(1 if any(r.get("spill_bytes") for r in rows) else 0)
    if args.smoke:
        # Before anything imports triton: the interpreter is chosen when functions are decorated.
        os.environ["TRITON_INTERPRET"] = "1"
    import importlib

    kernels = {name: importlib.import_module(f"flexserve_kernels.{module}") for name, module in (
        ("paged_attention", "attention.paged"), ("decode_attention", "attention.decode"),
        ("kv_cache_write", "attention.kv_cache_write"), ("rmsnorm", "norm_rope.rmsnorm"),
        ("rotary", "norm_rope.rotary"), ("activation", "activation"))}
    device = torch.device("cpu" if args.smoke else "cuda")
    dtype = torch.float16 if args.smoke else torch.bfloat16  # the interpreter's dot has no bf16
    shape = SMOKE if args.smoke else LLAMA8B
    def timer(fn):
        return harness.do_bench_us(fn, device=device)

    if args.smoke:
        args.prefill = ["40", "24+17"]
        args.decode_batches, args.decode_contexts, args.fused_tokens = [1, 3], [40, 100], [1, 5]
        peak = bandwidth = None
        device_name = "cpu-interpreter"
    else:
        peak = harness.matmul_peak(timer, device)
        bandwidth = harness.copy_bandwidth(timer, device)
        device_name = harness.gpu_name()

    todo = [("prefill", c) for c in args.prefill]
    todo += [("decode", (b, c)) for b in args.decode_batches for c in args.decode_contexts]
    todo += [("fused", t) for t in args.fused_tokens]
    results = []
    for kind, case in tqdm(todo, desc="attention kernels"):
        if kind == "prefill":
            rows = bench_prefill(case, shape, dtype, device, timer, args.sweep, kernels)
        elif kind == "decode":
            rows = bench_decode(*case, shape, dtype, device, timer, args.sweep, kernels)
        else:
            rows = bench_fused(case, shape, dtype, device, timer, kernels)
        for r in rows:
            r.update(device=device_name, dtype=str(dtype).replace("torch.", ""))
            if "flops" in r:
                r["tflops"] = round(r["flops"] / r["us"] / 1e6, 1)
                r["sdpa_tflops"] = None if r["sdpa_us"] is None else round(r["flops"] / r["sdpa_us"] / 1e6, 1)
                r["peak_tflops"] = None if peak is None else round(peak / 1e12, 1)
                r["of_peak"] = None if peak is None else round(r["flops"] / (r["us"] / 1e6) / peak, 3)
            else:
                r["gb_s"] = round(r["bytes"] / r["us"] / 1e3, 1)
                r["copy_gb_s"] = None if bandwidth is None else round(bandwidth / 1e9, 1)
                r["of_copy"] = None if bandwidth is None else round(r["bytes"] / (r["us"] / 1e6) / bandwidth, 3)
                r["floor_us"] = None if bandwidth is None else round(r["bytes"] / bandwidth * 1e6, 2)
            for key in ("us", "sdpa_us", "torch_us"):
                if r.get(key) is not None:
                    r[key] = round(r[key], 2)
            writer.write(r)
        results.extend(rows)
    print_tables(results, args.sweep)


def _table(rows: list[dict], cols: list[str]) -> None:
    if not rows:
        return
    cells = [[("-" if r.get(c) is None else str(r.get(c))) for c in cols] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(cols)]
    print("  ".join(c.ljust(w) for c, w in zip(cols, widths)))
    for row in cells:
        print("  ".join(v.ljust(w) for v, w in zip(row, widths)))
    print()


def print_tables(results: list[dict], sweep: bool) -> None:
    def shown(kind):
        rows = [r for r in results if r["kind"] == kind]
        if not sweep:
            return rows
        # Default row plus the fastest configuration of each case.
        best = {}
        for r in rows:
            if r["case"] not in best or r["us"] < best[r["case"]]["us"]:
                best[r["case"]] = r
        return [r for r in rows if r["config"].startswith("default(") or r["config"] == "default"
                or best[r["case"]] is r]

    _table(shown("prefill"), ["case", "config", "us", "tflops", "of_peak", "peak_tflops", "sdpa_us",
                              "sdpa_tflops"])
    _table(shown("decode"), ["case", "config", "us", "gb_s", "of_copy", "floor_us", "copy_gb_s",
                             "sdpa_us"])
    _table([r for r in results if r["kind"] == "fused"], ["case", "tokens", "us", "torch_us", "gb_s",
                                                          "of_copy", "floor_us"])


if __name__ == "__main__":
    main()
