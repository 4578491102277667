"""The tuned launch settings' JSON files and their loader (CPU only).

The expected values are the launchers' settings as they were written in the kernels before they
moved into the files: every GPU file and default.json must carry them until a new sweep changes
a GPU's file (and this test with it)."""

from __future__ import annotations

import json

import pytest
import torch

from flexserve_kernels import tuned_configs
from flexserve_kernels.configs import CONFIGS_DIR as KERNEL_CONFIGS_DIR
from flexserve_kernels.lora.train import configs as train_configs_module
from flexserve_kernels.lora.train.configs import CONFIGS_DIR, train_configs
from flexserve_kernels.tuned_configs import by_rank, config_file_name, load_configs

GPU_NAMES = ("NVIDIA H100 80GB HBM3", "NVIDIA H200")


def _gemm(shapes, extras=()):
    return [dict(block_m=m, block_n=n, block_k=k, num_warps=w, num_stages=s, **dict(zip(extras, rest)))
            for m, n, k, w, s, *rest in shapes]


TERM_CONFIG_SHAPES = ((64, 128, 16, 8, 1), (32, 128, 16, 4, 1), (64, 128, 16, 4, 1), (64, 256, 16, 8, 1),
                      (128, 128, 16, 8, 1), (128, 256, 16, 8, 1), (32, 256, 16, 4, 1), (32, 64, 16, 2, 1))
DX_TERM_CONFIG_SHAPES = ((64, 128, 16, 8, 1), (32, 128, 16, 4, 1), (128, 128, 16, 8, 1), (64, 256, 16, 8, 1),
                         (64, 64, 16, 4, 1), (32, 64, 16, 2, 1))
FWD_TMA_CONFIG_SHAPES = ((128, 256, 64, 8, 4, True, 2), (128, 256, 64, 8, 4, False, 2),
                         (128, 256, 64, 8, 3, True, 1), (128, 256, 64, 8, 3, False, 1),
                         (128, 128, 64, 8, 4, True, 1), (128, 128, 64, 8, 4, False, 1),
                         (128, 128, 64, 4, 4, False, 1), (128, 128, 128, 8, 3, False, 1),
                         (128, 128, 32, 8, 3, False, 1))
WIDE_RANK_TERM_CONFIGS = 1
SHRINK = dict(block_m=32, block_k=128, per_sm=4, num_stages=3, key_table=True)


def old_ds_db(max_rank: int, wide: bool) -> tuple[int, int, int, int]:
    """Kernel 3's CUDA (block_m, block_n, num_warps, per_sm) as the launcher computed them."""
    return ((128 if wide else 64), (256 if wide else 128 if max_rank <= 32 else 64),
            (8 if wide or max_rank > 32 else 4), (1 if wide else 2))


def old_da(max_rank: int) -> tuple[int, int, int, int]:
    return 32, (128 if max_rank <= 32 else 64), (4 if max_rank <= 32 else 8), (4 if max_rank <= 32 else 2)


def old_term_da(max_rank: int) -> tuple[int, int, int, int]:
    tiles = (16, 128, 4) if max_rank <= 16 else (32, 128, 8) if max_rank <= 32 else (32, 64, 8)
    return (*tiles, 4 if max_rank <= 32 else 2)


def old_dx_term(max_rank: int) -> tuple[int, int, int]:
    return (32, 128, 4) if max_rank <= 64 else (64, 128, 8)


@pytest.mark.parametrize("name", (None, *GPU_NAMES))
def test_every_file_carries_the_launchers_settings(name):
    c = load_configs(CONFIGS_DIR, name)
    assert c["lora_train_shrink_fwd"] == SHRINK
    assert c["lora_train_linear_fwd_term"] == dict(wide_rank_candidates=WIDE_RANK_TERM_CONFIGS,
                                                   candidates=_gemm(TERM_CONFIG_SHAPES))
    assert c["lora_train_dx_bwd_term"] == dict(wide_rank_candidates=WIDE_RANK_TERM_CONFIGS,
                                               candidates=_gemm(DX_TERM_CONFIG_SHAPES))
    assert c["lora_train_linear_fwd_tma"]["candidates"] == _gemm(FWD_TMA_CONFIG_SHAPES,
                                                                 ("warp_specialize", "epilogue_split"))
    assert (c["lora_train_dx_term_da_bwd"]["max_chunks"], c["lora_train_dx_term_da_bwd"]["lean_max_chunks"]) == (8, 16)
    for rank in range(1, 129):
        for op, wide in (("lora_train_ds_db_bwd", rank <= 16), ("lora_train_ds_db_bwd_fp32", False)):
            t = by_rank(c[op]["by_rank"], rank)
            assert (t["block_m"], t["block_n"], t["num_warps"], t["per_sm"]) == old_ds_db(rank, wide), (op, rank)
        t = by_rank(c["lora_train_da_bwd"]["by_rank"], rank)
        assert (t["block_m"], t["block_k"], t["num_warps"], t["per_sm"]) == old_da(rank), rank
        t = by_rank(c["lora_train_dx_term"]["by_rank"], rank)
        assert (t["block_m"], t["block_n"], t["num_warps"]) == old_dx_term(rank), rank
        t = by_rank(c["lora_linear_term"]["by_rank"], rank)
        assert (t["block_m"], t["block_n"], t["num_warps"]) == ((64, 128, 4) if rank <= 64 else (64, 128, 8)), rank
        if rank <= 64:  # MAX_TERM_DA_RANK
            t = by_rank(c["lora_train_dx_term_da_bwd"]["by_rank"], rank)
            assert (t["block_m"], t["block_k"], t["num_warps"], t["per_sm"]) == old_term_da(rank), rank


