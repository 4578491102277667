"""benchmarks/decode_kernel_profile.py's parsing on synthetic kernel records (CPU): step split,
busy/span/idle, grouping by kernel name, idle gaps, and reading torch profiler events."""

import importlib.util
import pathlib
import sys
import types

import pytest


@pytest.fixture(scope="module")
def prof():
    path = pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / "decode_kernel_profile.py"
    spec = importlib.util.spec_from_file_location("decode_kernel_profile_benchmark", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while it executes
    spec.loader.exec_module(module)
    return module


NVJET = "nvjet_tst_64x8_64x16_2x1_v_bz_TNT"
GEMV = "void gemv2T_kernel_val<int, int, __nv_bfloat16, __nv_bfloat16, float, 128, 16, 4, 4, false>(float, float)"


def two_steps(prof):
    """Step 1: norm 0-10, GEMM 12-42, rotary 45-50 (gaps 2 + 3). Step 2 from 100: norm 100-110,
    GEMM 111-141, rotary 141-146 (one gap of 1)."""
    r = prof.KernelRecord
    return [r("_rmsnorm_kernel", 0, 10), r(NVJET, 12, 42), r("_rotary_embedding_kernel", 45, 50),
            r("_rmsnorm_kernel", 100, 110), r(GEMV, 111, 141), r("_rotary_embedding_kernel", 141, 146)]


def test_busy_span_idle_per_step(prof):
    summary = prof.summarize_kernels(two_steps(prof), 2, step_starts_us=[-5.0, 90.0])
    assert summary["steps"] == [
        {"num_kernels": 3, "busy_us": 45.0, "span_us": 50.0, "idle_us": 5.0},
        {"num_kernels": 3, "busy_us": 45.0, "span_us": 46.0, "idle_us": 1.0},
    ]
    assert (summary["busy_us"], summary["span_us"], summary["idle_us"]) == (45.0, 48.0, 3.0)
    assert summary["kernel_us"] == 45.0 and summary["kernels_per_step"] == 3.0
    assert summary["num_left_out"] == 0


def test_groups_merge_cublas_kernels_and_keep_raw_names(prof):
    summary = prof.summarize_kernels(two_steps(prof), 2, step_starts_us=[0.0, 100.0])
    assert summary["groups"] == [
        {"group": "GEMM (cuBLAS)", "calls_per_step": 1.0, "us_per_call": 30.0, "us_per_step": 30.0,
         "pct_of_busy": 66.67},
        {"group": "RMSNorm (+residual)", "calls_per_step": 1.0, "us_per_call": 10.0,
         "us_per_step": 10.0, "pct_of_busy": 22.22},
        {"group": "rotary", "calls_per_step": 1.0, "us_per_call": 5.0, "us_per_step": 5.0,
         "pct_of_busy": 11.11},
    ]
    raw = {row["name"]: (row["calls_per_step"], row["us_per_step"]) for row in summary["kernels"]}
    assert raw == {"_rmsnorm_kernel": (1.0, 10.0), NVJET: (0.5, 15.0), GEMV: (0.5, 15.0),
                   "_rotary_embedding_kernel": (1.0, 5.0)}


def test_gaps_by_neighbouring_groups(prof):
    summary = prof.summarize_kernels(two_steps(prof), 2, step_starts_us=[0.0, 100.0])
    assert summary["gaps"] == [
        {"between": "GEMM (cuBLAS) -> rotary", "count_per_step": 0.5, "us_per_gap": 3.0,
         "us_per_step": 1.5},
        {"between": "RMSNorm (+residual) -> GEMM (cuBLAS)", "count_per_step": 1.0,
         "us_per_gap": 1.5, "us_per_step": 1.5},
    ]


def test_split_at_widest_gaps_without_step_starts(prof):
    with_starts = prof.summarize_kernels(two_steps(prof), 2, step_starts_us=[0.0, 100.0])
    without = prof.summarize_kernels(list(reversed(two_steps(prof))), 2)
    assert without == with_starts
    steps, _ = prof.split_steps(two_steps(prof), 3)  # widest gaps: 50 before 100, 3 before 45
    assert [len(step) for step in steps] == [2, 1, 3]
    one = prof.summarize_kernels(two_steps(prof), 1)
    assert (one["busy_us"], one["span_us"], one["idle_us"]) == (90.0, 146.0, 56.0)


def test_overlaps_count_once_and_early_records_are_left_out(prof):
    r = prof.KernelRecord
    records = [r("memcpy_before", -20, -10), r("a", 0, 10), r("b", 5, 12), r("c", 20, 25)]
    summary = prof.summarize_kernels(records, 1, step_starts_us=[0.0])
    assert summary["num_left_out"] == 1
    assert summary["steps"] == [{"num_kernels": 3, "busy_us": 17.0, "span_us": 25.0, "idle_us": 8.0}]
    assert summary["kernel_us"] == 22.0  # summed durations exceed the union when kernels overlap
    assert summary["gaps"] == [{"between": "b -> c", "count_per_step": 1.0, "us_per_gap": 8.0,
                                "us_per_step": 8.0}]
    assert prof.busy_us([]) == 0.0


def test_bad_step_arguments_raise(prof):
    with pytest.raises(ValueError, match="step starts"):
        prof.summarize_kernels(two_steps(prof), 2, step_starts_us=[0.0])
    with pytest.raises(ValueError, match="num_steps"):
        prof.summarize_kernels(two_steps(prof), 0)
    with pytest.raises(ValueError, match="cannot make"):
        prof.summarize_kernels(two_steps(prof)[:2], 3)


def test_kernel_names_and_groups(prof):
    group = prof.kernel_group
    assert group("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize64x64x64_warpgroupsize1x1x1") \
        == "GEMM (cuBLAS)"
    assert group("void cutlass::Kernel2<cutlass_80_wmma_tensorop_bf16_s161616gemm_bf16_16x16_128x2_tn_align8>"
                 "(cutlass_80_wmma_tensorop_bf16_s161616gemm_bf16_16x16_128x2_tn_align8::Params)") \
        == "GEMM (cuBLAS)"
    assert group("void splitKreduce_kernel<32, 16, int, float, __nv_bfloat16>(cublasSplitKParams<float>)") \
        == "GEMM (cuBLAS)"
    assert group("_decode_attention_reduce_kernel") == "decode attention reduce"
    assert group("_decode_attention_kernel") == "decode attention (split-K)"
    assert group("_kv_cache_write_kernel") == "KV-cache write"
    assert group("_rope_kv_write_kernel") == "rotary + KV-cache write"
    assert group("_silu_and_mul_kernel_0d1d2de") == "SiLU-and-mul"
    assert group("Memcpy HtoD (Pageable -> Device)") == "memcpy"
    assert prof.short_kernel_name("Memcpy HtoD (Pageable -> Device)") == "Memcpy HtoD"
    elementwise = ("void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<float>, "
                   "at::detail::Array<char*, 1> >(int, at::native::FillFunctor<float>, "
                   "at::detail::Array<char*, 1>)")
    assert group(elementwise) == "at::native::vectorized_elementwise_kernel"
    assert prof.short_kernel_name("void at::native::(anonymous namespace)::reduce_kernel<512, 1>(int)") \
        == "at::native::reduce_kernel"
    assert prof.short_kernel_name("_silu_and_mul_kernel_0d1d2de") == "_silu_and_mul_kernel"


def test_profiler_records_keep_device_activities_and_step_starts(prof):
    from torch.autograd import DeviceType

    def evt(name, device_type, start, end, **extra):
        return types.SimpleNamespace(name=name, device_type=device_type,
                                     time_range=types.SimpleNamespace(start=start, end=end), **extra)

    label = prof.STEP_LABEL
    events = [
        evt(label, DeviceType.CPU, 100, 300, is_user_annotation=True),
        evt(label, DeviceType.CUDA, 110, 290, is_user_annotation=True),  # device-side mirror
        evt("other_range", DeviceType.CUDA, 110, 290, is_user_annotation=True),
        evt("gpu_range", DeviceType.CUDA, 110, 290, activity_type="gpu_user_annotation"),
        evt("cudaGraphLaunch", DeviceType.CPU, 105, 108),
        evt("_rmsnorm_kernel", DeviceType.CUDA, 110, 112.5),
        evt(label, DeviceType.CPU, 0, 90, is_user_annotation=True),
        evt(NVJET, DeviceType.CUDA, 113, 140),
    ]
    records, starts = prof.profiler_records(events)
    assert starts == [0.0, 100.0]
    assert records == [prof.KernelRecord("_rmsnorm_kernel", 110.0, 112.5),
                       prof.KernelRecord(NVJET, 113.0, 140.0)]


def test_step_ranges_from_a_real_cpu_profile(prof):
    """The installed torch's profiler names and times record_function ranges as we read them."""
    import torch
    from torch.profiler import ProfilerActivity, profile, record_function

    with profile(activities=[ProfilerActivity.CPU]) as p:
        for _ in range(3):
            with record_function(prof.STEP_LABEL):
                torch.ones(4).sum()
    records, starts = prof.profiler_records(p.events())
    assert records == []
    assert len(starts) == 3 and starts == sorted(starts) and len(set(starts)) == 3
