"""Container lifecycle of the Docker simulator, and the opt-in end-to-end run.

No Docker engine runs on our machines, so the lifecycle tests drive the real
:class:`PhantoraDockerRunner` (and the real raw_timeline stage around it) with a fake Docker
client that records every call and plays the engine's part: the simulator writes
``timeline.bin`` into its bind-mounted ``out/`` when it gets SIGINT, host-1's exec streams the
training output. Everything else in this file is real: files, locks, the perf DB copy.

The last test needs a Docker engine and the Phantora image (README: "Simulating with
Phantora in Docker"); it is skipped unless pytest runs with ``--run-docker``.
"""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path

import docker.errors
import pytest
import yaml
from fixtures.materialize import ephemeral_with_runs
from fixtures.run_folders import megatron_log

from phantora_assets.checks import read_checks
from phantora_assets.lib.phantora.docker_config import DockerSettings, layout_for, training_argv
from phantora_assets.lib.phantora.docker_runner import PhantoraDockerError, PhantoraDockerRunner, SimulationSlots
from phantora_assets.lib.phantora.perfdb import default_perfdb_dir
from phantora_assets.lib.run.spec import RunSpec
from phantora_assets.matrix import spec_from_run_id
from phantora_assets.paths import DataPaths
from phantora_assets.sources import phantora_docker as pipeline

SPEC = RunSpec("W1", "l40s", 2, 1, source="docker")


class FakeContainer:
    def __init__(self, client: FakeClient, kw: dict) -> None:
        self.client, self.kw, self.name = client, kw, kw["name"]
        self.id = f"id-{self.name}"
        client.calls.append(("create", self.name))

    def _mount(self, target: str) -> Path:
        return next(Path(src) for src, v in self.kw["volumes"].items() if v["bind"] == target)

    def start(self):
        self.client.calls.append(("start", self.name))

    def exec_run(self, argv, detach=False):
        self.client.calls.append(("exec_detached", self.name, tuple(argv)))

    def kill(self, signal):
        self.client.calls.append(("kill", self.name, signal))
        if self.name.endswith("-simulator") and self.client.write_timeline:
            (self._mount("/phantora/out") / "timeline.bin").write_bytes(b"\x00" * 16)
            if self.client.missing_shapes:
                missing = self._mount("/phantora/perfdb") / "l40s.missing"
                missing.mkdir()
                (missing / "compute.csv").write_text('key\n{"MM":[["bf16",[1,2]],["bf16",[2,3]]]}\n')

    def wait(self, timeout=None):
        self.client.calls.append(("wait", self.name))
        return {"StatusCode": 0}

    def remove(self, force=False):
        self.client.calls.append(("remove", self.name, force))


class FakeNetwork:
    def __init__(self, client: FakeClient, name: str) -> None:
        self.client, self.name = client, name

    def connect(self, container, aliases):
        self.client.calls.append(("connect", container.name, tuple(aliases)))

    def remove(self):
        self.client.calls.append(("network_remove", self.name))


