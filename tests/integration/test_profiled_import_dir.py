"""Folders of PyTorch profiler traces and Chakra ETs dropped into ``$PHANTORA_ASSETS_IMPORT_DIR``:
with an ``import.toml`` they are partitions (``imported_runs.discover_imports``) that the real
``import_dir`` sensor requests and a materialization builds; without one (or with a broken one) the
tick's skip message names them and the reason. A trace replaced in place makes the partition stale
(the fingerprint covers the folder's files) and the sensor requests it again."""

from __future__ import annotations

import os
from pathlib import Path

import dagster as dg
from fixtures.kineto_traces import Coll, rank_trace, write_traces
from fixtures.materialize import materialize_run

from phantora_assets import definitions as d
from phantora_assets.imported_runs import IMPORT_DIR_ENV, discover_imports, effective_matrix, profiled_folder
from phantora_assets.lib.phantora.run_folder import Skipped
from phantora_assets.lib.run.spec import RunSpec
from phantora_assets.paths import DataPaths
from phantora_assets.stages.simulation import build_reason, run_spec_record

G = (0, 1, 2, 3)
COLLS = [Coll("allreduce", 1000, 1000, "BFloat16", G)]  # S = 2000 B: 4 hops of floor(2000 * 2 * 3 / 4) = 3000
#: 2 hosts of 2 GPUs: hops 1->2 and 3->0 of the ring cross hosts.
NET_PER_STEP = 2 * 3000


def _tick(data: Path) -> dg.SensorResult:
    defs = d.build_defs(data)
    sensor = defs.get_sensor_def("import_dir")
    with dg.instance_for_test() as instance:  # a real instance (ref): the sensor adds dynamic partitions
        return sensor.evaluate_tick(
            dg.build_sensor_context(instance=instance, instance_ref=instance.get_ref(), definitions=defs)
        )


def test_a_watched_folder_of_profiler_traces_is_a_partition_built_and_rebuilt_when_replaced(tmp_path, monkeypatch):
    watched, data = tmp_path / "watched", tmp_path / "data"
    probe = write_traces(watched / "probe", {0: rank_trace(0, 4, COLLS, steps=6)})
    (probe / "import.toml").write_text('gpus_per_node = 2\nworld_size = 4\nrun_id = "probe_run"\n')
    write_traces(watched / "bare", {0: rank_trace(0, 2, [Coll("allreduce", 8, 8, "Float", (0, 1))])})
    monkeypatch.setenv(IMPORT_DIR_ENV, str(watched))
    found, skipped = discover_imports(watched)
    assert [(f.spec.run_id, f.spec.source, f.spec.layout, f.spec.path) for f in found] == [
        ("probe_run", "kineto", "2x2", str(probe.resolve()))
    ]
    assert skipped == [
        Skipped(
            (watched / "bare").resolve(),
            "a folder of PyTorch profiler traces needs an import.toml (gpus_per_node, world_size; run_id, rank)",
        )
    ]
    first = _tick(data)
    (req,) = first.run_requests
    spec = {s.run_id: s for s in effective_matrix(data)}["probe_run"]
    assert (req.partition_key, req.run_key, req.tags["phantora/build_reason"]) == (
        "probe_run",
        f"probe_run@{run_spec_record(spec).fingerprint}",
        "missing",
    )
    res = materialize_run(data, "probe_run")
    assert res.success
    flows = res.asset_materializations_for_node("validated_flows")[0].metadata
    assert flows["network_bytes_per_step"].value == NET_PER_STEP and flows["step_time_ms"].value == 10.0
    built = _tick(data)
    assert built.run_requests == []
    assert (built.skip_message or "").split("; ", 1)[1] == (  # after "added 31 run partition(s): ..." (a new instance)
        "every imported run folder is built and current; declined "
        f"{(watched / 'bare').resolve()}: a folder of PyTorch profiler traces needs an import.toml "
        "(gpus_per_node, world_size; run_id, rank)"
    )
    paths = DataPaths(data)
    assert build_reason(spec, paths) is None
    trace = probe / "rank-0.pt.trace.json.gz"
    before = run_spec_record(spec).inputs["source_files"]
    assert sorted(before) == ["import.toml", "rank-0.pt.trace.json.gz"]
    write_traces(probe, {0: rank_trace(0, 4, [Coll("allreduce", 2000, 2000, "BFloat16", G)], steps=6)})  # in place
    assert run_spec_record(spec).inputs["source_files"][trace.name] != before[trace.name]
    assert build_reason(spec, paths) == (
        "stale: built from another source_files than the run matrix now gives; rebuild the run"
    )
    (again,) = _tick(data).run_requests
    assert again.partition_key == "probe_run" and again.run_key != req.run_key
    assert materialize_run(data, "probe_run").success
    assert build_reason(spec, paths) is None


