"""Readers never see a torn dataset (issue 29 item 4): ``phantora_v0`` is a link to the current
generation (lib/store/generations.py), the previous generations stay for a grace period, and a
per-run Parquet file is named by its content. Real Dagster runs of two shipped runs, real exports,
a reader in another process."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import pyarrow.dataset as pads
import pyarrow.parquet as pq
import pytest
from fixtures.materialize import ephemeral_with_runs

from phantora_assets.definitions import build_defs
from phantora_assets.lib.run.spec import RunSpec
from phantora_assets.lib.store import generations
from phantora_assets.paths import DataPaths
from phantora_assets.stages import dataset as dataset_stage

QUIET = {"loggers": {"console": {"config": {"log_level": "CRITICAL"}}}}
A = RunSpec("W4", "l40s", 2, 1)
B = RunSpec("W4", "h100", 2, 1)

#: The reader of the loop test: finds the folder as the dataset card's code does (its ``here = ...``
#: line, given the folder's path, argv[3]) once per read, reads the per-run Parquet files and
#: runs.csv under it, prints one JSON line per read.
READER = r"""
import json, os, sys, time
import pyarrow.dataset as pads, pyarrow.csv as pacsv
root, seconds, here_line = sys.argv[1], float(sys.argv[2]), sys.argv[3]
end = time.time() + seconds
while time.time() < end:
    try:
        ns = {"os": os}
        exec(here_line, ns)
        gen = ns["here"]
        t = pads.dataset(os.path.join(gen, "flows_100ms")).to_table()
        runs = pacsv.read_csv(os.path.join(gen, "runs.csv")).column("run_id").to_pylist()
        flows = t.group_by("run_id").aggregate([("bytes", "sum")]).to_pylist()
        print(json.dumps({"runs": sorted(runs), "flows": sorted((r["run_id"], r["bytes_sum"]) for r in flows)}))
    except Exception as exc:
        print(json.dumps({"error": f"{type(exc).__name__}: {exc}"}))
    sys.stdout.flush()
