"""Kernel keys in Phantora's compact format, perf-DB lookups and the roofline."""

from __future__ import annotations

import pytest

from phantora_assets.lib.phantora.perfdb import default_perfdb_dir
from phantora_assets.lib.run.catalog import gpu_specs
from phantora_assets.lib.sim.kernels import (
    GpuRoofline,
    KernelTimer,
    T,
    conv,
    ew,
    foreach,
    linear,
    load_compute_db,
    make_key,
    matmul,
    zeros_like,
)
from phantora_assets.lib.sim.workload_types import Compute
from phantora_assets.lib.sim.workloads import workload_model
from phantora_assets.matrix import load_run_matrix

SPECS = {s.run_id: s for s in load_run_matrix()}
DB = default_perfdb_dir() / "l40s"


def test_keys_are_phantoras_compact_json():
    assert (
        make_key("BMM", [T("bf16", 32, 1024, 128), T("bf16", 32, 128, 1024)])
        == '{"BMM":[["bf16",[32,1024,128]],["bf16",[32,128,1024]]]}'
    )
    # a tensor list repeating one period is {"R": [k, period]}; lists of lists are kept
    t = T("f32", 4096)
    assert make_key("Add_", [t, t]) == '{"Add_":{"R":[2,[["f32",[4096]]]]}}'
    a, b = T("f32", 2), T("f32", 3)
    assert make_key("ForeachMulScalar_", [a, b] * 3) == '{"ForeachMulScalar_":{"R":[3,[["f32",[2]],["f32",[3]]]]}}'
    assert (
        make_key("ForeachAddCMul_", [[t], [t], [t]])
        == '{"ForeachAddCMul_":[[["f32",[4096]]],[["f32",[4096]]],[["f32",[4096]]]]}'
    )
    assert (
        make_key("Linear", [T("bf16", 1, 8), T("bf16", 4, 8), None])
        == '{"Linear":[["bf16",[1,8]],["bf16",[4,8]],null]}'
    )
    assert conv(T("bf16", 8), "Float").key == '{"ConvDType":[["bf16",[8]],"Float"]}'
    assert zeros_like(t).key == '{"ZerosLike":["f32",[4096]]}'


def test_flops_and_bytes():
    k = matmul(T("bf16", 1024, 1, 4096), T("bf16", 4096, 3072))
    assert k.flops == 2 * 1024 * 4096 * 3072
    assert k.bytes == 2 * (1024 * 4096 + 4096 * 3072 + 1024 * 3072)
    lin = linear(T("bf16", 1, 1024, 4096), T("bf16", 14336, 4096))
    assert lin.flops == 2 * 1024 * 4096 * 14336
    # the foreach update reads and writes every tensor of one list (the lists alias)
    p = T("f32", 1000)
    assert foreach("ForeachAddCDiv_", [[p], [p], [p]]).bytes == 2 * 4000
    assert foreach("ForeachMulScalar_", [p, T("f32", 10)]).bytes == 2 * 4040
    assert ew("Add", [T("bf16", 100), T("bf16", 100)]).bytes == 200 + 200


def test_roofline_compute_and_memory_bound():
    r = GpuRoofline(100e12, 0.5, 1e12, 0.5, 0.0, 0.0, 1000.0, 5000.0)
    gemm = matmul(T("bf16", 4096, 4096), T("bf16", 4096, 4096))
    assert r.time_ns(gemm) == pytest.approx(gemm.flops / 50e12 * 1e9 + 5000)
    big = ew("Mul", [T("f32", 10**8), T("f64")])
    assert r.time_ns(big) == pytest.approx(big.bytes / 0.5e12 * 1e9 + 1000)
    with_l2 = GpuRoofline(100e12, 0.5, 1e12, 0.5, 64e6, 4e12, 0.0)
    small = ew("Add_", [T("bf16", 1 << 22)] * 2)
    assert with_l2.time_ns(small) == pytest.approx(small.bytes / 4e12 * 1e9)


def test_timer_prefers_the_db_and_counts_misses():
    db = load_compute_db(str(DB))
    timer = KernelTimer(gpu_specs()["l40s"], DB)
    hit = matmul(T("bf16", 1024, 1, 4096), T("bf16", 4096, 3072))
    miss = matmul(T("bf16", 1024, 1, 4096), T("bf16", 4096, 3073))
    assert timer.lookup(hit) == (float(db[hit.key]), True)
    ns, from_db = timer.lookup(miss)
    assert not from_db and ns > 0 and miss.key in timer.missing
    total, dbns = timer.time_kernels([hit, miss])
    assert total == pytest.approx(db[hit.key] + ns) and dbns == db[hit.key]
    no_db = KernelTimer(gpu_specs()["a100_40g"], default_perfdb_dir() / "a100_40g")
    assert no_db.lookup(hit)[1] is False and not no_db.missing


@pytest.mark.parametrize("run_id", ["phantora_l40s_W1_2x1", "phantora_l40s_W3_2x1", "phantora_l40s_W4_2x1"])
def test_published_l40s_runs_are_timed_from_the_real_perf_db(run_id):
    """The generated keys are the ones Phantora recorded: >= 99 % of compute time from the DB."""
    timer = KernelTimer(gpu_specs()["l40s"], DB)
    items = [i for i in workload_model(SPECS[run_id]).step_program() if isinstance(i, Compute)]
    total = dbns = 0.0
    for i in items:
        t, d = timer.time_kernels(i.kernels)
        total += t
        dbns += d
    assert dbns / total >= 0.99
