"""Issue 13, finding 7: host numbers and byte sums beyond int64 are named errors, never wrapped values.

Real traces, written by the project's writer (``write_chrome_trace``) from an analytic simulation
(tests/fixtures/run_folders.py) and edited to carry a host number beyond int64 or flows of ~2**59 bytes,
go through ``read_trace``, ``install_trace`` (the import's chrome_trace) and the
``validated_flows`` / ``binned_flows`` stages. Before the fix, ``host-99999999999999999999``
raised a raw ``OverflowError`` and the byte sums wrapped in int64, so ``flows_exist`` and
``bins_conserve_bytes`` passed on wrapped (even negative) totals.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from fixtures.run_folders import analytic

from phantora_assets.lib.errors import TraceFormatError
from phantora_assets.lib.phantora import trace_decode as td
from phantora_assets.lib.phantora.chrome_trace import read_trace, write_chrome_trace
from phantora_assets.lib.traffic.binning import build_bins, conservation_ok, exact_sum
from phantora_assets.paths import DataPaths
from phantora_assets.sources.phantora_run import install_trace
from phantora_assets.stages.flows import bin_flows, validate_flows

W1 = "phantora_a100_40g_W1_2x2"  # 2 hosts; a steady step of ~67 ms, 20 iterations
HUGE_HOST = "host-99999999999999999999"  # the host: k - 1 is beyond int64
INT64_MAX = 2**63 - 1


def _trace(tmp_path: Path, name: str, edit=None) -> Path:
    spec, raw, _ = analytic(W1)
    if edit is not None:
        raw = edit(raw)
    path = tmp_path / name
    write_chrome_trace(raw, path)
    return path


def _rehost(column: str, host: str, kind: str = "communication"):
    """Edit: the first event of ``kind`` whose ``column`` is host-2 gets ``host`` instead."""

    def edit(raw: pd.DataFrame) -> pd.DataFrame:
        i = raw.index[(raw["kind"] == kind) & (raw[column] == "host-2")][0]
        raw.loc[i, column] = host
        return raw

    return edit


def _scaled(factor: int):
    """Edit: every Communication event carries ``factor`` times its bytes and count (the ring rule
    still holds: bytes and counts scale together)."""

    def edit(raw: pd.DataFrame) -> pd.DataFrame:
        comm = raw["kind"] == "communication"
        raw.loc[comm, "bytes"] *= factor
        raw.loc[comm, "count"] *= factor
        return raw

    return edit


def _read_spying(path: Path, monkeypatch, **kwargs) -> tuple[pytest.ExceptionInfo, list]:
    """read_trace(path) that must raise a TraceFormatError; also the scanner's answers (None: declined)."""
    answers: list = []
    scanned = td.BatchDecoder._scanned

    def spy(self, res):
        out = scanned(self, res)
        answers.append(out is not None)
        return out

    monkeypatch.setattr(td.BatchDecoder, "_scanned", spy)
    with pytest.raises(TraceFormatError) as ei:
        read_trace(path, **kwargs)
    return ei, answers


# ---------------------------------------------------------------------------------------------
# host numbers
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "column,host,kind",
    [
        ("dst_host", HUGE_HOST, "communication"),
        ("src_host", HUGE_HOST, "communication"),
        ("src_host", HUGE_HOST, "computation"),  # a Computation event's hostname
        ("dst_host", "host-" + "9" * 5000, "communication"),  # beyond int()'s 4300-digit limit, too
        ("dst_host", f"host-{2**63 + 1}", "communication"),  # the first k whose node k - 1 overflows
    ],
    ids=["flow-dst", "flow-src", "computation", "5000-digits", "2**63+1"],
)
@pytest.mark.parametrize("path", ["scanner", "msgspec", "helper"])
def test_host_beyond_int64_is_a_named_error_on_every_decode_path(tmp_path, monkeypatch, column, host, kind, path):
    trace = _trace(tmp_path, "t.json.gz", _rehost(column, host, kind))
    if path == "msgspec":
        monkeypatch.setattr(td, "_tracescan", None)
    kwargs = {"workers": 1, "chunk_bytes": 64 << 10} if path == "helper" else {"workers": 0}
    ei, answers = _read_spying(trace, monkeypatch, **kwargs)
    assert ei.value.path == str(trace) and ei.value.rule == "host outside the layout", str(ei.value)
    assert f"{trace}: host outside the layout (host-{host[5:35]}" in str(ei.value)
    if path == "scanner" and td._tracescan is not None:
        assert answers and all(answers)  # the compiled scanner decoded the batch: the reader named it
    if path == "msgspec":
        assert answers == []  # every batch went through msgspec


def test_host_at_the_int64_bound_is_read_and_refused_by_the_layout(tmp_path):
    """k = 2**63 still has an int64 node (2**63 - 1): read_trace keeps it, install_trace (the
    chrome_trace of an imported or Docker run) refuses it against the run's 2 hosts, same rule."""
    trace = _trace(tmp_path, "edge.json.gz", _rehost("dst_host", f"host-{2**63}"))
    flows = read_trace(trace, workers=0).flows
    assert int(flows["dst_node"].max()) == INT64_MAX
    spec, _, _ = analytic(W1)
    for host in (f"host-{2**63}", HUGE_HOST):
        src = trace if host != HUGE_HOST else _trace(tmp_path, "huge.json.gz", _rehost("dst_host", HUGE_HOST))
        with pytest.raises(TraceFormatError) as ei:
            install_trace(spec, DataPaths(tmp_path / "data"), src, "test")
        assert ei.value.path == str(src) and ei.value.rule == "host outside the layout", str(ei.value)
    assert not DataPaths(tmp_path / "data").chrome_trace(spec).exists()  # nothing became visible


