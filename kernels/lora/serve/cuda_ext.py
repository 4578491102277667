"""The CUDA C++ BGMV decode kernels (csrc/lora_bgmv.cu): built once per machine, loaded as torch ops.

`load_lora_bgmv()` compiles csrc/lora_bgmv.{cu,cpp} with torch.utils.cpp_extension on the first
call (one nvcc compile of the two files; later processes reuse the cached build under
$FLEXSERVE_HOME/torch_extensions/<torch>-cu<cuda>-sm<arch>) and registers
`torch.ops.flexserve.lora_bgmv_shrink` and `torch.ops.flexserve.lora_bgmv_expand`. Where it cannot
(CPU torch, no GPU, no nvcc or ninja, a failed build) it returns None and logs the reason once;
the layers then run the Triton kernels. FLEXSERVE_CUDA_EXT=0 turns the extension off.

The kernels (csrc/lora_bgmv.cu says more): the shrink splits `in` into up to 8 chunks of about
1024 elements, one block per (token, chunk, rank tile), and adds the chunks' sums in chunk order
inside a thread block cluster (sm_90 and later; earlier GPUs keep `in` whole), so s is final when
the op returns, with no workspace and no atomics; a token's s and y do not depend on the rest of
its batch. The expand gives each output of B a group of lanes reading 16-byte chunks of its row.

FLEXSERVE_LORA_DECODE_BACKEND picks what runs the LoRA bypass of decode-only batches on CUDA. It is
read per call and decided on the host from the backend, the batch's token count and whether the
extension loaded (never from device data), so each CUDA graph, captured per padded batch size,
keeps its path:
    auto (default)  the CUDA BGMV pair where the Triton path runs a BGMV pair (down_proj; q/k/v, o
                    and gate/up take the fused Triton kernel) in batches of at most
                    CUDA_DECODE_MAX_ROWS = 16 tokens, Triton above. A group whose shrinks are
                    folded into its merged GEMM (`MergedProjection.fold_lora`: down_proj while
                    max_loras x max_rank <= FOLD_MAX_FRACTION x hidden_size, 512 rows on
                    Llama-3.1-8B) keeps the folded path, as with triton. Without the extension
                    (CPU torch, no nvcc, FLEXSERVE_CUDA_EXT=0, a failed build): exactly triton.
    cuda            the CUDA BGMV pair for every projection at every decode batch size (no fused
                    or folded Triton path)
    triton          Triton only; the engine never builds the extension
`benchmarks/kernels/lora_bgmv_cuda.py --part kernels` (H100, Llama-3.1-8B shapes, rank 16, 8
adapters, 32 layers in one CUDA graph), us per layer, Triton vs CUDA: the down_proj BGMV pair
6.3 vs 5.5 at batch 1, 9.8 vs 8.9 at 16, 11.7 vs 19.1 at 64; the layer's LoRA work (fused Triton
groups, down_proj on the Triton vs the CUDA pair) 27.4 vs 24.4, 33.2 vs 32.2, 47.4 vs 55.0. Hence
auto's 16-token cut-off. (The first version, without the split over `in`: 18.4-22.5 us vs Triton's
8.3-11.1 on an H200.) Decode TPOT end to end, per backend: `--part e2e` of the same script.

The engine builds or loads the extension once at start-up (`load_for_decode`, called by the model
runner before its profiling forward and CUDA-graph capture) unless the backend is triton, so no
nvcc build runs inside a capture or on a request's path.
"""

from __future__ import annotations

import fcntl
import functools
import logging
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from flexserve import envs
from flexserve_kernels.lora.serve.meta import LoRAKernelMeta

logger = logging.getLogger(__name__)

EXTENSION_NAME = "flexserve_lora_bgmv"
SOURCE_NAMES = ("lora_bgmv.cpp", "lora_bgmv.cu")
# auto's largest decode batch (tokens) for the CUDA BGMV pair. H100, Llama-3.1-8B down_proj (in
# 14336, out 4096), rank 16, 8 adapters, `benchmarks/kernels/lora_bgmv_cuda.py --part kernels`:
# the pair takes 5.5 / 8.9 / 19.1 us per layer at 1 / 16 / 64 tokens against Triton BGMV's 6.3 /
# 9.8 / 11.7, so the extension wins at 1 and 16 and loses at 64 (sizes in between: not measured).
CUDA_DECODE_MAX_ROWS = 16


@dataclass(frozen=True)
class BGMVOps:
    """The registered ops; both write into their last argument on the current stream."""

    shrink: object  # torch.ops.flexserve.lora_bgmv_shrink(x, lora_a, token_slots, s) -> None
    expand: object  # torch.ops.flexserve.lora_bgmv_expand(s, lora_b, token_slots, scaling, y) -> None


def source_dir() -> Path:
    """csrc/ beside kernels/ in a checkout, or flexserve_kernels/csrc in an installed package."""
    package = Path(__file__).resolve().parents[2]  # kernels/ (flexserve_kernels/ when installed)
    for candidate in (package.parent / "csrc", package / "csrc"):
        if all((candidate / name).is_file() for name in SOURCE_NAMES):
            return candidate
    return package.parent / "csrc"


