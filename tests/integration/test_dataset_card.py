"""The published dataset of two shipped runs (issue 14, items 3 and 6): per-run Parquet files
(one folder per run, named by its run_id) that DuckDB, pyarrow and pandas read by subset, the CSVs with the
same rows, a byte-identical rebuild, and the dataset card: its data dictionary covers every
column of every contract, and ``datasets.load_dataset`` reads the three configs offline."""

from __future__ import annotations

import hashlib
import shutil
from pathlib import Path

import duckdb
import pandas as pd
import pyarrow.dataset as pads
import pytest
import yaml
from fixtures.materialize import ephemeral_with_runs

from phantora_assets import contracts
from phantora_assets.definitions import build_defs
from phantora_assets.matrix import load_run_matrix
from phantora_assets.paths import DataPaths
from phantora_assets.stages import dataset as dataset_stage

QUIET = {"loggers": {"console": {"config": {"log_level": "CRITICAL"}}}}
RUNS = ["phantora_a100_40g_W1_4x1", "phantora_l40s_W4_2x1"]


@pytest.fixture(scope="module")
def dataset(tmp_path_factory) -> Path:
    specs = [s for s in load_run_matrix() if s.run_id in RUNS]
    root = tmp_path_factory.mktemp("card") / "data"
    defs = build_defs(root, specs)
    for spec in specs:
        res = defs.resolve_job_def("all_runs").execute_in_process(
            partition_key=spec.run_id, instance=ephemeral_with_runs([spec.run_id]), run_config=QUIET
        )
        assert res.success
    result = dataset_stage.export_dataset(specs, DataPaths(root))
    assert result.outcome.passed and result.included == RUNS
    return root / "phantora_v0"


def _digests(d: Path) -> dict[str, str]:
    return {
        str(p.relative_to(d)): hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(d.rglob("*")) if p.is_file()
    }


def test_layout_is_one_parquet_file_per_run(dataset):
    files = sorted(p.relative_to(dataset) for p in dataset.rglob("*.parquet"))
    assert [str(p.parent) if p.parent.name else str(p) for p in files] == [
        *(f"flows_100ms/{r}" for r in RUNS),
        "runs.parquet",
        *(f"windows/{r}" for r in RUNS),
    ]
    for p in files:  # a per-run file is named by its content (lib/store/generations.py)
        if p.parent.name:
            assert p.name == f"part-{hashlib.sha256((dataset / p).read_bytes()).hexdigest()[:16]}.parquet"
    assert {p.name for p in dataset.iterdir() if p.is_file()} == {
        "README.md",
        "flows_100ms.csv",
        "runs.csv",
        "runs.parquet",
        "run_status.csv",
        "windows.csv",
    }


@pytest.mark.parametrize("table", ["flows_100ms", "windows"])
def test_each_reader_takes_one_run_and_gets_the_csv_rows(dataset, table):
    csv = pd.read_csv(dataset / f"{table}.csv")
    want = csv[csv["run_id"] == RUNS[0]].reset_index(drop=True)
    glob = str(dataset / table / "*" / "*.parquet")
    via_duckdb = duckdb.sql(
        f"SELECT * FROM read_parquet('{glob}', hive_partitioning = true) WHERE run_id = '{RUNS[0]}'"
    ).df()
    via_arrow = (
        pads.dataset(dataset / table, partitioning="hive").to_table(filter=pads.field("run_id") == RUNS[0]).to_pandas()
    )
    via_pandas = pd.read_parquet(dataset / table, partitioning=None, filters=[("run_id", "==", RUNS[0])])
    for got in (via_duckdb, via_arrow, via_pandas):
        pd.testing.assert_frame_equal(got[list(want.columns)].reset_index(drop=True), want, check_dtype=False)
    # one run's file alone is the run's rows
    (one_file,) = (dataset / table / RUNS[1]).glob("part-*.parquet")
    one = pd.read_parquet(one_file)
    assert len(one) == int((csv["run_id"] == RUNS[1]).sum()) and set(one["run_id"]) == {RUNS[1]}


def test_flows_100ms_rows_and_bytes(dataset):
    csv = pd.read_csv(dataset / "flows_100ms.csv")
    # 1800 bins x directed node pairs: 4 nodes -> 12 pairs, 2 nodes -> 2
    assert csv.groupby("run_id").size().to_dict() == {RUNS[0]: 1800 * 12, RUNS[1]: 1800 * 2}


def test_rebuild_is_byte_identical(dataset, tmp_path):
    before = _digests(dataset)
    root = dataset.parent
    other = tmp_path / "data"
    shutil.copytree(root, other)
    specs = [s for s in load_run_matrix() if s.run_id in RUNS]
    assert dataset_stage.export_dataset(specs, DataPaths(other)).outcome.passed
    assert _digests(other / "phantora_v0") == before


