"""The optical rail in the simulator (lib/net/optical.py, lib/sim/analytic.py): hand-built DAGs with
closed-form times, and the run-matrix rules of ``reconfig``.

The DAG: two hosts of two GPUs on RailOptimized (a NIC a GPU, 400 Gb/s = 50 bytes/ns; the GPUs of a host
are one scale-up domain), ranks 0 and 2 on rail 0 (both NIC 0). A chain of point-to-point calls from
rank 0 to rank 2 alternating between a ``dp`` and a ``pp`` communicator of the same two ranks, each of
B bytes, optionally with a compute item of C ns between consecutive calls. With nothing else on the
network a call takes B / 50 ns, so the EPS chain takes K·B/50 + (K-1)·C, and:

* on demand: every change of group stalls D (the port has drained: the previous call ended), so the
  chain takes EPS + (K-1)·D (here each pair of calls is a "step": 2·D a step);
* provisioned: the port switches as soon as the previous call ends, so with C >= D nothing stalls
  (EPS exactly), and with C < D each change stalls D - C.
"""

from __future__ import annotations

import numpy as np
import pytest
from fixtures.optical_rails import T_CALL, B, D, rail_sim

from phantora_assets.lib.net.fabric import build_fabric
from phantora_assets.lib.net.optical import OpticalConfig, reconfig_rule, reconfig_tail
from phantora_assets.lib.run.catalog import presets
from phantora_assets.lib.sim.analytic import AnalyticSimulator
from phantora_assets.lib.sim.workload_types import Communicator, Compute, SendRecv


