"""The code location: asset and check keys, workspace loading, domain code free of Dagster."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from fixtures.paths import DATA, ROOT

EXPECTED = DATA / "asset_keys.txt"


def current_keys() -> list[str]:
    from phantora_assets.definitions import defs

    graph = defs().resolve_asset_graph()
    keys = [f"asset {k.to_user_string()}" for k in graph.get_all_asset_keys()]
    keys += [f"check {c.asset_key.to_user_string()}:{c.name}" for c in graph.asset_check_keys]
    return sorted(keys)


def test_asset_and_check_keys_match_checked_in_list():
    assert current_keys() == EXPECTED.read_text().split("\n")[:-1]


#: The only modules that may import Dagster: the asset wrappers, resources, definitions, the CLI,
#: the instance plug-ins (run launcher, storages).
DAGSTER_MODULES = (
    "phantora_assets.assets",
    "phantora_assets.instance",
    "phantora_assets.definitions",
    "phantora_assets.resources",
    "phantora_assets.cli",
)


def test_domain_code_imports_without_dagster():
    """Every module but the Dagster-facing ones imports without importing Dagster."""
    code = (
        "import importlib, pathlib, sys\n"
        f"skip = {DAGSTER_MODULES!r}\n"
        "files = sorted(pathlib.Path('phantora_assets').rglob('*.py'))\n"
        "names = ['.'.join(p.with_suffix('').parts).removesuffix('.__init__') for p in files]\n"
        "names = [n for n in names if not n.startswith(skip)]\n"
        "for n in names:\n"
        "    importlib.import_module(n)\n"
        "assert 'dagster' not in sys.modules, sorted(m for m in sys.modules if m.startswith('dagster'))\n"
        "assert len(names) > 30, names\n"
        "print(len(names))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT, capture_output=True, text=True)
    assert int(out.stdout) > 30


@pytest.mark.slow
def test_workspace_loads_with_dagster_cli():
    out = subprocess.run(
        [sys.executable, "-m", "dagster", "definitions", "validate", "-w", str(ROOT / "workspace.yaml")],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    assert out.returncode == 0, out.stdout + out.stderr


@pytest.mark.slow
def test_build_defs_uses_the_specs_it_is_given(tmp_path):
    """Partitions, RunSpecs and the dataset all come from ``specs``, not from the shipped matrix."""
    import dagster as dg
    import pytest
    from fixtures.materialize import ephemeral_with_runs

    from phantora_assets.definitions import build_defs
    from phantora_assets.lib.errors import RunMatrixError
    from phantora_assets.lib.run.spec import RunSpec

    spec = RunSpec("W4", "l40s", 2, 1, topology=(("host_bw_gbps", 100),))
    defs = build_defs(tmp_path / "data", [spec])
    job = defs.resolve_job_def("all_runs")
    assert isinstance(job.partitions_def, dg.DynamicPartitionsDefinition)  # keys on the instance (docs/IMPORTS.md)
    quiet = {"loggers": {"console": {"config": {"log_level": "CRITICAL"}}}}
    res = job.execute_in_process(
        partition_key=spec.run_id, instance=ephemeral_with_runs([spec.run_id]), run_config=quiet
    )
    assert res.success
    netconfig = (tmp_path / "data" / spec.trace_dir / "config" / "netconfig.toml").read_text()
    assert "host_bw = 100" in netconfig
    res = defs.resolve_job_def("dataset").execute_in_process(instance=dg.DagsterInstance.ephemeral(), run_config=quiet)
    assert res.success
    status = (tmp_path / "data" / "phantora_v0" / "run_status.csv").read_text().splitlines()
    assert status == ["run_id,status,reason", f"{spec.run_id},included,"]
    with pytest.raises(RunMatrixError, match="unknown workload 'W9'"):
        build_defs(tmp_path / "data", [RunSpec("W9", "l40s", 2, 1)])


def test_every_job_runs_its_steps_in_one_process():
    """The named jobs and the asset job Dagster makes for a UI selection or a sensor's request (the
    dataset_automation sensor launches it) use the in-process executor: Dagster's default
    multiprocess executor started a process per step (the sensor's dataset run took 11.5 s, not 3)."""
    import dagster as dg

    from phantora_assets.definitions import defs

    loaded = defs()
    jobs = [loaded.resolve_job_def(n) for n in ("all_runs", "docker_runs", "perf_dbs", "dataset")]
    jobs.append(loaded.resolve_implicit_global_asset_job_def())
    repo = loaded.get_repository_def()
    jobs += [repo.get_job(n) for n in repo.job_names if n.startswith("__ASSET_JOB")]
    assert len(jobs) > 5
    assert {j.executor_def.name for j in jobs} == {dg.in_process_executor.name}


def test_import_reads_nothing_and_the_loader_names_a_missing_matrix(tmp_path):
    """Importing the code location reads no file (``@dagster.definitions``): with
    $PHANTORA_ASSETS_RUN_MATRIX naming a file that does not exist the import succeeds, and only
    ``defs()`` (what Dagster calls to load it) raises the RunMatrixError naming that file."""
    missing = tmp_path / "no_such_matrix.toml"
    code = (
        "import phantora_assets.definitions as d\n"
        "print('imported', d._LOADED == [])\n"
        "from phantora_assets.lib.errors import RunMatrixError\n"
        "try:\n"
        "    d.defs()\n"
        "except RunMatrixError as exc:\n"
        "    print('RunMatrixError', exc)\n"
    )
    env = {
        **os.environ,
        "PHANTORA_ASSETS_RUN_MATRIX": str(missing),
        "PHANTORA_ASSETS_DATA_DIR": str(tmp_path / "data"),
    }
    env.pop("DAGSTER_HOME", None)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, env=env, check=True)
    lines = out.stdout.splitlines()
    assert lines[0] == "imported True"
    assert lines[1].startswith("RunMatrixError ") and str(missing) in lines[1]
    assert not (tmp_path / "data").exists()