"""


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("gens") / "data"
    defs = build_defs(root, [A, B])
    for spec in (A, B):
        res = defs.resolve_job_def("all_runs").execute_in_process(
            partition_key=spec.run_id, instance=ephemeral_with_runs([spec.run_id]), run_config=QUIET
        )
        assert res.success
    return root


def _export(root: Path, specs: list[RunSpec]) -> None:
    assert dataset_stage.export_dataset(specs, DataPaths(root)).outcome.passed


def _card_here(root: Path) -> str:
    """The dataset card's line that sets ``here`` (README.md's code block), given the folder's path
    from outside it, as the card says (``realpath(".")`` -> ``realpath("<root>/phantora_v0")``)."""
    card = (root / "phantora_v0" / "README.md").read_text()
    (code,) = re.findall(r"```python\n(.*?)```", card, flags=re.S)
    (line,) = [x for x in code.splitlines() if x.startswith("here, run = ")]
    assert '(".")' in line
    return line.replace('(".")', f"({str(root / 'phantora_v0')!r})", 1)


def _table(path: str | Path) -> pd.DataFrame:
    t = pads.dataset(path).to_table().to_pandas()
    return t.sort_values(["run_id", "t", "src_node", "dst_node"]).reset_index(drop=True)


def test_phantora_v0_links_to_its_generation_and_the_previous_one_stays(root, monkeypatch):
    monkeypatch.setenv("PHANTORA_ASSETS_DATASET_GRACE_S", "600")
    _export(root, [A, B])
    first = generations.current(root / "phantora_v0")
    assert (root / "phantora_v0").is_symlink() and first is not None
    assert os.readlink(root / "phantora_v0") == f".phantora_v0.gens/{first.name}"
    _export(root, [A])
    second = generations.current(root / "phantora_v0")
    assert second is not None and second != first and first.is_dir()  # kept for the grace period
    assert set(pd.read_csv(root / "phantora_v0" / "runs.csv")["run_id"]) == {A.run_id}
    assert set(pd.read_csv(first / "runs.csv")["run_id"]) == {A.run_id, B.run_id}
    # past the grace period the replaced generation goes, the current one never
    later = time.time_ns() + int(601e9)
    assert generations.retire(root / "phantora_v0", 600, now_ns=later) != []
    assert not first.exists() and second.is_dir()
    assert generations.retire(root / "phantora_v0", 0, now_ns=later) == [] and second.is_dir()
    assert not [p for p in generations.generations_dir(root / "phantora_v0").iterdir() if p.name.endswith(".tmp")]


def test_a_reader_that_listed_before_a_swap_reads_the_old_generation_whole(root, monkeypatch):
    monkeypatch.setenv("PHANTORA_ASSETS_DATASET_GRACE_S", "600")
    _export(root, [A, B])
    want = _table(root / "phantora_v0" / "flows_100ms")
    assert set(want["run_id"]) == {A.run_id, B.run_id}
    pinned = pads.dataset(os.path.realpath(root / "phantora_v0") + "/flows_100ms")
    plain = pads.dataset(str(root / "phantora_v0" / "flows_100ms"))
    _export(root, [A])  # B leaves the dataset
    got = pinned.to_table().to_pandas().sort_values(["run_id", "t", "src_node", "dst_node"])
    pd.testing.assert_frame_equal(got.reset_index(drop=True), want)
    # through the link: B's listed file is gone from the new generation -> loud, never a mix
    with pytest.raises(FileNotFoundError):
        plain.to_table()


def test_a_reader_following_the_card_reads_its_generation_whole_across_a_re_export(root, monkeypatch):
    """The card's code run from outside the folder: it lists ``flows_100ms``, a re-export (B leaves)
    swaps the link, then it reads: the rows of the generation it listed, whole (issue 39 item 12: the
    card's ``here = os.path.abspath(...)`` kept the link in every path, and the read failed with
    ``FileNotFoundError ... part-<h>.parquet``: 3 of 791 reads during repeated re-exports)."""
    monkeypatch.setenv("PHANTORA_ASSETS_DATASET_GRACE_S", "600")
    _export(root, [A, B])
    want = _table(root / "phantora_v0" / "flows_100ms")
    ns: dict = {"os": os}
    exec(_card_here(root), ns)
    listed = pads.dataset(f"{ns['here']}/flows_100ms")  # the card's reader, as written: listed
    _export(root, [A])  # ... and a re-export between its listing and its reads
    got = listed.to_table().to_pandas().sort_values(["run_id", "t", "src_node", "dst_node"])
    pd.testing.assert_frame_equal(got.reset_index(drop=True), want)
    assert set(pd.read_csv(f"{ns['here']}/runs.csv")["run_id"]) == {A.run_id, B.run_id}
    assert set(pd.read_csv(root / "phantora_v0" / "runs.csv")["run_id"]) == {A.run_id}


def test_a_changed_run_is_a_new_file_name_so_a_listing_never_mixes_two_generations(root, monkeypatch):
    monkeypatch.setenv("PHANTORA_ASSETS_DATASET_GRACE_S", "600")
    _export(root, [A])
    plain = pads.dataset(str(root / "phantora_v0" / "flows_100ms"))
    (old,) = plain.files
    src = root / "partitions" / A.run_id / "flows_100ms.parquet"
    kept = src.read_bytes()
    try:
        t = pq.read_table(src)
        pq.write_table(t.slice(0, t.num_rows // 2), src)  # the run's rows change
        _export(root, [A])
        (new,) = pads.dataset(str(root / "phantora_v0" / "flows_100ms")).files
        assert Path(new).name != Path(old).name and Path(new).name.startswith("part-")
        with pytest.raises(FileNotFoundError):  # not the new rows under the old listing
            plain.to_table()
    finally:
        src.write_bytes(kept)
    _export(root, [A])
    (again,) = pads.dataset(str(root / "phantora_v0" / "flows_100ms")).files
    assert Path(again).name == Path(old).name  # same bytes, same name: a plain reader keeps reading


def test_a_reader_in_a_loop_during_repeated_exports_never_fails_or_mixes(root, monkeypatch):
    monkeypatch.setenv("PHANTORA_ASSETS_DATASET_GRACE_S", "600")
    gens = {}
    for specs in ([A, B], [A]):
        _export(root, specs)
        t = _table(root / "phantora_v0" / "flows_100ms")
        flows = sorted((r, int(b)) for r, b in t.groupby("run_id")["bytes"].sum().items())
        gens[len(specs)] = json.loads(json.dumps({"runs": sorted(s.run_id for s in specs), "flows": flows}))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    here = _card_here(root)
    reader = subprocess.Popen(
        [sys.executable, "-c", READER, str(root), "25", here], stdout=subprocess.PIPE, text=True, env=env
    )
    n = 0
    try:
        while reader.poll() is None and n < 40:
            _export(root, [A, B] if n % 2 else [A])
            n += 1
    finally:
        out, _ = reader.communicate(timeout=120)
    reads = [json.loads(line) for line in out.splitlines()]
    errors = [r["error"] for r in reads if "error" in r]
    assert errors == []
    seen = [r for r in reads if "error" not in r]
    mixed = [r for r in seen if r not in (gens[1], gens[2])]
    assert mixed == []
    assert n >= 6 and len(seen) >= 10
    assert gens[1] in seen and gens[2] in seen  # both generations were read: the test can see a mix
