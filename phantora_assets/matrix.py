"""The run matrix: which training configurations are simulated, one Dagster partition each.

No Dagster import here. ``load_run_matrix()`` reads ``runs.toml`` (or a file the user names
through ``PHANTORA_ASSETS_RUN_MATRIX``), validates every entry against ``presets.toml``,
``gpus.toml`` and the source registry (``sources.REGISTRY``) and returns :class:`RunSpec`
objects. Invalid entries raise :class:`~phantora_assets.lib.errors.RunMatrixError` naming the
entry and the rule, before anything is simulated.

:func:`load_run_matrix` parses and validates the matrix file once per process and state of the
file (path, inode, size, mtime and ctime). The run matrix of a data root, with its imported run
folders, is :func:`phantora_assets.imported_runs.matrix_for`.
"""

from __future__ import annotations

import os
import tomllib
from dataclasses import dataclass, field
from functools import cache
from importlib import resources
from pathlib import Path
from typing import Any

from phantora_assets.lib.errors import RunMatrixError
from phantora_assets.sources import SOURCE_NAMES

RUN_MATRIX_ENV = "PHANTORA_ASSETS_RUN_MATRIX"
SOURCES = SOURCE_NAMES


def _package_toml(name: str) -> dict[str, Any]:
    with resources.files("phantora_assets").joinpath(name).open("rb") as fh:
        return tomllib.load(fh)


@cache
def presets() -> dict[str, Any]:
    """``presets.toml``: common settings, GPUs, cluster and the W1..W5 workloads."""
    return _package_toml("presets.toml")


@cache
def gpu_specs() -> dict[str, dict[str, Any]]:
    """``gpus.toml``: one dict per GPU key (memory_gb, peak_bf16_flops, mem_bw_bytes_per_s, ...)."""
    return _package_toml("gpus.toml")


@dataclass(frozen=True)
class RunSpec:
    """One training configuration = one partition.

    Attributes:
        workload: ``W1`` .. ``W5``.
        gpu: key of ``gpus.toml``.
        n_nodes: hosts, >= 1.
        gpus_per_node: GPUs per host, >= 1; rank r lives on host r // gpus_per_node.
        source: ``analytic`` | ``docker`` | ``import``.
        published: status in the published dataset (``ok``, ``out_of_memory`` or ``""``).
        topology: overrides of the ``[cluster]`` network settings (host_bw_gbps, ...).
        path: for ``source = "import"``, the run folder the run is imported from
            (``traces/<gpu>/<workload>_<layout>/`` of a Phantora dataset); else ``""``.
    """

    workload: str
    gpu: str
    n_nodes: int
    gpus_per_node: int
    source: str = "analytic"
    published: str = ""
    topology: tuple[tuple[str, Any], ...] = field(default=())
    path: str = ""

    @property
    def run_id(self) -> str:
        return f"phantora_{self.gpu}_{self.workload}_{self.layout}"

    @property
    def layout(self) -> str:
        return f"{self.n_nodes}x{self.gpus_per_node}"

    @property
    def world_size(self) -> int:
        return self.n_nodes * self.gpus_per_node

    @property
    def preset(self) -> dict[str, Any]:
        return presets()["workloads"][self.workload]

    @property
    def framework(self) -> str:
        return self.preset["framework"]

    @property
    def gpu_spec(self) -> dict[str, Any]:
        return gpu_specs()[self.gpu]

    @property
    def cluster(self) -> dict[str, Any]:
        """Network settings: presets ``[cluster]`` with this run's overrides applied."""
        return {**presets()["cluster"], **dict(self.topology)}

    @property
    def tp(self) -> int:
        return int(self.preset.get("tensor_parallel_size", 1))

    @property
    def ep(self) -> int:
        return self.world_size if self.preset.get("expert_parallel") else 1

    @property
    def dp(self) -> int:
        """Data-parallel size of the dense parameters."""
        return self.world_size // self.tp

    @property
    def zero_stage(self) -> int:
        return int(self.preset.get("zero_stage", 0))

    @property
    def parallelism(self) -> str:
        """Published-style parallelism string, e.g. ``tp=2,dp=4``, ``ep=4``, ``dp=4,zero=3``."""
        if self.ep > 1:
            return f"ep={self.ep}"
        if self.tp > 1:
            return f"tp={self.tp},dp={self.dp}"
        if self.zero_stage:
            return f"dp={self.dp},zero={self.zero_stage}"
        return f"dp={self.dp}"

    @property
    def trace_dir(self) -> str:
        """Run folder relative to the data root: ``traces/<gpu>/<workload>_<layout>``."""
        return f"traces/{self.gpu}/{self.workload}_{self.layout}"


