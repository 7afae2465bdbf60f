"""The run matrix: which training configurations are simulated, one Dagster partition each.

No Dagster import here. ``load_run_matrix()`` reads ``runs.toml`` (or ``$PHANTORA_ASSETS_RUN_MATRIX``)
once per process and state of the file, validates every entry against ``presets.toml``, ``gpus.toml``
and the source registry (``sources.REGISTRY``) and returns :class:`RunSpec` objects; an invalid entry
raises :class:`~phantora_assets.lib.errors.RunMatrixError` naming it and the rule. The rules are strict
(README "Runs are partitions"): every value has its TOML type (nothing is coerced), counts and bandwidths
in range (> 0, finite), names known, ``bin_s`` of ``lib/bins/width.BIN_WIDTHS_MS``, a layout at most
:data:`MAX_NODES` nodes and :data:`MAX_WORLD_SIZE` GPUs. :func:`validate` applies them to any RunSpec (matrix
file, imports registry, run folders, sweep points, code); with imports: ``imported_runs.matrix_for``.
"""

from __future__ import annotations

import os
import re
import tomllib
from dataclasses import dataclass, field
from functools import cache
from importlib import resources
from pathlib import Path
from typing import Any

from phantora_assets.lib.bins.width import DEFAULT_BIN_S, bin_s_rule
from phantora_assets.lib.errors import RunMatrixError
from phantora_assets.lib.net.fabric_rules import topology_problem, topology_tail
from phantora_assets.lib.sim.network import (  # noqa: F401 (the rules' names, re-exported)
    MAX_BW_GBPS,
    MIN_BW_GBPS,
    TOPOLOGY_BANDWIDTHS,
    TOPOLOGY_COUNTS,
    TOPOLOGY_NAMES,
    topology_rule,
)
from phantora_assets.sources import SOURCE_NAMES

RUN_MATRIX_ENV = "PHANTORA_ASSETS_RUN_MATRIX"
SOURCES = SOURCE_NAMES
#: Largest layout simulated: hosts, and GPUs in all (README "Runs are partitions" says why).
MAX_NODES = 4096
MAX_WORLD_SIZE = 65536
MAX_NSPINES = 512  #: spines of a TwoLayerMultiPath network (a ToR port each; routes grow with racks x spines)
PUBLISHED = ("ok", "out_of_memory", "")
PROFILED_SOURCES = ("kineto", "chakra")  # no workload preset nor simulated GPU; the run_id is the entry's name
_NAME = re.compile(r"^(?!phantora_)[a-z0-9][a-z0-9_]{0,99}$")
_ENTRY_KEYS: tuple[str, ...] = ("workload", "gpu", "nodes", "gpus_per_node", "source", "published", "topology")
_ENTRY_KEYS += ("path", "name", "rank", "bin_s", "ep")
_TOML_KINDS = {bool: "boolean", int: "integer", float: "float", str: "string", dict: "table", list: "array"}