def test_broken_or_incomplete_import_toml_is_declined_in_the_skip_message(tmp_path, monkeypatch):
    watched, data = tmp_path / "watched", tmp_path / "data"
    job = write_traces(watched / "job", {0: rank_trace(0, 2, [Coll("allreduce", 8, 8, "Float", (0, 1))])})
    monkeypatch.setenv(IMPORT_DIR_ENV, str(watched))
    cases = {
        "world_size = 4.0\n": f"{job / 'import.toml'}: import.toml (world_size must be an integer >= 0, got 4.0)",
        "gpus = 2\n": f"{job / 'import.toml'}: import.toml (unknown keys ['gpus'] (known: gpus_per_node, world_size, "
        "run_id, rank))",
        "world_size = [\n": f"{job / 'import.toml'}: import.toml (cannot be read as TOML (",
        "gpus_per_node = 2\n": "import.toml gives no world_size (the job's GPU count)",
        "world_size = 3\ngpus_per_node = 2\n": "import.toml: gpus_per_node 2 does not divide world_size 3",
        'world_size = 2\nrun_id = "Bad"\n': "import.toml: a kineto run has workload = gpu = '', a path, a name of",
    }
    for text, reason in cases.items():
        (job / "import.toml").write_text(text)
        result = _tick(data)  # the tick does not fail
        assert result.run_requests == []
        assert f"; declined {job.resolve()}: {reason}" in result.skip_message, (text, result.skip_message)


def test_a_watched_folder_of_chakra_ets_counts_its_ranks_and_its_fingerprint_covers_them(tmp_path):
    """Discovery reads names only (the ETs are read by the run's raw_timeline): 4 ETs and
    ``gpus_per_node = 2`` are a 2x2 partition; rewriting an ET or the comm groups changes the
    fingerprint."""
    folder = tmp_path / "w4_et"
    folder.mkdir()
    for r in range(4):
        (folder / f"w4.{r}.et").write_bytes(b"x" * (10 + r))
    (folder / "w4.comm_groups.json").write_text('{"1": [0, 1, 2, 3]}')
    (folder / "import.toml").write_text("gpus_per_node = 2\n")
    got = profiled_folder(folder)
    assert not isinstance(got, Skipped)
    assert (got.spec.run_id, got.spec.source, got.spec.layout) == ("w4_et_2x2", "chakra", "2x2")
    rec = run_spec_record(got.spec)
    assert {k: v[0] for k, v in rec.inputs["source_files"].items()} == {
        "w4.0.et": 10,
        "w4.1.et": 11,
        "w4.2.et": 12,
        "w4.3.et": 13,
        "w4.comm_groups.json": 19,
        "import.toml": 18,
    }
    (folder / "w4.2.et").write_bytes(b"y" * 12)  # same size, another mtime
    os.utime(folder / "w4.2.et", ns=(1, 1))
    assert run_spec_record(got.spec).fingerprint != rec.fingerprint
    kineto = RunSpec("", "", 1, 2, source="kineto", path=str(tmp_path / "gone"), name="gone")
    assert "source_files" in run_spec_record(kineto).inputs and run_spec_record(kineto).inputs["source_files"] == {}