def validate(spec: RunSpec, entry: str) -> None:
    """Raise RunMatrixError (naming ``entry`` and the rule) if ``spec`` cannot be simulated."""
    wl = presets()["workloads"]
    if spec.workload not in wl:
        raise RunMatrixError(f"{entry}: unknown workload {spec.workload!r} (known: {', '.join(sorted(wl))})")
    if spec.gpu not in gpu_specs():
        raise RunMatrixError(f"{entry}: unknown GPU {spec.gpu!r} (known: {', '.join(sorted(gpu_specs()))})")
    if spec.source not in SOURCES:
        raise RunMatrixError(f"{entry}: unknown source {spec.source!r} (known: {', '.join(SOURCES)})")
    if spec.n_nodes < 1 or spec.gpus_per_node < 1:
        raise RunMatrixError(f"{entry}: nodes and gpus_per_node must be >= 1")
    world = spec.world_size
    tp = spec.tp
    if world % tp or world < tp:
        raise RunMatrixError(
            f"{entry}: layout {spec.layout} has {world} GPU(s); {spec.workload} needs tensor_parallel_size={tp} "
            f"to divide the GPU count"
        )
    if spec.preset.get("expert_parallel"):
        experts = int(spec.preset["num_moe_experts"])
        if experts % world:
            raise RunMatrixError(
                f"{entry}: layout {spec.layout} has {world} GPUs; {spec.workload} sets expert_model_parallel_size = "
                f"GPU count, which must divide num_moe_experts={experts}"
            )
    if spec.source == "import" and not spec.path:
        raise RunMatrixError(f"{entry}: source 'import' needs the run folder as path = \"...\"")
    if spec.path and spec.source != "import":
        raise RunMatrixError(f"{entry}: path is only allowed with source = 'import' (source is {spec.source!r})")
    unknown = set(dict(spec.topology)) - set(presets()["cluster"])
    if unknown:
        raise RunMatrixError(f"{entry}: unknown topology keys {sorted(unknown)}")


def parse_entries(entries: list[dict[str, Any]], source_name: str = "runs.toml") -> list[RunSpec]:
    """Turn ``[[run]]`` tables into validated RunSpecs; run_ids must be unique."""
    specs: list[RunSpec] = []
    seen: dict[str, str] = {}
    for i, raw in enumerate(entries):
        entry = f"{source_name} [[run]] #{i + 1}"
        missing = {"workload", "gpu", "nodes", "gpus_per_node"} - set(raw)
        if missing:
            raise RunMatrixError(f"{entry}: missing keys {sorted(missing)}")
        extra = set(raw) - {"workload", "gpu", "nodes", "gpus_per_node", "source", "published", "topology", "path"}
        if extra:
            raise RunMatrixError(f"{entry}: unknown keys {sorted(extra)}")
        spec = RunSpec(
            workload=str(raw["workload"]),
            gpu=str(raw["gpu"]),
            n_nodes=int(raw["nodes"]),
            gpus_per_node=int(raw["gpus_per_node"]),
            source=str(raw.get("source", "analytic")),
            published=str(raw.get("published", "")),
            topology=tuple(sorted(dict(raw.get("topology", {})).items())),
            path=str(raw.get("path", "")),
        )
        validate(spec, f"{entry} ({spec.workload} {spec.gpu} {spec.layout})")
        if spec.run_id in seen:
            raise RunMatrixError(f"{entry}: duplicate run_id {spec.run_id} (also {seen[spec.run_id]})")
        seen[spec.run_id] = entry
        specs.append(spec)
    return specs


def check_specs(specs: list[RunSpec], source_name: str) -> None:
    """Validate RunSpecs built in code (not parsed from a file): each entry's rules, unique run_ids.

    Raises:
        RunMatrixError: naming ``source_name``, the entry and the rule.
    """
    seen: set[str] = set()
    for i, spec in enumerate(specs):
        entry = f"{source_name} #{i + 1} ({spec.workload} {spec.gpu} {spec.layout})"
        validate(spec, entry)
        if spec.run_id in seen:
            raise RunMatrixError(f"{entry}: duplicate run_id {spec.run_id}")
        seen.add(spec.run_id)


def run_matrix_path() -> Path | None:
    """The user's run matrix file from ``PHANTORA_ASSETS_RUN_MATRIX``, or None for the shipped one."""
    value = os.environ.get(RUN_MATRIX_ENV)
    return Path(value) if value else None


def _stamp(path: Path) -> tuple[int, ...] | None:
    try:
        st = path.stat()
    except OSError:
        return None
    return st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns


_PARSED: dict[str, tuple[tuple[int, ...] | None, list[RunSpec]]] = {}


def load_run_matrix(path: str | Path | None = None) -> list[RunSpec]:
    """Load and validate a run matrix (default: ``$PHANTORA_ASSETS_RUN_MATRIX``, else the shipped
    ``runs.toml``). Parsed once per process and state of the file (inode, size, mtime, ctime);
    returns a new list of the same frozen RunSpecs each call.

    Raises:
        RunMatrixError: an entry is invalid; the message names the file, the entry and the rule.
    """
    path = Path(path) if path else run_matrix_path()
    key = str(path) if path is not None else ""
    stamp = _stamp(path) if path is not None else None
    hit = _PARSED.get(key)
    if hit is not None and hit[0] == stamp and (path is None or stamp is not None):
        return list(hit[1])
    if path is None:
        data, name = _package_toml("runs.toml"), "runs.toml"
    else:
        try:
            data = tomllib.loads(path.read_text())
        except (OSError, tomllib.TOMLDecodeError) as exc:
            raise RunMatrixError(f"{path}: cannot read run matrix ({exc})") from exc
        name = str(path)
    specs = parse_entries(list(data.get("run", [])), name)
    _PARSED[key] = (stamp, specs)
    return list(specs)


def spec_from_run_id(run_id: str, matrix: list[RunSpec] | None = None) -> RunSpec:
    """The RunSpec of ``run_id`` from the matrix (KeyError naming it if absent)."""
    for spec in matrix if matrix is not None else load_run_matrix():
        if spec.run_id == run_id:
            return spec
    raise KeyError(f"run_id {run_id!r} is not in the run matrix")
