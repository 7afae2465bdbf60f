"""The bin width is a run setting (issue 14, item 4): ``bin_s`` of a run entry and ``build --bin-s``.

Widths from 1 ms to 1 s conserve bytes exactly: a shipped run binned at 0.01 s and 0.001 s has the
per-pair totals of its 0.1 s build, and its fine bins summed per 100 ms are the 0.1 s bins, to the
byte; the build at another width is what DuckDB's ``flows_binned`` holds, ``flows_100ms`` does not.
"""

from __future__ import annotations

import json
import shutil

import duckdb
import numpy as np
import pandas as pd
import pytest

from phantora_assets.cli import main
from phantora_assets.imported_runs import matrix_for
from phantora_assets.lib.bins.width import BIN_S_ENV, BIN_WIDTHS_MS, bin_s_rule, control_bins
from phantora_assets.lib.errors import RunMatrixError
from phantora_assets.lib.traffic import binning
from phantora_assets.lib.traffic import window_features as wf
from phantora_assets.matrix import parse_entries, spec_from_run_id
from phantora_assets.paths import DataPaths
from phantora_assets.records import TraceSummary, read_record
from phantora_assets.stages.simulation import build_reason

RUN = "phantora_a100_40g_W4_4x2"  # 4 nodes, 12 directed pairs; a 194 ms step
ENTRY = {"workload": "W4", "gpu": "a100_40g", "nodes": 4, "gpus_per_node": 2}


@pytest.mark.parametrize(
    "value, message",
    [
        (0.003, "bin_s must be one of 0.001, 0.002, 0.005, 0.01, 0.02, 0.025, 0.05, 0.1, 0.2, 0.5, 1 s"),
        (0.3, "got 0.3"),
        (1, "bin_s must be a float (seconds: one of 0.001, "),
        (True, "got True (boolean)"),
        ("0.1", "got '0.1' (string)"),
        (0.0, "got 0.0"),
        (2.0, "got 2.0"),
    ],
)
def test_bad_bin_s_is_refused_with_the_entry_and_rule(value, message):
    with pytest.raises(RunMatrixError) as err:
        parse_entries([{**ENTRY, "bin_s": value}], "my_runs.toml")
    assert str(err.value).startswith("my_runs.toml [[run]] #1 (W4 a100_40g 4x2): bin_s ")
    assert message in str(err.value)


def test_every_allowed_width_is_accepted_and_divides_the_windows():
    for ms in BIN_WIDTHS_MS:
        (spec,) = parse_entries([{**ENTRY, "bin_s": ms / 1000}])
        assert spec.bin_s == ms / 1000 and bin_s_rule(spec.bin_s) is None
        assert 180_000 % ms == 0 and 1000 % ms == 0 and (100 % ms == 0 or ms % 100 == 0)
    (default,) = parse_entries([ENTRY])
    assert default.bin_s == 0.1


def test_imports_registry_keeps_the_width(tmp_path):
    from phantora_assets.imported_runs import _entry

    (spec,) = parse_entries([{**ENTRY, "bin_s": 0.01}])
    assert _entry(spec)["bin_s"] == 0.01 and parse_entries([_entry(spec)]) == [spec]
    (default,) = parse_entries([ENTRY])
    assert "bin_s" not in _entry(default)  # a 100 ms run's entry is written as before


def test_build_bin_s_outside_the_rule_exits_2(tmp_path, capsys):
    root = tmp_path / "data"
    assert main(["build", "--data-dir", str(root), "--bin-s", "0.003", "--quiet"]) == 2
    assert "error: --bin-s 0.003: bin_s must be one of 0.001," in capsys.readouterr().err
    assert not root.exists()  # refused before anything is built


def test_env_override_is_validated_and_applied(tmp_path, monkeypatch):
    monkeypatch.setenv(BIN_S_ENV, "0.01")
    assert {s.bin_s for s in matrix_for(tmp_path)} == {0.01}
    monkeypatch.setenv(BIN_S_ENV, "fast")
    with pytest.raises(RunMatrixError, match=r"\$PHANTORA_ASSETS_BIN_S: bin_s must be a number of seconds"):
        matrix_for(tmp_path)


