"""The run matrix: which training configurations are simulated, one Dagster partition each.

No Dagster import here. ``load_run_matrix()`` reads ``runs.toml`` (or a file the user names
through ``PHANTORA_ASSETS_RUN_MATRIX``), validates every entry against ``presets.toml``,
``gpus.toml`` and the source registry (``sources.REGISTRY``) and returns :class:`RunSpec`
objects. Invalid entries raise :class:`~phantora_assets.lib.errors.RunMatrixError` naming the
entry and the rule, before anything is simulated.

:func:`matrix_for` is the run matrix of a data root: the matrix merged with the root's imported
run folders (``lib/phantora/run_folder.py``). It is parsed and validated once per process and
read again only when one of its inputs changes on disk (the matrix file, the imports registry,
a ``$PHANTORA_ASSETS_IMPORT_DIR`` folder) or the environment names other inputs.
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


def run_matrix_path() -> Path | None:
    """The user's run matrix file from ``PHANTORA_ASSETS_RUN_MATRIX``, or None for the shipped one."""
    value = os.environ.get(RUN_MATRIX_ENV)
    return Path(value) if value else None


def load_run_matrix(path: str | Path | None = None) -> list[RunSpec]:
    """Load and validate a run matrix (default: the shipped ``runs.toml``).

    Raises:
        RunMatrixError: an entry is invalid; the message names the file, the entry and the rule.
    """
    path = Path(path) if path else run_matrix_path()
    if path is None:
        data, name = _package_toml("runs.toml"), "runs.toml"
    else:
        try:
            data = tomllib.loads(path.read_text())
        except (OSError, tomllib.TOMLDecodeError) as exc:
            raise RunMatrixError(f"{path}: cannot read run matrix ({exc})") from exc
        name = str(path)
    return parse_entries(list(data.get("run", [])), name)


def spec_from_run_id(run_id: str, matrix: list[RunSpec] | None = None) -> RunSpec:
    """The RunSpec of ``run_id`` from the matrix (KeyError naming it if absent)."""
    for spec in matrix if matrix is not None else load_run_matrix():
        if spec.run_id == run_id:
            return spec
    raise KeyError(f"run_id {run_id!r} is not in the run matrix")


def _stamp(path: Path) -> tuple[int, int] | None:
    try:
        st = path.stat()
    except OSError:
        return None
    return st.st_mtime_ns, st.st_size


def _inputs_key(data_dir: Path) -> tuple:
    """What :func:`matrix_for`'s answer depends on: paths from the environment and the stamps
    (mtime, size) of the files and folders read."""
    from phantora_assets.lib.phantora.run_folder import IMPORT_DIR_ENV, registry_path

    matrix_file = run_matrix_path()
    import_dirs = tuple(p for p in os.environ.get(IMPORT_DIR_ENV, "").split(os.pathsep) if p.strip())
    registry = registry_path(data_dir)
    return (
        str(data_dir.resolve()),
        str(matrix_file),
        matrix_file and _stamp(matrix_file),
        _stamp(registry),
        import_dirs,
        tuple(_stamp(Path(d)) for d in import_dirs),
    )


_RESOLVED: dict[str, tuple[tuple, list[RunSpec]]] = {}


def matrix_for(data_dir: str | Path) -> list[RunSpec]:
    """The run matrix as seen from ``data_dir``: ``runs.toml`` (or ``$PHANTORA_ASSETS_RUN_MATRIX``)
    merged with the imports of ``data_dir/imports.toml`` and ``$PHANTORA_ASSETS_IMPORT_DIR``.

    Parsed once per process and input state (see the module docstring); returns a new list of
    the same frozen RunSpecs each call.

    Raises:
        RunMatrixError: an entry of the matrix or of the imports is invalid (named).
    """
    from phantora_assets.lib.phantora.run_folder import effective_matrix

    root = Path(data_dir)
    key = _inputs_key(root)
    hit = _RESOLVED.get(key[0])
    if hit is None or hit[0] != key:
        _RESOLVED[key[0]] = hit = (key, effective_matrix(root))
    return list(hit[1])


def runs_by_id(data_dir: str | Path) -> dict[str, RunSpec]:
    """``run_id -> RunSpec`` of :func:`matrix_for`."""
    return {s.run_id: s for s in matrix_for(data_dir)}