class FakeClient:
    """Stands in for docker.DockerClient: images, networks, containers and the low-level exec API."""

    def __init__(
        self,
        *,
        images=("phantora:latest",),
        log: str = "",
        exit_code: int = 0,
        fail_at: str = "",
        write_timeline: bool = True,
        missing_shapes: bool = False,
    ) -> None:
        self.calls: list[tuple] = []
        self.known_images = set(images)
        self.log, self.exit_code, self.fail_at = log, exit_code, fail_at
        self.write_timeline, self.missing_shapes = write_timeline, missing_shapes
        self.created: list[FakeContainer] = []
        client = self

        class Images:
            def get(self, name):
                client.calls.append(("image", name))
                if name not in client.known_images:
                    raise docker.errors.ImageNotFound(name)

        class Networks:
            def create(self, name, driver, labels):
                client.calls.append(("network", name, driver))
                return FakeNetwork(client, name)

        class Containers:
            def create(self, **kw):
                if client.fail_at and kw["name"].endswith(client.fail_at):
                    raise docker.errors.APIError(f"cannot create {kw['name']}")
                c = FakeContainer(client, kw)
                client.created.append(c)
                return c

            def run(self, image, command, **kw):
                client.calls.append(("run", image, tuple(command)))
                out = next(Path(src) for src, v in kw["volumes"].items() if v["bind"] == "/phantora/out")
                if client.fail_at == "visualizer":
                    raise docker.errors.ContainerError(
                        None,
                        101,
                        command,
                        image,
                        b"thread 'main' panicked: called `Option::unwrap()` on a `None` value",
                    )
                (out / "timeline.json").write_text(client.trace_json)

        class Api:
            def exec_create(self, container_id, argv, stdout, stderr):
                client.calls.append(("exec", container_id, tuple(argv)))
                return {"Id": "exec-1"}

            def exec_start(self, exec_id, stream):
                if client.fail_at == "exec":
                    yield b"starting\n"
                    raise docker.errors.APIError("connection reset")
                if client.fail_at == "interrupt":
                    raise KeyboardInterrupt
                for line in client.log.splitlines(keepends=True):
                    yield line.encode()

            def exec_inspect(self, exec_id):
                return {"ExitCode": client.exit_code}

        self.images, self.networks, self.containers, self.api = Images(), Networks(), Containers(), Api()
        self.trace_json = ""


def _layout(tmp_path: Path, spec: RunSpec = SPEC):
    paths = DataPaths(tmp_path / "data")
    layout = layout_for(spec, paths.root, paths.run_folder(spec))
    return paths, layout


def _settings(tmp_path: Path) -> DockerSettings:
    return DockerSettings(
        startup_wait_s=0, phantora_tests_dir="/opt/phantora/tests", socket_dir=str(tmp_path / "run-phantora")
    )


def _assert_torn_down(client: FakeClient, project: str = "phantora-phantora_l40s_w1_2x1"):
    removed = {c[1] for c in client.calls if c[0] == "remove"}
    assert removed == {c.name for c in client.created}
    assert all(c[2] is True for c in client.calls if c[0] == "remove")  # force
    assert ("network_remove", project) in client.calls


def test_lifecycle_starts_runs_stops_and_tears_down(tmp_path):
    settings = _settings(tmp_path)
    client = FakeClient(log="rank 0 iter 0 time: 0.50 wall: 3.00\n")
    _, layout = _layout(tmp_path)
    outcome = PhantoraDockerRunner(client, settings).simulate(SPEC, layout, replay=True)
    p = "phantora-phantora_l40s_w1_2x1"
    train = ("bash", "-c", "timeout 14400 " + " ".join(training_argv(SPEC)))
    assert client.calls == [
        ("image", "phantora:latest"),
        ("network", p, "bridge"),
        ("create", f"{p}-simulator"),
        ("connect", f"{p}-simulator", ("simulator",)),
        ("start", f"{p}-simulator"),
        ("create", f"{p}-host-1"),
        ("connect", f"{p}-host-1", ("host-1",)),
        ("start", f"{p}-host-1"),
        ("create", f"{p}-host-2"),
        ("connect", f"{p}-host-2", ("host-2",)),
        ("start", f"{p}-host-2"),
        ("exec_detached", f"{p}-host-2", train),
        ("exec", f"id-{p}-host-1", train),
        ("kill", f"{p}-simulator", "SIGINT"),
        ("wait", f"{p}-simulator"),
        ("remove", f"{p}-host-2", True),
        ("remove", f"{p}-host-1", True),
        ("remove", f"{p}-simulator", True),
        ("network_remove", p),
    ]
    sim_kw = client.created[0].kw
    assert sim_kw["pid_mode"] == "host" and sim_kw["ipc_mode"] == "host"
    assert sim_kw["volumes"][str(tmp_path / "run-phantora" / SPEC.run_id)] == {"bind": "/run/phantora", "mode": "rw"}
    assert client.created[1].kw["hostname"] == "host-1"
    assert (tmp_path / "run-phantora" / SPEC.run_id).is_dir()
    assert outcome.exit_code == 0 and outcome.run_log.read_text() == "rank 0 iter 0 time: 0.50 wall: 3.00\n"
    assert outcome.timeline == layout.out_dir / "timeline.bin"