def test_card_lists_every_column_with_unit_and_type(dataset):
    text = (dataset / "README.md").read_text()
    assert text.startswith("---\n")
    for schema in (contracts.RUNS, contracts.FLOWS_100MS, contracts.windows_schema()):
        assert f"### `{schema.name}`" in text
        for name, col in schema.columns.items():
            unit = contracts.unit(col) or "-"
            assert any(line.startswith(f"| `{name}` |") and f"| {unit} |" in line for line in text.splitlines()), name
    assert "| `nic_bw` | double | bytes/s | no | > 0 |" in text
    assert "| `t` | double | s | no | >= 0; < 180.0 | bin start, s |" in text
    assert "U[1 - jitter, 1 + jitter]" in text and "5 kB/s of control traffic" in text
    assert "## Known limits" in text and "## License" in text


def test_card_states_the_bin_width_of_the_runs(dataset):
    """Both runs are built at v1's 0.1 s (runs.bin_s): the card says so, from the data."""
    text = " ".join((dataset / "README.md").read_text().split())  # the text, its line breaks as spaces
    widths = set(pd.read_parquet(dataset / "runs.parquet")["bin_s"])
    assert widths == {0.1}
    assert "per bin of the run's width (100 ms (2 runs)) over a 180 s window" in text
    assert "summed into bins of the run's width (`runs.bin_s`; in this build 100 ms (2 runs))" in text
    assert "shorter than two bins (200 ms at 100 ms)" in text
    assert "runs at other widths" not in text
    assert "no per-link volume" not in text  # link_bins holds it (database), the card says where
    assert (
        "bytes per directed link and bin (routes from the network model, ECMP as configured) are in the "
        "database's `link_bins`" in text
    )
    assert "| `n_bins` | int64 | bins | no | >= 1 | bins of the run's bin_s (runs.bin_s) in the window |" in text


def test_card_front_matter_names_the_three_configs(dataset):
    head = (dataset / "README.md").read_text().split("---\n")[1]
    meta = yaml.safe_load(head)
    assert meta["license"] == "apache-2.0"
    assert meta["configs"] == [
        {"config_name": "runs", "data_files": "runs.parquet"},
        {"config_name": "flows_100ms", "data_files": "flows_100ms/*/*.parquet"},
        {"config_name": "windows", "data_files": "windows/*/*.parquet"},
    ]


def test_datasets_load_dataset_reads_the_three_configs_offline(dataset, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "hf" / "datasets"))
    import datasets  # the dev extra brings it: a missing package fails, never skips

    monkeypatch.setattr(datasets.config, "HF_DATASETS_OFFLINE", True, raising=False)
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True, raising=False)
    for name in ("runs", "flows_100ms", "windows"):
        csv = pd.read_csv(dataset / f"{name}.csv")
        got = datasets.load_dataset(str(dataset), name, cache_dir=str(tmp_path / "hf" / "datasets"))["train"]
        assert got.num_rows == len(csv), name
        assert got.column_names == list(csv.columns), name
        df = got.to_pandas()
        if name == "flows_100ms":
            assert df.groupby("run_id")["bytes"].sum().to_dict() == csv.groupby("run_id")["bytes"].sum().to_dict()
        elif name == "runs":
            want = csv.set_index("run_id")["step_time_s"].to_dict()  # %.10g in the CSV
            assert df.set_index("run_id")["step_time_s"].to_dict() == pytest.approx(want, rel=1e-9)
            assert df.set_index("run_id")["inter_node_bytes_per_step"].to_dict() == {
                r: int(v) for r, v in csv.set_index("run_id")["inter_node_bytes_per_step"].items()
            }
        else:
            assert df["total_bytes"].sum() == pytest.approx(csv["total_bytes"].sum(), rel=1e-12)


def test_csv_rows_are_what_pandas_writes_for_the_whole_table(tmp_path):
    """Batches appended one by one give the bytes atomic_write_csv (pandas' to_csv) gives the whole
    table: floats with %.10g (-0.0, NaN as empty), a string that needs quotes (pandas' fallback)."""
    import pyarrow as pa

    from phantora_assets.lib.store import export as ex
    from phantora_assets.lib.store.io import atomic_write_csv

    df = pd.DataFrame(
        {
            "run_id": ["a", "a", "b", "b"],
            "x": [0.1, -0.0, float("nan"), 1 / 3],
            "n": [1, -2, 3, 2**62],
            "s": ["p", "tp=2,dp=4", 'q"', "r"],
        }
    )
    atomic_write_csv(df, tmp_path / "whole.csv")
    table = pa.Table.from_pandas(df, preserve_index=False)
    text = ex.csv_header(table.schema) + b"".join(ex.csv_rows(b) for b in table.to_batches(max_chunksize=1))
    assert text == (tmp_path / "whole.csv").read_bytes()


