"""What every benchmark shares: timing with warm-up, measured ceilings, JSON-lines results stamped
with their environment, and the common command-line arguments.

Scripts import it as `from benchmarks import harness` after putting the repository root on
sys.path (one line at the top of each script; see benchmarks/README.md), so they run as
`python benchmarks/x.py`, `python benchmarks/kernels/y.py` or `python -m benchmarks.kernels.y`.

Timers (each calls fn() `warmup` times untimed first):
- `time_ms`: median of per-call CUDA-event times, synchronized after each call (perf_counter on
  the CPU);
- `mean_ms`: mean over back-to-back calls between two CUDA events (no synchronize between calls);
- `wall_us`: host and drained wall-clock time per call of back-to-back calls;
- `do_bench_us`: `triton.testing.do_bench`'s median (L2 flushed before each call);
- `kernel_times`: each CUDA kernel's device time per call (torch.profiler), optionally with the L2
  flushed before each call (`L2_FLUSH_BYTES`).

Only the standard library is imported here: torch and triton are imported where used, so scripts
can set TRITON_INTERPRET or parse arguments before either loads.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import importlib.metadata
import json
import os
import re
import shlex
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]
RESULTS_DIR = REPO_ROOT / "docs" / "results"
# `--out` without a path: RESULTS_DIR/<benchmark>-<gpu>-<date>.jsonl
AUTO_OUT = "auto"
# Over the L2 of every GPU this runs on (H100 50 MB, H200 60 MB).
L2_FLUSH_BYTES = 256 << 20


# ------------------------------------------------------------------------------------- timing
def median(values: Iterable[float]) -> float:
    return statistics.median(values)


def _synchronize() -> None:
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        torch.cuda.synchronize()


def time_ms(fn: Callable[[], Any], *, iters: int, warmup: int = 0, device: Any = "cuda") -> float:
    """Median milliseconds of fn() over `iters` calls. On CUDA: events around each call (host work
    before its first kernel included) and a synchronize after each; on the CPU: perf_counter."""
    import torch

    for _ in range(warmup):
        fn()
    if torch.device(device).type != "cuda":
        times = []
        for _ in range(iters):
            start = time.perf_counter()
            fn()
            times.append((time.perf_counter() - start) * 1e3)
        return median(times)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(iters):
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return median(times)


def mean_ms(fn: Callable[[], Any], *, iters: int, warmup: int = 0) -> float:
    """Mean device milliseconds per call of `iters` back-to-back calls between two CUDA events
    (the device is synchronized before, not between calls: consecutive calls overlap as they
    would in a loop or a graph replay)."""
    import torch

    torch.cuda.synchronize()
    for _ in range(warmup):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


@dataclass(frozen=True)
class WallTime:
    """Wall-clock time per call of back-to-back calls (`wall_us`)."""

    host_us: float  # microseconds per call until the last call returned on the host
    drained_us: float  # microseconds per call until the device finished the calls too


def wall_us(fn: Callable[[], Any], *, iters: int, warmup: int = 0) -> WallTime:
    """perf_counter around `iters` back-to-back calls, the device synchronized before and after;
    where host_us is the larger share of drained_us, the calls are bound by the host."""
    for _ in range(warmup):
        fn()
    _synchronize()
    begin = time.perf_counter()
    for _ in range(iters):
        fn()
    host = time.perf_counter()
    _synchronize()
    drained = time.perf_counter()
    return WallTime((host - begin) / iters * 1e6, (drained - begin) / iters * 1e6)


def do_bench_us(fn: Callable[[], Any], *, device: Any = "cuda") -> float:
    """Median microseconds of fn() by `triton.testing.do_bench` (25 ms of warm-up, 100 ms of timed
    calls, L2 flushed before each). On the CPU (Triton's interpreter: checks the script, its times
    mean nothing) one warm-up call and one timed call."""
    import torch

    if torch.device(device).type != "cuda":
        return time_ms(fn, iters=1, warmup=1, device=device) * 1e3
    import triton

    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median") * 1e3


@dataclass(frozen=True)
class KernelTime:
    """One CUDA kernel's share of a timed call (`kernel_times`)."""

    us: float  # self device microseconds per call
    launches: float  # launches per call


