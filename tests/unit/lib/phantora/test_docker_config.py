"""The Docker simulator's generated files and command lines, parsed back and compared with
Phantora's conventions (PHANTORA_FORMATS.md section 1; upstream tests/docker/*/config_gen.py)."""

from __future__ import annotations

import shlex
import tomllib
from pathlib import Path

import pytest
import yaml

from phantora_assets.lib.phantora.docker_config import (
    DockerSettings,
    command_lines,
    config_files,
    container_kwargs,
    launch_table,
    layout_for,
    missing_listing,
    training_argv,
    training_hosts,
)
from phantora_assets.lib.run.catalog import shipped_workloads
from phantora_assets.lib.run.spec import RunSpec
from phantora_assets.matrix import spec_from_run_id
from phantora_assets.paths import DataPaths
from phantora_assets.resources import AnalyticSimulatorResource, PhantoraDocker, simulator_from_env

SETTINGS = DockerSettings(phantora_tests_dir="/opt/phantora/tests")


def _files(tmp_path: Path, spec: RunSpec, replay: bool = True, settings: DockerSettings = SETTINGS):
    paths = DataPaths(tmp_path / "data")
    layout = layout_for(spec, paths.root, paths.run_folder(spec))
    return layout, config_files(spec, settings, layout, replay)


def test_compose_follows_phantora_conventions(tmp_path):
    spec = spec_from_run_id("phantora_l40s_W1_2x1")
    layout, files = _files(tmp_path, spec)
    compose = yaml.safe_load(files["compose.yaml"])
    assert compose["name"] == "phantora-phantora_l40s_w1_2x1"
    services = compose["services"]
    assert list(services) == ["simulator", "host-1", "host-2"]
    sim = services["simulator"]
    assert sim["image"] == "phantora:latest"
    assert sim["pid"] == "host" and sim["ipc"] == "host"
    assert sim["command"] == (
        "/phantora/dist/phantora_server --netconfig /netconfig.toml "
        "--timeline-file /phantora/out/timeline.bin --perf-db /phantora/perfdb/l40s"
    )
    assert sim["volumes"] == [
        "/run/phantora/phantora_l40s_W1_2x1:/run/phantora",
        "./netconfig.toml:/netconfig.toml:ro",
        "../../../../work/phantora_l40s_W1_2x1/perfdb:/phantora/perfdb",
        "../../../../work/phantora_l40s_W1_2x1/out:/phantora/out",
    ]
    assert "PHANTORA_SOCKET_PREFIX=/run/phantora/phantora" in sim["environment"]
    assert "deploy" not in sim  # replay: no GPU reservation
    for i in (1, 2):
        host = services[f"host-{i}"]
        assert host["hostname"] == f"host-{i}"
        assert host["pid"] == "host" and host["ipc"] == "host"
        assert host["volumes"] == [
            "/run/phantora/phantora_l40s_W1_2x1:/run/phantora",
            "/opt/phantora/tests:/phantora/tests:ro",
        ]
        assert host["command"] == "sleep infinity"
        assert host["depends_on"] == ["simulator"]
        env = dict(e.split("=", 1) for e in host["environment"])
        assert env == {
            "CUDA_DEVICE_MAX_CONNECTIONS": "1",
            "PHANTORA_NGPU": "1",
            "PHANTORA_VRAM_MIB": str(46 * 1024),
            "PHANTORA_IGNORE_CPU_TIME": "1",
            "PHANTORA_SOCKET_PREFIX": "/run/phantora/phantora",
            "PHANTORA_GPU_NAME": "NVIDIA L40S",
        }
    # the relative paths land in the data root's work folder
    assert (layout.config_dir / "../../../../work/phantora_l40s_W1_2x1/out").resolve() == layout.out_dir.resolve()
    assert "hostfile" not in files  # Megatron needs none


def test_profiling_without_perf_db_reserves_the_gpu(tmp_path):
    spec = spec_from_run_id("phantora_a100_40g_W1_2x2")
    _, files = _files(tmp_path, spec, replay=False)
    sim = yaml.safe_load(files["compose.yaml"])["services"]["simulator"]
    assert "--perf-db" not in sim["command"]
    assert sim["deploy"]["resources"]["reservations"]["devices"] == [
        {"driver": "nvidia", "device_ids": ["0"], "capabilities": ["gpu"]}
    ]
    kw = container_kwargs("simulator", sim, Path("/x/config"), "p")
    assert kw["device_requests"] == [{"driver": "nvidia", "device_ids": ["0"], "capabilities": [["gpu"]]}]
    env = dict(e.split("=", 1) for e in yaml.safe_load(files["compose.yaml"])["services"]["host-1"]["environment"])
    assert env["PHANTORA_VRAM_MIB"] == str(40 * 1024) and env["PHANTORA_NGPU"] == "2"


