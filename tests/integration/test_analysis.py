"""The analysis layer on a real build: the DuckDB database, the query command, the plots, the period feature.

Everything here reads the session's one full `phantora-assets build` (fixture `built`).
"""

from __future__ import annotations

import base64
import csv
import io
import json
import os

import dagster as dg
import duckdb
import numpy as np
import pandas as pd
import pytest
from fixtures.materialize import ephemeral_with_runs
from fixtures.paths import DATA

from phantora_assets import definitions as d
from phantora_assets.cli import format_rows, main
from phantora_assets.lib.store import plots
from phantora_assets.lib.store.database import VIEWS, views_markdown
from phantora_assets.lib.traffic.periodicity import alias_period_s
from phantora_assets.lib.traffic.window_features import feature_markdown
from phantora_assets.matrix import load_run_matrix
from phantora_assets.paths import DataPaths
from phantora_assets.resources import AnalyticSimulatorResource, DataRoot
from phantora_assets.stages import analysis
from phantora_assets.stages import dataset as dataset_stage

RUN_MATRIX = load_run_matrix()
RUNS_BY_ID = {s.run_id: s for s in RUN_MATRIX}

ROOT = DATA.parent.parent
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
RUN = "phantora_a100_40g_W1_2x2"


@pytest.fixture(scope="module")
def runs(built) -> pd.DataFrame:
    return pd.read_csv(built / "phantora_v0" / "runs.csv").set_index("run_id")


@pytest.fixture(scope="module")
def con(built):
    with duckdb.connect(str(DataPaths(built).duckdb_path), read_only=True) as c:
        yield c


def query(built, sql: str, *extra: str, capsys) -> tuple[int, str, str]:
    rc = main(["query", sql, "--data-dir", str(built), *extra])
    out = capsys.readouterr()
    return rc, out.out, out.err


# --------------------------------------------------------------------------- the database
def test_database_holds_the_runs_that_passed(con, runs) -> None:
    for table in ("runs", "flows_100ms", "windows", "flows", "steps", "step_anatomy"):
        got = {r[0] for r in con.execute(f"SELECT DISTINCT run_id FROM {table}").fetchall()}
        assert got == set(runs.index), table
    status = dict(con.execute("SELECT run_id, status FROM run_status").fetchall())
    assert len(status) == len(RUN_MATRIX)
    assert {r for r, s in status.items() if s == "included"} == set(runs.index)
    reasons = con.execute("SELECT reason FROM run_status WHERE status <> 'included'").fetchall()
    assert len(reasons) == 4 and all("fits_in_memory: failed" in r[0] for r in reasons)


def test_database_tables_equal_the_dataset(built, con) -> None:
    for table in ("runs", "flows_100ms", "windows"):
        want = pd.read_parquet(
            built / "phantora_v0" / (table if table != "runs" else "runs.parquet"), partitioning=None
        )
        got = con.execute(f"SELECT * FROM {table}").df()
        keys = [c for c in ("run_id", "window_s", "window_start_s", "t", "src_node", "dst_node") if c in want]
        pd.testing.assert_frame_equal(
            got.sort_values(keys).reset_index(drop=True),
            want.sort_values(keys).reset_index(drop=True),
            check_dtype=False,
        )


def test_flows_table_is_the_validated_flow_table(built, con) -> None:
    cols = [r[0] for r in con.execute("DESCRIBE flows").fetchall()]
    for c in ("run_id", "op", "comm_id", "step", "bytes", "ts_us", "dur_us", "src_node", "dst_node"):
        assert c in cols
    want = pd.read_parquet(DataPaths(built).partition_dir(RUN) / "flows.parquet")
    got = con.execute("SELECT * EXCLUDE (run_id) FROM flows WHERE run_id = ? ORDER BY ts_us, flow_id", [RUN]).df()
    pd.testing.assert_frame_equal(got, want.sort_values(["ts_us", "flow_id"]).reset_index(drop=True), check_dtype=False)
    assert con.execute("SELECT count(*) FROM flows WHERE src_node = dst_node").fetchone()[0] == 0