@pytest.mark.parametrize("fail_at", ["exec", "interrupt", "host-2"])
def test_containers_are_removed_when_a_step_fails(tmp_path, fail_at):
    client = FakeClient(fail_at=fail_at)
    _, layout = _layout(tmp_path)
    with pytest.raises((docker.errors.APIError, KeyboardInterrupt)):
        PhantoraDockerRunner(client, _settings(tmp_path)).simulate(SPEC, layout, replay=True)
    assert client.created  # something was started before the failure
    _assert_torn_down(client)


def test_missing_image_creates_nothing(tmp_path):
    client = FakeClient(images=())
    _, layout = _layout(tmp_path)
    with pytest.raises(PhantoraDockerError, match="patches/visualizer.patch"):
        PhantoraDockerRunner(client, _settings(tmp_path)).simulate(SPEC, layout, replay=True)
    assert client.created == [] and not any(c[0] == "network" for c in client.calls)


def test_raw_timeline_stage_collects_outputs_and_checks(tmp_path):
    """The docker raw_timeline stage around the runner: configs, perf DB copy, run.log, timeline.bin."""
    log = megatron_log([0.9, 0.61, 0.62, 0.61], ranks=2, peak_mib=20480.0)
    client = FakeClient(log=log)
    paths, layout = _layout(tmp_path)
    settings = _settings(tmp_path)
    slots = SimulationSlots(paths.root / "work" / ".slots", 1)
    result = pipeline.simulate_docker(
        SPEC,
        paths,
        PhantoraDockerRunner(client, settings),
        slots,
        settings,
        perfdb_source=default_perfdb_dir() / "l40s",
    )
    folder = paths.run_folder(SPEC)
    assert {o.name: o.passed for o in result.outcomes} == {"fits_in_memory": True, "perfdb_complete": True}
    assert (folder / "timeline.bin").read_bytes() == b"\x00" * 16
    assert (folder / "run.log").read_text() == log
    assert (layout.perfdb_dir / "compute.csv").read_bytes() == (
        default_perfdb_dir() / "l40s" / "compute.csv"
    ).read_bytes()
    compose = yaml.safe_load((folder / "config" / "compose.yaml").read_text())
    assert compose["services"]["simulator"]["command"].endswith("--perf-db /phantora/perfdb/l40s")
    assert (folder / "config" / "command.txt").read_text().count(
        "docker compose"
    ) == 5  # up, exec -d, exec -T, kill, down
    assert result.metadata["run_log_peak_memory_gib"] == 20.0 and result.metadata["mode"] == "replay"
    assert json.loads((paths.partition_dir(SPEC.run_id) / "run_log.json").read_text())["iteration_s"] == [
        0.9,
        0.61,
        0.62,
        0.61,
    ]
    _assert_torn_down(client)


def test_missing_perf_db_shapes_fail_the_blocking_check(tmp_path):
    client = FakeClient(log=megatron_log([0.9, 0.6], ranks=2, peak_mib=1000.0), missing_shapes=True)
    paths, _ = _layout(tmp_path)
    settings = _settings(tmp_path)
    result = pipeline.simulate_docker(
        SPEC,
        paths,
        PhantoraDockerRunner(client, settings),
        SimulationSlots(paths.root / "work" / ".slots", 1),
        settings,
        perfdb_source=default_perfdb_dir() / "l40s",
    )
    perfdb = next(o for o in result.outcomes if o.name == "perfdb_complete")
    assert not perfdb.passed and "compute.csv (2)" in perfdb.message and "invalid" in perfdb.message
    folder = paths.run_folder(SPEC)
    assert read_checks(folder)["perfdb_complete"]["status"] == "failed"
    assert (folder / "perfdb_missing" / "compute.csv").exists()  # kept for the user


