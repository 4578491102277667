"""Torch references for the segmented LoRA kernels (the test oracle and the CPU path), and the input
checks that the kernels' launchers and the CPU path share."""

from __future__ import annotations

import torch

from flexserve_kernels.lora.serve.meta import LoRAKernelMeta


def lora_shrink_ref(x: torch.Tensor, lora_a: torch.Tensor, meta: LoRAKernelMeta) -> torch.Tensor:
    """S[t] = x[t] @ lora_a[slot(t)].T for tokens with an adapter, 0 elsewhere.

    x: [T, in]; lora_a: [num_slots, max_rank, in]. Returns [T, max_rank] in float32.
    """
    out = torch.zeros(x.shape[0], lora_a.shape[1], dtype=torch.float32, device=x.device)
    for start, length, slot in zip(meta.seg_starts.tolist(), meta.seg_lens.tolist(), meta.seg_slots.tolist()):
        out[start : start + length] = x[start : start + length].float() @ lora_a[slot].float().T
    return out


def lora_expand_ref(
    s: torch.Tensor,
    lora_b: torch.Tensor,
    meta: LoRAKernelMeta,
    y: torch.Tensor,
    scaling: torch.Tensor,
) -> torch.Tensor:
    """y[t] += scaling[slot(t)] * s[t] @ lora_b[slot(t)].T, in place, for tokens with an adapter.

    s: [T, max_rank]; lora_b: [num_slots, out, max_rank]; y: [T, out]; scaling: [num_slots].
    """
    for start, length, slot in zip(meta.seg_starts.tolist(), meta.seg_lens.tolist(), meta.seg_slots.tolist()):
        delta = (s[start : start + length].float() @ lora_b[slot].float().T) * scaling[slot].float()
        y[start : start + length] += delta.to(y.dtype)
    return y


_KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def check_shrink_args(x: torch.Tensor, lora_a: torch.Tensor, meta: LoRAKernelMeta) -> None:
    """Raise ValueError unless (x, lora_a, meta) fit the shrink layouts above."""
    if x.dim() != 2 or lora_a.dim() != 3:
        raise ValueError(f"lora shrink wants x [T, in] and lora_a [num_slots, max_rank, in], "
                         f"got x {tuple(x.shape)} and lora_a {tuple(lora_a.shape)}")
    if lora_a.shape[2] != x.shape[1]:
        raise ValueError(f"lora_a {tuple(lora_a.shape)} does not take x's hidden size {x.shape[1]}")
    if lora_a.shape[0] == 0 or lora_a.shape[1] == 0:
        raise ValueError(f"lora_a {tuple(lora_a.shape)} has no slot or no rank")
    _check_tokens(x, meta)
    if x.dtype not in _KERNEL_DTYPES or lora_a.dtype != x.dtype:
        raise ValueError(f"lora shrink wants x and lora_a of one dtype in {_KERNEL_DTYPES}, "
                         f"got {x.dtype} and {lora_a.dtype}")
    _check_inner_contiguous(x=x, lora_a=lora_a)
    _check_devices(x, lora_a=lora_a, token_slots=meta.token_slots)


def check_expand_args(
    s: torch.Tensor, lora_b: torch.Tensor, meta: LoRAKernelMeta, y: torch.Tensor, scaling: torch.Tensor
) -> None:
    """Raise ValueError unless (s, lora_b, meta, y, scaling) fit the expand layouts above."""
    if s.dim() != 2 or lora_b.dim() != 3 or y.dim() != 2 or scaling.dim() != 1:
        raise ValueError(f"lora expand wants s [T, max_rank], lora_b [num_slots, out, max_rank], "
                         f"y [T, out] and scaling [num_slots], got s {tuple(s.shape)}, lora_b "
                         f"{tuple(lora_b.shape)}, y {tuple(y.shape)}, scaling {tuple(scaling.shape)}")
    num_slots, out_size, max_rank = lora_b.shape
    if num_slots == 0 or max_rank == 0:
        raise ValueError(f"lora_b {tuple(lora_b.shape)} has no slot or no rank")
    if s.shape[1] != max_rank:
        raise ValueError(f"s {tuple(s.shape)} does not match lora_b's max_rank {max_rank}")
    if y.shape[1] != out_size:
        raise ValueError(f"y {tuple(y.shape)} does not match lora_b's output size {out_size}")
    if s.shape[0] != y.shape[0]:
        raise ValueError(f"s has {s.shape[0]} tokens but y has {y.shape[0]}")
    if scaling.shape[0] != num_slots:
        raise ValueError(f"scaling has {scaling.shape[0]} entries for {num_slots} slots")
    _check_tokens(y, meta)
    if y.dtype not in _KERNEL_DTYPES or lora_b.dtype != y.dtype:
        raise ValueError(f"lora expand wants y and lora_b of one dtype in {_KERNEL_DTYPES}, "
                         f"got {y.dtype} and {lora_b.dtype}")
    if s.dtype not in (torch.float32, y.dtype):
        raise ValueError(f"s must be float32 or y's dtype {y.dtype}, got {s.dtype}")
    if scaling.dtype != torch.float32:
        raise ValueError(f"scaling must be float32, got {scaling.dtype}")
    _check_inner_contiguous(s=s, lora_b=lora_b, y=y, scaling=scaling)
    _check_devices(y, s=s, lora_b=lora_b, scaling=scaling, token_slots=meta.token_slots)


def _check_tokens(t: torch.Tensor, meta: LoRAKernelMeta) -> None:
    if t.shape[0] != meta.num_tokens or meta.token_slots.shape[0] != meta.num_tokens:
        raise ValueError(f"{t.shape[0]} tokens in the tensor but the LoRA metadata covers "
                         f"{meta.num_tokens} ({meta.token_slots.shape[0]} token slots)")


def _check_inner_contiguous(**tensors: torch.Tensor) -> None:
    for name, t in tensors.items():
        # A size-1 dimension may carry any stride; kernels never step along it.
        if t.shape[-1] > 1 and t.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous in its last dimension, got strides {t.stride()}")


def _check_devices(ref: torch.Tensor, **tensors: torch.Tensor) -> None:
    for name, t in tensors.items():
        if t.device != ref.device:
            raise ValueError(f"{name} is on {t.device} but the activations are on {ref.device}")
