"""One training configuration as data (:class:`RunSpec`, one partition of the run matrix) and its rules.

:func:`validate` applies the run matrix's rules (README "Runs are partitions") to any RunSpec (matrix
file, imports registry, run folders, sweep points, code) and raises
:class:`~phantora_assets.lib.errors.RunMatrixError` naming the entry and the rule. The rules are strict:
every value has its TOML type (nothing is coerced), counts and bandwidths in range (> 0, finite), names
known (:mod:`~phantora_assets.lib.run.catalog`: workloads, GPUs; :data:`SOURCES`), ``bin_s`` of
``lib/bins/width.BIN_WIDTHS_MS``, a layout at most :data:`MAX_NODES` nodes and :data:`MAX_WORLD_SIZE` GPUs.
A run names its workload and GPU; :attr:`RunSpec.wl` and :attr:`RunSpec.gpu_spec` look them up in the
catalog unless the run carries the definition (``workload_def``, ``gpu_def``). No Dagster import.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from functools import cache, cached_property
from typing import Any

from phantora_assets.lib.bins.width import DEFAULT_BIN_S, bin_s_rule
from phantora_assets.lib.errors import RunMatrixError
from phantora_assets.lib.net.fabric_rules import topology_problem, topology_tail
from phantora_assets.lib.net.optical import reconfig_rule, reconfig_tail
from phantora_assets.lib.run.catalog import gpu_specs, presets, workload_specs
from phantora_assets.lib.workload import tables
from phantora_assets.lib.workload.spec import Parallel, WorkloadSpec, got_repr, parallelism_label

#: Largest layout simulated: hosts, and GPUs in all (README "Runs are partitions" says why).
MAX_NODES = 4096
MAX_WORLD_SIZE = 65536
MAX_NSPINES = 512  #: spines of a TwoLayerMultiPath network (a ToR port each; routes grow with racks x spines)
PUBLISHED = ("ok", "out_of_memory", "")
PROFILED_SOURCES = ("kineto", "chakra")  # no workload preset nor simulated GPU; the run_id is the entry's name
#: The ``source`` names a run may give, in the order of the sources' registry (``sources.REGISTRY``
#: maps each to the module that simulates or imports it).
SOURCES: tuple[str, ...] = ("analytic", "docker", "import", *PROFILED_SOURCES)
_NAME = re.compile(r"^(?!phantora_)[a-z0-9][a-z0-9_]{0,99}$")
_SUFFIX = re.compile(r"^[a-z0-9][a-z0-9_]{0,39}$")


@cache
def _resolved(wl: WorkloadSpec, world: int, ep_size: int | None) -> Parallel:
    return tables.resolve(wl, world, "run", ep_size)


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
        name, rank: a profiled run's run_id (:data:`PROFILED_SOURCES`; workload and gpu ``""``), else the
            suffix of a simulated run's run_id (``_<name>``: runs differing only in topology coexist); the rank
            of a ``kineto`` folder of one trace without ``distributedInfo`` (``--rank``), else None.
        bin_s: width of the run's bins, s (``lib/bins/width.py``: 0.001 .. 1.0; v1's 0.1 by default).
        ep_size: entry key ``ep``, an MoE run's expert_model_parallel_size (None: the workload's ``parallel.ep``).
        workload_def, gpu_def: the ``[workloads.NAME]`` / ``[gpus.NAME]`` of a user's matrix file the run
            names (None / () for a shipped workload / GPU: ``catalog.workload_specs``, ``catalog.gpu_specs``).
        matrix_dir: the folder of the run-matrix file the entry was read from ("" for a RunSpec built in
            code): ``run_spec.json`` names the files a topology reads relative to it (``fabric_file``), so a
            data root and its matrix moved elsewhere stay current and hold no path of this machine. Not part
            of the run's identity (the topology holds the resolved path).
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
    workload_def: WorkloadSpec | None = None
    gpu_def: tuple[tuple[str, Any], ...] = ()
    reconfig: tuple[tuple[str, Any], ...] = ()
    matrix_dir: str = field(default="", compare=False, repr=False)

    @property
    def run_id(self) -> str:
        """``phantora_<gpu>_<workload>_<layout>[<topology_tail>][_<name>]``; a profiled run's ``name``."""
        if self.source in PROFILED_SOURCES:
            return self.name
        return f"phantora_{self.gpu}_{self._folder_name}"

    @property
    def _folder_name(self) -> str:
        """``<workload>_<layout>[<topology_tail>][_<name>]``: a simulated run's name under its GPU."""
        suffix = f"_{self.name}" if self.name else ""
        ocs = reconfig_tail(dict(self.reconfig))  # "" unless the run's own network is reconfigured
        return f"{self.workload}_{self.layout}{self.topology_tail}{ocs}{suffix}"

    @property
    def job_key(self) -> str:
        """``phantora_<gpu>_<workload>_<layout>``: the job (what runs on which GPUs), without its fabric
        (``topology_tail``), its optical network (the ``_ocs_...`` tail) or its label (``name``). The analytic
        simulator's step jitter is seeded by it (``lib/sim/keys.seed_of``), so runs of one job that differ only
        in fabric, reconfiguration or name get the same compute and jitter, and their steps differ by what the
        network does and nothing else. Equal to ``run_id`` for a run on the preset topology without ``name``
        or ``reconfig.mode`` (every shipped run: their seeds, and outputs, are unchanged)."""
        return f"phantora_{self.gpu}_{self.workload}_{self.layout}"

    @property
    def topology_tail(self) -> str:  # "" on presets.toml's topology, else _<type in lower case>
        return topology_tail(dict(self.topology), presets()["cluster"]["topology"])

    @property
    def layout(self) -> str:
        return f"{self.n_nodes}x{self.gpus_per_node}"

    @property
    def world_size(self) -> int:
        return self.n_nodes * self.gpus_per_node

    @cached_property
    def wl(self) -> WorkloadSpec:
        """The run's workload (schema: lib/workload/spec.py). KeyError for a profiled run."""
        return self.workload_def or workload_specs()[self.workload]

    @cached_property
    def par(self) -> Parallel:
        """The run's parallel sizes (the workload resolved on the layout; cached)."""
        return _resolved(self.wl, self.world_size, self.ep_size)

    @property
    def preset(self) -> dict[str, Any]:
        """The workload's table as written (``{"framework": "", "model": ""}`` for a profiled run)."""
        if self.source in PROFILED_SOURCES:  # no preset: a profiled run is what its traces show
            return {"framework": "", "model": ""}
        return self.wl.table()

    @property
    def framework(self) -> str:
        return "" if self.source in PROFILED_SOURCES else self.wl.framework

    @property
    def model_name(self) -> str:
        """The model's display name (``model.name``, else the workload's name); "" for a profiled run."""
        return "" if self.source in PROFILED_SOURCES else self.wl.model_name

    @property
    def gpu_spec(self) -> dict[str, Any]:
        if self.source in PROFILED_SOURCES:
            return {}
        return dict(self.gpu_def) if self.gpu_def else gpu_specs()[self.gpu]

    @property
    def cluster(self) -> dict[str, Any]:
        """Network settings: presets ``[cluster]`` with this run's overrides applied; a GPU that gives
        its scale-up bandwidth (``scale_up_bw_bytes_per_s``, bytes/s) sets ``loopback_gbps`` (x 8 / 1e9:
        the rate of a flow inside a scale-up domain; the entry may not set it too: :func:`validate`)."""
        out = {**presets()["cluster"], **dict(self.topology)}
        try:
            scale_up = self.gpu_spec.get("scale_up_bw_bytes_per_s")
        except KeyError:  # a GPU of no table (refused by validate): no scale-up bandwidth of its own
            scale_up = None
        if scale_up:
            out["loopback_gbps"] = float(scale_up) * 8 / 1e9
        return out

    @property
    def tp(self) -> int:
        return self.par.tp

    @property
    def ep(self) -> int:
        return self.par.ep

    @property
    def dp(self) -> int:
        """Data-parallel size of the dense parameters (world / (tp x pp x cp))."""
        return self.par.dp

    @property
    def zero_stage(self) -> int:
        return self.par.zero

    @property
    def parallelism(self) -> str:
        """Published-style parallelism string (``tp=2,dp=4``, ``ep=4``, ``dp=4,zero=3``, ``world=8``
        for a profiled run; :func:`~phantora_assets.lib.workload.spec.parallelism_label`)."""
        return parallelism_label(self.par, self.framework) if self.workload else f"world={self.world_size}"

    @property
    def trace_dir(self) -> str:
        """Run folder under the data root: ``traces/<gpu>/<workload>_<layout>``, ``traces/<source>/<name>``."""
        if self.source in PROFILED_SOURCES:
            return f"traces/{self.source}/{self.name}"
        return f"traces/{self.gpu}/{self._folder_name}"