def test_netconfig_parses_back(tmp_path):
    spec = spec_from_run_id("phantora_a100_40g_W4_4x2")
    _, files = _files(tmp_path, spec)
    cfg = tomllib.loads(files["netconfig.toml"])
    assert cfg == {
        "host_mapping": ["host-1", "host-2", "host-3", "host-4"],
        "simulator": {"loopback_speed": 2880, "fairness": "PerFlowMaxMin"},
        "topology": {
            "type": "TwoLayerMultiPath",
            "args": {
                "nspines": 2,
                "nracks": 2,
                "rack_size": 2,
                "host_bw": 800,
                "rack_uplink_port_bw": 800,
                "load_balancer_type": "EcmpEverything",
            },
        },
    }


def test_deepspeed_files_and_command(tmp_path):
    spec = spec_from_run_id("phantora_a100_40g_W4_2x2")
    _, files = _files(tmp_path, spec)
    assert files["hostfile"] == "host-1 slots=2\nhost-2 slots=2\n"
    env = dict(line.split("=", 1) for line in files["deepspeed_env"].splitlines())
    assert env["PHANTORA_NGPU"] == "2" and env["PHANTORA_VRAM_MIB"] == "40960" and env["PHANTORA"] == "1"
    assert env["LD_PRELOAD"] == "/phantora/dist/libcuda.so.1"
    host = yaml.safe_load(files["compose.yaml"])["services"]["host-2"]
    assert host["command"] == "/usr/sbin/sshd -D"
    assert "./hostfile:/hostfile:ro" in host["volumes"]
    assert "./deepspeed_env:/root/.deepspeed_env:ro" in host["volumes"]
    assert training_hosts(spec) == ["host-1"]
    assert training_argv(spec) == [
        "/phantora/dist/phantora_run",
        "deepspeed",
        "-H",
        "/hostfile",
        "/phantora/tests/test_deepspeed.py",
        "--num_layers",
        "4",
        "--sequence_length",
        "1024",
        "--iterations",
        "20",
        "--hidden_size",
        "4096",
        "--ffn_hidden_size",
        "14336",
        "--num_attention_heads",
        "32",
        "--num_key_value_heads",
        "8",
        "--vocab_size",
        "128256",
        "--rope_theta",
        "500000",
    ]


def test_megatron_moe_command_runs_on_every_host(tmp_path):
    spec = spec_from_run_id("phantora_a100_40g_W2_2x2")
    argv = training_argv(spec)
    assert argv[:10] == [
        "/phantora/dist/phantora_run",
        "torchrun",
        "--nproc_per_node",
        "2",
        "--nnodes",
        "2",
        "--rdzv_backend",
        "c10d",
        "--rdzv_endpoint=host-1:12345",
        "/phantora/tests/test_megatron.py",
    ]
    assert argv[argv.index("--expert_model_parallel_size") + 1] == "4"
    assert argv[argv.index("--iterations") + 1] == "20"
    assert training_hosts(spec) == ["host-2", "host-1"]


def test_command_txt_is_exact(tmp_path):
    spec = spec_from_run_id("phantora_l40s_W1_2x1")
    layout, files = _files(tmp_path, spec)
    train = (
        "timeout 14400 /phantora/dist/phantora_run torchrun --nproc_per_node 1 --nnodes 2 --rdzv_backend c10d "
        "--rdzv_endpoint=host-1:12345 /phantora/tests/test_megatron.py --num_layers 4 --sequence_length 1024 "
        "--iterations 20 --tensor_parallel_size 2 --hidden_size 4096 --ffn_hidden_size 14336 "
        "--num_attention_heads 32 --num_query_groups 8 --vocab_size 128256 --swiglu --position_embedding_type "
        "rope --rotary_base 500000 --normalization RMSNorm --disable_bias_linear"
    )
    out = "../../../../work/phantora_l40s_W1_2x1/out"
    assert command_lines(spec, SETTINGS, layout, True) == [
        f"mkdir -p /run/phantora/phantora_l40s_W1_2x1 {out}",
        "docker compose -f compose.yaml up -d",
        "sleep 6",
        f"docker compose -f compose.yaml exec -d host-2 bash -c '{train}'",
        f"docker compose -f compose.yaml exec -T host-1 bash -c '{train}' > {out}/run.log 2>&1",
        "docker compose -f compose.yaml kill -s SIGINT simulator",
        "docker compose -f compose.yaml down --remove-orphans",
        f'docker run --rm -v "$(realpath {out})":/phantora/out phantora:latest /phantora/dist/phantora_visualizer '
        "-t /phantora/out/timeline.bin -o /phantora/out/timeline.json",
    ]
    txt = files["command.txt"].splitlines()
    assert txt[0].startswith("# Phantora simulation of phantora_l40s_W1_2x1: megatron Llama3-8B (tp=2,dp=1)")
    assert [line for line in txt if not line.startswith("#")] == command_lines(spec, SETTINGS, layout, True)
    assert shlex.split(txt[6])[-1] == train  # the quoted command round-trips


