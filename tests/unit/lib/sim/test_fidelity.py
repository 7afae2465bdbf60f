"""The analytic simulator against the published phantora_v0 step times (benchmarks/fidelity.py)."""

from __future__ import annotations

import importlib.util

import numpy as np
from fixtures.paths import BENCHMARKS

_spec = importlib.util.spec_from_file_location("fidelity", BENCHMARKS / "fidelity.py")
fidelity = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(fidelity)


def test_step_times_meet_the_fidelity_targets():
    rows = fidelity.fidelity_rows()
    assert len(rows) == 18
    err = np.abs([r["error"] for r in rows])
    assert np.median(err) <= 0.15 and err.max() <= 0.40, [(r["run_id"], round(r["error"], 3)) for r in rows]
    assert all(r["bytes_ok"] for r in rows)
    assert fidelity.oom_check()[0]


def test_l40s_constants_are_the_perf_db_fit():
    """gpus.toml [l40s] is the fit of perfdb/l40s that benchmarks/fidelity.py --fit prints."""
    from phantora_assets.lib.run.catalog import gpu_specs

    fit = fidelity.fit_l40s()
    l40s = gpu_specs()["l40s"]
    assert abs(fit["matmul_efficiency"] - l40s["matmul_efficiency"]) < 0.01
    assert abs(fit["memory_efficiency"] - l40s["memory_efficiency"]) < 0.01
    assert abs(fit["l2_bw_bytes_per_s"] - l40s["l2_bw_bytes_per_s"]) / l40s["l2_bw_bytes_per_s"] < 0.05
    assert abs(fit["kernel_floor_ns"] - l40s["kernel_floor_ns"]) < 100
    assert abs(fit["gemm_floor_ns"] - l40s["gemm_floor_ns"]) < 200