def test_file_names_follow_torch_device_names():
    assert config_file_name("NVIDIA H100 80GB HBM3") == "NVIDIA_H100_80GB_HBM3.json"
    assert config_file_name("NVIDIA H200") == "NVIDIA_H200.json"
    assert config_file_name(None) == "default.json"


def _write(folder, name, configs):
    (folder / name).write_text(json.dumps(configs))


@pytest.fixture
def configs_dir(tmp_path, monkeypatch):
    """A configs folder whose H200 file differs from default.json, read by `train_configs`."""
    _write(tmp_path, "default.json", {"op": {"block_m": 32, "by_rank": {"16": {"num_warps": 4}}}})
    _write(tmp_path, "NVIDIA_H200.json", {"op": {"block_m": 64, "by_rank": {"16": {"num_warps": 8}}}})
    monkeypatch.setattr(train_configs_module, "CONFIGS_DIR", str(tmp_path))
    return tmp_path


def test_loader_picks_the_gpu_file(configs_dir, monkeypatch):
    monkeypatch.setattr(tuned_configs, "_cuda_device_name", lambda index: "NVIDIA H200")
    assert train_configs(torch.device("cuda", 0))["op"]["block_m"] == 64
    assert train_configs("cuda:1")["op"]["by_rank"]["16"]["num_warps"] == 8


def test_loader_falls_back_to_default_for_unknown_gpus_and_the_cpu(configs_dir, monkeypatch):
    monkeypatch.setattr(tuned_configs, "_cuda_device_name", lambda index: "NVIDIA A100-SXM4-80GB")
    assert train_configs(torch.device("cuda", 0))["op"]["block_m"] == 32
    assert train_configs(torch.device("cpu"))["op"]["block_m"] == 32
    assert train_configs("cpu") is load_configs(str(configs_dir), None)  # read once


@pytest.mark.parametrize("bad, message", [
    ({"op": {"block_m": 48}}, "op.block_m must be a power of two"),
    ({"op": {"num_warps": 4.0}}, "op.num_warps must be a positive integer"),
    ({"op": {"per_sm": 0}}, "op.per_sm must be a positive integer"),
    ({"op": {"per_sm": True}}, "op.per_sm must be a positive integer"),
    ({"op": {"key_table": 1}}, "op.key_table must be true or false"),
    ({"op": {"by_rank": {"sixteen": {"num_warps": 4}}}}, "rank key 'sixteen'"),
    ({"op": {"candidates": []}}, "op.candidates is empty"),
    ({"other": {"block_m": 32}}, "missing operations ['op']"),
])
def test_loader_rejects_a_malformed_file(tmp_path, bad, message):
    _write(tmp_path, "default.json", {"op": {"block_m": 32}})
    _write(tmp_path, "NVIDIA_H200.json", bad)
    with pytest.raises(ValueError, match="NVIDIA_H200.json") as info:
        load_configs(str(tmp_path), "NVIDIA H200")
    assert message in str(info.value)


def test_loader_rejects_a_file_that_is_not_json(tmp_path):
    (tmp_path / "default.json").write_text('{"op": {"block_m": 32,}}')
    with pytest.raises(ValueError, match="default.json: not a readable JSON file"):
        load_configs(str(tmp_path), None)


def test_by_rank_takes_the_smallest_covering_entry():
    table = {"16": {"n": 1}, "64": {"n": 2}}
    assert [by_rank(table, r)["n"] for r in (1, 16, 17, 64)] == [1, 1, 2, 2]
    with pytest.raises(ValueError, match="rank 65"):
        by_rank(table, 65)


@pytest.mark.parametrize("name", (None, *GPU_NAMES))
def test_every_file_carries_the_gemv_settings(name):
    gemv = load_configs(KERNEL_CONFIGS_DIR, name)["gemv"]
    assert gemv["default"] == dict(block_n=8, block_k=1024, num_warps=4, num_stages=1)
    assert gemv["by_shape"] == {"6144x4096": dict(block_n=4, block_k=512, num_warps=2, num_stages=1)}


def test_gemv_config_reads_the_device_file(monkeypatch):
    from flexserve_kernels.gemv import gemv_config

    assert gemv_config(6144, 4096, "cpu") == dict(BLOCK_N=4, BLOCK_K=512, num_warps=2, num_stages=1)
    assert gemv_config(4096, 4096, "cpu") == dict(BLOCK_N=8, BLOCK_K=1024, num_warps=4, num_stages=1)
    monkeypatch.setattr(tuned_configs, "_cuda_device_name", lambda index: "NVIDIA H200")
    assert gemv_config(6144, 4096, "cuda:0") == dict(BLOCK_N=4, BLOCK_K=512, num_warps=2, num_stages=1)


def test_shape_keys_are_checked(tmp_path):
    _write(tmp_path, "default.json", {"gemv": {"by_shape": {"6144-4096": {"block_n": 4}}}})
    with pytest.raises(ValueError, match="default.json: gemv.by_shape has shape key '6144-4096'"):
        load_configs(str(tmp_path), None)