# ---------------------------------------------------------------------------------------------
# byte sums
# ---------------------------------------------------------------------------------------------


def _checks(paths: DataPaths, spec) -> dict:
    return json.loads((paths.run_folder(spec) / "checks.json").read_text())


def test_trace_bytes_beyond_int64_fail_flows_exist(tmp_path):
    """Flows of up to ~2**59 bytes (W1 x 2**28): the network bytes sum to ~2**65."""
    trace = _trace(tmp_path, "huge.json.gz", _scaled(2**28))
    flows = read_trace(trace, workers=0).flows
    net = flows[flows["src_node"] != flows["dst_node"]]
    assert 2**58 < int(net["bytes"].max()) < 2**59
    exact = sum(int(b) for b in net["bytes"])
    assert exact > INT64_MAX and int(net["bytes"].sum()) != exact  # an int64 sum wraps here
    spec, _, _ = analytic(W1)
    paths = DataPaths(tmp_path / "data")
    result = validate_flows(spec, paths, trace)
    exists = next(o for o in result.outcomes if o.name == "flows_exist")
    assert not exists.passed
    assert exists.message.startswith(f"{trace}: bytes beyond int64: the {len(net)} network flows carry {exact} bytes")
    assert exists.metadata["observed_network_bytes"] == exact
    assert result.path is None and not (paths.partition_dir(spec.run_id) / "flows.parquet").exists()
    assert _checks(paths, spec)["flows_exist"]["status"] == "failed"


def test_window_bytes_beyond_int64_fail_bins_conserve_bytes(tmp_path):
    """W1 x 2**20: the trace (~2**57 network bytes) passes every trace rule, but the 180 s window
    repeats its ~67 ms step ~2670 times: ~2**64 bytes, which no int64 sum holds."""
    trace = _trace(tmp_path, "big.json.gz", _scaled(2**20))
    spec, _, _ = analytic(W1)
    paths = DataPaths(tmp_path / "data")
    validated = validate_flows(spec, paths, trace)
    assert all(o.passed for o in validated.outcomes if o.severity != "warn"), [o.message for o in validated.outcomes]
    result = bin_flows(spec, paths)
    (outcome,) = result.outcomes
    assert outcome.name == "bins_conserve_bytes" and not outcome.passed
    assert outcome.message.startswith("bytes beyond int64: the window's placed flow bytes"), outcome.message
    expected = outcome.metadata["placed_flow_bytes"] + outcome.metadata["control_bytes"]
    assert expected > INT64_MAX and f"= {expected} exceed" in outcome.message
    assert result.path is None and not paths.table(spec.run_id, "flows_100ms").exists()
    assert _checks(paths, spec)["bins_conserve_bytes"]["status"] == "failed"


def test_wrapped_bins_do_not_conserve_bytes():
    """Two 0 us flows of 2**62 + 2**61 bytes per 50 ms step, one 100 ms bin: the int64 bin wraps
    (to a negative value), and an int64 sum of the bins still equals an int64 sum of the placed
    bytes, which is what conservation used to compare."""
    b = 2**62 + 2**61
    step_flows = pd.DataFrame(
        {"offset_us": [10.0, 10.0], "dur_us": [0.0, 0.0], "src_node": [0, 0], "dst_node": [1, 1], "bytes": [b, b]}
    )
    built = build_bins(step_flows, step_time_s=0.05, n_nodes=2, run_id="x", window_s=0.1, control_bytes_per_s=0)
    assert built.placed_flow_bytes == 4 * b  # exact: two repetitions in the window
    assert built.bins["bytes"].min() < 0  # wrapped
    assert (int(built.bins["bytes"].sum()) - built.placed_flow_bytes) % 2**64 == 0  # equal in int64 arithmetic
    assert not conservation_ok(built)
    v = np.array([b, b, -5, 7], np.int64)
    assert exact_sum(v) == 2 * b + 2 and exact_sum(v[:0]) == 0


def test_a_flow_longer_than_the_window_is_refused_before_binning(tmp_path):
    """Issue 13 (finding 4): a flow with dur 1e11 us passed every check, then binning ran for
    minutes. validated_flows now refuses it, naming the trace, the rule and the flow."""

    def edit(raw: pd.DataFrame) -> pd.DataFrame:
        i = raw.index[(raw["kind"] == "communication") & (raw["src_host"] != raw["dst_host"])][3]
        raw.loc[i, "end_ns"] = raw.loc[i, "start_ns"] + 10**14  # 1e11 us
        return raw

    trace = _trace(tmp_path, "long.json.gz", edit)
    spec, _, _ = analytic(W1)
    paths = DataPaths(tmp_path / "data")
    with pytest.raises(TraceFormatError, match=r"flow longer than the window \(1 flow\(s\) last longer than the 180 s"):
        validate_flows(spec, paths, trace)
    assert not (paths.partition_dir(spec.run_id) / "flows.parquet").exists()
