"""The export of a simulated run from its step program (issue 42): a small 3-D job (torchtitan, TP 2,
PP 2, DP 2 on 2 hosts of 4 GPUs) replayed through an independent replayer written from Chakra's
semantics (tests/fixtures/chakra_replayer.py) gives the simulator's step within 10 %; the dependencies
a replay needs are there (FSDP gathers and pipeline receives before the compute that consumes them);
pipeline traffic is matched send/receive pairs; the stream order goes to ctrl_deps or data_deps."""

from __future__ import annotations

import hashlib
import tomllib
from pathlib import Path

import pytest
from fixtures.chakra_replayer import Network, load_groups, replay
from fixtures.paths import ROOT

from phantora_assets.lib.chakra.et_io import read_et
from phantora_assets.lib.chakra.program import export_program
from phantora_assets.lib.phantora.netconfig import netconfig_for
from phantora_assets.matrix import load_run_matrix

EXAMPLE = ROOT / "docs" / "examples" / "opus_jobs.toml"
TOLERANCE = 0.10  # the bound; the replay of this job lands within 1 %


def _job_toml(tmp: Path) -> Path:
    """The example's Llama 3 8B torchtitan job (FSDP2 + TP with sequence parallelism + PP 1F1B) cut to 4
    layers, 4 micro-batches of 2,048 tokens, TP 2 x PP 2 x DP 2 on 2 hosts of 4 GPUs."""
    job = tomllib.loads(EXAMPLE.read_text())["workloads"]["llama3_8b_3d"]
    job["model"]["layers"] = 4
    job["parallel"].update(tp=2, pp=2, dp=2)
    job["train"].update(global_batch=8, iterations=3, seq_len=2048)
    lines = ["[workloads.small3d]", f'framework = "{job["framework"]}"']
    for sect in ("model", "parallel", "train"):
        lines.append(f"[workloads.small3d.{sect}]")
        for k, v in job[sect].items():
            lines.append(
                f"{k} = " + (f'"{v}"' if isinstance(v, str) else str(v).lower() if isinstance(v, bool) else str(v))
            )
    lines += ["[[run]]", 'workload = "small3d"', 'gpu = "h100"', "nodes = 2", "gpus_per_node = 4"]
    path = tmp / "jobs.toml"
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("small3d")
    (spec,) = load_run_matrix(_job_toml(tmp))
    out = tmp / "et"
    summary = export_program(spec, [1, 2], out, "s")
    return spec, out, summary


def _network(spec, out: Path, prefix: str) -> Network:
    """The run's fabric (its netconfig.toml: host NIC and loopback speeds in Gbps) as the replayer's
    equivalent network; the fabric has no latency (alpha 0)."""
    cfg = netconfig_for(spec)
    host, loop = float(cfg["topology"]["args"]["host_bw"]), float(cfg["simulator"]["loopback_speed"])
    return Network(load_groups(out, prefix), spec.gpus_per_node, host * 1e9, loop * 1e9)


def test_replay_gives_the_simulated_step(exported):
    spec, out, summary = exported
    assert spec.parallelism == "tp=2,pp=2,dp=2,zero=3"
    makespan, _ = replay(out, "s", _network(spec, out, "s"))
    ours = sum(summary.step_ns) / 1e9
    assert abs(makespan - ours) <= TOLERANCE * ours, (makespan, ours)


def test_consumers_wait_for_their_collectives(exported):
    spec, out, _ = exported
    groups = load_groups(out, "s")
    for rank in (0, 4):  # the first rank of each stage (placement: tp innermost, then dp, pp outermost)
        nodes = read_et(out / f"s.{rank}.et").nodes
        by_id = {n.id: n for n in nodes}
        fwd = [n for n in nodes if n.type == 4 and ".fwd" in n.name and n.name.startswith("layers.")]
        assert fwd
        for n in fwd:  # FSDP2 (fully_shard per block) all-gathers a block's parameters before its forward
            kinds = {(by_id[d].type, by_id[d].attrs.get("comm_type")) for d in n.data_deps}
            gathers = [by_id[d] for d in n.data_deps if by_id[d].attrs.get("comm_type") == 2]
            assert (7, 2) in kinds and all(len(groups[g.attrs["pg_name"]]) == 2 for g in gathers), n
        recvs = [n for n in nodes if n.type == 6]
        assert recvs
        for rv in recvs:  # a pipeline receive is a data dependency of the next compute
            nxt = next(m for m in nodes[rv.id :] if m.type == 4 and not m.attrs["is_cpu_op"])
            assert rv.id in nxt.data_deps, (rv, nxt)


