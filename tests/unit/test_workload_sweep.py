"""Sweeps vary any workload schema key (``phantora-assets sweep --set``), and the UI metadata and
``phantora-assets runs`` show each run's workload (issue 26 item 7)."""

from __future__ import annotations

import pandas as pd
import pytest

from phantora_assets.cli import main
from phantora_assets.matrix import spec_from_run_id
from phantora_assets.stages.simulation import workload_metadata
from phantora_assets.sweep import grid, parse_set, run_sweep


def test_parse_set_reads_toml_values():
    assert parse_set("parallel.tp=2,4,8") == ("parallel.tp", [2, 4, 8])
    assert parse_set("parallel.dp=rest,2") == ("parallel.dp", ["rest", 2])
    assert parse_set("parallel.sequence_parallel=true") == ("parallel.sequence_parallel", [True])
    with pytest.raises(ValueError, match="parallel.tp=2,4,8"):
        parse_set("parallel.tp")


def test_sweep_varies_schema_keys_and_refuses_bad_points():
    pts = grid(["2x8"], [400], ["W1"], "h100", [parse_set("parallel.tp=2,8,3"), parse_set("train.micro_batch=1,2")])
    assert [p.settings for p in pts][:2] == [
        (("parallel.tp", 2), ("train.micro_batch", 1)),
        (("parallel.tp", 2), ("train.micro_batch", 2)),
    ]
    df = run_sweep(pts[:1] + pts[2:3] + pts[4:5])
    assert list(df["settings"]) == [
        "parallel.tp=2 train.micro_batch=1",
        "parallel.tp=8 train.micro_batch=1",
        "parallel.tp=3 train.micro_batch=1",
    ]
    assert list(df["parallelism"][:2]) == ["tp=2,dp=8", "tp=8,dp=2"]
    assert list(df["status"][:2]) == ["ok", "ok"]
    assert df["status"][2].startswith("invalid: sweep --set parallel.tp=3 train.micro_batch=1 [workloads.W1]")
    assert "tp = 3 must divide heads = 32" in df["status"][2]
    # more tensor parallelism inside a host: less data-parallel traffic crosses the hosts
    assert df["inter_node_bytes_per_step"][1] < df["inter_node_bytes_per_step"][0]


def test_cli_sweep_set(tmp_path, capsys):
    out = tmp_path / "s.csv"
    args = ["sweep", "--layouts", "2x4", "--bandwidths", "200", "--workloads", "W4"]
    rc = main([*args, "--set", "train.micro_batch=1,2", "--out", str(out), "--jobs", "1", "--quiet"])
    assert rc == 0
    df = pd.read_csv(out)
    assert list(df["settings"]) == ["train.micro_batch=1", "train.micro_batch=2"] and set(df["status"]) == {"ok"}


def test_workload_metadata_of_a_run():
    meta = workload_metadata(spec_from_run_id("phantora_a100_40g_W1_2x4"))
    assert meta["model"] == "Llama3-8B (dense, 4 layers, hidden 4096)"
    assert (meta["parallelism"], meta["framework"], meta["seq_len"]) == ("tp=2,dp=4", "megatron", 1024)
    assert meta["batch"] == "global 4 = micro 1 x dp 4 x 1 micro-batches"


_TINY_MATRIX = """
[workloads.tiny]
framework = "megatron"
model = {kind = "dense", layers = 2, hidden = 256, ffn_hidden = 512, heads = 8, kv_heads = 4, vocab = 1024}
parallel = {tp = 2, pp = 2}
train = {seq_len = 128, global_batch = 4, iterations = 3}

[[run]]
workload = "tiny"
gpu = "h100"
nodes = 2
gpus_per_node = 4
"""


def test_sweep_command_sees_the_matrix_files_workloads(tmp_path):
    """`phantora-assets sweep --workloads NAME` with NAME a [workloads.NAME] of $PHANTORA_ASSETS_RUN_MATRIX
    (was: "unknown workload(s) ['tiny']", exit 2): tp = 3 does not divide heads = 8, a row `invalid: <rule>`."""
    import csv
    import os
    import subprocess
    import sys

    matrix = tmp_path / "m.toml"
    matrix.write_text(_TINY_MATRIX)
    out = tmp_path / "sweep.csv"
    proc = subprocess.run(
        [sys.executable, "-m", "phantora_assets.cli", "sweep", "--layouts", "2x4", "--workloads", "tiny"]
        + ["--gpu", "h100", "--set", "parallel.tp=3", "--out", str(out), "--quiet"],
        env={**os.environ, "PHANTORA_ASSETS_RUN_MATRIX": str(matrix)},
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    rows = list(csv.DictReader(out.open()))
    assert rows and all(r["workload"] == "tiny" and r["settings"] == "parallel.tp=3" for r in rows)
    assert all(r["status"].startswith("invalid: ") and "tp = 3 must divide heads = 8" in r["status"] for r in rows)