def test_out_of_memory_and_failed_training(tmp_path):
    paths, _ = _layout(tmp_path)
    settings = _settings(tmp_path)
    slots = SimulationSlots(paths.root / "work" / ".slots", 1)
    oom = FakeClient(
        log="torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 8.00 GiB\n",
        exit_code=1,
        write_timeline=False,
    )
    result = pipeline.simulate_docker(
        SPEC, paths, PhantoraDockerRunner(oom, settings), slots, settings, perfdb_source=default_perfdb_dir() / "l40s"
    )
    assert {o.name: o.passed for o in result.outcomes}["fits_in_memory"] is False
    broken = FakeClient(log="Traceback (most recent call last):\nImportError: no module named megatron\n", exit_code=1)
    with pytest.raises(PhantoraDockerError, match="exited with status 1(.|\n)*no module named megatron"):
        pipeline.simulate_docker(
            SPEC,
            paths,
            PhantoraDockerRunner(broken, settings),
            slots,
            settings,
            perfdb_source=default_perfdb_dir() / "l40s",
        )
    _assert_torn_down(broken)


def test_visualizer_conversion_and_unpatched_image(tmp_path):
    from fixtures.run_folders import analytic

    paths, layout = _layout(tmp_path)
    spec = spec_from_run_id("phantora_l40s_W1_2x1")
    _, raw, _ = analytic(spec)
    from phantora_assets.lib.phantora.chrome_trace import write_chrome_trace

    write_chrome_trace(raw, tmp_path / "t.json")
    client = FakeClient()
    client.trace_json = (tmp_path / "t.json").read_text()
    layout.out_dir.mkdir(parents=True)
    (layout.out_dir / "timeline.bin").write_bytes(b"\x00")
    result = pipeline.docker_trace(SPEC, paths, PhantoraDockerRunner(client, _settings(tmp_path)))
    assert (
        "run",
        "phantora:latest",
        ("/phantora/dist/phantora_visualizer", "-t", "/phantora/out/timeline.bin", "-o", "/phantora/out/timeline.json"),
    ) in client.calls
    assert result.path == paths.chrome_trace(SPEC) and result.metadata["n_network_flows"] > 0
    assert not (layout.out_dir / "timeline.json").exists()  # the big JSON is not kept twice
    client = FakeClient(fail_at="visualizer")
    with pytest.raises(PhantoraDockerError, match="patches/visualizer.patch"):
        pipeline.docker_trace(SPEC, paths, PhantoraDockerRunner(client, _settings(tmp_path)))


def test_slots_limit_concurrent_simulations(tmp_path):
    slots = SimulationSlots(tmp_path / "slots", 1, poll_s=0.05)
    order: list[str] = []

    def second():
        with SimulationSlots(tmp_path / "slots", 1, poll_s=0.05).acquire():
            order.append("second")

    with slots.acquire() as i:
        assert i == 0
        t = threading.Thread(target=second)
        t.start()
        time.sleep(0.3)
        order.append("first done")
    t.join(5)
    assert order == ["first done", "second"]
    two = SimulationSlots(tmp_path / "slots2", 2)
    with two.acquire() as a, two.acquire() as b:
        assert {a, b} == {0, 1}


