"""PyTorch profiler traces without ``distributedInfo``: ``phantora-assets import PATH --world-size N``
(and ``--rank R`` for a folder of one trace; ranks from file names such as ``rank-3`` / ``rank3``
otherwise) places them; they are still declined, naming the file and the reason, when they lack
message sizes or the rank cannot be told. Small traces in the real format (tests/fixtures/kineto_traces.py)
with the bytes by hand, and the real HTA trace without distributedInfo (MIT, tests/data/kineto_hta/)."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest
from fixtures.kineto_traces import Coll, kineto_layout, rank_trace
from fixtures.materialize import materialize_run
from fixtures.paths import ROOT

from phantora_assets.cli import main
from phantora_assets.imported_runs import read_registry
from phantora_assets.lib.errors import RunMatrixError
from phantora_assets.lib.kineto.run import convert, rank_from_name, read_folder
from phantora_assets.lib.run.spec import RunSpec, validate
from phantora_assets.paths import DataPaths
from phantora_assets.stages.simulation import run_spec_record

NO_INFO = ROOT / "tests" / "data" / "kineto_hta" / "distributed_info_unavailable"
G = (0, 1, 2, 3)
COLLS = [
    Coll("allreduce", 1000, 1000, "BFloat16", G),  # S = 2000 B: 4 hops of floor(2000 * 2 * 3 / 4) = 3000
    Coll("_allgather_base", 250, 1000, "Float", G),  # per-rank S = 1000 B: 4 hops of 3 * 1000 = 3000
    Coll("alltoall_base", 400, 400, "Half", G, in_split=(1, 1, 1, 1)),  # 12 flows of 100 x 2 B = 200
]
#: 2 hosts of 2 GPUs: per ring 2 of the 4 hops cross hosts (2 x 3000 twice), 8 of the 12 all-to-all flows.
NET_PER_STEP = 2 * 3000 + 2 * 3000 + 8 * 200


def _bare(rank: int, world: int, colls=COLLS, **kw) -> dict:
    """A rank's trace as a profiler without torch.distributed writes it: no distributedInfo."""
    t = rank_trace(rank, world, colls, **kw)
    del t["distributedInfo"]
    return t


def _write(folder: Path, name: str, trace: dict) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / name).write_bytes(gzip.compress(kineto_layout(trace).encode(), mtime=0))
    return folder / name


def _import(folder: Path, data: Path, *opts: str) -> int:
    return main(["import", str(folder), "--data-dir", str(data), "--no-build", *opts])


def test_rank_from_the_file_name():
    names = {
        "rank-0.Apr_03_18_51_38.1102.pt.trace.json.gz": 0,  # the HTA traces' names
        "rank34.json": 34,
        "job_rank_3.pt.trace.json": 3,
        "rank1_of_rank1.json": 1,  # the same rank twice is one rank
        "rank1_rank2.json": None,  # two ranks: ambiguous
        "frank3.json": None,  # not the word rank
        "distributed_info_not_found.json.gz": None,
    }
    assert {n: rank_from_name(Path(n)) for n in names} == names


def test_one_trace_with_world_size_and_rank_imports_and_builds(tmp_path, capsys):
    folder = tmp_path / "probe"
    _write(folder, "worker.pt.trace.json.gz", _bare(0, 4, steps=6))
    data = tmp_path / "data"
    assert _import(folder, data) == 2  # no placement at all
    err = capsys.readouterr().err
    assert err.startswith(f"import: declined {folder / 'worker.pt.trace.json.gz'}: no distributedInfo (")
    assert "give --world-size N (the job's GPU count) and, for a folder of one trace, --rank R" in err
    assert _import(folder, data, "--world-size", "4") == 2  # no rank: the name gives none
    err = capsys.readouterr().err
    assert err.startswith(f"import: declined {folder / 'worker.pt.trace.json.gz'}: no distributedInfo (")
    assert "--world-size 4 is given, but not the rank: the file name names none" in err
    assert read_registry(data) == []
    assert _import(folder, data, "--world-size", "4", "--rank", "0", "--gpus-per-node", "2") == 0
    (spec,) = read_registry(data)
    assert (spec.run_id, spec.source, spec.layout, spec.rank) == ("probe_2x2", "kineto", "2x2", 0)
    assert "rank = 0\n" in (data / "imports.toml").read_text()
    assert run_spec_record(spec).inputs["entry"]["rank"] == 0
    res = materialize_run(data, "probe_2x2")
    assert res.success
    flows = res.asset_materializations_for_node("validated_flows")[0].metadata
    assert flows["network_bytes_per_step"].value == NET_PER_STEP and flows["step_time_ms"].value == 10.0
    rec = json.loads((DataPaths(data).partition_dir("probe_2x2") / "kineto.json").read_text())
    assert rec["backend"] == "" and rec["ranks_present"] == [0] and rec["world_size"] == 4
    assert any(
        n.startswith("no distributedInfo in the trace(s) of rank(s) 0: placed by the world size 4")
        for n in rec["notes"]
    )