def _package_toml(name: str) -> dict[str, Any]:
    return tomllib.loads(resources.files("phantora_assets").joinpath(name).read_text())


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
        source: ``analytic`` | ``docker`` | ``import`` | ``kineto`` | ``chakra``.
        published: status in the published dataset (``ok``, ``out_of_memory`` or ``""``).
        topology: overrides of the ``[cluster]`` network settings (host_bw_gbps, ...).
        path: the folder an ``import`` run (``traces/<gpu>/<workload>_<layout>/``) or a profiled run comes from.
        name, rank: a profiled run's run_id (:data:`PROFILED_SOURCES`; workload and gpu ``""``), and the rank
            of a ``kineto`` folder of one trace without ``distributedInfo`` (``--rank``), else None.
        bin_s: width of the run's bins, s (``lib/bins/width.py``: 0.001 .. 1.0; v1's 0.1 by default).
        ep_size: entry key ``ep``, an MoE run's expert_model_parallel_size (None: the GPU count); EDP = world / ep.
    """

    workload: str
    gpu: str
    n_nodes: int
    gpus_per_node: int
    source: str = "analytic"
    published: str = ""
    topology: tuple[tuple[str, Any], ...] = field(default=())
    path: str = ""
    name: str = ""
    rank: int | None = None
    bin_s: float = DEFAULT_BIN_S
    ep_size: int | None = None

    @property
    def run_id(self) -> str:
        """``phantora_<gpu>_<workload>_<layout>[<topology_tail>]``; a profiled run's ``name``."""
        return self.name or f"phantora_{self.gpu}_{self.workload}_{self.layout}{self.topology_tail}"

    @property
    def topology_tail(self) -> str:  # "" on presets.toml's topology, else _<type in lower case>
        return topology_tail(dict(self.topology), presets()["cluster"]["topology"])

    @property
    def layout(self) -> str:
        return f"{self.n_nodes}x{self.gpus_per_node}"

    @property
    def world_size(self) -> int:
        return self.n_nodes * self.gpus_per_node

    @property
    def preset(self) -> dict[str, Any]:
        if self.source in PROFILED_SOURCES:  # no preset: a profiled run is what its traces show
            return {"framework": "", "model": ""}
        return presets()["workloads"][self.workload]

    @property
    def framework(self) -> str:
        return self.preset["framework"]

    @property
    def gpu_spec(self) -> dict[str, Any]:
        return {} if self.source in PROFILED_SOURCES else gpu_specs()[self.gpu]

    @property
    def cluster(self) -> dict[str, Any]:
        """Network settings: presets ``[cluster]`` with this run's overrides applied."""
        return {**presets()["cluster"], **dict(self.topology)}

    @property
    def tp(self) -> int:
        return int(self.preset.get("tensor_parallel_size", 1))

    @property
    def ep(self) -> int:
        if not self.preset.get("expert_parallel"):
            return 1
        return self.world_size if self.ep_size is None else self.ep_size

    @property
    def dp(self) -> int:
        """Data-parallel size of the dense parameters."""
        return self.world_size // self.tp

    @property
    def zero_stage(self) -> int:
        return int(self.preset.get("zero_stage", 0))

    @property
    def parallelism(self) -> str:
        """Published-style parallelism string, e.g. ``tp=2,dp=4``, ``ep=4``, ``dp=4,zero=3``, ``world=8``."""
        if not self.workload:
            return f"world={self.world_size}"
        if self.ep > 1:
            return f"ep={self.ep}" if self.ep == self.world_size else f"ep={self.ep},dp={self.dp}"
        if self.tp > 1:
            return f"tp={self.tp},dp={self.dp}"
        if self.zero_stage:
            return f"dp={self.dp},zero={self.zero_stage}"
        return f"dp={self.dp}"

    @property
    def trace_dir(self) -> str:
        """Run folder under the data root: ``traces/<gpu>/<workload>_<layout>``, ``traces/<source>/<name>``."""
        name = f"{self.workload}_{self.layout}{self.topology_tail}"
        return f"traces/{self.source}/{self.name}" if self.name else f"traces/{self.gpu}/{name}"


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _got(value: object) -> str:
    """``got <value> (<TOML type>)`` for a message (booleans spelled as in TOML, long values cut)."""
    shown = str(value).lower() if isinstance(value, bool) else repr(value)
    shown = shown if len(shown) <= 60 else shown[:57] + "..."
    return f"got {shown} ({_TOML_KINDS.get(type(value), type(value).__name__)})"


def _describe(workload: object, gpu: object, nodes: object, gpus_per_node: object) -> str:
    """``<workload> <gpu> <layout>`` of an entry for its label; ``?`` for a value of the wrong type."""
    name = [v if isinstance(v, str) else "?" for v in (workload, gpu)]
    layout = "x".join(str(v) if _is_int(v) else "?" for v in (nodes, gpus_per_node))
    return f"{name[0]} {name[1]} {layout}"