def test_pipeline_traffic_is_matched_send_recv(exported):
    spec, out, _ = exported
    sends, recvs = {}, {}
    for rank in range(spec.world_size):
        for n in read_et(out / f"s.{rank}.et").nodes:
            key = (n.attrs.get("comm_src"), n.attrs.get("comm_dst"), n.attrs.get("comm_tag"))
            if n.type == 5:
                assert n.attrs["comm_src"] == rank and key not in sends
                sends[key] = n.attrs["comm_size"]
            elif n.type == 6:
                assert n.attrs["comm_dst"] == rank and key not in recvs
                recvs[key] = n.attrs["comm_size"]
            elif n.type == 7:
                assert n.attrs["comm_type"] != 6  # no all-to-all stands for pipeline traffic
    assert sends and sends == recvs
    # 1F1B over 4 micro-batches (8 sequences over DP 2), 2 steps: each of the 4 stage-0 ranks sends 4
    # activations a step, each of the 4 stage-1 ranks 4 gradients
    assert len(sends) == 2 * 2 * 4 * 4


def test_stream_order_in_data_deps(exported, tmp_path):
    spec, out, summary = exported
    data = export_program(spec, [1, 2], tmp_path, "d", stream_order="data")
    for rank in (0, 7):
        a, b = read_et(out / f"s.{rank}.et").nodes, read_et(tmp_path / f"d.{rank}.et").nodes
        assert any(n.ctrl_deps for n in a) and not any(n.ctrl_deps for n in b)
        assert [sorted(set(x.data_deps) | set(x.ctrl_deps)) for x in a] == [x.data_deps for x in b]
    assert data.step_ns == summary.step_ns
    assert replay(tmp_path, "d", _network(spec, tmp_path, "d"))[0] == replay(out, "s", _network(spec, out, "s"))[0]


def test_stream_order_is_checked(exported, tmp_path):
    spec, _, _ = exported
    with pytest.raises(ValueError, match="stream order 'both'"):
        export_program(spec, [1], tmp_path, "x", stream_order="both")
    with pytest.raises(ValueError, match="not steady steps"):
        export_program(spec, [0, 1], tmp_path, "x")


def test_without_the_waits_the_replay_is_short(exported, tmp_path):
    """The tolerance tells: the same ETs without the collective -> compute data dependencies (the
    export before issue 42 had none) replay more than 10 % short of the simulated step."""
    from phantora_assets.lib.chakra.et_io import write_et

    spec, out, summary = exported
    for rank in range(spec.world_size):
        et = read_et(out / f"s.{rank}.et")
        comm = {n.id for n in et.nodes if n.type in (5, 6, 7)}
        for n in et.nodes:
            if n.type == 4:
                n.data_deps = [d for d in n.data_deps if d not in comm]
                n.ctrl_deps = [d for d in n.ctrl_deps if d not in comm]
        write_et(tmp_path / f"s.{rank}.et", et.metadata, et.nodes)
    (tmp_path / "s.comm_groups.json").write_text((out / "s.comm_groups.json").read_text())
    makespan, _ = replay(tmp_path, "s", _network(spec, tmp_path, "s"))
    assert makespan < (1 - TOLERANCE) * sum(summary.step_ns) / 1e9


def _toml_of(name: str, job: dict, nodes: int, gpn: int, tmp: Path) -> Path:
    lines = [f"[workloads.{name}]", f'framework = "{job["framework"]}"']
    for sect in ("model", "parallel", "train"):
        lines.append(f"[workloads.{name}.{sect}]")
        for k, v in job[sect].items():
            lines.append(
                f"{k} = " + (f'"{v}"' if isinstance(v, str) else str(v).lower() if isinstance(v, bool) else str(v))
            )
    lines += ["[[run]]", f'workload = "{name}"', 'gpu = "h100"', f"nodes = {nodes}", f"gpus_per_node = {gpn}"]
    path = tmp / f"{name}.toml"
    path.write_text("\n".join(lines) + "\n")
    return path


def _shapes(tmp: Path) -> list[tuple[str, Path]]:
    """Jobs of several shapes: the 3-D job with TP inside a host and across hosts (2 GPUs a host), and
    a DeepSeek-V2 MoE job cut to 4 layers with expert parallelism (all-to-all) over PP 2 x TP 2 x DP 2."""
    jobs = tomllib.loads(EXAMPLE.read_text())["workloads"]
    small = jobs["llama3_8b_3d"]
    small["model"]["layers"] = 4
    small["parallel"].update(tp=2, pp=2, dp=2)
    small["train"].update(global_batch=8, iterations=3, seq_len=2048)
    moe = jobs["deepseek_v2"]
    moe["model"].update(layers=4, experts=8)
    moe["parallel"].update(tp=2, pp=2, dp=2, ep=4, first_stage_layers=2)
    moe["train"].update(global_batch=8, seq_len=1024)
    return [
        ("s2x4", _toml_of("s3d", small, 2, 4, tmp)),
        ("s4x2", _toml_of("s3d", small, 4, 2, tmp / "x2")),
        ("moe", _toml_of("dsv2", moe, 2, 4, tmp / "moe")),
    ]


def _digests(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir())}