def test_a_row_breaking_the_contract_publishes_nothing_and_names_the_file(dataset, tmp_path):
    root = tmp_path / "data"
    shutil.copytree(dataset.parent, root)
    before = _digests(root / "phantora_v0")
    bad = DataPaths(root).table(RUNS[1], "flows_100ms")
    df = pd.read_parquet(bad)
    df.loc[5, "bytes"] = -1
    df.to_parquet(bad, index=False)
    specs = [s for s in load_run_matrix() if s.run_id in RUNS]
    result = dataset_stage.export_dataset(specs, DataPaths(root))
    assert not result.outcome.passed
    assert str(bad) in result.outcome.message and "bytes" in result.outcome.message
    assert _digests(root / "phantora_v0") == before
    assert not [p for p in root.iterdir() if p.name.startswith(".phantora_v0.") and p.name != ".phantora_v0.gens"]
    assert not [p for p in (root / ".phantora_v0.gens").iterdir() if p.name.endswith(".tmp")]  # no staging left


def test_a_dataset_without_100ms_runs_lists_only_configs_with_files(tmp_path, monkeypatch):
    """Every run at 10 ms: ``flows_100ms`` has no Parquet file, so the card must not offer a
    ``flows_100ms`` config (``load_dataset`` would fail: "At least one valid data file must be
    specified"); every config it does list loads offline with the CSV's rows."""
    import dataclasses

    spec = dataclasses.replace(next(s for s in load_run_matrix() if s.run_id == RUNS[1]), bin_s=0.01)
    root = tmp_path / "data"
    res = (
        build_defs(root, [spec])
        .resolve_job_def("all_runs")
        .execute_in_process(partition_key=spec.run_id, instance=ephemeral_with_runs([spec.run_id]), run_config=QUIET)
    )
    assert res.success
    result = dataset_stage.export_dataset([spec], DataPaths(root))
    assert result.outcome.passed and result.included == [spec.run_id]
    d = root / "phantora_v0"
    assert not list(d.glob("flows_100ms/*/*.parquet")) and len(pd.read_csv(d / "flows_100ms.csv")) == 0
    text = (d / "README.md").read_text()
    meta = yaml.safe_load(text.split("---\n")[1])
    assert [c["config_name"] for c in meta["configs"]] == ["runs", "windows"]
    assert 'datasets.load_dataset(here, "windows")["train"]  # configs: runs, windows' in text
    assert "- `flows_100ms`: no run, no Parquet file; and `flows_100ms.csv` (its header only)" in text
    import datasets

    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setattr(datasets.config, "HF_DATASETS_OFFLINE", True, raising=False)
    for c in meta["configs"]:
        got = datasets.load_dataset(str(d), c["config_name"], cache_dir=str(tmp_path / "hf"))["train"]
        assert got.num_rows == len(pd.read_csv(d / f"{c['config_name']}.csv")) > 0


def test_load_dataset_after_a_rebuild_reads_the_new_build(tmp_path, monkeypatch):
    """``datasets`` keys its cache of a local folder on the card's YAML (configs, dataset_info), not
    on the files: the same folder rebuilt at 5 ms must not load as the cached 10 ms build. The
    card's dataset_info carries each table's Parquet sha256, so a new build is a new cache entry."""
    import dataclasses

    import datasets

    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setattr(datasets.config, "HF_DATASETS_OFFLINE", True, raising=False)
    base = next(s for s in load_run_matrix() if s.run_id == RUNS[1])
    root, cache = tmp_path / "data", str(tmp_path / "hf")
    for bin_s in (0.01, 0.005):
        spec = dataclasses.replace(base, bin_s=bin_s)
        job = build_defs(root, [spec]).resolve_job_def("all_runs")
        assert job.execute_in_process(
            partition_key=spec.run_id, instance=ephemeral_with_runs([spec.run_id]), run_config=QUIET
        ).success
        assert dataset_stage.export_dataset([spec], DataPaths(root)).outcome.passed
        d = root / "phantora_v0"
        runs = datasets.load_dataset(str(d), "runs", cache_dir=cache)["train"]
        windows = datasets.load_dataset(str(d), "windows", cache_dir=cache)["train"].to_pandas()
        assert runs["bin_s"] == [bin_s]
        assert set(windows["n_bins"]) == {round(1 / bin_s), round(15 / bin_s)}
        assert windows.equals(pd.read_parquet(d / "windows", partitioning=None))