@pytest.mark.parametrize("view", [v.name for v in VIEWS])
def test_every_view_has_rows_for_every_run(con, runs, view: str) -> None:
    got = {r[0] for r in con.execute(f"SELECT DISTINCT run_id FROM {view}").fetchall()}
    assert got == set(runs.index)
    comment = con.execute("SELECT comment FROM duckdb_views() WHERE view_name = ?", [view]).fetchone()[0]
    assert comment  # documented in the database too


def test_pair_and_collective_bytes_add_up_to_the_step(con, runs) -> None:
    per_pair = dict(con.execute("SELECT run_id, sum(bytes_per_step) FROM pair_bytes GROUP BY 1").fetchall())
    per_coll = dict(con.execute("SELECT run_id, sum(bytes_per_step) FROM collective_bytes GROUP BY 1").fetchall())
    window = dict(con.execute("SELECT run_id, sum(window_bytes) FROM pair_bytes GROUP BY 1").fetchall())
    binned = dict(con.execute("SELECT run_id, sum(bytes) FROM flows_100ms GROUP BY 1").fetchall())
    for run_id, row in runs.iterrows():
        assert per_pair[run_id] == pytest.approx(row.inter_node_bytes_per_step, rel=1e-12), run_id
        assert per_coll[run_id] == pytest.approx(row.inter_node_bytes_per_step, rel=1e-12), run_id
        assert window[run_id] == binned[run_id]
    shares = con.execute("SELECT run_id, sum(share_of_step) FROM collective_bytes GROUP BY 1").fetchall()
    assert all(s == pytest.approx(1.0) for _, s in shares)


def test_collective_types_follow_the_workload(con, runs) -> None:
    kinds = {}
    for run_id, coll in con.execute("SELECT run_id, collective FROM collective_bytes").fetchall():
        kinds.setdefault(run_id, set()).add(coll)
    assert set().union(*kinds.values()) <= {"all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast"}
    for run_id, row in runs.iterrows():
        if row.workload in ("W2", "W3"):  # MoE: expert all-to-all as grouped send/recv
            assert "all_to_all" in kinds[run_id], run_id
        if row.workload == "W5":  # ZeRO-3: parameters gathered, gradients scattered
            assert {"all_gather", "reduce_scatter"} <= kinds[run_id], run_id
        if row.workload == "W4":  # DeepSpeed ZeRO-0 data parallel
            assert "all_reduce" in kinds[run_id], run_id


def test_step_anatomy_adds_up(con, runs) -> None:
    bad = con.execute("""SELECT count(*) FROM step_anatomy
                         WHERE abs(compute_us + exposed_comm_us + idle_us - duration_us) > 1e-3
                            OR overlap_us < 0 OR exposed_comm_us < 0 OR idle_us < 0""").fetchone()[0]
    assert bad == 0
    hosts = dict(con.execute("SELECT run_id, n_hosts FROM run_anatomy").fetchall())
    steady = dict(con.execute("SELECT run_id, n_steady_steps FROM run_anatomy").fetchall())
    for run_id, row in runs.iterrows():
        assert hosts[run_id] == row.n_nodes and steady[run_id] == row.n_steady_steps
    # the anatomy covers the run's steps: its median steady step is the step time (which is the median
    # of the timed steady steps)
    got = dict(con.execute("SELECT run_id, step_time_ms FROM run_anatomy").fetchall())
    for run_id, row in runs.iterrows():
        assert got[run_id] == pytest.approx(row.step_time_s * 1000, rel=1e-3)


