"""The strict run matrix (issue 13, finding 6): every entry's types, ranges and known values are
checked when the matrix is loaded, nothing is coerced, and the CLI prints the rule and exits 2.

Each case of finding 6 goes through the real CLI (``phantora-assets runs``) with the matrix named
by ``PHANTORA_ASSETS_RUN_MATRIX``; on the previous release every one of them either raised a
traceback, silently coerced the value, ran out of memory or looped in the network simulator.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from phantora_assets.cli import main
from phantora_assets.lib.errors import RunMatrixError
from phantora_assets.lib.run.catalog import presets
from phantora_assets.lib.run.spec import MAX_NODES, MAX_WORLD_SIZE, RunSpec, validate
from phantora_assets.lib.sim.network import TOPOLOGY_BANDWIDTHS, TOPOLOGY_COUNTS, TOPOLOGY_NAMES
from phantora_assets.matrix import check_specs, parse_entries

GOOD = '[[run]]\nworkload = "W4"\ngpu = "l40s"\nnodes = 2\ngpus_per_node = 1\n'


def _entry(nodes: str = "2", gpus_per_node: str = "1", extra: str = "") -> str:
    return f'[[run]]\nworkload = "W4"\ngpu = "h100"\nnodes = {nodes}\ngpus_per_node = {gpus_per_node}\n{extra}'


#: finding 6: matrix text -> (label of the bad entry, rule). The bad entry is #2, after a good one.
FINDING_6 = {
    "nodes_string": (_entry(nodes='"two"'), "#2 (W4 h100 ?x1)", "nodes must be an integer, got 'two' (string)"),
    "topology_string": (
        _entry(extra='topology = "fast"\n'),
        "#2 (W4 h100 2x1)",
        "topology must be a table ({ host_bw_gbps = 400, ... }), got 'fast' (string)",
    ),
    "nodes_float": (_entry(nodes="2.9"), "#2 (W4 h100 ?x1)", "nodes must be an integer, got 2.9 (float)"),
    "gpus_per_node_bool": (
        _entry(gpus_per_node="true"),
        "#2 (W4 h100 2x?)",
        "gpus_per_node must be an integer, got true (boolean)",
    ),
    "nodes_huge": (
        _entry(nodes="1000000000"),
        "#2 (W4 h100 1000000000x1)",
        f"layout 1000000000x1 (1000000000 GPUs) is larger than the simulator supports: at most {MAX_NODES} nodes "
        f"and {MAX_WORLD_SIZE} GPUs in all",
    ),
    "host_bw_negative": (
        _entry(extra="topology = { host_bw_gbps = -100 }\n"),
        "#2 (W4 h100 2x1)",
        "topology.host_bw_gbps must be a number from 0.001 to 1000000 (Gbps), got -100",
    ),
    "host_bw_zero": (
        _entry(extra="topology = { host_bw_gbps = 0 }\n"),
        "#2 (W4 h100 2x1)",
        "topology.host_bw_gbps must be a number from 0.001 to 1000000 (Gbps), got 0",
    ),
    "ecmp_bogus": (
        _entry(extra='topology = { ecmp = "bogus" }\n'),
        "#2 (W4 h100 2x1)",
        "topology.ecmp 'bogus' is not supported (known: hash, split, first)",
    ),
}


def _no_model(*args: object, **kwargs: object) -> None:
    raise AssertionError("a workload model or memory estimate was built for a matrix that should be refused")


def _runs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, text: str, command: str = "runs") -> tuple[int, Path]:
    """``main([command, "--data-dir", ...])`` with ``text`` as the run matrix. The workload model and
    the memory estimate fail the test if reached (the previous release built them for 10^9 nodes:
    23.7 GB)."""
    import phantora_assets.lib.sim.memory as memory
    import phantora_assets.lib.sim.workloads as workloads

    monkeypatch.setattr(workloads, "WorkloadModel", _no_model)
    monkeypatch.setattr(memory, "estimate_memory", _no_model)
    matrix = tmp_path / "matrix.toml"
    matrix.write_text(text)
    monkeypatch.setenv("PHANTORA_ASSETS_RUN_MATRIX", str(matrix))
    monkeypatch.delenv("PHANTORA_ASSETS_IMPORT_DIR", raising=False)
    argv = [command, "--data-dir", str(tmp_path / "data")]
    return main(argv + (["--jobs", "1", "--no-plots", "--quiet"] if command == "build" else [])), matrix


@pytest.mark.parametrize("case", list(FINDING_6))
def test_finding_6_refused_by_the_cli(tmp_path, monkeypatch, capsys, case):
    text, label, rule = FINDING_6[case]
    rc, matrix = _runs(tmp_path, monkeypatch, GOOD + "\n" + text)
    err = capsys.readouterr().err
    assert rc == 2, err
    assert err.startswith(f"error: {matrix} [[run]] {label}: {rule}"), err
    assert "Traceback" not in err


def test_run_not_an_array_of_tables(tmp_path, monkeypatch, capsys):
    """finding 6: ``run = 5`` (was TypeError: 'int' object is not iterable)."""
    rc, matrix = _runs(tmp_path, monkeypatch, "run = 5\n")
    err = capsys.readouterr().err
    assert rc == 2
    assert err.startswith(f"error: {matrix}: run must be an array of tables ([[run]] entries), got 5 (integer)"), err


def test_huge_layout_refused_before_any_memory_estimate(tmp_path, monkeypatch, capsys):
    """finding 6: ``nodes = 1000000000`` took 23.7 GB in the memory estimate of ``runs`` (the
    workload model and the estimate fail this test if reached, see ``_runs``)."""
    t0 = time.perf_counter()
    rc, _ = _runs(tmp_path, monkeypatch, _entry(nodes="1000000000"))
    assert time.perf_counter() - t0 < 5
    assert rc == 2
    assert "is larger than the simulator supports" in capsys.readouterr().err


def test_negative_bandwidth_refused_at_load_not_simulated(tmp_path, monkeypatch, capsys):
    """finding 6: ``host_bw_gbps = -100`` looped forever in the network simulator; ``build``
    must refuse it while loading the matrix, before any simulation or file."""
    from phantora_assets.lib.sim.analytic import AnalyticSimulator

    def no_simulation(self, *args, **kwargs):
        raise AssertionError("simulated a run the matrix should refuse")

    monkeypatch.setattr(AnalyticSimulator, "run", no_simulation)
    monkeypatch.delenv("DAGSTER_HOME", raising=False)
    rc, matrix = _runs(tmp_path, monkeypatch, _entry(extra="topology = { host_bw_gbps = -100 }\n"), "build")
    err = capsys.readouterr().err
    assert rc == 2, err
    assert f"{matrix} [[run]] #1 (W4 h100 2x1): topology.host_bw_gbps must be a number from 0.001" in err
    assert not (tmp_path / "data" / "traces").exists()


#: more rules of the strict matrix: entry text -> rule (entry #1 of a file)
MORE_RULES = {
    "workload_int": (
        '[[run]]\nworkload = 4\ngpu = "h100"\nnodes = 2\ngpus_per_node = 1\n',
        "workload must be a string",
    ),
    "gpus_per_node_zero": (_entry(gpus_per_node="0"), "nodes and gpus_per_node must be >= 1"),
    "too_many_nodes": (_entry(nodes=str(MAX_NODES + 1)), "larger than the simulator supports"),
    "too_many_gpus": (_entry(nodes="1", gpus_per_node=str(MAX_WORLD_SIZE + 1)), "larger than the simulator supports"),
    "published_unknown": (_entry(extra='published = "yes"\n'), "unknown published status 'yes'"),
    "path_int": (_entry(extra="path = 3\n"), "path must be a string, got 3 (integer)"),
    "rack_size_zero": (_entry(extra="topology = { rack_size = 0 }\n"), "topology.rack_size must be between 1 and"),
    "nspines_float": (_entry(extra="topology = { nspines = 1.5 }\n"), "topology.nspines must be an integer, got 1.5"),
    "nspines_huge": (_entry(extra="topology = { nspines = 100000 }\n"), "topology.nspines must be between 1 and 512"),
    "loopback_inf": (_entry(extra="topology = { loopback_gbps = inf }\n"), "loopback_gbps must be a number from 0.001"),
    "uplink_nan": (
        _entry(extra="topology = { rack_uplink_port_bw_gbps = nan }\n"),
        "must be a number from 0.001 to 1000000 (Gbps), got nan",
    ),
    "bandwidth_tiny": (_entry(extra="topology = { host_bw_gbps = 1e-300 }\n"), "(Gbps), got 1e-300"),
    "bandwidth_huge": (_entry(extra="topology = { loopback_gbps = 1e300 }\n"), "(Gbps), got 1e+300"),
    "bandwidth_string": (_entry(extra='topology = { host_bw_gbps = "800" }\n'), "must be a number (Gbps), got '800'"),
    "bandwidth_bool": (_entry(extra="topology = { host_bw_gbps = true }\n"), "must be a number (Gbps), got true"),
    "ecmp_int": (_entry(extra="topology = { ecmp = 1 }\n"), "topology.ecmp must be a string, got 1 (integer)"),
    "topology_type": (_entry(extra='topology = { topology = "Torus" }\n'), "topology.topology 'Torus' is not"),
    "fairness_unknown": (_entry(extra='topology = { fairness = "Fair" }\n'), "topology.fairness 'Fair' is not"),
    "fairness_analytic": (
        _entry(extra='topology = { fairness = "TenantFlowMaxMin" }\n'),
        "is not simulated by the analytic simulator",
    ),
    "load_balancer": (_entry(extra='topology = { load_balancer = "Random" }\n'), "topology.load_balancer 'Random'"),
    "unknown_topology_key": (_entry(extra="topology = { speed = 1 }\n"), "unknown topology keys ['speed']"),
    "entry_not_table": ("run = [1]\n", "an entry must be a table ([[run]] with workload, gpu, ...), got 1 (integer)"),
}


@pytest.mark.parametrize("case", list(MORE_RULES))
def test_more_rules(tmp_path, monkeypatch, capsys, case):
    text, rule = MORE_RULES[case]
    rc, matrix = _runs(tmp_path, monkeypatch, text)
    err = capsys.readouterr().err
    assert rc == 2 and f"error: {matrix} [[run]] #1" in err and rule in err, err


def test_single_table_instead_of_array(tmp_path, monkeypatch, capsys):
    rc, _ = _runs(tmp_path, monkeypatch, GOOD.replace("[[run]]", "[run]"))
    assert rc == 2 and "(write [[run]], not [run]), got {" in capsys.readouterr().err


def test_values_are_kept_as_written():
    """Valid entries: ints stay ints, a float bandwidth stays a float (no coercion either way)."""
    (spec,) = parse_entries(
        [{"workload": "W4", "gpu": "h100", "nodes": 2, "gpus_per_node": 8, "topology": {"host_bw_gbps": 400.5}}]
    )
    assert type(spec.n_nodes) is int and type(spec.gpus_per_node) is int
    assert spec.topology == (("host_bw_gbps", 400.5),)


def test_largest_layouts_accepted():
    largest = [
        {"workload": "W4", "gpu": "h100", "nodes": MAX_NODES, "gpus_per_node": MAX_WORLD_SIZE // MAX_NODES},
        {"workload": "W4", "gpu": "h100", "nodes": 1, "gpus_per_node": MAX_WORLD_SIZE},
    ]
    assert [s.world_size for s in parse_entries(largest)] == [MAX_WORLD_SIZE, MAX_WORLD_SIZE]


def test_every_cluster_key_has_a_rule_and_the_presets_pass():
    cluster = presets()["cluster"]
    assert set(cluster) == set(TOPOLOGY_NAMES) | set(TOPOLOGY_COUNTS) | set(TOPOLOGY_BANDWIDTHS)
    validate(RunSpec("W4", "h100", 2, 8, topology=tuple(sorted(cluster.items()))), "presets")


def test_imports_registry_entries_follow_the_same_rules(tmp_path, monkeypatch, capsys):
    data = tmp_path / "data"
    data.mkdir()
    registry = data / "imports.toml"
    registry.write_text(_entry(nodes="2.9", extra=f'source = "import"\npath = "{tmp_path}"\n'))
    rc, _ = _runs(tmp_path, monkeypatch, GOOD)
    err = capsys.readouterr().err
    assert rc == 2
    assert f"error: {registry} [[run]] #1 (W4 h100 ?x1): nodes must be an integer, got 2.9 (float)" in err, err


@pytest.mark.parametrize(
    ("spec", "rule"),
    [
        (RunSpec("W4", "l40s", 2.9, 1), "build_defs(specs=...) #2 (W4 l40s ?x1): nodes must be an integer"),  # type: ignore[arg-type]
        (RunSpec("W4", "l40s", 2, True), "#2 (W4 l40s 2x?): gpus_per_node must be an integer, got true"),
        (RunSpec("W4", "l40s", 5000, 1), "#2 (W4 l40s 5000x1): layout 5000x1 (5000 GPUs) is larger"),
        (
            RunSpec("W4", "l40s", 2, 1, topology=(("host_bw_gbps", -100),)),
            "topology.host_bw_gbps must be a number from",
        ),
        (RunSpec("W4", "l40s", 2, 1, topology=(("ecmp", "bogus"),)), "topology.ecmp 'bogus' is not supported"),
        (RunSpec("W4", "l40s", 2, 1, topology={"ecmp": "hash"}), "topology must be (key, value) pairs"),  # type: ignore[arg-type]
    ],
)
def test_check_specs_applies_the_same_rules(spec, rule):
    with pytest.raises(RunMatrixError) as err:
        check_specs([RunSpec("W4", "l40s", 2, 2), spec], "build_defs(specs=...)")
    assert rule in str(err.value)
