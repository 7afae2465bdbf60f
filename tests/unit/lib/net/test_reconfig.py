"""The reconfiguration analysis (lib/net/reconfig.py): phases and transition windows on a generated flows
table with known windows, and the sweep's stalls against the formula (by hand and over drawn tables)."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from phantora_assets.lib.net import reconfig as rc


def _flows(rows: list[tuple]) -> pd.DataFrame:
    """(step, start ms, end ms, src host, dst host, group[, network]) rows, one NIC a host, 1000 bytes each."""
    r = [(*x, True) if len(x) == 6 else x for x in rows]
    return pd.DataFrame(
        {
            "step": [x[0] for x in r],
            "ts_us": [x[1] * 1000.0 for x in r],
            "dur_us": [(x[2] - x[1]) * 1000.0 for x in r],
            "src_node": [x[3] for x in r],
            "src_nic": [0] * len(r),
            "dst_node": [x[4] for x in r],
            "dst_nic": [0] * len(r),
            "group": [x[5] for x in r],
            "network": [x[6] for x in r],
            "bytes": [1000] * len(r),
        }
    )


FLOWS = _flows(
    [
        (0, -50, -40, 0, 1, "pp"),  # warm-up step: its own transitions are dropped
        (1, 0, 10, 0, 1, "dp"),
        (1, 5, 12, 1, 0, "dp"),  # same phase: dp [0, 12]
        (1, 6, 7, 0, 1, "tp", False),  # inside the scale-up domain: on no NIC
        (1, 20, 25, 0, 1, "pp"),  # window 8 ms
        (1, 30, 31, 0, 1, "pp"),  # same pp phase [20, 31]
        (1, 31, 40, 0, 1, "dp"),  # window 0
        (1, 38, 45, 0, 1, "ep"),  # overlaps the dp phase: window 0
        (2, 100, 110, 0, 1, "dp"),  # window 55 ms, in step 2
        # host-3 -> host-4: five back-to-back transitions in step 1 (1 ms, then 0 ms windows)
        (1, 0, 1, 2, 3, "dp"),
        (1, 2, 3, 2, 3, "pp"),
        (1, 3, 4, 2, 3, "dp"),
        (1, 4, 5, 2, 3, "pp"),
        (1, 5, 6, 2, 3, "dp"),
        (1, 6, 7, 2, 3, "pp"),
    ]
)
STEPS = pd.DataFrame({"step": [1, 2], "step_time_s": [0.1, 0.1], "compute_s": [0.06, 0.08]})


def _transitions() -> pd.DataFrame:
    return rc.transition_windows(rc.nic_phases(FLOWS, 1, "r"), {1, 2}, "r")


def test_phases_of_a_generated_trace():
    ph = rc.nic_phases(FLOWS, 1, "r")
    h1 = ph[ph["nic"] == "host-1"]
    assert h1["group"].tolist() == ["pp", "dp", "pp", "dp", "ep", "dp"]
    assert h1["start_s"].round(6).tolist() == [-0.05, 0.0, 0.02, 0.031, 0.038, 0.1]
    assert h1["end_s"].round(6).tolist() == [-0.04, 0.012, 0.031, 0.04, 0.045, 0.11]
    assert h1["n_flows"].tolist() == [1, 2, 2, 1, 1, 1] and h1["bytes"].tolist() == [1000, 2000, 2000, 1000, 1000, 1000]
    cols = ["group", "start_s", "end_s"]
    assert ph[ph["nic"] == "host-2"][cols].reset_index(drop=True).equals(h1[cols].reset_index(drop=True))
    assert "tp" not in set(ph["group"])


def test_transition_windows_are_the_known_ones():
    t = _transitions()
    h1 = t[t["nic"] == "host-1"]
    assert list(zip(h1["step"], h1["from_group"], h1["to_group"], h1["window_s"].round(9))) == [
        (1, "pp", "dp", 0.04),  # the warm-up step's last phase -> step 1's first: counted in step 1
        (1, "dp", "pp", 0.008),
        (1, "pp", "dp", 0.0),
        (1, "dp", "ep", 0.0),
        (2, "ep", "dp", 0.055),
    ]
    h3 = t[t["nic"] == "host-3"]
    assert h3["window_s"].round(9).tolist() == [0.001, 0.0, 0.0, 0.0, 0.0] and set(h3["step"]) == {1}
    assert list(t.columns) == list(rc.TRANSITION_COLUMNS) and len(t) == 2 * 5 + 2 * 5
    cdf = rc.window_cdf(t)
    assert sorted(cdf) == ["dp->ep", "dp->pp", "ep->dp", "pp->dp"]
    w, p = cdf["dp->pp"]
    assert w.round(9).tolist() == [0.0, 0.0, 0.0, 0.0, 0.001, 0.001, 0.008, 0.008] and p[-1] == 1.0


def test_sweep_by_hand_at_10_ms():
    sw = rc.reconfig_sweep(_transitions(), STEPS, "r", delays_ms=(0, 10))
    got = {
        (m, d): (s, t, u)
        for d, m, s, t, u in zip(sw["delay_ms"], sw["mode"], sw["stall_s"], sw["step_time_s"], sw["utilisation"])
    }
    # on demand: step 1 host-1 4 x 10 ms, host-3 5 x 10 ms -> 50 ms (the most stalled NIC); step 2: 10 ms
    s, t, u = got[("on_demand", 10)]
    assert s == pytest.approx(0.030) and t == pytest.approx(0.130) and u == pytest.approx(0.14 / 0.26)
    # provisioned: host-1 0 + 2 + 10 + 10 = 22 ms, host-3 9 + 4 x 10 = 49 ms -> 49; step 2: max(0, 10 - 55) = 0
    s, t, u = got[("provisioned", 10)]
    assert s == pytest.approx(0.0245) and t == pytest.approx(0.1245) and u == pytest.approx(0.14 / 0.249)
    assert got[("on_demand", 0)] == got[("provisioned", 0)] == (0.0, pytest.approx(0.1), pytest.approx(0.7))
    assert list(sw.columns) == list(rc.SWEEP_COLUMNS)


def test_full_sweep_shape_and_order():
    sw = rc.reconfig_sweep(_transitions(), STEPS, "r")
    assert sw["delay_ms"].tolist() == [d for d in rc.DELAYS_MS for _ in rc.MODES]
    assert sw["mode"].tolist() == list(rc.MODES) * len(rc.DELAYS_MS)
    od, pv = sw[sw["mode"] == "on_demand"], sw[sw["mode"] == "provisioned"]
    assert (np.diff(od["stall_s"]) >= 0).all() and (pv["stall_s"].to_numpy() <= od["stall_s"].to_numpy()).all()


@settings(derandomize=True, max_examples=60, deadline=None)
@given(
    st.lists(
        st.tuples(st.integers(1, 3), st.integers(0, 3), st.floats(0, 0.3, allow_nan=False)),
        min_size=0,
        max_size=25,
    ),
    st.sampled_from(rc.DELAYS_MS),
)
def test_sweep_stall_is_the_formula(rows, delay_ms):
    """Stall of a step = max over NICs of sum_i max(0, D - w_i) (provisioned) or n_i D (on demand)."""
    t = pd.DataFrame(
        {
            "run_id": "r",
            "step": [r[0] for r in rows],
            "nic": [f"host-{r[1] + 1}" for r in rows],
            "from_group": "dp",
            "to_group": "pp",
            "window_s": [r[2] for r in rows],
        },
        columns=list(rc.TRANSITION_COLUMNS),
    )
    steps = pd.DataFrame({"step": [1, 2, 3], "step_time_s": [1.0, 2.0, 3.0], "compute_s": [0.5, 1.0, 1.5]})
    sw = rc.reconfig_sweep(t, steps, "r", delays_ms=(delay_ms,))
    d = delay_ms / 1000
    for mode in rc.MODES:
        per_step = []
        for s in (1, 2, 3):
            nic_sum = {}
            for step, nic, w in rows:
                if step == s:
                    nic_sum[nic] = nic_sum.get(nic, 0.0) + (d if mode == "on_demand" else max(0.0, d - w))
            per_step.append(max(nic_sum.values(), default=0.0))
        row = sw[sw["mode"] == mode].iloc[0]
        assert row["stall_s"] == pytest.approx(sum(per_step) / 3)
        assert row["utilisation"] == pytest.approx(3.0 / (6.0 + sum(per_step)))


def test_refusals():
    with pytest.raises(ValueError, match="outside tp, cp, ep, dp, pp, other"):
        rc.nic_phases(FLOWS.assign(group="data"), 1, "r")
    with pytest.raises(ValueError, match="no steady step"):
        rc.reconfig_sweep(_transitions(), STEPS.iloc[:0], "r")
    with pytest.raises(ValueError, match="unknown mode"):
        rc.step_stalls(_transitions(), 0.01, "eager")


def test_empty_tables_keep_their_text_columns_typed(tmp_path):
    """A run with no transition writes a table the database fills beside another run's: its text columns are
    strings, not Parquet's null type (DuckDB refuses to cast the next file's strings to it)."""
    import duckdb

    from phantora_assets.lib.store import database
    from phantora_assets.lib.store.parquet import write_parquet
    from phantora_assets.stages.reconfig import database_tables

    empty = rc.transition_windows(rc.nic_phases(FLOWS.iloc[:0], 1, "a"), {1}, "a")
    full = _transitions()
    dirs = {"a": tmp_path / "a", "b": tmp_path / "b"}
    for run_id, table in (("a", empty), ("b", full)):
        write_parquet(table, dirs[run_id] / "transition_windows.parquet", columns=rc.TRANSITION_COLUMNS)
    (t,) = [t for t in database_tables() if t.name == "transition_windows"]
    with duckdb.connect() as con:
        ddl = ", ".join(f"{c} {database._sql_type(d)}" for c, d in t.columns.items())
        con.execute(f"CREATE TABLE transition_windows ({ddl})")
        database._fill(con, t, dirs, {})
        (n,) = con.execute("select count(*) from transition_windows").fetchone() or (0,)
    assert len(empty) == 0 and n == len(full) == 20


# A step's end: the pipeline's sends (pp), then at one instant the zero-length scalar all-reduces of the
# loss over DP and of the gradient norm over DP and over PP, both directions of each (issue 38 item 3.1).
SIMULTANEOUS = [
    (1, 0, 10, 0, 1, "dp"),
    (1, 12, 15, 0, 1, "pp"),
    (1, 20, 20, 0, 1, "dp"),  # loss
    (1, 20, 20, 1, 0, "dp"),
    (1, 20, 20, 0, 1, "dp"),  # gradient norm over DP
    (1, 20, 20, 1, 0, "dp"),
    (1, 20, 20, 0, 1, "pp"),  # gradient norm over PP
    (1, 20, 20, 1, 0, "pp"),
    (2, 30, 40, 0, 1, "pp"),
]


def test_simultaneous_flows_continue_the_current_phase_whatever_the_row_order():
    """Flows starting at one instant: the current phase's group continues first, then the others; the
    phases and windows do not depend on the rows' order (by hand: dp [0, 10], pp [12, 20], dp [20, 20],
    pp [30, 40]; windows 2, 0, 10 ms)."""
    rng = np.random.default_rng(38)
    orders = [list(range(9)), list(range(8, -1, -1))] + [list(rng.permutation(9)) for _ in range(60)]
    for order in orders:
        ph = rc.nic_phases(_flows([SIMULTANEOUS[i] for i in order]), 1, "r")
        for nic in ("host-1", "host-2"):
            p = ph[ph["nic"] == nic]
            assert p["group"].tolist() == ["dp", "pp", "dp", "pp"], order
            assert p["start_s"].round(9).tolist() == [0.0, 0.012, 0.02, 0.03]
            assert p["end_s"].round(9).tolist() == [0.01, 0.02, 0.02, 0.04]
            assert p["n_flows"].tolist() == [1, 3, 4, 1] and p["step"].tolist() == [1, 1, 1, 2]
        t = rc.transition_windows(ph, {1, 2}, "r")
        got = t[t["nic"] == "host-1"]
        assert list(zip(got["step"], got["from_group"], got["to_group"], got["window_s"].round(9))) == [
            (1, "dp", "pp", 0.002),
            (1, "pp", "dp", 0.0),
            (2, "dp", "pp", 0.01),
        ]


def test_simultaneous_groups_without_the_current_one_take_the_fixed_order():
    """At an instant the current group is not at, the groups come in GROUPS' order (dp before pp), and the
    next instant continues the last of them: tp, then {pp, dp} at 10 ms, then pp -> 3 transitions."""
    rows = [(1, 0, 5, 0, 1, "tp"), (1, 10, 10, 0, 1, "pp"), (1, 10, 10, 1, 0, "dp"), (1, 12, 14, 0, 1, "pp")]
    for order in ([0, 1, 2, 3], [3, 2, 1, 0], [2, 0, 3, 1]):
        ph = rc.nic_phases(_flows([rows[i] for i in order]), 1, "r")
        p = ph[ph["nic"] == "host-1"]
        assert p["group"].tolist() == ["tp", "dp", "pp"] and p["end_s"].round(9).tolist() == [0.005, 0.01, 0.014]


def test_a_window_is_time_with_no_flow_of_any_group_on_the_nic():
    """An earlier phase's flow still on the NIC is not idle time (issue 38 item 3.2). host-1: dp [0, 100],
    pp [10, 20], then dp at 50 (the dp flow of [0, 100] is still on: window 0, was 30 ms), tp at 150
    (window 150 - 100 = 50 ms, was 150 - 60 = 90 ms), pp at 160 after tp [150, 155] (window 5 ms)."""
    rows = [
        (1, 0, 100, 0, 1, "dp"),
        (1, 10, 20, 0, 1, "pp"),
        (1, 50, 60, 0, 1, "dp"),
        (1, 150, 155, 0, 1, "tp"),
        (1, 160, 170, 0, 1, "pp"),
        (2, 300, 310, 0, 1, "dp"),  # a second NIC's phases do not carry the first's busy end
        (2, 400, 410, 2, 3, "dp"),
        (2, 420, 430, 2, 3, "pp"),
    ]
    t = rc.transition_windows(rc.nic_phases(_flows(rows), 1, "r"), {1, 2}, "r")
    h1 = t[t["nic"] == "host-1"]
    assert list(zip(h1["from_group"], h1["to_group"], h1["window_s"].round(9))) == [
        ("dp", "pp", 0.0),
        ("pp", "dp", 0.0),
        ("dp", "tp", 0.05),
        ("tp", "pp", 0.005),
        ("pp", "dp", 0.13),
    ]
    assert t[t["nic"] == "host-3"]["window_s"].round(9).tolist() == [0.01]
    # provisioned at 10 ms: step 1 host-1 stalls 10 + 10 + 0 + 5 = 25 ms (was 10 + 0 + 0 + 5 = 15 ms)
    assert rc.step_stalls(t, 0.010, "provisioned").round(9).to_dict() == {1: 0.025, 2: 0.0}


def test_the_step_cut_by_the_trace_end_is_no_step_time():
    """Issue 38 item 3.3: step_anatomy rows of a run whose steady steps 1, 2 last 10.48 ms and whose last,
    step 3, is cut by the trace's end at 3.42 ms (steady, not timed). The sweep's step time is the timed
    steps' (10.48 ms at 0 ms delay; 8.127 ms with step 3 averaged in), utilisation the timed steps' compute
    over their time (2 hosts: 6 and 8 ms of compute, 7 ms a step -> 14 / 20.96)."""
    from phantora_assets.stages.reconfig import steady_step_times

    rows = []
    for step, t_ms, timed in ((0, 12.0, False), (1, 10.48, True), (2, 10.48, True), (3, 3.42, False)):
        for node, c_ms in ((0, 6.0), (1, 8.0)):
            rows.append((step, step > 0, timed, f"host-{node + 1}", node, t_ms * 1e3, min(c_ms, t_ms) * 1e3))
    anat = pd.DataFrame(rows, columns=["step", "steady", "timed", "host", "node", "duration_us", "compute_us"])
    times = steady_step_times(anat)
    assert times["step"].tolist() == [1, 2]
    sw = rc.reconfig_sweep(rc.transition_windows(rc.nic_phases(FLOWS.iloc[:0], 1, "r"), {1, 2}, "r"), times, "r")
    row = sw[(sw["delay_ms"] == 0) & (sw["mode"] == "on_demand")].iloc[0]
    assert row["step_time_s"] == pytest.approx(0.01048) and row["utilisation"] == pytest.approx(14 / 20.96)
    with pytest.raises(ValueError, match="no 'timed' column"):
        steady_step_times(anat.drop(columns="timed"))


def test_a_scoped_runs_hosts_compute_is_weighed_by_the_hosts_they_stand_for():
    """Issue 37: a timeline of scope one rank a stage holds the compute of some hosts whole, each standing for
    the hosts with that very compute (simulation.json compute_hosts). 4 hosts, host-1 (6 ms) for hosts 1-3,
    host-4 (10 ms) for itself: the hosts' mean is (3 x 6 + 10) / 4 = 7 ms, not the reported hosts' 8 ms. Counts
    short of the run's hosts: no sweep, and the rule says why."""
    from phantora_assets.lib.workload.collectives import run_spec_of
    from phantora_assets.stages.reconfig import steady_step_times, sweep_rule

    rows = [(1, True, True, h, node, 20e3, c) for h, node, c in (("host-1", 0, 6e3), ("host-4", 3, 10e3))]
    anat = pd.DataFrame(rows, columns=["step", "steady", "timed", "host", "node", "duration_us", "compute_us"])
    assert steady_step_times(anat)["compute_s"].tolist() == [pytest.approx(0.008)]
    assert steady_step_times(anat, {"host-1": 3, "host-4": 1})["compute_s"].tolist() == [pytest.approx(0.007)]
    with pytest.raises(ValueError, match="compute_hosts does not"):
        steady_step_times(anat, {"host-1": 3})
    model = {"kind": "dense", "layers": 4, "hidden": 256, "ffn_hidden": 512, "heads": 4, "kv_heads": 2, "vocab": 1000}
    table = {
        "framework": "megatron",
        "model": model,
        "parallel": {"tp": 1, "pp": 2},
        "train": {"seq_len": 256, "micro_batch": 1, "grad_accumulation": 2},
    }
    spec = run_spec_of(table, 4, 2, "h100", "w")
    assert sweep_rule(spec, None) is None and sweep_rule(spec, {"host-1": 2, "host-3": 2}) is None
    why = sweep_rule(spec, {"host-1": 1})
    assert why is not None and "holds the compute of 1 of the run's 4 hosts" in why


def test_the_sweeps_step_time_at_no_delay_is_the_runs_step_time():
    """Issue 39 item 18: a run had three step times; the sweep's was the mean of the timed steps. Four
    timed steps of 10 ms and a checkpoint step of 30 ms: the run's step time (runs.step_time_s, the
    median of the typical timed steps: the 30 ms one is an outlier, more than 10 % off) is 10 ms, the
    mean 14 ms. The sweep at 0 ms delay says 10 ms now; its utilisation stays the ratio of the sums."""
    steps = pd.DataFrame(
        {"step": [1, 2, 3, 4, 5], "step_time_s": [0.01] * 4 + [0.03], "compute_s": [0.005] * 4 + [0.025]}
    )
    empty = rc.transition_windows(rc.nic_phases(FLOWS.iloc[:0], 1, "r"), {1, 2, 3, 4, 5}, "r")
    sw = rc.reconfig_sweep(empty, steps, "r", delays_ms=(0,))
    assert sw["step_time_s"].tolist() == [pytest.approx(0.01)] * 2
    assert sw["utilisation"].tolist() == [pytest.approx(0.045 / 0.07)] * 2