def _check_fields(spec: RunSpec, entry: str) -> None:  # noqa: C901 (one check per run-matrix key, each with its message)
    """Types, known names and ranges of the entry's own keys (not the layout rules, not topology)."""
    strings = {"workload": spec.workload, "gpu": spec.gpu, "source": spec.source, "name": spec.name}
    for key, value in {**strings, "published": spec.published, "path": spec.path}.items():
        if not isinstance(value, str):
            raise RunMatrixError(f"{entry}: {key} must be a string, {_got(value)}")
    for key, count in (("nodes", spec.n_nodes), ("gpus_per_node", spec.gpus_per_node)):
        if not _is_int(count):
            raise RunMatrixError(f"{entry}: {key} must be an integer, {_got(count)}")
    if spec.source in PROFILED_SOURCES:
        if spec.workload or spec.gpu or not spec.path or not _NAME.match(spec.name):
            raise RunMatrixError(f"{entry}: a {spec.source} run has workload = gpu = '', a path, a name of [a-z0-9_]")
    elif spec.name:
        raise RunMatrixError(f"{entry}: name is only allowed with source = {' | '.join(PROFILED_SOURCES)}")
    elif spec.workload not in (wl := presets()["workloads"]):
        raise RunMatrixError(f"{entry}: unknown workload {spec.workload!r} (known: {', '.join(sorted(wl))})")
    elif spec.gpu not in gpu_specs():
        raise RunMatrixError(f"{entry}: unknown GPU {spec.gpu!r} (known: {', '.join(sorted(gpu_specs()))})")
    if spec.source not in SOURCES:
        raise RunMatrixError(f"{entry}: unknown source {spec.source!r} (known: {', '.join(SOURCES)})")
    if spec.published not in PUBLISHED:
        raise RunMatrixError(f"{entry}: unknown published status {spec.published!r} (known: 'ok', 'out_of_memory', '')")
    if spec.n_nodes < 1 or spec.gpus_per_node < 1:
        raise RunMatrixError(f"{entry}: nodes and gpus_per_node must be >= 1")
    if rule := bin_s_rule(spec.bin_s):
        raise RunMatrixError(f"{entry}: bin_s {rule}")
    if spec.n_nodes > MAX_NODES or (world := spec.world_size) > MAX_WORLD_SIZE:
        raise RunMatrixError(
            f"{entry}: layout {spec.layout} ({spec.world_size} GPUs) is larger than the simulator supports: at most "
            f"{MAX_NODES} nodes and {MAX_WORLD_SIZE} GPUs in all (the largest layouts: e.g. 4096x16, 2048x32)"
        )
    if spec.rank is not None and not (spec.source == "kineto" and _is_int(spec.rank) and 0 <= spec.rank < world):
        raise RunMatrixError(f"{entry}: rank is a kineto run's traced rank, 0 to world size - 1, {_got(spec.rank)}")


def _check_topology(spec: RunSpec, entry: str) -> None:
    if why := topology_problem(
        spec.topology, presets()["cluster"], spec.n_nodes, spec.gpus_per_node, spec.source, _got
    ):
        raise RunMatrixError(f"{entry}: {why}")


def validate(spec: RunSpec, entry: str) -> None:
    """Raise RunMatrixError (naming ``entry`` and the rule) if ``spec`` cannot be simulated.

    Checks, in this order: the types of every field (no coercion), the known workload, GPU,
    source and published status, nodes and gpus_per_node >= 1, bin_s, the largest layout
    (:data:`MAX_NODES`, :data:`MAX_WORLD_SIZE`), the workload's parallelism rules, ``path`` with
    ``import`` and profiled sources only (``name`` with the latter) and UTF-8 text (a folder name
    of undecodable bytes is refused: the registry could not be written), then every topology key.
    """
    _check_fields(spec, entry)
    world = spec.world_size
    tp = spec.tp
    if world % tp or world < tp:
        raise RunMatrixError(
            f"{entry}: layout {spec.layout} has {world} GPU(s); {spec.workload} needs tensor_parallel_size={tp} "
            f"to divide the GPU count"
        )
    _check_ep(spec, entry)
    if spec.source == "import" and not spec.path:
        raise RunMatrixError(f"{entry}: source 'import' needs the run folder as path = \"...\"")
    if spec.path and spec.source not in ("import", *PROFILED_SOURCES):
        raise RunMatrixError(f"{entry}: path is only allowed with source = 'import' (source is {spec.source!r})")
    if spec.path.encode("utf-8", "replace").decode() != spec.path:  # a file name's undecodable bytes
        raise RunMatrixError(f"{entry}: path {spec.path!r} is not UTF-8 text (the registry and records are): rename it")
    _check_topology(spec, entry)


