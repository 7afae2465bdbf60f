"""Every flow knows its parallelism group (issue 26): a user job of docs/examples/opus_jobs.toml
built for real (``phantora-assets build`` with ``$PHANTORA_ASSETS_RUN_MATRIX``), its flows'
``group`` against the documented placement (tp innermost, then dp, pp outermost), and the group
rule for runs whose communicators are known only by their member ranks."""

from __future__ import annotations

import tomllib
from pathlib import Path

import duckdb
import pandas as pd
import pytest
from fixtures.paths import ROOT

from phantora_assets.cli import main
from phantora_assets.lib.run.spec import RunSpec
from phantora_assets.lib.workload.collectives import comm_groups, run_spec_of
from phantora_assets.lib.workload.placement import rank_coords

EXAMPLE = ROOT / "docs" / "examples" / "opus_jobs.toml"


def _smallest_job() -> dict:
    """The example's smallest job (Llama 3 8B, torchtitan, DP=2 PP=2 TP=4 on 16 GPUs) as written,
    cut to 4 layers and 2 micro-batches a step so that the build stays fast; parallelism, FSDP2,
    sequence parallelism and the schedule are the example's."""
    job = tomllib.loads(EXAMPLE.read_text())["workloads"]["llama3_8b_3d"]
    job["model"]["layers"] = 4
    job["train"].update(global_batch=4, iterations=3, seq_len=2048)
    return job


def _toml(job: dict, name: str, nodes: int, gpn: int) -> str:
    lines = [f"[workloads.{name}]", f'framework = "{job["framework"]}"']
    for sect in ("model", "parallel", "train"):
        lines.append(f"[workloads.{name}.{sect}]")
        for k, v in job[sect].items():
            lines.append(
                f"{k} = " + (f'"{v}"' if isinstance(v, str) else str(v).lower() if isinstance(v, bool) else str(v))
            )
    lines += ["[[run]]", f'workload = "{name}"', 'gpu = "h100"', f"nodes = {nodes}", f"gpus_per_node = {gpn}"]
    return "\n".join(lines) + "\n"


def test_example_matrix_validates():
    from phantora_assets.matrix import load_run_matrix

    specs = {s.workload: s for s in load_run_matrix(EXAMPLE)}
    assert {w: s.parallelism for w, s in specs.items()} == {
        "llama3_8b_3d": "tp=4,pp=2,dp=2,zero=3",
        "llama3_8b_3d_64": "tp=4,pp=2,dp=8,zero=3",
        "deepseek_16b": "tp=4,pp=4,dp=1",
        "deepseek_v2": "tp=4,pp=8,ep=32,dp=8",
    }
    assert specs["deepseek_v2"].world_size == 256 and specs["deepseek_v2"].par.edp == 1


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> tuple[Path, RunSpec]:
    tmp = tmp_path_factory.mktemp("groups")
    matrix = tmp / "jobs.toml"
    matrix.write_text(_toml(_smallest_job(), "llama3_8b_3d", 4, 4))  # 4 GPUs a host: tp in a host, dp and pp across
    mp = pytest.MonkeyPatch()
    mp.setenv("PHANTORA_ASSETS_RUN_MATRIX", str(matrix))
    try:
        from phantora_assets.matrix import load_run_matrix

        (spec,) = load_run_matrix(matrix)
        rc = main(["build", "--data-dir", str(tmp / "data"), "--quiet", "--no-plots"])
    finally:
        mp.undo()
    assert rc == 0
    return tmp / "data", spec


def test_flows_groups_match_the_placement(built):
    root, spec = built
    flows = pd.read_parquet(root / "partitions" / spec.run_id / "flows.parquet")
    assert set(flows["group"]) == {"dp", "pp"}  # tp stays inside a host: no network flow
    g = spec.gpus_per_node
    for row in flows.drop_duplicates(["group", "src_node", "dst_node"]).itertuples():
        a, b = row.src_node * g, row.dst_node * g  # a rank of each host: hosts hold whole tp groups
        ca, cb = rank_coords(spec.par, a), rank_coords(spec.par, b)
        if row.group == "pp":  # hosts 0-1 hold stage 0, hosts 2-3 stage 1
            assert (ca["pp"], cb["pp"]) in ((0, 1), (1, 0)) and ca["dp"] == cb["dp"]
        else:  # FSDP over dp: the two dp replicas of one stage
            assert ca["pp"] == cb["pp"] and ca["dp"] != cb["dp"]
    pairs = set(zip(flows["src_node"], flows["dst_node"], flows["group"]))
    assert pairs == {(0, 1, "dp"), (1, 0, "dp"), (2, 3, "dp"), (3, 2, "dp"), (0, 2, "pp"), (2, 0, "pp")} | {
        (1, 3, "pp"),
        (3, 1, "pp"),
    }


def test_group_bytes_view_and_summary(built):
    root, spec = built
    con = duckdb.connect(str(root / "phantora.duckdb"), read_only=True)
    got = dict(
        con.execute('SELECT "group", bytes_per_step FROM group_bytes WHERE run_id = ?', [spec.run_id]).fetchall()
    )
    import json

    summary = json.loads((root / "partitions" / spec.run_id / "trace_summary.json").read_text())
    assert set(got) == set(summary["network_bytes_by_group"]) == {"dp", "pp"}
    assert sum(summary["network_bytes_by_group"].values()) == pytest.approx(summary["network_bytes_per_step"], rel=1e-6)
    # pp: per micro-batch one activation and one gradient message of [seq, hidden / tp] bf16 on each
    # of the 8 pipeline communicators, and the 1-element fp32 grad-norm all-reduce (2 hops of 4 bytes)
    m = spec.par.micro_batches
    assert summary["network_bytes_by_group"]["pp"] == 8 * (2 * m * 2048 * 4096 // 4 * 2 + 2 * 4)


def test_groups_from_member_ranks_without_names():
    """A run whose communicator ids say nothing (Phantora in Docker, imports): senders and size
    against the layout's communicators; a set of ranks no communicator holds is ``other``."""
    spec = run_spec_of(_smallest_job(), 4, 4, "h100", "llama3_8b_3d")
    spec = RunSpec(spec.workload, spec.gpu, 4, 4, source="docker", workload_def=spec.workload_def)
    rows = []
    for cid, ranks in {"a": (0, 1, 2, 3), "b": (0, 4), "c": (0, 8), "d": (0, 5)}.items():
        for i, r in enumerate(ranks):
            rows.append({"comm_id": cid, "src_node": r // 4, "stream": (r % 4) << 32, "comm_rank": i})
    assert comm_groups(spec, pd.DataFrame(rows)) == {"a": "tp", "b": "dp", "c": "pp", "d": "other"}
