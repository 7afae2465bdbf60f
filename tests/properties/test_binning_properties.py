"""Properties of the binning (lib/traffic/binning.py, DATASET.md sections 4 and 5): bytes are conserved at
any bin size and phase, and repeated flows place as each flow alone."""

from __future__ import annotations

import numpy as np
from fixtures.bin_flows import build_alone, control_total, flows
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from phantora_assets.lib.traffic.binning import build_bins, conservation_ok


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    data=st.data(),
    n_nodes=st.integers(1, 4),
    step_ms=st.integers(1, 900),
    n_bins=st.sampled_from([1, 2, 3, 4, 5, 6, 8, 10, 12, 15, 20, 24, 30]),
    jitter=st.sampled_from([0.0, 0.02, 0.3]),
    run_id=st.text(min_size=1, max_size=12),
)
def test_conservation_property(data, n_nodes, step_ms, n_bins, jitter, run_id) -> None:
    window_ms = 1200  # every bin length 1200 / n_bins ms divides the window
    bin_ms = window_ms // n_bins
    n_flows = data.draw(st.integers(0, 12)) if n_nodes > 1 else 0
    rows = []
    for _ in range(n_flows):
        src = data.draw(st.integers(0, n_nodes - 1))
        dst = (src + data.draw(st.integers(1, n_nodes - 1))) % n_nodes
        rows.append(
            (
                data.draw(st.floats(0, 2 * step_ms * 1000, allow_nan=False)),
                data.draw(st.one_of(st.just(0.0), st.floats(0, 3_000_000, allow_nan=False))),
                src,
                dst,
                data.draw(st.integers(0, 10**12)),
            )
        )
    r = build_bins(
        flows(rows),
        step_time_s=step_ms / 1000,
        n_nodes=n_nodes,
        run_id=run_id,
        window_s=window_ms / 1000,
        bin_s=bin_ms / 1000,
        jitter=jitter,
        control_bytes_per_s=1000,
    )
    assert conservation_ok(r)
    assert (r.bins["bytes"] >= 0).all()
    assert len(r.bins) == n_bins * n_nodes * (n_nodes - 1)
    assert r.control_bytes == control_total(n_nodes, 1000, window_ms * 1_000_000)


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    data=st.data(),
    n_nodes=st.integers(2, 5),
    bin_us=st.integers(1, 250_000),  # any bin size (whole microseconds)
    n_bins=st.integers(1, 40),
    step_us=st.integers(1, 2_000_000),
    jitter=st.sampled_from([0.0, 0.02, 0.5]),
    control=st.sampled_from([0, 1_000_000, 5_000_000]),
)
def test_conservation_property_any_bin_size(data, n_nodes, bin_us, n_bins, step_us, jitter, control) -> None:
    """Random flows (zero-length, longer than a step or the whole window, huge byte counts)
    and any bin size: the bins hold exactly the placed flow bytes plus the control bytes."""
    rows = []
    for _ in range(data.draw(st.integers(0, 15))):
        src = data.draw(st.integers(0, n_nodes - 1))
        dst = (src + data.draw(st.integers(1, n_nodes - 1))) % n_nodes
        rows.append(
            (
                data.draw(st.floats(0, 3 * step_us, allow_nan=False)),
                data.draw(st.one_of(st.just(0.0), st.floats(0, 5 * step_us + bin_us * n_bins, allow_nan=False))),
                src,
                dst,
                data.draw(st.one_of(st.integers(0, 10), st.integers(0, 2**50))),
            )
        )
    r = build_bins(
        flows(rows),
        step_time_s=step_us / 1e6,
        n_nodes=n_nodes,
        run_id="prop",
        window_s=bin_us * n_bins / 1e6,
        bin_s=bin_us / 1e6,
        jitter=jitter,
        control_bytes_per_s=control,
    )
    assert conservation_ok(r)
    assert sum(map(int, r.bins["bytes"])) == r.placed_flow_bytes + r.control_bytes  # past int64 as a whole
    assert (r.bins["bytes"] >= 0).all()
    assert len(r.bins) == n_bins * n_nodes * (n_nodes - 1)
    assert r.control_bytes == control_total(n_nodes, control, bin_us * n_bins * 1000)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    data=st.data(),
    n_nodes=st.integers(2, 5),
    bin_ms=st.sampled_from([1, 10, 100]),
    step_us=st.integers(1_000, 400_000),
    jitter=st.sampled_from([0.0, 0.02, 0.3]),
)
def test_repeated_flows_place_as_each_flow_alone(data, n_nodes, bin_ms, step_us, jitter) -> None:
    """Flows that share offset, duration and bytes, on one pair or on many (a ring's every hop), are
    split once (lib/bins/place.py): the bins are the sum of building each flow on its own, to the byte."""
    shape = st.tuples(
        st.floats(0, 2 * step_us, allow_nan=False),
        st.one_of(st.just(0.0), st.floats(0, 3 * step_us, allow_nan=False)),
        st.one_of(st.integers(0, 10), st.integers(0, 2**40)),
    )
    shapes = data.draw(st.lists(shape, min_size=1, max_size=3))
    rows = []
    for _ in range(data.draw(st.integers(1, 14))):
        offset, dur, nbytes = shapes[data.draw(st.integers(0, len(shapes) - 1))]
        src = data.draw(st.integers(0, n_nodes - 1))
        rows.append((offset, dur, src, (src + data.draw(st.integers(1, n_nodes - 1))) % n_nodes, nbytes))
    kw = dict(step_time_s=step_us / 1e6, n_nodes=n_nodes, run_id="dup", window_s=1.2, bin_s=bin_ms / 1000)
    kw.update(jitter=jitter, control_bytes_per_s=0)
    full = build_bins(flows(rows), **kw)
    matrix, placed = build_alone(rows, **kw)
    assert np.array_equal(full.matrix, matrix)
    assert full.placed_flow_bytes == placed
    assert conservation_ok(full)
