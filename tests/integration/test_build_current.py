"""``phantora-assets build`` builds only what is missing or stale (issue 39, item 16): a second build of an
unchanged matrix materializes no per-run asset, runs no dataset job and leaves the dataset and the database
byte-identical; an edit of one run's input (its fabric file, in place) rebuilds that run and the dataset
only; ``--force`` rebuilds every run."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import dagster as dg
import pytest

from phantora_assets.cli import main
from phantora_assets.matrix import RUN_MATRIX_ENV

FABRIC_RUN = "phantora_a100_40g_W4_2x2_arbitrary"
OTHER_RUN = "phantora_a100_40g_W4_2x1"


def _fabric(gbps: int) -> str:
    """Two hosts of 2 NICs at ``gbps`` each, all on one switch."""
    nics = "".join(f'[[nic]]\nhost = {h}\nnic = {n}\nswitch = "tor"\ngbps = {gbps}\n' for h in (1, 2) for n in (0, 1))
    return '[[switch]]\nname = "tor"\n' + nics


def _study(folder: Path) -> Path:
    folder.mkdir(parents=True)
    (folder / "fabric.toml").write_text(_fabric(400))
    (folder / "runs.toml").write_text(
        '[[run]]\nworkload = "W4"\ngpu = "a100_40g"\nnodes = 2\ngpus_per_node = 2\n'
        'topology = { topology = "Arbitrary", fabric_file = "fabric.toml" }\n'
        '[[run]]\nworkload = "W4"\ngpu = "a100_40g"\nnodes = 2\ngpus_per_node = 1\n'
    )
    return folder / "runs.toml"


def _dataset_bytes(root: Path) -> dict[str, bytes]:
    """Every file of the published dataset (through the ``phantora_v0`` link) and the database, by path."""
    files = sorted(p for p in (root / "phantora_v0").rglob("*") if p.is_file())
    out = {p.relative_to(root).as_posix(): p.read_bytes() for p in files}
    out["phantora.duckdb"] = (root / "phantora.duckdb").read_bytes()
    return out


def _runs(root: Path) -> Counter:
    """How many Dagster runs the data root's instance holds, by (job, partition)."""
    with dg.DagsterInstance.from_config(str(root / "dagster_home")) as instance:
        return Counter((r.job_name, r.tags.get("dagster/partition")) for r in instance.get_runs())


def _materialized(root: Path) -> Counter:
    """Materializations of the per-run assets on the data root's instance, by (asset, partition)."""
    from phantora_assets.assets.common import RUN_ASSET_NAMES

    out: Counter = Counter()
    with dg.DagsterInstance.from_config(str(root / "dagster_home")) as instance:
        for name in RUN_ASSET_NAMES:
            recs = instance.fetch_materializations(dg.AssetKey(name), limit=1000).records
            out.update((name, r.partition_key) for r in recs)
    return out


def _build(root: Path, capsys, *extra: str) -> str:
    capsys.readouterr()
    assert main(["build", "--data-dir", str(root), "--no-plots", *extra]) == 0
    return capsys.readouterr().out


@pytest.fixture
def study_root(tmp_path: Path, monkeypatch) -> Path:
    monkeypatch.setenv(RUN_MATRIX_ENV, str(_study(tmp_path / "study")))
    monkeypatch.chdir(tmp_path)
    return tmp_path / "data"


def test_an_unchanged_build_materializes_nothing_and_an_edited_input_rebuilds_only_its_run(study_root, capsys):
    root = study_root
    _build(root, capsys)
    runs1, mats1, data1 = _runs(root), _materialized(root), _dataset_bytes(root)
    assert runs1[("all_runs", FABRIC_RUN)] == runs1[("all_runs", OTHER_RUN)] == 1
    assert mats1[("raw_timeline", FABRIC_RUN)] == mats1[("raw_timeline", OTHER_RUN)] == 1

    out = _build(root, capsys)  # nothing changed
    assert _runs(root) == runs1  # no Dagster run at all: no run partition, no perf DB, no dataset job
    assert _materialized(root) == mats1
    assert _dataset_bytes(root) == data1
    for run_id in (FABRIC_RUN, OTHER_RUN):
        (line,) = [ln for ln in out.splitlines() if ln.startswith(run_id)]
        assert line.endswith("ok (current, not rebuilt)"), line
    assert "built 0 runs, 2 current (not rebuilt; --force rebuilds them)" in out
    assert "(current, not rebuilt)" in next(ln for ln in out.splitlines() if ln.startswith("dataset:"))

    (root.parent / "study" / "fabric.toml").write_text(_fabric(200))  # one run's input, edited in place
    out = _build(root, capsys)
    runs3 = _runs(root)
    assert runs3 - runs1 == Counter({("all_runs", FABRIC_RUN): 1, ("dataset", None): 1})
    mats3 = _materialized(root) - mats1
    assert {p for _, p in mats3} == {FABRIC_RUN} and mats3[("raw_timeline", FABRIC_RUN)] == 1
    assert "built 1 runs, 1 current" in out
    data3 = _dataset_bytes(root)
    assert data3["phantora_v0/runs.csv"] != data1["phantora_v0/runs.csv"]  # the new bandwidth's numbers

    _build(root, capsys, "--force")  # everything again, whatever is current
    forced = Counter({("perf_dbs", "a100_40g"): 1, ("all_runs", FABRIC_RUN): 1, ("all_runs", OTHER_RUN): 1})
    assert _runs(root) - runs3 == forced + Counter({("dataset", None): 1})
    assert {k: v for k, v in _dataset_bytes(root).items() if k != "phantora.duckdb"} == {
        k: v for k, v in data3.items() if k != "phantora.duckdb"
    }


def test_a_deleted_output_or_a_build_with_plots_after_one_without_rebuilds_that_run(study_root, capsys):
    root = study_root
    _build(root, capsys)
    runs1 = _runs(root)
    (root / "partitions" / OTHER_RUN / "windows.parquet").unlink()
    _build(root, capsys)
    runs2 = _runs(root)
    assert runs2 - runs1 == Counter({("all_runs", OTHER_RUN): 1, ("dataset", None): 1})
    capsys.readouterr()
    assert main(["build", "--data-dir", str(root), "--run", FABRIC_RUN]) == 0  # with plots: run_plots was not built
    assert _runs(root) - runs2 == Counter({("all_runs", FABRIC_RUN): 1, ("dataset", None): 1})