@pytest.mark.parametrize(("stream_order", "compress"), [("ctrl", True), ("data", True), ("ctrl", False)])
def test_alike_ranks_encoded_once_give_the_walks_bytes(tmp_path, monkeypatch, stream_order, compress):
    """The export encodes one rank of a class of alike ranks and fills in the others' times, streams,
    pg_name and peers (program._Template); every file is byte-identical (sha256) to the rank walked
    node by node and encoded field by field through protobuf (``share=False``, the export before).
    ``compress=False``: every rank simulated (as when a stage's ranks differ, e.g. the 1,024-GPU job),
    so each rank reads its times from its own DAG nodes."""
    from phantora_assets.lib.sim import analytic

    if not compress:
        init = analytic.AnalyticSimulator.__init__
        monkeypatch.setattr(
            analytic.AnalyticSimulator, "__init__", lambda self, *a, **k: init(self, *a, **{**k, "compress": False})
        )
    (tmp_path / "x2").mkdir()
    (tmp_path / "moe").mkdir()
    for label, toml in _shapes(tmp_path):
        (spec,) = load_run_matrix(toml)
        shared, walked = tmp_path / f"{label}_shared", tmp_path / f"{label}_walked"
        a = export_program(spec, [1, 2], shared, "j", stream_order)
        b = export_program(spec, [1, 2], walked, "j", stream_order, share=False)
        assert len(a.files) == spec.world_size, label
        assert _digests(shared) == _digests(walked), label
        assert a.nodes == b.nodes, label
        assert a.symmetry.startswith("one rank" if compress else "every rank"), label


def _cp_job(tmp: Path) -> Path:
    """The 3-D job's Llama block as a Megatron job with context parallelism: CP 2 x PP 2 x DP 2 on 2 hosts
    of 4 GPUs, 4 layers, 4 micro-batches of 1,024 tokens (the ring exchange runs once a layer a
    micro-batch, under one tag)."""
    job = tomllib.loads(EXAMPLE.read_text())["workloads"]["llama3_8b_3d"]
    job["framework"] = "megatron"
    job["model"]["layers"] = 4
    job["parallel"] = {"tp": 1, "pp": 2, "dp": 2, "cp": 2, "zero": 1, "pp_schedule": "1f1b"}
    job["train"] = {"seq_len": 1024, "micro_batch": 1, "global_batch": 8, "recompute": "none", "iterations": 3}
    return _toml_of("cp", job, 2, 4, tmp)


def test_every_send_has_its_own_tag_and_one_receive(tmp_path):
    """A send and its receive are one message: (comm_src, comm_dst, comm_tag) names one call, since
    ASTRA-sim's analytical backend keys a message by (tag, src, dst, size, chunk) (its
    ``CallbackTracker``), and two in flight under one key are taken as one. The context-parallel ring
    exchange issues one tag once a micro-batch (4 a step here): each call needs its own tag (before:
    the 4 calls of a step shared one). Every send matches exactly one receive of the same size on the peer."""
    (spec,) = load_run_matrix(_cp_job(tmp_path))
    assert spec.parallelism == "pp=2,cp=2,dp=2"
    out = tmp_path / "et"
    export_program(spec, [1, 2], out, "c")
    sends: dict[tuple, int] = {}
    recvs: dict[tuple, int] = {}
    n_send = n_recv = 0
    for rank in range(spec.world_size):
        for n in read_et(out / f"c.{rank}.et").nodes:
            key = (n.attrs.get("pg_name"), n.attrs.get("comm_src"), n.attrs.get("comm_dst"), n.attrs.get("comm_tag"))
            if n.type == 5:
                n_send += 1
                assert n.attrs["comm_src"] == rank
                sends[key] = n.attrs["comm_size"]
            elif n.type == 6:
                n_recv += 1
                assert n.attrs["comm_dst"] == rank
                recvs[key] = n.attrs["comm_size"]
    assert any(".cp_ring" in n.name for n in read_et(out / "c.0.et").nodes)
    assert len(sends) == n_send and len(recvs) == n_recv  # no two calls share a key
    assert sends == recvs
    assert _digests(out) == _digests_of(spec, tmp_path / "walked")


def _digests_of(spec, out: Path) -> dict[str, str]:
    export_program(spec, [1, 2], out, "c", share=False)
    return _digests(out)


@pytest.mark.parametrize("prefix", ["../escaped", "a/b", "", ".."])
def test_a_prefix_with_a_path_is_refused_and_nothing_is_written(exported, tmp_path, prefix):
    """``OUT_DIR/P.<rank>.et``: a prefix holding a path separator wrote elsewhere (before: ``../escaped``
    put every ET and the comm groups beside OUT_DIR, ``a/b`` into a new sub-folder)."""
    spec, _, _ = exported
    out = tmp_path / "out"
    with pytest.raises(ValueError, match="plain file name"):
        export_program(spec, [1], out, prefix)
    assert sorted(p.name for p in tmp_path.rglob("*")) == []


def test_an_out_dir_that_is_a_file_is_refused(exported, tmp_path):
    """Before: ``FileExistsError`` from ``mkdir`` after the whole simulation (a traceback from the CLI)."""
    spec, _, _ = exported
    (tmp_path / "f").write_text("x")
    with pytest.raises(ValueError, match="is not a folder"):
        export_program(spec, [1], tmp_path / "f", "p")
    assert [p.name for p in tmp_path.iterdir()] == ["f"] and (tmp_path / "f").read_text() == "x"