def _chain(k_calls: int, compute_ns: float, small: int = 0):
    """Nodes: call, [compute], call, ... alternating dp / pp; ``small``: bytes of an extra tiny dp call
    after every pp call (a control scalar)."""
    comms = [Communicator("dp0", "dp", (0, 2)), Communicator("pp0", "pp", (0, 2))]
    kind, dur, who, what = [], [], [], []
    for i in range(k_calls):
        if i and compute_ns:
            kind.append(0)
            dur.append(compute_ns)
            who.append(0)
            what.append(Compute("c", 0.0, 0.0, "fwd"))
        kind.append(1)
        dur.append(0.0)
        who.append(i % 2)
        what.append(SendRecv("dp" if i % 2 == 0 else "pp", ((0, 1),), B // 2, "Bf16", f"t{i}"))
        if small and i % 2 == 1:
            kind.append(1)
            dur.append(0.0)
            who.append(0)
            what.append(SendRecv("dp", ((0, 1),), small // 4, "F32", f"s{i}"))
    n = len(kind)
    dependents = [[i + 1] if i + 1 < n else [] for i in range(n)]
    deps_left = [0] + [1] * (n - 1)
    return kind, dur, who, what, dependents, deps_left, comms


def _end(sim: AnalyticSimulator, k_calls: int, compute_ns: float, small: int = 0) -> float:
    start, end, *_ = sim._event_loop(*_chain(k_calls, compute_ns, small))
    assert sim.unfinished == 0
    return float(np.max(end))


@pytest.mark.parametrize("k_calls", [2, 4, 6])
def test_eps_chain_is_calls_back_to_back(k_calls):
    assert _end(rail_sim(None), k_calls, 0) == pytest.approx(k_calls * T_CALL, rel=1e-9)


@pytest.mark.parametrize("k_calls", [2, 4, 6])
def test_on_demand_adds_one_delay_per_change_of_group(k_calls):
    got = _end(rail_sim(OpticalConfig("on_demand", D)), k_calls, 0)
    assert got == pytest.approx(k_calls * T_CALL + (k_calls - 1) * D, rel=1e-9)
    # two groups alternating: each [dp, pp] pair after the first adds 2 D
    assert _end(rail_sim(OpticalConfig("on_demand", D)), 6, 0) - _end(
        rail_sim(OpticalConfig("on_demand", D)), 4, 0
    ) == (pytest.approx(2 * T_CALL + 2 * D, rel=1e-9))


def _schedule(k_calls, compute_ns, small=0):
    eps = rail_sim(OpticalConfig("eps", 0.0))
    _end(eps, k_calls, compute_ns, small)
    return eps.rails.log


@pytest.mark.parametrize("compute_ns", [D, 2 * D])
def test_provisioned_hides_the_delay_behind_enough_compute(compute_ns):
    k = 6
    eps = k * T_CALL + (k - 1) * compute_ns
    sim = rail_sim(OpticalConfig("provisioned", D), _schedule(k, compute_ns))
    assert _end(sim, k, compute_ns) == pytest.approx(eps, rel=1e-9)
    assert sim.rails.reconfigurations == 2 * (k - 1)  # both ends of the rail change
    on_demand = _end(rail_sim(OpticalConfig("on_demand", D)), k, compute_ns)
    assert on_demand == pytest.approx(eps + (k - 1) * D, rel=1e-9)


def test_provisioned_stalls_what_the_compute_does_not_hide():
    k, c = 4, 2e6
    sim = rail_sim(OpticalConfig("provisioned", D), _schedule(k, c))
    assert _end(sim, k, c) == pytest.approx(k * T_CALL + (k - 1) * c + (k - 1) * (D - c), rel=1e-9)


def test_control_scalars_on_the_packet_network_by_default():
    """A 4-byte dp call after each pp call: on the packet network (<= packet_bytes) it changes nothing;
    with packet_bytes = 0 it needs the dp circuit: pp -> dp -> (next) dp costs one change more a pp call."""
    k = 4
    plain = _end(rail_sim(OpticalConfig("on_demand", D)), k, 0)
    assert _end(rail_sim(OpticalConfig("on_demand", D)), k, 0, small=4) == pytest.approx(plain, rel=1e-9)
    # packet_bytes = 0: dp, pp, [dp scalar], dp, pp, [dp scalar]: changes dp->pp, pp->dp, (dp), dp->pp, pp->dp
    strict = _end(rail_sim(OpticalConfig("on_demand", D, packet_bytes=0)), k, 0, small=4)
    assert strict == pytest.approx(k * T_CALL + 4 * D, rel=1e-9)


def test_reconfig_rules_and_run_id_tail():
    ok = {"mode": "provisioned", "delay_ms": 10}
    assert reconfig_rule(ok, "RailOptimized", "analytic") is None
    assert reconfig_tail(ok) == "_ocs_provisioned_10ms"
    assert reconfig_tail({"mode": "on_demand", "delay_ms": 2.5}) == "_ocs_on_demand_2p5ms"
    assert reconfig_tail({"sweep_delays_ms": (1, 10)}) == ""
    assert "optical rails" in reconfig_rule(ok, "FatTree", "analytic")
    assert "analytic" in reconfig_rule(ok, "RailOptimized", "docker")
    assert "mode must be" in reconfig_rule({"mode": "eager", "delay_ms": 1}, "RailOptimized", "analytic")
    assert "needs reconfig.delay_ms" in reconfig_rule({"mode": "on_demand"}, "RailOptimized", "analytic")
    assert "unknown keys" in reconfig_rule({"delay": 1}, "RailOptimized", "analytic")
    assert "distinct" in reconfig_rule({"sweep_delays_ms": [1, 1]}, "MultiPlane", "analytic")


def test_run_matrix_entry_asks_for_a_reconfigured_run_of_its_own():
    from phantora_assets.lib.errors import RunMatrixError
    from phantora_assets.matrix import parse_entries
    from phantora_assets.stages.simulation import run_spec_record

    rail = {"topology": "RailOptimized", "nic_bw_gbps": 400}
    base = {"workload": "W1", "gpu": "h100", "nodes": 2, "gpus_per_node": 2, "topology": rail}
    eps, ocs, sweep_only = parse_entries(
        [
            base,
            {**base, "reconfig": {"mode": "provisioned", "delay_ms": 10}},
            {**base, "reconfig": {"sweep_delays_ms": [0, 1]}, "name": "sweep"},
        ]
    )
    assert eps.run_id == "phantora_h100_W1_2x2_railoptimized"
    assert ocs.run_id == "phantora_h100_W1_2x2_railoptimized_ocs_provisioned_10ms"
    assert "reconfig" not in run_spec_record(eps).inputs["entry"]  # unreconfigured runs: records as before
    assert run_spec_record(ocs).inputs["entry"]["reconfig"] == {"mode": "provisioned", "delay_ms": 10}
    assert sweep_only.reconfig == (("sweep_delays_ms", (0, 1)),)
    with pytest.raises(RunMatrixError, match="needs optical rails"):
        parse_entries([{**base, "topology": {}, "reconfig": {"mode": "on_demand", "delay_ms": 1}}])
    with pytest.raises(RunMatrixError, match="reconfig must be a table"):
        parse_entries([{**base, "reconfig": 5}])


def test_jitter_follows_the_job_not_its_name_or_optical_tail():
    """Runs of one job differing only in ``name`` or in an optical network that takes no call (every call a
    control collective: ``packet_bytes`` above any call) are the same simulation: their steps are equal to
    the ns, jitter included (the seed was the run id, so each got its own 0.1 % jitter). A shipped run's
    seed key is its run id (outputs unchanged). The reconfigured run simulates every iteration (its later ones
    are no replicas), so it is the EPS simulated so."""
    from phantora_assets.lib.sim.analytic import AnalyticSimulator
    from phantora_assets.matrix import load_run_matrix, parse_entries

    rail = {"topology": "RailOptimized", "nic_bw_gbps": 400}
    base = {"workload": "W1", "gpu": "h100", "nodes": 2, "gpus_per_node": 2, "topology": rail}
    no_circuit = {"mode": "on_demand", "delay_ms": 10, "packet_bytes": 2**62}
    eps, named, ocs = parse_entries([base, {**base, "name": "twin"}, {**base, "reconfig": no_circuit}])
    assert len({eps.run_id, named.run_id, ocs.run_id}) == 3
    steps = [AnalyticSimulator(s, emit=False).run().iteration_ns for s in (eps, named)]
    assert len(set(steps[0][1:])) > 1  # jittered steady steps
    assert steps[1] == steps[0]
    # a reconfigured network simulates every iteration (no replica scaling its delays): as the EPS does so
    every = AnalyticSimulator(eps, emit=False, replicate=False).run().iteration_ns
    assert AnalyticSimulator(ocs, emit=False).run().iteration_ns == every
    assert every[:2] == steps[0][:2]
    assert all(s.job_key == s.run_id for s in load_run_matrix())


def _arbitrary_file(tmp_path, optical: dict[str, object], core: str = "core", nic_switch=("sw-0", "sw-1")) -> dict:
    """2 hosts x 2 NICs at 400 Gbps: NIC i of both hosts on switch ``nic_switch[i]``, each 400 Gbps to ``core``;
    ``optical``: switch name -> its ``optical`` value."""
    names = sorted({*nic_switch, core})
    toml = lambda v: str(v).lower() if isinstance(v, bool) else f'"{v}"'
    text = "".join(
        f'[[switch]]\nname = "{n}"\n' + (f"optical = {toml(optical[n])}\n" if n in optical else "") for n in names
    )
    text += "".join(f'[[link]]\na = "{sw}"\nb = "{core}"\ngbps = 400\n' for sw in sorted(set(nic_switch)))
    text += "".join(
        f'[[nic]]\nhost = {h}\nnic = {i}\nswitch = "{nic_switch[i]}"\ngbps = 400\n' for h in (1, 2) for i in (0, 1)
    )
    (tmp_path / "fabric.toml").write_text(text)
    return {"topology": "Arbitrary", "fabric_file": str(tmp_path / "fabric.toml")}


def test_arbitrary_file_marks_switches_optical(tmp_path):
    """Issue 38 item 1's Arbitrary case: the chain runs between NIC 0 of both hosts (switch sw-0). With sw-0
    ``optical = true`` its ports hold circuits: on demand adds (K-1) D, as on a rail fabric; with only sw-1
    optical (the chain's NICs on a packet switch) nothing waits: the EPS time, exactly."""
    k = 4
    topo = _arbitrary_file(tmp_path, {"sw-0": True})
    assert build_fabric({**presets()["cluster"], **topo}, 2, 2).optical_endpoints.tolist() == [True, False, True, False]
    assert _end(rail_sim(OpticalConfig("on_demand", D), topology=topo), k, 0) == pytest.approx(
        k * T_CALL + (k - 1) * D, rel=1e-9
    )
    assert _end(rail_sim(None, topology=topo), k, 0) == pytest.approx(k * T_CALL, rel=1e-9)
    other = _arbitrary_file(tmp_path, {"sw-0": False, "sw-1": True})
    assert _end(rail_sim(OpticalConfig("on_demand", D), topology=other), k, 0) == pytest.approx(k * T_CALL, rel=1e-9)


def test_arbitrary_optical_rules(tmp_path):
    """A non-boolean ``optical`` and an optical switch crossed between two other switches are refused with the
    file and the rule; a run's reconfig on an Arbitrary file with no optical switch under a NIC is refused by
    the schema; with one it is accepted and gets its ``_ocs_`` tail."""
    from phantora_assets.lib.errors import RunMatrixError
    from phantora_assets.matrix import parse_entries

    cluster = presets()["cluster"]
    with pytest.raises(ValueError, match="optical must be true or false"):
        build_fabric({**cluster, **_arbitrary_file(tmp_path, {"sw-0": "yes"})}, 2, 2)
    with pytest.raises(ValueError, match="optical switch 'core' is on a shortest path between 'sw-0' and 'sw-1'"):
        build_fabric({**cluster, **_arbitrary_file(tmp_path, {"core": True})}, 2, 2)
    base = {"workload": "W1", "gpu": "h100", "nodes": 2, "gpus_per_node": 2}
    rc = {"mode": "on_demand", "delay_ms": 10}
    with pytest.raises(RunMatrixError, match="needs optical switches"):
        parse_entries([{**base, "topology": _arbitrary_file(tmp_path, {"sw-0": False}), "reconfig": rc}])
    (spec,) = parse_entries([{**base, "topology": _arbitrary_file(tmp_path, {"sw-1": True}), "reconfig": rc}])
    assert spec.run_id == "phantora_h100_W1_2x2_arbitrary_ocs_on_demand_10ms"


def test_every_run_id_shape_passes_the_contracts(tmp_path):
    """A simulated run's id with a topology tail, an ``_ocs_`` tail and a ``name`` suffix, in every combination,
    matches the published tables' run_id rule (``contracts._RUN_ID``: was without the last two, so a run with
    ``name`` or ``reconfig.mode`` failed ``windows_contract`` in a real build); a delay's digits are positional
    (``1e-05`` ms made a '-' in the id)."""
    import pandas as pd

    from phantora_assets.contracts import _RUN_ID
    from phantora_assets.matrix import parse_entries

    rail = {"topology": "RailOptimized", "nic_bw_gbps": 400}
    base = {"workload": "W1", "gpu": "h100", "nodes": 2, "gpus_per_node": 2}
    entries = [
        {**base, **extra, **({"name": name} if name else {}), **({"reconfig": rc} if rc else {})}
        for extra in ({}, {"topology": rail})
        for name in ("", "nopxn", "a_2x2")
        for rc in ({}, {"mode": "on_demand", "delay_ms": 10}, {"mode": "provisioned", "delay_ms": 0.00001})
        if extra or not rc  # reconfig needs the rails
    ]
    ids = [s.run_id for s in parse_entries(entries)]
    assert "phantora_h100_W1_2x2_railoptimized_ocs_provisioned_0p00001ms_a_2x2" in ids
    assert "phantora_h100_W1_2x2_nopxn" in ids and len(set(ids)) == len(entries) == 12
    assert _RUN_ID(pd.Series(ids)).check_passed
    assert not _RUN_ID(pd.Series(["phantora_h100_W1_2x2_railoptimized_ocs_eager_1ms-x"])).check_passed