@pytest.mark.parametrize("n_nodes", [2, 3, 4, 5, 8])
def test_control_traffic_of_fine_bins_sums_to_the_100ms_split(n_nodes):
    per_split = binning.control_matrix(n_nodes, 5000, 0.1)[~np.eye(n_nodes, dtype=bool)]
    for ms in BIN_WIDTHS_MS:
        per_bin = control_bins(per_split, ms * 1_000_000, 180_000 // ms)
        if ms >= 100:  # one value for every bin: the split times the width
            assert per_bin.tolist() == (per_split * (ms // 100)).tolist()
            continue
        assert per_bin.shape == (180_000 // ms, len(per_split))
        assert per_bin.reshape(1800, 100 // ms, -1).sum(axis=1).tolist() == [per_split.tolist()] * 1800


@pytest.fixture(scope="module")
def two_widths(tmp_path_factory):
    """One shipped run built at 0.1 s, then rebuilt in the same data root with ``--bin-s 0.01``."""
    root = tmp_path_factory.mktemp("binwidth") / "data"
    assert main(["build", "--data-dir", str(root), "--run", RUN, "--quiet", "--no-plots"]) == 0
    paths = DataPaths(root)
    pdir = paths.partition_dir(RUN)
    keep = tmp_path_factory.mktemp("at_100ms")
    for name in ("flows_100ms.parquet", "windows.parquet", "step_flows.parquet", "trace_summary.json"):
        shutil.copy(pdir / name, keep / name)
    assert main(["build", "--data-dir", str(root), "--run", RUN, "--quiet", "--no-plots", "--bin-s", "0.01"]) == 0
    return paths, keep


def _bins(df: pd.DataFrame) -> np.ndarray:
    """(n_bins, 12) bytes of the run, bins in time order, pairs in (src, dst) order."""
    df = df.sort_values(["t", "src_node", "dst_node"])
    return df["bytes"].to_numpy(np.int64).reshape(-1, 12)


def test_run_at_10ms_conserves_bytes_against_100ms(two_widths):
    paths, keep = two_widths
    coarse = _bins(pd.read_parquet(keep / "flows_100ms.parquet"))
    fine = _bins(pd.read_parquet(paths.table(RUN, "flows_100ms")))
    assert coarse.shape == (1800, 12) and fine.shape == (18000, 12)
    assert fine.sum(axis=0).tolist() == coarse.sum(axis=0).tolist()  # per (src, dst), to the byte
    assert (fine.reshape(1800, 10, 12).sum(axis=1) == coarse).all()  # every 100 ms bin, to the byte
    checks = json.loads((paths.run_folder(spec_from_run_id(RUN)) / "checks.json").read_text())
    assert checks["bins_conserve_bytes"]["status"] == "passed"
    rec = json.loads((paths.partition_dir(RUN) / "run_spec.json").read_text())
    assert rec["inputs"]["entry"]["bin_s"] == 0.01
    # the matrix says 0.1 s: without --bin-s the run is stale, and rebuilt
    assert build_reason(spec_from_run_id(RUN), paths).startswith("stale: built from another entry")


def test_run_at_1ms_conserves_bytes_against_100ms(two_widths):
    """The binning of the run's steady step at 1 ms, and its windows, against the 100 ms build."""
    _paths, keep = two_widths
    summary = read_record(keep / "trace_summary.json", TraceSummary)
    args = dict(step_time_s=summary.step_time_us / 1e6, n_nodes=4, run_id=RUN, control_bytes_per_s=5000)
    built = binning.build_bins(pd.read_parquet(keep / "step_flows.parquet"), bin_s=0.001, **args)
    assert binning.conservation_ok(built)
    coarse = _bins(pd.read_parquet(keep / "flows_100ms.parquet"))
    fine = _bins(built.bins)
    assert fine.shape == (180_000, 12)
    assert fine.sum(axis=0).tolist() == coarse.sum(axis=0).tolist()
    assert (fine.reshape(1800, 100, 12).sum(axis=1) == coarse).all()
    feats = wf.compute_window_features(built.bins, run_id=RUN, bin_s=0.001)
    v1 = pd.read_parquet(keep / "windows.parquet")
    assert feats["total_bytes"].tolist() == v1["total_bytes"].tolist()  # the same windows, the same bytes
    assert sorted(set(zip(feats["window_s"], feats["n_bins"], strict=True))) == [(1.0, 1000), (15.0, 15000)]


def test_windows_runs_and_database_follow_the_width(two_widths):
    paths, keep = two_widths
    wins = pd.read_parquet(paths.table(RUN, "windows"))
    assert sorted(set(zip(wins["window_s"], wins["n_bins"], strict=True))) == [(1.0, 100), (15.0, 1500)]
    assert wins["total_bytes"].tolist() == pd.read_parquet(keep / "windows.parquet")["total_bytes"].tolist()
    fifteen = wins[wins["window_s"] == 15.0]["dominant_period_s"]
    step_s = read_record(keep / "trace_summary.json", TraceSummary).step_time_us / 1e6
    assert abs(fifteen.median() - step_s) < 0.001  # a 194 ms step, read in 10 ms bins
    runs = pd.read_csv(paths.dataset_dir / "runs.csv")
    assert runs.set_index("run_id").loc[RUN, "bin_s"] == 0.01
    assert RUN not in set(pd.read_csv(paths.dataset_dir / "flows_100ms.csv")["run_id"])  # v1's table: 100 ms runs
    with duckdb.connect(str(paths.duckdb_path), read_only=True) as con:
        sql = "SELECT any_value(bin_s), count(*), sum(bytes) FROM flows_binned WHERE run_id = ?"
        got = con.execute(sql, [RUN]).fetchone()
        assert got == (0.01, 18000 * 12, int(_bins(pd.read_parquet(keep / "flows_100ms.parquet")).sum()))
        assert con.execute("SELECT count(*) FROM flows_100ms").fetchone() == (0,)
        aliased, expected = con.execute(
            "SELECT period_aliased, expected_period_s FROM step_period WHERE run_id = ?", [RUN]
        ).fetchone()
        assert aliased is False and expected == pytest.approx(step_s)


def test_the_dataset_card_describes_the_10ms_build(two_widths):
    """The card of a build whose one run has 10 ms bins says 10 ms wherever it speaks of the runs' bins,
    and where that run's bins are (not in flows_100ms)."""
    paths, _keep = two_widths
    text = " ".join((paths.dataset_dir / "README.md").read_text().split())  # line breaks as spaces
    assert "per bin of the run's width (10 ms (1 run)) over a 180 s window" in text
    assert "summed into bins of the run's width (`runs.bin_s`; in this build 10 ms (1 run))" in text
    assert "`flows_100ms` holds the runs of 100 ms bins only (the runs at other widths, 10 ms (1 run), are in" in text
    assert "shorter than two bins (20 ms at 10 ms)" in text
    for v1_claim in ("summed into 100 ms bins", "per 100 ms bin over", "100 ms bins cannot show", "100 ms bins in the"):
        assert v1_claim not in text
    assert "`flows_100ms` 0 rows" in text