def test_ranks_of_several_traces_come_from_their_names(tmp_path, capsys):
    folder = tmp_path / "pair"
    colls = [Coll("allreduce", 8, 8, "Float", (0, 1))]  # S = 32 B: 2 hops of floor(32 * 2 * 1 / 2) = 32
    for r in (0, 1):
        _write(folder, f"rank{r}.json.gz", _bare(r, 2, colls))
    run = read_folder(folder, 1, 2)
    assert [(rt.rank, rt.world_size, rt.placed) for rt in run.ranks] == [(0, 2, "given"), (1, 2, "given")]
    conv = convert(run)
    comm = conv.raw[conv.raw["kind"] == "communication"]
    pairs = sorted(zip(comm["src_host"], comm["dst_host"], comm["bytes"]))  # 4 steps, a ring of 2 each
    assert pairs == [("host-1", "host-2", 32)] * 4 + [("host-2", "host-1", 32)] * 4
    data = tmp_path / "data"
    assert _import(folder, data, "--rank", "0", "--world-size", "2") == 2  # --rank names one trace only
    assert f"import: declined {folder}: placement (--rank 0 names the rank of a folder of one trace" in (
        capsys.readouterr().err
    )
    assert _import(folder, data, "--world-size", "2") == 0
    assert [(s.run_id, s.layout, s.rank) for s in read_registry(data)] == [("pair_2x1", "2x1", None)]
    _write(folder, "rank0_rank1.json.gz", _bare(0, 2, colls))  # a third file whose name says two ranks
    assert _import(folder, data, "--world-size", "2") == 2
    err = capsys.readouterr().err
    assert err.startswith(f"import: declined {folder / 'rank0_rank1.json.gz'}: no distributedInfo (")
    assert "the file name names none (rank-<r> / rank<r>) or more than one" in err


def test_the_placement_given_must_agree_with_distributedInfo(tmp_path, capsys):
    folder = tmp_path / "job"
    _write(folder, "trace.json.gz", rank_trace(1, 2, [Coll("allreduce", 8, 8, "Float", (0, 1))]))
    data = tmp_path / "data"
    assert _import(folder, data, "--world-size", "4") == 2
    assert f"import: declined {folder / 'trace.json.gz'}: layout (world size 2, but --world-size 4)" in (
        capsys.readouterr().err
    )
    assert _import(folder, data, "--rank", "0") == 2
    assert f"{folder / 'trace.json.gz'}: placement (--rank 0, but its distributedInfo.rank is 1)" in (
        capsys.readouterr().err
    )
    assert _import(folder, data, "--world-size", "2", "--rank", "1") == 0  # agreeing options are fine
    assert [(s.layout, s.rank) for s in read_registry(data)] == [("2x1", 1)]


def test_traces_without_sizes_are_still_declined_with_the_options(tmp_path, capsys):
    """The real HTA trace without distributedInfo also lacks message sizes: placed by the options,
    it is declined for that, naming the file; a world size of 1 is declined as such."""
    data = tmp_path / "data"
    assert _import(NO_INFO, data, "--world-size", "8", "--rank", "0") == 2
    err = capsys.readouterr().err
    assert err.startswith(f"import: declined {NO_INFO / 'distributed_info_not_found.json.gz'}: no message sizes (")
    assert "nccl:all_to_all x6, record_param_comms x12" in err
    folder = tmp_path / "single"
    _write(folder, "rank-0.json.gz", _bare(0, 1, [Coll("allreduce", 8, 8, "Float", (0,))]))
    assert _import(folder, data, "--world-size", "1") == 2
    assert "rank-0.json.gz: world size 1 (the world size given = 1: a single-GPU job has no network traffic)" in (
        capsys.readouterr().err
    )
    assert read_registry(data) == []


def test_rank_follows_the_matrix_rules():
    validate(RunSpec("", "", 2, 2, source="kineto", path="/t", name="job", rank=3), "t")
    for bad in (
        RunSpec("", "", 2, 2, source="kineto", path="/t", name="job", rank=4),  # not below the world size
        RunSpec("", "", 2, 2, source="kineto", path="/t", name="job", rank=-1),
        RunSpec("", "", 2, 2, source="kineto", path="/t", name="job", rank=True),  # type: ignore[arg-type]
        RunSpec("", "", 2, 2, source="chakra", path="/t", name="job", rank=0),  # a Chakra rank is in its name
        RunSpec("W1", "a100_40g", 2, 2, rank=0),
    ):
        with pytest.raises(RunMatrixError, match="rank is a kineto run's traced rank"):
            validate(bad, "t")
