"""One rank a stage (lib/sim/symmetry.py): when the simulator may run it and when it must not.

The same job on an Arbitrary fabric of two hosts, two GPUs and two NICs each (GPU g on NIC g, every NIC at
400 Gb/s), host 2's NIC 1 on a second switch: the two data-parallel rings (ranks 0, 2 on NIC 0 of each
host; ranks 1, 3 on NIC 1) run alike when the switches' link is 400 Gb/s, and one rank is simulated; at
100 Gb/s the second ring is four times slower, the check finds it, and the simulator runs every rank.
Either way the timeline is the full simulation's.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from phantora_assets.lib.run.spec import RunSpec
from phantora_assets.lib.sim.analytic import AnalyticSimulator
from phantora_assets.lib.workload.collectives import run_spec_of

JOB = {
    "framework": "megatron",
    "model": {"kind": "dense", "layers": 2, "hidden": 256, "ffn_hidden": 1024, "heads": 4, "kv_heads": 2, "vocab": 512},
    "parallel": {"tp": 2, "dp": 2, "zero": 1},
    "train": {"seq_len": 256, "micro_batch": 1, "grad_accumulation": 2},
}


def _fabric(tmp_path: Path, slow_gbps: int) -> str:
    """Every NIC at 400 Gb/s on switch ``s``, but host 2's NIC 1 on switch ``t``, linked to ``s`` at
    ``slow_gbps`` (400: no slower than a NIC, so both rings run alike)."""
    nics = "".join(
        f'[[nic]]\nhost = {h}\nnic = {n}\nswitch = "{"t" if (h, n) == (2, 1) else "s"}"\ngbps = 400\n'
        for h in (1, 2)
        for n in (0, 1)
    )
    p = tmp_path / f"fabric_{slow_gbps}.toml"
    links = f'[[link]]\na = "s"\nb = "t"\ngbps = {slow_gbps}\n'
    p.write_text('[[switch]]\nname = "s"\n[[switch]]\nname = "t"\n' + links + nics)
    return str(p)


def _both(spec: RunSpec) -> tuple[AnalyticSimulator, object, AnalyticSimulator, object]:
    fast = AnalyticSimulator(spec, iterations=3)
    full = AnalyticSimulator(spec, iterations=3, compress=False)
    return fast, fast.run(), full, full.run()


def _spec(fabric_file: str) -> RunSpec:
    base = run_spec_of(JOB, nodes=2, gpus_per_node=2, gpu="h100", name="sym")
    topo = (("topology", "Arbitrary"), ("fabric_file", fabric_file), ("nics_per_host", 2), ("ecmp", "first"))
    return RunSpec(base.workload, "h100", 2, 2, topology=topo, workload_def=base.workload_def)


@pytest.mark.parametrize("slow_gbps", [400, 100])
def test_equal_rings_run_one_rank_unequal_rings_every_rank(tmp_path, slow_gbps):
    fast, a, full, b = _both(_spec(_fabric(tmp_path, slow_gbps)))
    if slow_gbps == 400:
        assert fast.symmetry == "one rank a stage: 1 of 4 ranks simulated, the others checked equal"
        # the quotient DAG: a compute item once, not once per rank; a dp / tp call once, not per communicator
        assert fast.n_nodes < full.n_nodes / 2.5  # 117 against 336: compute x 4 ranks, calls x 2 communicators
    else:
        assert fast.symmetry.startswith("every rank (the ranks of a stage differ: ")
        assert "on communicator #" in fast.symmetry and fast.n_nodes == full.n_nodes
    assert full.symmetry == "every rank"
    ra, rb = a.raw.drop(columns="event_id"), b.raw.drop(columns="event_id")
    assert ra.equals(rb)
    assert a.iteration_ns == b.iteration_ns


def test_the_slow_nic_is_what_differs(tmp_path):
    """The asymmetric fabric's step is longer than the symmetric one's: the check did not hide a real
    difference (the second ring's 100 Gb/s link carries its gradient reduction)."""
    _, sym, _, _ = _both(_spec(_fabric(tmp_path, 400)))
    _, slow, _, _ = _both(_spec(_fabric(tmp_path, 100)))
    assert slow.step_ns > sym.step_ns