# --------------------------------------------------------------------------- the period feature
def test_dominant_period_recovers_the_step_time(built, runs) -> None:
    """Against runs.csv, in the 15 s windows (the 1 s ones hold 2 cycles of at most 0.5 s).

    A step of at least two bins is recovered within one bin (the run's median and most windows); a
    shorter one cannot be (aliasing): the windows then read the fold of the step's rhythm or of a low
    harmonic, |h/step - k/bin_s| (h <= 4), to one frequency cell of the window (1/15 Hz).
    """
    wins = pd.read_csv(built / "phantora_v0" / "windows.csv")
    w15 = wins[wins.window_s == 15.0]
    checked = {"recovered": 0, "aliased": 0, "window too short": 0}
    for run_id, row in runs.iterrows():
        p = w15.loc[w15.run_id == run_id, "dominant_period_s"].to_numpy()
        assert len(p) == 12 and np.isfinite(p).all()
        step, bin_s = row.step_time_s, row.bin_s
        if step >= 2 * bin_s:
            assert abs(np.median(p) - step) <= bin_s, (run_id, step, p.tolist())
            assert (np.abs(p - step) <= bin_s).mean() >= 0.75, (run_id, step, p.tolist())
            checked["recovered"] += 1
        else:
            folds = np.array([abs(h / step - round(h * bin_s / step) / bin_s) for h in (1, 2, 3, 4)])
            if folds[0] * 15.0 < 5:
                # the folded rhythm makes fewer than 5 cycles in a 15 s window (a step within a few ms
                # of a bin multiple): the window is not long enough to read it
                checked["window too short"] += 1
                continue
            hit = np.min(np.abs(1 / p[:, None] - folds[None, :]), axis=1) <= 1 / 15.0
            assert hit.mean() >= 0.75, (run_id, step, p.tolist(), folds.tolist())
            checked["aliased"] += 1
    assert checked["recovered"] >= 1 and checked["aliased"] >= 1, checked
    assert checked["window too short"] <= 2, checked


def test_step_period_view_flags_aliased_runs(con, runs) -> None:
    rows = con.execute("SELECT run_id, period_aliased, expected_period_s FROM step_period").fetchall()
    for run_id, aliased, expected in rows:
        step, bin_s = runs.loc[run_id, "step_time_s"], runs.loc[run_id, "bin_s"]
        assert aliased == (step < 2 * bin_s)
        assert expected == pytest.approx(alias_period_s(step, bin_s))


# --------------------------------------------------------------------------- the query command
def test_query_the_done_when_statement(built, runs, capsys) -> None:
    rc, out, err = query(built, "select run_id, sum(bytes) from flows_100ms group by 1", capsys=capsys)
    assert rc == 0 and err == ""
    lines = out.splitlines()
    assert lines[0].split() == ["run_id", "sum(bytes)"]
    assert {ln.split()[0] for ln in lines[2:-1]} == set(runs.index)
    assert lines[-1] == f"({len(runs)} rows)"


def test_query_formats(built, runs, capsys) -> None:
    sql = "select run_id, step_time_s, period_aliased from step_period order by run_id"
    rc, out, _ = query(built, sql, "--format", "csv", capsys=capsys)
    assert rc == 0
    rows = list(csv.DictReader(io.StringIO(out)))
    assert [r["run_id"] for r in rows] == sorted(runs.index)
    assert float(rows[0]["step_time_s"]) == pytest.approx(runs.loc[rows[0]["run_id"], "step_time_s"])
    rc, out, _ = query(built, sql, "--format", "json", capsys=capsys)
    data = json.loads(out)
    assert rc == 0 and len(data) == len(runs) and isinstance(data[0]["period_aliased"], bool)


def test_query_bad_sql_is_duckdbs_message_and_exit_2(built, capsys) -> None:
    rc, out, err = query(built, "selec run_id from runs", capsys=capsys)
    assert rc == 2 and out == ""
    assert "Parser Error" in err and "Traceback" not in err
    rc, _, err = query(built, "select nope from runs", capsys=capsys)
    assert rc == 2 and "Binder Error" in err and "nope" in err