@pytest.mark.docker
def test_end_to_end_phantora_in_docker(tmp_path, monkeypatch):
    """Simulate l40s W1 2x1 with the real image and engine through every asset and check.

    Needs: a Docker engine, the image built with patches/visualizer.patch (tag from
    $PHANTORA_ASSETS_DOCKER_IMAGE, default phantora:latest), Phantora's tests/ folder in
    $PHANTORA_ASSETS_PHANTORA_TESTS_DIR unless the image has /phantora/tests. Takes minutes.
    """
    import dagster as dg

    from phantora_assets import definitions as d
    from phantora_assets.imported_runs import effective_matrix
    from phantora_assets.resources import DataRoot, PhantoraDocker

    matrix_file = tmp_path / "runs.toml"
    matrix_file.write_text('[[run]]\nworkload = "W1"\ngpu = "l40s"\nnodes = 2\ngpus_per_node = 1\nsource = "docker"\n')
    monkeypatch.setenv("PHANTORA_ASSETS_RUN_MATRIX", str(matrix_file))
    data = tmp_path / "data"
    matrix = effective_matrix(data)
    all_assets, run_assets = d.assets_for(matrix)
    sim = PhantoraDocker(
        image=os.environ.get("PHANTORA_ASSETS_DOCKER_IMAGE", "phantora:latest"),
        phantora_tests_dir=os.environ.get("PHANTORA_ASSETS_PHANTORA_TESTS_DIR") or None,
        socket_dir=str(tmp_path / "sockets"),
    )
    res = dg.materialize(
        all_assets,
        selection=run_assets,
        partition_key="phantora_l40s_W1_2x1",
        resources={"data": DataRoot(data_dir=str(data)), "simulator": sim},
        instance=ephemeral_with_runs(["phantora_l40s_W1_2x1"]),
        raise_on_error=False,
    )
    checks = read_checks(DataPaths(data).run_folder(matrix[0]))
    assert res.success, checks
    assert checks["perfdb_complete"]["status"] == "passed"
    folder = DataPaths(data).run_folder(matrix[0])
    assert (folder / "timeline.bin").stat().st_size > 0 and (folder / "timeline.json.gz").stat().st_size > 0
    summary = json.loads((DataPaths(data).partition_dir("phantora_l40s_W1_2x1") / "trace_summary.json").read_text())
    published = 0.30e9  # published l40s W1 2x1: 0.30 GB per step
    assert abs(summary["network_bytes_per_step"] - published) <= 0.005e9
    log = json.loads((DataPaths(data).partition_dir("phantora_l40s_W1_2x1") / "run_log.json").read_text())
    assert len(log["iteration_s"]) == 20


def test_raw_timeline_stage_killed_anywhere_keeps_the_previous_outputs(tmp_path):
    """The docker raw_timeline stage killed (SIGKILL) before each of its file-system changes, over a
    previous build of the run: ``config/`` (a DeepSpeed run's hostfile and deepspeed_env too),
    ``perfdb_missing/``, ``run.log`` and ``timeline.bin`` stay whole (issue 39 item 13: the optional
    config files were unlinked before being written again, ``perfdb_missing/`` removed before its
    copy was renamed in)."""
    from fixtures.kill_points import every_kill_point

    spec = RunSpec("W4", "l40s", 2, 1, source="docker")
    paths, _ = _layout(tmp_path)
    settings = _settings(tmp_path)
    slots = SimulationSlots(paths.root / "work" / ".slots", 1)
    log = megatron_log([0.9, 0.61, 0.62, 0.61], ranks=2, peak_mib=20480.0)

    def build() -> None:
        client = FakeClient(log=log, missing_shapes=True)
        runner = PhantoraDockerRunner(client, settings)
        pipeline.simulate_docker(spec, paths, runner, slots, settings, perfdb_source=default_perfdb_dir() / "l40s")

    build()
    folder = paths.run_folder(spec)
    outputs = ["config/hostfile", "config/deepspeed_env", "config/compose.yaml", "config/netconfig.toml"]
    outputs += ["config/command.txt", "perfdb_missing/compute.csv", "run.log", "timeline.bin"]
    before = {rel: (folder / rel).read_bytes() for rel in outputs}

    def check(k: int) -> None:
        for rel in outputs:
            assert (folder / rel).is_file(), f"killed before file-system change {k}: {rel} is gone"
            assert (folder / rel).read_bytes() == before[rel]
        assert sorted(p.name for p in (folder / "perfdb_missing").iterdir()) == ["compute.csv"]

    assert every_kill_point(build, check) >= 3