def _check_fields(spec: RunSpec, entry: str) -> None:  # noqa: C901, PLR0912 (one check per run-matrix key, each with its message)
    """Types, known names and ranges of the entry's own keys (not the layout rules, not topology)."""
    strings = {"workload": spec.workload, "gpu": spec.gpu, "source": spec.source, "name": spec.name}
    for key, value in {**strings, "published": spec.published, "path": spec.path}.items():
        if not isinstance(value, str):
            raise RunMatrixError(f"{entry}: {key} must be a string, {got_repr(value)}")
    for key, count in (("nodes", spec.n_nodes), ("gpus_per_node", spec.gpus_per_node)):
        if not tables._is_int(count):
            raise RunMatrixError(f"{entry}: {key} must be an integer, {got_repr(count)}")
    if spec.source in PROFILED_SOURCES:
        if spec.workload or spec.gpu or not spec.path or not _NAME.match(spec.name):
            raise RunMatrixError(f"{entry}: a {spec.source} run has workload = gpu = '', a path, a name of [a-z0-9_]")
    elif spec.name and (spec.source == "import" or not isinstance(spec.name, str) or not _SUFFIX.match(spec.name)):
        raise RunMatrixError(
            f"{entry}: name is a simulated run's run-id suffix ([a-z0-9][a-z0-9_]*, at most 40 characters: runs "
            f"differing only in topology settings coexist) or a {' | '.join(PROFILED_SOURCES)} run's run_id; "
            f"{got_repr(spec.name)}"
            + (" (an imported run folder is named by its folder)" if spec.source == "import" else "")
        )
    elif spec.workload_def is None and spec.workload not in (wl := workload_specs()):
        raise RunMatrixError(f"{entry}: unknown workload {spec.workload!r} (known: {', '.join(sorted(wl))})")
    elif spec.workload_def is not None and spec.workload_def.name != spec.workload:
        raise RunMatrixError(
            f"{entry}: workload {spec.workload!r} carries the definition of {spec.workload_def.name!r}"
        )
    elif not spec.gpu_def and spec.gpu not in gpu_specs():
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
    if spec.rank is not None and not (spec.source == "kineto" and tables._is_int(spec.rank) and 0 <= spec.rank < world):
        raise RunMatrixError(f"{entry}: rank is a kineto run's traced rank, 0 to world size - 1, {got_repr(spec.rank)}")