def test_container_kwargs_resolve_compose_paths(tmp_path):
    spec = spec_from_run_id("phantora_l40s_W1_2x1")
    layout, files = _files(tmp_path, spec)
    compose = yaml.safe_load(files["compose.yaml"])
    kw = container_kwargs("simulator", compose["services"]["simulator"], layout.config_dir, compose["name"])
    assert kw["name"] == "phantora-phantora_l40s_w1_2x1-simulator"
    assert kw["pid_mode"] == "host" and kw["ipc_mode"] == "host"
    assert kw["volumes"] == {
        "/run/phantora/phantora_l40s_W1_2x1": {"bind": "/run/phantora", "mode": "rw"},
        str((layout.config_dir / "netconfig.toml").resolve()): {"bind": "/netconfig.toml", "mode": "ro"},
        str(layout.perfdb_root.resolve()): {"bind": "/phantora/perfdb", "mode": "rw"},
        str(layout.out_dir.resolve()): {"bind": "/phantora/out", "mode": "rw"},
    }
    assert kw["command"] == compose["services"]["simulator"]["command"]
    assert kw["labels"] == {"phantora_assets.run_id": spec.run_id}
    host = container_kwargs("host-1", compose["services"]["host-1"], layout.config_dir, compose["name"])
    assert host["hostname"] == "host-1" and "PHANTORA_NGPU=1" in host["environment"]


@pytest.mark.parametrize("workload", ["W1", "W2", "W3", "W4", "W5"])
def test_launch_options_agree_with_presets(workload):
    entry = launch_table()[workload]
    args = entry["args"]
    wl = shipped_workloads()[workload]  # the schema's keys (presets.toml [workloads.W*])
    opts = dict(zip(args, args[1:]))
    assert opts["--hidden_size"] == str(wl.model.hidden)
    assert opts["--ffn_hidden_size"] == str(wl.model.ffn_hidden)
    assert opts["--num_attention_heads"] == str(wl.model.heads)
    assert opts["--vocab_size"] == str(wl.model.vocab)
    assert entry["launcher"] == {"megatron": "torchrun", "deepspeed": "deepspeed"}[wl.framework]
    if wl.model.kind == "moe" and wl.framework == "megatron":
        assert opts["--num_moe_experts"] == str(wl.model.experts)
        assert opts["--moe_router_topk"] == str(wl.model.topk)
        assert opts["--expert_model_parallel_size"] == "{ep}"
    if wl.framework == "deepspeed" and wl.parallel.zero:
        assert opts["--zero_stage"] == str(wl.parallel.zero)
    if wl.framework == "megatron" and wl.parallel.tp > 1:
        assert opts["--tensor_parallel_size"] == str(wl.parallel.tp)


def test_perf_db_choice(tmp_path):
    docker = PhantoraDocker()
    assert docker.perfdb_source(spec_from_run_id("phantora_l40s_W1_2x1")).name == "l40s"
    with pytest.raises(FileNotFoundError, match="no perf DB for a100_40g"):
        docker.perfdb_source(spec_from_run_id("phantora_a100_40g_W1_2x1"))
    assert (
        PhantoraDocker(profile_without_perfdb=True).perfdb_source(spec_from_run_id("phantora_a100_40g_W1_2x1")) is None
    )


def test_missing_listing(tmp_path):
    d = tmp_path / "l40s.missing"
    assert missing_listing(d) == {}
    d.mkdir()
    (d / "compute.csv").write_text("")
    assert missing_listing(d) == {}
    (d / "compute.csv").write_text('key\n{"MM":[["bf16",[1024,4096]],["bf16",[4096,4096]]]}\n')
    (d / "memcpy.csv").write_text("\n")
    assert missing_listing(d) == {"compute.csv": 2}


def test_simulator_is_picked_from_the_environment(monkeypatch):
    monkeypatch.setenv("PHANTORA_ASSETS_SIMULATOR", "docker")
    monkeypatch.setenv("PHANTORA_ASSETS_DOCKER_IMAGE", "registry.example/phantora:patched")
    monkeypatch.setenv("PHANTORA_ASSETS_DOCKER_MAX_CONCURRENT", "3")
    sim = simulator_from_env([])
    assert isinstance(sim, PhantoraDocker) and sim.image == "registry.example/phantora:patched"
    assert sim.max_concurrent == 3
    monkeypatch.setenv("PHANTORA_ASSETS_SIMULATOR", "analytic")
    assert isinstance(simulator_from_env([RunSpec("W1", "l40s", 2, 1, source="docker")]), AnalyticSimulatorResource)
    monkeypatch.delenv("PHANTORA_ASSETS_SIMULATOR")
    assert isinstance(simulator_from_env([RunSpec("W1", "l40s", 2, 1, source="docker")]), PhantoraDocker)


def test_analytic_resource_refuses_docker_runs(tmp_path):
    spec = RunSpec("W1", "l40s", 2, 1, source="docker")
    with pytest.raises(ValueError, match="needs the Phantora Docker simulator"):
        AnalyticSimulatorResource().simulate(spec, DataPaths(tmp_path))