def unavailable_reason() -> str | None:
    """Why the extension cannot be built here, or None when it can be tried (checks only; no build)."""
    if not envs.cuda_ext_enabled():
        return "FLEXSERVE_CUDA_EXT=0 turns it off"
    if torch.version.cuda is None:
        return f"torch {torch.__version__} is built without CUDA"
    if not torch.cuda.is_available():
        return "no CUDA device is visible"
    from torch.utils import cpp_extension

    if cpp_extension.CUDA_HOME is None:
        return "no CUDA toolkit (nvcc) found; set CUDA_HOME"
    if not cpp_extension.is_ninja_available():
        return "ninja is not installed (torch.utils.cpp_extension needs it)"
    missing = [name for name in SOURCE_NAMES if not (source_dir() / name).is_file()]
    if missing:
        return f"sources {missing} are missing from {source_dir()}"
    return None


def load_lora_bgmv() -> BGMVOps | None:
    """The BGMV ops, building the extension on first use; None where it is unavailable (the
    reason is logged once per process). Honors FLEXSERVE_CUDA_EXT=0 on every call."""
    if not envs.cuda_ext_enabled():
        _log_once("FLEXSERVE_CUDA_EXT=0 turns it off")
        return None
    return _load()


def cuda_bgmv_available(device: torch.device | str) -> bool:
    """Whether LoRA layers on `device` can run the CUDA BGMV kernels (builds on first use)."""
    return torch.device(device).type == "cuda" and load_lora_bgmv() is not None


def cuda_bgmv_loaded(device: torch.device | str) -> bool:
    """Whether this process has already loaded the extension (`load_for_decode` at start-up,
    or `load_lora_bgmv`) and LoRA layers on `device` can run it. Never builds: a build on a
    request's path stalled one co-serving iteration of an H200 server for 10.6 s, when a
    fine-tuning window of one token made a captured forward's batch decode-only while the
    start-up had not built it (down_proj folded)."""
    if torch.device(device).type != "cuda" or not envs.cuda_ext_enabled():
        return False
    return _load.cache_info().currsize > 0 and _load() is not None


def cuda_decode_wanted(device: torch.device | str, meta: LoRAKernelMeta) -> bool:
    """Whether this batch's BGMV pair runs on the extension: decode-only batches on CUDA when the
    extension is available, of any size with FLEXSERVE_LORA_DECODE_BACKEND=cuda, of at most
    CUDA_DECODE_MAX_ROWS tokens with auto, never with triton. Host-side only (no device sync);
    the same for every batch of one size, so a CUDA graph captured per batch size stays valid."""
    if not meta.decode_only:
        return False
    backend = envs.lora_decode_backend()
    if backend == "triton" or (backend == "auto" and meta.num_tokens > CUDA_DECODE_MAX_ROWS):
        return False
    return cuda_bgmv_loaded(device)


def cuda_decode_replaces_fused(device: torch.device | str, meta: LoRAKernelMeta) -> bool:
    """Whether FLEXSERVE_LORA_DECODE_BACKEND=cuda sends the fused Triton groups (and the folded
    ones) to the extension too; auto never does."""
    return envs.lora_decode_backend() == "cuda" and cuda_decode_wanted(device, meta)


def load_for_decode(device: torch.device | str, bgmv_pairs: bool = True) -> BGMVOps | None:
    """Build (first time on this machine) or load the extension now if LoRA decode on `device`
    may use it, logging how long it took: on CUDA with FLEXSERVE_LORA_DECODE_BACKEND=cuda, or
    auto when `bgmv_pairs` (some projection's decode runs a BGMV pair: down_proj not folded into
    its GEMM). The model runner calls this at start-up, before its profiling forward and CUDA-graph
    capture, so the build (12.8 s of nvcc on a fresh H200) never runs inside a capture or on a
    request's path. None where it is not wanted or unavailable (the reason logged once);
    ValueError for a bad FLEXSERVE_LORA_DECODE_BACKEND."""
    backend = envs.lora_decode_backend()
    if backend == "triton" or torch.device(device).type != "cuda" or (backend == "auto" and not bgmv_pairs):
        return None
    start = time.perf_counter()
    ops = load_lora_bgmv()
    if ops is not None:
        logger.info("CUDA BGMV extension ready for LoRA decode in %.1f s (FLEXSERVE_LORA_DECODE_BACKEND=%s)",
                    time.perf_counter() - start, backend)
    return ops


def lora_shrink_cuda(x: torch.Tensor, lora_a: torch.Tensor, token_slots: torch.Tensor) -> torch.Tensor:
    """s [T, max_rank] float32 = x[t] @ lora_a[token_slots[t]].T, zero rows for slot -1 (or a slot
    past lora_a's last), on the extension (which must be loaded: `cuda_bgmv_available`). s is final
    when this returns: the shrink adds its split-K partial sums itself (no workspace)."""
    _check_args("lora_shrink_cuda", token_slots, (x, 2, "x"), (lora_a, 3, "lora_a"))
    if lora_a.dtype != x.dtype or lora_a.shape[2] != x.shape[1]:
        raise ValueError(f"lora_shrink_cuda: lora_a {tuple(lora_a.shape)} {lora_a.dtype} does not "
                         f"take x {tuple(x.shape)} {x.dtype} (same dtype, hidden size)")
    s = torch.empty(x.shape[0], lora_a.shape[1], dtype=torch.float32, device=x.device)
    _load().shrink(x, lora_a, token_slots, s)
    return s


