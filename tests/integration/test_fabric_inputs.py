"""A run's fabric file is an input of the run, read from its run-matrix file's folder (issue 39, item 6),
and runs.csv ``nic_bw`` is a host's NIC bandwidth on a multi-NIC fabric (item 8), through the CLI: a build,
an edit of the fabric file in place (the run is stale: ``phantora-assets runs`` says so and the dataset
leaves it out), a rebuild serving what a fresh build of the edited file gives."""

from __future__ import annotations

import shutil

import pandas as pd
import pytest
from fixtures.materialize import ephemeral_with_runs

from phantora_assets.cli import main
from phantora_assets.definitions import build_defs
from phantora_assets.lib.run.spec import RunSpec
from phantora_assets.matrix import RUN_MATRIX_ENV, check_specs, load_run_matrix
from phantora_assets.paths import DataPaths
from phantora_assets.stages import dataset as dataset_stage
from phantora_assets.stages.simulation import build_reason

RUN = "phantora_a100_40g_W4_2x2_arbitrary"
QUIET = {"loggers": {"console": {"config": {"log_level": "CRITICAL"}}}}


def _fabric(gbps: int) -> str:
    """Two hosts of 2 NICs at ``gbps`` each, all on one switch."""
    nics = "".join(f'[[nic]]\nhost = {h}\nnic = {n}\nswitch = "tor"\ngbps = {gbps}\n' for h in (1, 2) for n in (0, 1))
    return '[[switch]]\nname = "tor"\n' + nics


def _study(folder, gbps: int):
    folder.mkdir(parents=True)
    (folder / "fabric.toml").write_text(_fabric(gbps))
    (folder / "runs.toml").write_text(
        '[[run]]\nworkload = "W4"\ngpu = "a100_40g"\nnodes = 2\ngpus_per_node = 2\n'
        'topology = { topology = "Arbitrary", fabric_file = "fabric.toml" }\n'
    )
    return folder / "runs.toml"


def _build(root) -> pd.Series:
    assert main(["build", "--data-dir", str(root), "--quiet", "--no-plots"]) == 0
    (row,) = pd.read_csv(root / "phantora_v0" / "runs.csv").to_dict("records")
    return pd.Series(row)


def test_editing_the_fabric_file_in_place_makes_the_run_stale_and_a_rebuild_serves_the_new_numbers(
    tmp_path, monkeypatch, capsys
):
    matrix = _study(tmp_path / "study", 400)
    monkeypatch.setenv(RUN_MATRIX_ENV, str(matrix))
    monkeypatch.chdir(tmp_path)  # not the matrix's folder: fabric.toml is read from study/
    root = tmp_path / "data"
    before = _build(root)
    assert before["run_id"] == RUN
    assert before["nic_bw"] == 2 * 400e9 / 8  # a host's 2 NICs of 400 Gbps, bytes/s
    (spec,) = load_run_matrix()
    assert build_reason(spec, DataPaths(root)) is None

    (tmp_path / "study" / "fabric.toml").write_text(_fabric(50))  # in place: same path, same matrix entry
    assert build_reason(spec, DataPaths(root)) == (
        "stale: built from another fabric_file than the run matrix now gives; rebuild the run"
    )
    capsys.readouterr()
    assert main(["runs", "--data-dir", str(root)]) == 0
    (line,) = [x for x in capsys.readouterr().out.splitlines() if x.startswith(RUN)]
    assert line.endswith("stale: built from another fabric_file than the run matrix now gives; rebuild the run")
    copy = tmp_path / "copy"
    shutil.copytree(root, copy, ignore=shutil.ignore_patterns("dagster_home"))
    result = dataset_stage.export_dataset([spec], DataPaths(copy))  # the old numbers are not served
    assert result.included == [] and result.excluded[RUN].startswith("stale: built from another fabric_file")

    after = _build(root)
    assert after["nic_bw"] == 2 * 50e9 / 8
    fresh = _build(tmp_path / "fresh")  # a data root that never saw the 400 Gbps file
    assert after["step_time_s"] == fresh["step_time_s"] and after["nic_bw"] == fresh["nic_bw"]
    assert after["step_time_s"] > before["step_time_s"]  # 8x less bandwidth: the DP all-reduce is slower
    capsys.readouterr()
    assert main(["runs", "--data-dir", str(root)]) == 0
    (line,) = [x for x in capsys.readouterr().out.splitlines() if x.startswith(RUN)]
    assert "stale" not in line


@pytest.mark.parametrize(
    ("topology", "nic_bw"),
    [
        ({"topology": "RailOptimized", "nic_bw_gbps": 400}, 8 * 400e9 / 8),  # 8 NICs a host
        ({"topology": "RailOptimized", "nic_bw_gbps": 400, "nics_per_host": 4}, 4 * 400e9 / 8),
        ({"topology": "MultiPlane", "nic_bw_gbps": 400, "planes": 4}, 8 * 400e9 / 8),  # 4 x 100 Gbps a NIC
        ({"topology": "FatTree", "host_bw_gbps": 200}, 200e9 / 8),
        ({"host_bw_gbps": 200}, 200e9 / 8),  # TwoLayerMultiPath, as the shipped runs
    ],
    ids=["rail-8", "rail-4", "multiplane", "fattree", "leaf-spine"],
)
def test_nic_bw_is_a_hosts_nic_bandwidth(tmp_path, topology, nic_bw):
    """runs.csv nic_bw of an analytic W4 run on 2 hosts x 8 GPUs: the sum of a host's NIC links (was the
    unused leaf-spine host_bw_gbps, 1e11, on RailOptimized and MultiPlane)."""
    spec = RunSpec("W4", "h100", 2, 8, topology=tuple(sorted(topology.items())))
    check_specs([spec], "test")
    res = (
        build_defs(tmp_path, [spec])
        .resolve_job_def("all_runs")
        .execute_in_process(
            partition_key=spec.run_id,
            instance=ephemeral_with_runs([spec.run_id]),
            run_config=QUIET,
        )
    )
    assert res.success
    row = pd.read_parquet(DataPaths(tmp_path).partition_dir(spec.run_id) / "run_summary.parquet")
    assert row["nic_bw"].tolist() == [nic_bw]