def kernel_times(fn: Callable[[], Any], *, iters: int, warmup: int = 0,
                 flush_l2: Any = None) -> dict[str, KernelTime]:
    """Device time per fn() call of each CUDA kernel it launches, by kernel name (torch.profiler:
    the kernels' own time, without host launch time or idle gaps between them). `flush_l2`, a
    tensor of L2_FLUSH_BYTES (`l2_flush_buffer`), is zeroed before each call; that fill's kernel
    is in the result (its name holds "FillFunctor")."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    for _ in range(warmup):
        fn()
    _synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            if flush_l2 is not None:
                flush_l2.zero_()
            fn()
        torch.cuda.synchronize()
    return {e.key: KernelTime(e.self_device_time_total / iters, e.count / iters)
            for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA}


def l2_flush_buffer(device: Any = "cuda"):
    """A byte tensor larger than the L2, for `kernel_times(..., flush_l2=...)`."""
    import torch

    return torch.empty(L2_FLUSH_BYTES, dtype=torch.uint8, device=device)


def cuda_graph(fn: Callable[[], Any], *, warmup: int = 1):
    """fn() captured in a CUDA graph, after `warmup` eager calls on a side stream (Triton compiles,
    autotuning and lazy allocations stay out of the capture)."""
    import torch

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(warmup):
            fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph


# ------------------------------------------------------------------------ measured ceilings
def copy_bandwidth(timer_us: Callable[[Callable[[], Any]], float], device: Any = "cuda") -> float:
    """Device copy bandwidth in bytes/s: a 512 MiB bf16 copy (read + write) timed by `timer_us`."""
    import torch

    n = 1 << 28
    src = torch.empty(n, dtype=torch.bfloat16, device=device)
    dst = torch.empty_like(src)
    return 2 * n * 2 / (timer_us(lambda: dst.copy_(src)) / 1e6)


def matmul_peak(timer_us: Callable[[Callable[[], Any]], float], device: Any = "cuda") -> float:
    """bf16 dense matmul FLOP/s: an 8192^3 torch.matmul timed by `timer_us`."""
    import torch

    n = 8192
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    return 2 * n**3 / (timer_us(lambda: a @ b) / 1e6)


# -------------------------------------------------------------------------------- environment
@functools.cache
def _nvidia_smi_name() -> str | None:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    names = out.stdout.strip().splitlines()
    return names[0].strip() if out.returncode == 0 and names else None


def kernel_target(smoke: bool):
    """(device, dtype, device name for the records) of a kernel benchmark: CUDA in bf16, or for
    `--smoke` the CPU in fp32 under Triton's interpreter (TRITON_INTERPRET set here, so call this
    before triton is imported; fp32, since the interpreter computes bf16 tl.dot wrongly)."""
    import torch

    if smoke:
        os.environ["TRITON_INTERPRET"] = "1"
        return torch.device("cpu"), torch.float32, "cpu-interpreter"
    return torch.device("cuda"), torch.bfloat16, gpu_name()


def gpu_name() -> str:
    """The GPU's name ("NVIDIA H200"), "cpu" without one. Without a CUDA context in this process it
    asks nvidia-smi, so a script that leaves the GPU to a server subprocess makes no context."""
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        return torch.cuda.get_device_name()
    return _nvidia_smi_name() or "cpu"


def gpu_slug(name: str) -> str:
    """File-name form of a device name: 'NVIDIA H100 80GB HBM3' -> 'h100', 'cpu' -> 'cpu'."""
    words = re.findall(r"[a-z0-9]+", name.lower().replace("nvidia", ""))
    return next((w for w in words if any(c.isdigit() for c in w)), words[0] if words else "cpu")


def _version(package: str) -> str | None:
    module = sys.modules.get(package)
    if module is not None and hasattr(module, "__version__"):
        return str(module.__version__)
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def command_line(argv: list[str] | None = None) -> str:
    """How this script was started, repository-relative: 'python benchmarks/x.py --flag 1'."""
    script = Path(sys.argv[0]).resolve()
    if script.is_relative_to(REPO_ROOT):
        script = script.relative_to(REPO_ROOT)
    args = sys.argv[1:] if argv is None else argv
    return shlex.join(["python", str(script), *args])


def environment(argv: list[str] | None = None) -> dict[str, Any]:
    """The fields every result record carries: GPU, versions, date and command line."""
    return {"gpu": gpu_name(), "torch": _version("torch"), "triton": _version("triton"),
            "transformers": _version("transformers"), "date": datetime.date.today().isoformat(),
            "command": command_line(argv)}


# ----------------------------------------------------------------------------------- results
def benchmark_name(script: str) -> str:
    """'benchmarks/kernels/lora_fused_train.py' -> 'lora-fused-train'."""
    return Path(script).stem.replace("_", "-")


def results_path(benchmark: str, gpu: str, date: str) -> Path:
    """docs/results/<benchmark>-<gpu slug>-<date>.jsonl."""
    return RESULTS_DIR / f"{benchmark}-{gpu_slug(gpu)}-{date}.jsonl"


class JsonlWriter:
    """Appends result records to a JSON-lines file, each with `environment()`'s fields (a record's
    own field of the same name wins), and echoes each record as given (through `echo`, e.g.
    print or tqdm.write; None: silent). Without a path it only echoes; with AUTO_OUT it writes
    `results_path` of the script's benchmark name, the GPU and today's date."""

    def __init__(self, out: str | None, script: str, *, echo: Callable[[str], Any] | None = print,
                 argv: list[str] | None = None) -> None:
        self.out = out
        self.benchmark = benchmark_name(script)
        self.echo = echo
        self.argv = argv
        self._stamp: dict[str, Any] | None = None

    @property
    def path(self) -> Path | None:
        """Where records go (resolved on first use: the GPU name needs the device)."""
        if self.out is None:
            return None
        if self.out == AUTO_OUT:
            stamp = self.stamp
            return results_path(self.benchmark, stamp["gpu"], stamp["date"])
        return Path(self.out)

    @property
    def stamp(self) -> dict[str, Any]:
        if self._stamp is None:
            self._stamp = environment(self.argv)
        return self._stamp

    def write(self, record: dict[str, Any]) -> dict[str, Any]:
        """Echo `record`, append it stamped; returns the stamped record."""
        if self.echo is not None:
            self.echo(json.dumps(record))
        stamped = {**record, **{k: v for k, v in self.stamp.items() if k not in record}}
        path = self.path
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
            with open(path, "a", encoding="utf-8") as f:
                f.write(json.dumps(stamped) + "\n")
        return stamped


def read_jsonl(path: str) -> list[dict[str, Any]]:
    """The records of a JSON-lines file (blank lines skipped)."""
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


# ------------------------------------------------------------------------------------ models
def tiny_llama_config(*, vocab_size: int, hidden_size: int, num_layers: int, max_len: int):
    """A Llama config small enough that its compute barely counts next to the host's work: 4
    attention heads, 2 KV heads, an MLP of twice the hidden size."""
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=2 * hidden_size,
                       num_hidden_layers=num_layers, num_attention_heads=4, num_key_value_heads=2,
                       max_position_embeddings=max_len, rms_norm_eps=1e-6)


# ----------------------------------------------------------------------------------- arguments
def add_out_argument(parser: argparse.ArgumentParser, *, default: str | None = None,
                     aliases: tuple[str, ...] = ()) -> None:
    """--out [PATH]: append the JSON lines to PATH; `--out` alone: docs/results/<benchmark>-<gpu>-
    <date>.jsonl. `default` AUTO_OUT writes there without the flag."""
    where = "docs/results/<benchmark>-<gpu>-<date>.jsonl"
    parser.add_argument("--out", *aliases, nargs="?", const=AUTO_OUT, default=default, metavar="PATH",
                        help=f"append the JSON lines to PATH (alone: {where}) "
                             f"[{where if default == AUTO_OUT else 'stdout only'}]")


def add_timing_arguments(parser: argparse.ArgumentParser, *, iters: int, warmup: int | None = None) -> None:
    """--warmup N (untimed calls first) and --iters N (timed calls)."""
    if warmup is not None:
        parser.add_argument("--warmup", type=int, default=warmup, help="untimed calls first [%(default)s]")
    parser.add_argument("--iters", type=int, default=iters, help="timed calls [%(default)s]")