def lora_expand_cuda(s: torch.Tensor, lora_b: torch.Tensor, token_slots: torch.Tensor, y: torch.Tensor,
                     scaling: torch.Tensor) -> torch.Tensor:
    """y[t] += scaling[slot] * s[t] @ lora_b[slot].T in place (s float32); returns y."""
    _check_args("lora_expand_cuda", token_slots, (s, 2, "s"), (lora_b, 3, "lora_b"),
                (y, 2, "y"), (scaling, 1, "scaling"))
    if (s.dtype != torch.float32 or lora_b.dtype != y.dtype or scaling.shape[0] != lora_b.shape[0]
            or lora_b.shape[1] != y.shape[1] or s.shape != (y.shape[0], lora_b.shape[2])):
        raise ValueError(f"lora_expand_cuda: s {tuple(s.shape)} {s.dtype}, lora_b "
                         f"{tuple(lora_b.shape)} {lora_b.dtype}, scaling {tuple(scaling.shape)} and y "
                         f"{tuple(y.shape)} {y.dtype} do not fit (s float32 [T, max_rank], one "
                         "scaling per slot, y and lora_b of one dtype and width)")
    _load().expand(s, lora_b, token_slots, scaling, y)
    return y


def _check_args(op: str, token_slots: torch.Tensor, *specs: tuple[torch.Tensor, int, str]) -> None:
    """Python-side checks before the C++ op: the ops' own ValueErrors crashed the process on the
    H200 (torch 2.11, the extension built by cpp_extension), so a bad call from Python must not
    reach them. specs: (tensor, number of dims, name)."""
    for tensor, ndim, name in specs:
        if not tensor.is_cuda:
            raise ValueError(f"{op}: {name} must be a CUDA tensor, got {tensor.device}")
        if tensor.dim() != ndim:
            raise ValueError(f"{op}: {name} must have {ndim} dims, got {tuple(tensor.shape)}")
        if tensor.shape[-1] > 1 and tensor.stride(-1) != 1:
            raise ValueError(f"{op}: {name} must be contiguous in its last dimension")
    num_tokens = specs[0][0].shape[0]
    if (token_slots.dtype != torch.int32 or token_slots.dim() != 1
            or token_slots.shape[0] != num_tokens or not token_slots.is_cuda):
        raise ValueError(f"{op}: token_slots must be a CUDA int32 [{num_tokens}] tensor, got "
                         f"{token_slots.dtype} {tuple(token_slots.shape)} on {token_slots.device}")


@functools.cache
def _load() -> BGMVOps | None:
    reason = unavailable_reason()
    if reason is not None:
        _log_once(reason)
        return None
    try:
        _build()
    except Exception as exc:  # a compiler error must not take the server down: Triton still works
        _log_once(f"building it failed: {type(exc).__name__}: {str(exc)[-2000:]}")
        return None
    ops = torch.ops.flexserve
    return BGMVOps(shrink=ops.lora_bgmv_shrink, expand=ops.lora_bgmv_expand)


def _build() -> None:
    from torch.utils import cpp_extension

    major, minor = torch.cuda.get_device_capability()
    # sm_90 on Hopper (H100/H200): -arch=sm_90 embeds sm_90 machine code and compute_90 PTX; an
    # explicit arch flag also stops torch from adding its own -gencode list.
    arch = f"sm_{major}{minor}"
    build_dir = (Path(envs.home()) / "torch_extensions"
                 / f"torch{torch.__version__.replace('+', '_')}-cu{torch.version.cuda}-{arch}")
    build_dir.mkdir(parents=True, exist_ok=True)
    sources = [str(source_dir() / name) for name in SOURCE_NAMES]
    # Two server processes starting together would both run ninja in one folder; the lock makes
    # the second wait and then find the build done (torch's own lock file covers only part of it).
    with open(build_dir / "flexserve_build.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            cpp_extension.load(
                name=EXTENSION_NAME, sources=sources, build_directory=str(build_dir),
                extra_cflags=["-O3"], extra_cuda_cflags=["-O3", f"-arch={arch}", "-lineinfo"],
                is_python_module=False, verbose=False)
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
    logger.info("loaded the CUDA BGMV extension from %s", build_dir)


@functools.cache
def _log_once(reason: str) -> None:
    # A warning where the user asked for the extension; under the default (auto) falling back to
    # Triton is expected on machines without nvcc, so it is news, not a problem.
    asked = envs.lora_decode_backend() == "cuda"
    logger.log(logging.WARNING if asked else logging.INFO,
               "CUDA BGMV extension unavailable, LoRA decode uses Triton: %s", reason)