def _check_topology(spec: RunSpec, entry: str) -> None:
    if spec.gpu and "loopback_gbps" in dict(spec.topology) and spec.gpu_spec.get("scale_up_bw_bytes_per_s"):
        raise RunMatrixError(
            f"{entry}: topology.loopback_gbps and the GPU's scale_up_bw_bytes_per_s ([gpus.{spec.gpu}]) both set the "
            "scale-up bandwidth: give it once (the GPU's, bytes/s, or the entry's, Gbps)"
        )
    if why := topology_problem(
        spec.topology, presets()["cluster"], spec.n_nodes, spec.gpus_per_node, spec.source, got_repr
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
    if spec.source not in PROFILED_SOURCES:
        tables.check_layout(spec, entry)
    if spec.source == "import" and not spec.path:
        raise RunMatrixError(f"{entry}: source 'import' needs the run folder as path = \"...\"")
    if spec.path and spec.source not in ("import", *PROFILED_SOURCES):
        raise RunMatrixError(f"{entry}: path is only allowed with source = 'import' (source is {spec.source!r})")
    if spec.path.encode("utf-8", "replace").decode() != spec.path:  # a file name's undecodable bytes
        raise RunMatrixError(f"{entry}: path {spec.path!r} is not UTF-8 text (the registry and records are): rename it")
    _check_topology(spec, entry)
    kind = str(spec.cluster.get("topology"))
    optical_nics = None
    if spec.reconfig and kind == "Arbitrary":  # the file says which switches are optical (built: _check_topology)
        from phantora_assets.lib.net.fabric import build_fabric

        optical_nics = int(build_fabric(spec.cluster, spec.n_nodes, spec.gpus_per_node).optical_endpoints.sum())
    if spec.reconfig and (why := reconfig_rule(dict(spec.reconfig), kind, spec.source, optical_nics)):
        raise RunMatrixError(f"{entry}: {why} (docs/FABRIC.md, 'The optical rail in the simulator')")
