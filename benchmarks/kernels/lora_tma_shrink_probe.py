"""Probe (session 20, H100): where does base_gemm='tma_shrink' lose time? Variants of its kernel made by
text substitution, timed against kernel 2 over TMA and F.linear (bf16, rank 16, one adapter,
dropout 0.1), fixed tiles 128 x 256 x 64, 3 stages, 8 warps."""
import importlib.util, statistics, torch, triton
import torch.nn.functional as F
from flexserve_kernels import lora_fused_train_tma_shrink as ks, lora_fused_train_tma as kt, lora_fused_train as kf
from flexserve_kernels.lora_meta import LoRAKernelMeta
src = open(ks.__file__).read()
WAIT = 'while tl.atomic_add(ready_ptr + 2 * pid_m, 0, sem="acquire") != epoch:'
NO_WAIT = 'while tl.atomic_add(ready_ptr + 2 * pid_m, 0, sem="acquire") == -12345:'
VARIANTS = {
    "as_is": [],
    "no_wait": [(WAIT, NO_WAIT)],
    "no_arrive_no_wait": [(WAIT, NO_WAIT), ("if slot != -1:\n            _arrive(", "if slot == -12345:\n            _arrive(")],
    "no_shrink_no_rotate": [("slot = tile_slot(token_slots_ptr, rows, M)", "slot = tile_slot(token_slots_ptr, rows, M) * 0 - 1"),
                  ("k_first = pid_n * num_k // num_pid_n", "k_first = 0 * pid_n"),
                  ("k_last = (pid_n + 1) * num_k // num_pid_n", "k_last = 0 * pid_n")],
}
mods = {}
for name, subs in VARIANTS.items():
    text = src
    for a, b in subs:
        assert a in text, a
        text = text.replace(a, b)
    path = f"/tmp/ks_{name}.py"
    open(path, "w").write(text)
    spec = importlib.util.spec_from_file_location(f"ks_{name}", path)
    m = importlib.util.module_from_spec(spec); spec.loader.exec_module(m); mods[name] = m

def bench(fn, reps=20, rounds=7):
    fn(); torch.cuda.synchronize()
    best = []
    for _ in range(rounds):
        b, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(4_000_000); b.record()
        for _ in range(reps): fn()
        e.record(); e.synchronize(); best.append(b.elapsed_time(e) / reps)
    return statistics.median(best)

dev = "cuda"
for m, n in ((4096, 4096), (8192, 8192)):
    k = n
    x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
    w = torch.randn(n, k, device=dev, dtype=torch.bfloat16) / k**0.5
    a = torch.randn(1, 16, k, device=dev, dtype=torch.bfloat16) / k**0.5
    bb = torch.randn(1, n, 16, device=dev, dtype=torch.bfloat16) * 0.02
    meta = LoRAKernelMeta.build([m], [0], dev)
    slots = kf.LoRATrainSlots.build([2.0], [0.1], dev)
    segs = kf.token_segments(meta)
    s = torch.empty(m, 16, device=dev, dtype=torch.bfloat16)
    y = torch.empty(m, n, device=dev, dtype=torch.bfloat16)
    base = bench(lambda: F.linear(x, w))
    row = {"base_ms": round(base, 4)}
    row["k1"] = bench(lambda: kf.lora_train_shrink_fwd(x, a, meta, slots, 5)) / base
    s1 = kf.lora_train_shrink_fwd(x, a, meta, slots, 5)
    row["k2_tma_fixed"] = bench(lambda: kt.linear_fwd_tma(x, w, s1, bb, y, segs, meta, slots, blocks=(128, 256, 64))) / base
    row["k2_tma_tuned"] = bench(lambda: kt.linear_fwd_tma(x, w, s1, bb, y, segs, meta, slots)) / base
    for (name, mod), dropout in [(item, d) for item in mods.items() for d in (True, False)]:
        if not dropout and name not in ("as_is", "no_arrive_no_wait"):
            continue
        label = name if dropout else name + "_p0"
        def run(mod=mod, dropout=dropout):
            parts = torch.empty(triton.cdiv(n, 256), m, 16, device=dev, dtype=torch.float32)
            keys = kf.column_keys(x.device, k)
            rest = (a, s, bb, parts, mod.fused_sync(x.device, m), keys, meta.token_slots, segs, meta.seg_starts,
                    meta.seg_lens, meta.seg_slots, slots.scalings, slots.dropout_ps, m, n, k, 16, 5,
                    triton.next_power_of_2(m), a.stride(0), a.stride(1), s.stride(0), bb.stride(0), bb.stride(1),
                    parts.stride(0))
            descs = [kt._descriptor(x, [128, 64]), kt._descriptor(w, [256, 64]), kt._descriptor(y, [128, 256])]
            P = kt._num_sms(x.device)
            mod._lora_train_fused_fwd_tma_kernel[(P,)](*descs, *rest, P, HAS_DROPOUT=dropout, KEY_TABLE=dropout, BLOCK_M=128,
                BLOCK_N=256, BLOCK_K=64, BLOCK_R=16, GROUP_M=8, EPILOGUE_SPLIT=1, num_warps=8, num_stages=3)
        row[label] = bench(run) / base
        if label == "as_is":
            ref = (F.linear(x, w).float() + 2.0 * (s1.float() @ bb[0].float().t()))
            row["as_is_err"] = ((y.float() - ref).abs().max() / ref.abs().max()).item()
            row["s_err"] = ((s.float() - s1.float()).abs().max() / s1.float().abs().max()).item()
    print(m, n, " ".join(f"{k_}={v:.4g}" for k_, v in row.items()), flush=True)
