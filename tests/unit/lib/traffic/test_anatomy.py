"""Tests of phantora_assets.lib.traffic.anatomy: intervals, the step anatomy by hand, the compute-event reader."""

from __future__ import annotations

import gzip
import json

import numpy as np
import pandas as pd
import pytest

from phantora_assets.lib.columns import STEP_COLUMNS
from phantora_assets.lib.errors import TraceFormatError
from phantora_assets.lib.traffic import anatomy


def test_merge_intervals() -> None:
    s, e = anatomy.merge_intervals([5, 0, 2, 10, 12, 20], [7, 3, 4, 12, 15, 20])
    # [0,3) + [2,4) -> [0,4); [5,7); [10,12) + [12,15) touch -> [10,15); [20,20) is empty
    assert s.tolist() == [0, 5, 10] and e.tolist() == [4, 7, 15]
    s, e = anatomy.merge_intervals([], [])
    assert len(s) == 0 and len(e) == 0


def test_covered() -> None:
    s, e = np.array([0.0, 5.0, 10.0]), np.array([4.0, 7.0, 15.0])
    a = np.array([0.0, 3.0, 6.0, 16.0, -5.0])
    b = np.array([20.0, 6.0, 11.0, 30.0, 0.0])
    assert anatomy.covered(s, e, a, b).tolist() == [11.0, 2.0, 2.0, 0.0, 0.0]
    assert anatomy.covered(np.array([]), np.array([]), a, b).tolist() == [0.0] * 5


def _steps(bounds: list[tuple[float, float]], steady: list[bool]) -> pd.DataFrame:
    rows = [
        (i, a, b, b - a, s, s and i < len(bounds) - 1, 0, 0, "") for i, ((a, b), s) in enumerate(zip(bounds, steady))
    ]
    return pd.DataFrame(rows, columns=list(STEP_COLUMNS)).astype(STEP_COLUMNS)


def test_step_anatomy_by_hand() -> None:
    # two 100 us steps, two hosts
    steps = _steps([(0.0, 100.0), (100.0, 200.0)], [False, True])
    compute = pd.DataFrame(
        {
            "host": ["host-1", "host-1", "host-2", "host-1"],
            "ts_us": [0.0, 30.0, 0.0, 110.0],
            "dur_us": [40.0, 20.0, 50.0, 60.0],  # host-1 step 0: [0,50) (two overlapping kernels)
        }
    )
    flows = pd.DataFrame(
        {
            "ts_us": [40.0, 40.0, 150.0, 60.0],
            "dur_us": [30.0, 30.0, 40.0, 0.0],
            "src_node": [0, 1, 0, 0],
            "dst_node": [1, 0, 1, 0],  # the last one is loopback: not network
        }
    )
    t = anatomy.step_anatomy(steps, flows, compute)
    assert list(t.columns) == list(anatomy.ANATOMY_COLUMNS)
    r = t.set_index(["step", "host"])
    # host-1, step 0: C = [0,50), N = [40,70): overlap 10, exposed 20, idle 100 - 70 = 30
    h = r.loc[(0, "host-1")]
    assert (h.compute_us, h.comm_us, h.overlap_us, h.exposed_comm_us, h.idle_us) == (50, 30, 10, 20, 30)
    # host-2, step 0: C = [0,50), N = [40,70) (it receives the first flow and sends the second)
    h = r.loc[(0, "host-2")]
    assert (h.compute_us, h.comm_us, h.exposed_comm_us, h.idle_us) == (50, 30, 20, 30)
    # host-1, step 1: C = [110,170), N = [150,190): overlap 20, exposed 20, idle 100 - 80 = 20
    h = r.loc[(1, "host-1")]
    assert (h.compute_us, h.comm_us, h.overlap_us, h.exposed_comm_us, h.idle_us) == (60, 40, 20, 20, 20)
    assert bool(h.steady) and h.node == 0 and h.duration_us == 100
    # steps.timed carried over: step 1 is the last one (cut by the trace's end), steady but not timed
    assert t["timed"].tolist() == [False] * 4 and t["steady"].tolist() == [False, False, True, True]
    # host-2, step 1: no compute, receives [150,190)
    h = r.loc[(1, "host-2")]
    assert (h.compute_us, h.exposed_comm_us, h.idle_us) == (0, 40, 60)
    assert np.allclose(t.compute_us + t.exposed_comm_us + t.idle_us, t.duration_us)


def test_step_spans_are_relative_and_clipped() -> None:
    steps = _steps([(100.0, 200.0)], [True])
    compute = pd.DataFrame({"host": ["host-1"], "ts_us": [90.0], "dur_us": [30.0]})
    flows = pd.DataFrame({"ts_us": [150.0], "dur_us": [100.0], "src_node": [0], "dst_node": [1]})
    sp = anatomy.step_spans(steps.iloc[0], flows, compute, ["host-1", "host-2"])
    got = sorted(zip(sp.host, sp.kind, sp.start_us, sp.end_us))
    assert got == [
        ("host-1", "communication", 50.0, 100.0),
        ("host-1", "compute", 0.0, 20.0),
        ("host-2", "communication", 50.0, 100.0),
    ]


def _event(cat: str, ts: float, dur: float, host: str) -> dict:
    if cat == "Computation":
        args = {"Computation": [{"hostname": host, "pid": 7}, int(dur * 1000), {"Torch": {"time": 1}}]}
    else:
        args = {
            "Communication": [
                {"id": 0, "bytes": 8, "src": host, "dst": "host-2"},
                {"NcclAllReduce": {"count": 2, "dtype": "Bf16", "comm": {"rank": 0, "id": [1]}}},
            ]
        }
    return {"name": "x", "cat": cat, "ph": "X", "ts": ts, "dur": dur, "pid": 1, "tid": 1, "args": args}