def _check_ep(spec: RunSpec, entry: str) -> None:
    """``ep``: an integer from 1 to the GPU count that divides the GPU count and the experts, MoE only."""
    world, ep, experts = spec.world_size, spec.ep_size, int(spec.preset.get("num_moe_experts", 0))
    if ep is None and spec.preset.get("expert_parallel") and experts % world:
        why = f"sets expert_model_parallel_size = GPU count, which must divide num_moe_experts={experts} (or set ep)"
    elif ep is None:
        return
    elif not _is_int(ep):
        raise RunMatrixError(f"{entry}: ep must be an integer, {_got(ep)}")
    elif not spec.preset.get("expert_parallel"):
        raise RunMatrixError(f"{entry}: ep is only allowed for an MoE workload (expert_parallel in presets.toml)")
    elif not 1 <= ep <= world or world % ep or experts % ep:
        why = f"needs ep from 1 to {world} dividing the GPU count and num_moe_experts={experts}, got {ep}"
    else:
        return
    raise RunMatrixError(f"{entry}: layout {spec.layout} has {world} GPUs; {spec.workload} {why}")


def parse_entries(entries: object, source_name: str = "runs.toml") -> list[RunSpec]:
    """Turn ``[[run]]`` tables into validated RunSpecs (values as written: nothing is coerced);
    run_ids must be unique. ``entries`` is the file's ``run`` value: an array of tables."""
    if not isinstance(entries, list):
        hint = " (write [[run]], not [run])" if isinstance(entries, dict) else ""
        raise RunMatrixError(f"{source_name}: run must be an array of tables ([[run]] entries){hint}, {_got(entries)}")
    specs: list[RunSpec] = []
    seen: dict[str, str] = {}
    for i, raw in enumerate(entries):
        entry = f"{source_name} [[run]] #{i + 1}"
        if not isinstance(raw, dict):
            raise RunMatrixError(f"{entry}: an entry must be a table ([[run]] with workload, gpu, ...), {_got(raw)}")
        missing = {"workload", "gpu", "nodes", "gpus_per_node"} - set(raw)
        if missing:
            raise RunMatrixError(f"{entry}: missing keys {sorted(missing)}")
        extra = set(raw) - set(_ENTRY_KEYS)
        if extra:
            raise RunMatrixError(f"{entry}: unknown keys {sorted(extra)}")
        label = f"{entry} ({_describe(raw['workload'], raw['gpu'], raw['nodes'], raw['gpus_per_node'])})"
        topology = raw.get("topology", {})
        if not isinstance(topology, dict):
            raise RunMatrixError(f"{label}: topology must be a table ({{ host_bw_gbps = 400, ... }}), {_got(topology)}")
        spec = RunSpec(
            workload=raw["workload"],
            gpu=raw["gpu"],
            n_nodes=raw["nodes"],
            gpus_per_node=raw["gpus_per_node"],
            source=raw.get("source", "analytic"),
            published=raw.get("published", ""),
            topology=tuple(sorted(topology.items())),
            path=raw.get("path", ""),
            name=raw.get("name", ""),
            rank=raw.get("rank"),
            bin_s=raw.get("bin_s", DEFAULT_BIN_S),
            ep_size=raw.get("ep"),
        )
        validate(spec, label)
        if spec.run_id in seen:
            raise RunMatrixError(f"{entry}: duplicate run_id {spec.run_id} (also {seen[spec.run_id]})")
        seen[spec.run_id] = entry
        specs.append(spec)
    return specs


def check_specs(specs: list[RunSpec], source_name: str) -> None:
    """Validate RunSpecs built in code (not parsed from a file): each entry's rules (:func:`validate`:
    types, ranges, known values, layout bound, topology), unique run_ids; else ``RunMatrixError``
    naming ``source_name``, the entry and the rule."""
    seen: set[str] = set()
    for i, spec in enumerate(specs):
        if not isinstance(spec, RunSpec):
            raise RunMatrixError(f"{source_name} #{i + 1}: not a RunSpec, {_got(spec)}")
        entry = f"{source_name} #{i + 1} ({_describe(spec.workload, spec.gpu, spec.n_nodes, spec.gpus_per_node)})"
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
    """Load and validate a run matrix (default: ``$PHANTORA_ASSETS_RUN_MATRIX``, else the shipped ``runs.toml``).
    Parsed once per process and state of the file (inode, size, mtime, ctime); a new list of the same specs each call.

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
    specs = parse_entries(data.get("run", []), name)
    _PARSED[key] = (stamp, specs)
    return list(specs)


def spec_from_run_id(run_id: str, matrix: list[RunSpec] | None = None) -> RunSpec:
    """The RunSpec of ``run_id`` from the matrix (KeyError naming it if absent)."""
    for spec in matrix if matrix is not None else load_run_matrix():
        if spec.run_id == run_id:
            return spec
    raise KeyError(f"run_id {run_id!r} is not in the run matrix")