def test_query_bad_sql_in_a_subprocess_has_no_traceback(built) -> None:
    import subprocess
    import sys

    out = subprocess.run(
        [sys.executable, "-m", "phantora_assets.cli", "query", "select * from nowhere", "--data-dir", str(built)],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    assert out.returncode == 2
    assert "Catalog Error" in out.stderr and "nowhere" in out.stderr and "Traceback" not in out.stderr


def test_query_without_database(tmp_path, capsys) -> None:
    rc, out, err = query(tmp_path, "select 1", capsys=capsys)
    assert rc == 2 and out == "" and "no database" in err and "phantora-assets build" in err


def test_format_rows_table() -> None:
    text = format_rows(["a", "bb"], [(1, "x"), (None, "yy"), (2.5, None)], "table")
    assert text.splitlines() == ["   a  bb", "----  ----", "   1  x", "NULL  yy", " 2.5  NULL", "(3 rows)"]
    assert format_rows(["a"], [(float("nan"),)], "json") == '[\n {\n  "a": null\n }\n]\n'


# --------------------------------------------------------------------------- the database build
def test_rebuild_is_atomic_and_leaves_no_temporary_files(built, tmp_path) -> None:
    """A failed rebuild keeps the old database; a good one replaces it under an open reader."""
    import shutil

    root = tmp_path / "data"
    shutil.copytree(built, root, ignore=shutil.ignore_patterns("*.png", "timeline.json.gz", "raw_timeline.parquet"))
    paths = DataPaths(root)
    before = paths.duckdb_path.read_bytes()
    victim = next(iter(dataset_stage.run_status_rows(RUN_MATRIX, paths)[0].values())) / "windows.parquet"
    victim.write_bytes(b"not parquet")
    with pytest.raises(duckdb.Error):
        dataset_stage.dataset_duckdb_stage(RUN_MATRIX, paths)
    assert paths.duckdb_path.read_bytes() == before
    # no temporary file left (the dataset's generations folder, .phantora_v0.gens, is no temporary file)
    assert sorted(p.name for p in root.rglob("*") if p.name.endswith(".tmp")) == []
    shutil.copy(built / "partitions" / victim.parent.name / "windows.parquet", victim)
    with duckdb.connect(str(paths.duckdb_path), read_only=True) as reader:
        res = dataset_stage.dataset_duckdb_stage(RUN_MATRIX, paths)
        assert reader.execute("SELECT count(*) FROM runs").fetchone()[0] == len(res.build.included)
    assert res.outcome.passed, res.outcome.message
    assert sorted(os.listdir(root)) == sorted(os.listdir(built))


# --------------------------------------------------------------------------- plots
def png_size(data: bytes) -> tuple[int, int]:
    assert data[:8] == PNG_SIGNATURE and data[12:16] == b"IHDR"
    return int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")


@pytest.mark.parametrize("name", analysis.RUN_PLOTS)
def test_run_plots_are_pngs_of_the_expected_size(built, name: str) -> None:
    for run_id in (RUN, "phantora_a100_40g_W5_4x2"):
        data = (DataPaths(built).plots_dir(RUNS_BY_ID[run_id]) / f"{name}.png").read_bytes()
        assert len(data) > 5000
        assert png_size(data) == plots.SIZES[name]
        assert analysis.png_size(data) == plots.SIZES[name]


@pytest.mark.parametrize("name", analysis.DATASET_PLOTS)
def test_dataset_plots_are_pngs_of_the_expected_size(built, name: str) -> None:
    data = (DataPaths(built).dataset_plots_dir / f"{name}.png").read_bytes()
    assert len(data) > 5000 and png_size(data) == plots.SIZES[name]


def test_every_plot_renders_for_one_run(built, tmp_path) -> None:
    """Each plot function, called directly on one run's tables, writes the PNG it returns."""
    pdir = DataPaths(built).partition_dir(RUN)
    flows = pd.read_parquet(pdir / "flows.parquet")
    steps = pd.read_parquet(pdir / "steps.parquet")
    bins = pd.read_parquet(pdir / "flows_100ms.parquet")
    table = pd.read_parquet(pdir / "step_anatomy.parquet")
    spans = pd.read_parquet(pdir / "step_spans.parquet")
    step = int(spans.step.iloc[0])
    out = {
        "pair_heatmap": plots.pair_heatmap(plots.pair_matrix(flows, steps, 2), RUN, tmp_path / "a.png"),
        "timeseries": plots.timeseries(bins, RUN, 0.1, 0.07, path=tmp_path / "b.png"),
        "step_anatomy": plots.step_anatomy_chart(
            spans, table[table.step == step], RUN, step, 71000.0, path=tmp_path / "c.png"
        ),
    }
    for (name, data), f in zip(out.items(), ("a", "b", "c")):
        assert (tmp_path / f"{f}.png").read_bytes() == data
        assert png_size(data) == plots.SIZES[name]
    matrix = plots.pair_matrix(flows, steps, 2)
    assert matrix.sum() == pytest.approx(
        pd.read_csv(built / "phantora_v0" / "runs.csv").set_index("run_id").loc[RUN, "inter_node_bytes_per_step"]
    )


def test_plots_metadata_renders_in_the_ui(built) -> None:
    """A real materialization of run_plots: Markdown metadata with each PNG embedded, plus its path."""
    result = dg.materialize(
        d.ALL_ASSETS,
        selection=[d.ASSETS["run_plots"]],
        partition_key=RUN,
        resources={"data": DataRoot(data_dir=str(built)), "simulator": AnalyticSimulatorResource()},
        instance=ephemeral_with_runs([RUN]),
        run_config={"loggers": {"console": {"config": {"log_level": "CRITICAL"}}}},
    )
    assert result.success
    meta = result.asset_materializations_for_node("run_plots")[0].metadata
    for name in analysis.RUN_PLOTS:
        md = meta[name]
        assert isinstance(md, dg.MarkdownMetadataValue)
        b64 = md.value.split("data:image/png;base64,")[1].rstrip(")")
        assert png_size(base64.b64decode(b64)) == plots.SIZES[name]
        assert meta[f"{name}_path"].value.endswith(f"plots/{name}.png")


def test_published_figures_shipped_with_the_package() -> None:
    assert analysis.PUBLISHED_RUNS.read_bytes() == (DATA / "published_runs.csv").read_bytes()


# --------------------------------------------------------------------------- docs
def test_docs_document_features_and_views() -> None:
    features = (ROOT / "docs" / "WINDOW_FEATURES.md").read_text()
    assert feature_markdown() in features, (
        "docs/WINDOW_FEATURES.md's feature table is stale: paste lib.traffic.window_features.feature_markdown()"
    )
    views = (ROOT / "docs" / "QUERIES.md").read_text()
    assert views_markdown() in views, "docs/QUERIES.md's view list is stale: paste lib.store.database.views_markdown()"


def test_windows_csv_covers_every_run_with_the_feature_set(built, runs) -> None:
    wins = pd.read_csv(built / "phantora_v0" / "windows.csv")
    assert set(wins.run_id) == set(runs.index)
    assert wins.groupby(["run_id", "window_s"]).size().unstack().to_dict("list") == {
        1.0: [180] * len(runs),
        15.0: [12] * len(runs),
    }
    assert np.isfinite(wins[["total_bytes", "cv", "pair_entropy_bits", "top_pair_share"]]).all().all()


def test_database_rebuild_has_identical_contents(built, tmp_path) -> None:
    """phantora.duckdb is not byte-identical between rebuilds (README), but its contents are:
    every table's rows, every view's rows, and the comments."""
    import shutil

    copy = tmp_path / "data"
    shutil.copytree(built, copy, ignore=shutil.ignore_patterns("*.png", "traces"))
    shutil.copytree(built / "traces", copy / "traces", ignore=shutil.ignore_patterns("*.png", "*.json.gz"))
    (copy / "phantora.duckdb").unlink()
    dataset_stage.dataset_duckdb_stage(RUN_MATRIX, DataPaths(copy))

    def contents(path):
        with duckdb.connect(str(path), read_only=True) as c:
            names = [r[0] for r in c.execute("SELECT table_name FROM duckdb_tables() ORDER BY 1").fetchall()]
            names += [
                r[0] for r in c.execute("SELECT view_name FROM duckdb_views() WHERE NOT internal ORDER BY 1").fetchall()
            ]
            rows = {n: c.execute(f'SELECT * FROM "{n}" ORDER BY ALL').fetchall() for n in names}
            comments = c.execute(
                "SELECT table_name, comment FROM duckdb_tables() UNION ALL "
                "SELECT view_name, comment FROM duckdb_views() WHERE NOT internal ORDER BY 1"
            ).fetchall()
            cols = c.execute("SELECT table_name, column_name, comment FROM duckdb_columns() ORDER BY 1, 2").fetchall()
        return names, rows, comments, cols

    first, again = contents(built / "phantora.duckdb"), contents(copy / "phantora.duckdb")
    assert len(first[0]) >= 10
    assert first[0] == again[0]
    for name in first[0]:  # table by table, a short message (a diff of millions of rows would take hours)
        differ = [i for i, (a, b) in enumerate(zip(first[1][name], again[1][name])) if a != b][:1]
        assert len(first[1][name]) == len(again[1][name]) and not differ, (
            name,
            len(first[1][name]),
            len(again[1][name]),
            [first[1][name][i] for i in differ],
            [again[1][name][i] for i in differ],
        )
    assert first[2:] == again[2:]