EVENTS = [
    _event("Communication", 0, 5, "host-1"),
    _event("Computation", 1.5, 2.25, "host-1"),
    _event("Computation", 3, 1, "host-2"),
    _event("Communication", 4, 1, "host-2"),
]


@pytest.mark.parametrize("layout", ["visualizer", "one_line"])
@pytest.mark.parametrize("compress", [True, False])
def test_read_compute_events(tmp_path, layout: str, compress: bool) -> None:
    if layout == "visualizer":
        text = "[\n" + ",\n".join(json.dumps(e, separators=(",", ":")) for e in EVENTS) + "\n]"
    else:
        text = json.dumps(EVENTS)
    path = tmp_path / ("t.json.gz" if compress else "t.json")
    path.write_bytes(gzip.compress(text.encode()) if compress else text.encode())
    got = anatomy.read_compute_events(path)
    assert list(got.columns) == list(anatomy.COMPUTE_EVENT_COLUMNS)
    assert got.values.tolist() == [["host-1", 1.5, 2.25], ["host-2", 3.0, 1.0]]


def test_read_compute_events_names_file_and_line(tmp_path) -> None:
    lines = [json.dumps(e, separators=(",", ":")) for e in EVENTS]
    lines[2] = lines[2][:40]  # a truncated Computation event on line 4
    path = tmp_path / "bad.json"
    path.write_text("[\n" + ",\n".join(lines) + "\n]")
    with pytest.raises(TraceFormatError, match=r"bad\.json.*invalid JSON.*line 4"):
        anatomy.read_compute_events(path)


def test_hosts_and_nodes() -> None:
    assert anatomy.node_of("host-3") == 2
    with pytest.raises(ValueError):
        anatomy.node_of("gpu-1")
    flows = pd.DataFrame({"src_node": [0], "dst_node": [2]})
    compute = pd.DataFrame({"host": ["host-2"]})
    assert anatomy.hosts_of(flows, compute) == ["host-1", "host-2", "host-3"]
    assert anatomy.hosts_of(flows, compute, n_nodes=4) == ["host-1", "host-2", "host-3", "host-4"]


def test_run_anatomy_view_averages_timed_steps_only() -> None:
    """The database's run_anatomy view: times over the timed steady steps (the last step, cut by the trace's
    end at 3.42 ms beside 10.48 ms ones, is counted as steady but not averaged; issue 38 item 3.3)."""
    import duckdb

    from phantora_assets.lib.store.database import VIEWS

    (view,) = [v for v in VIEWS if v.name == "run_anatomy"]
    rows = [
        ("r", s, s > 0, timed, "host-1", 0, 0.0, t, c, 0.0, 0.0, 0.0, t - c)
        for s, timed, t, c in (
            (0, False, 12_000.0, 6_000.0),
            (1, True, 10_480.0, 6_000.0),
            (2, True, 10_480.0, 8_000.0),
            (3, False, 3_420.0, 3_000.0),
        )
    ]
    cols = ["run_id", *anatomy.ANATOMY_COLUMNS]
    frame = pd.DataFrame(rows, columns=cols)  # noqa: F841 (read by DuckDB by name)
    with duckdb.connect() as con:
        con.execute("CREATE TABLE step_anatomy AS SELECT * FROM frame")
        con.execute("CREATE TABLE runs AS SELECT 'r' AS run_id, 0.01048 AS step_time_s")
        con.execute(f"CREATE VIEW run_anatomy AS {view.sql}")
        got = con.execute("SELECT n_steady_steps, n_timed_steps, step_time_ms, compute_ms FROM run_anatomy").fetchone()
    assert got == (3, 2, pytest.approx(10.48), pytest.approx(7.0))


def test_run_anatomy_step_time_is_the_runs_step_time() -> None:
    """Issue 39 item 18: one step time a run. run_anatomy's step_time_ms was the median of its own rows'
    durations over the timed steps (outliers in, the typical-step rule of lib/traffic/steps not applied);
    it is runs.step_time_s now, whatever the rows' durations: three timed steps of 10, 10 and 40 ms
    (median 10, mean 20) beside a run whose step time is 10.2 ms give 10.2."""
    import duckdb

    from phantora_assets.lib.store.database import VIEWS

    (view,) = [v for v in VIEWS if v.name == "run_anatomy"]
    rows = [("r", s, True, True, "host-1", 0, 0.0, t, 0.0, 0.0, 0.0, 0.0, t) for s, t in ((1, 1e4), (2, 1e4), (3, 4e4))]
    frame = pd.DataFrame(rows, columns=["run_id", *anatomy.ANATOMY_COLUMNS])  # noqa: F841 (read by DuckDB)
    assert "duration_us" in anatomy.ANATOMY_COLUMNS and "step_time_us" not in anatomy.ANATOMY_COLUMNS
    with duckdb.connect() as con:
        con.execute("CREATE TABLE step_anatomy AS SELECT * FROM frame")
        con.execute("CREATE TABLE runs AS SELECT 'r' AS run_id, 0.0102 AS step_time_s")
        con.execute(f"CREATE VIEW run_anatomy AS {view.sql}")
        assert con.execute("SELECT step_time_ms FROM run_anatomy").fetchone()[0] == pytest.approx(10.2)
