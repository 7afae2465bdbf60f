"""The run matrix: which training configurations are simulated, one Dagster partition each.

No Dagster import here. ``load_run_matrix()`` reads ``runs.toml`` (or ``$PHANTORA_ASSETS_RUN_MATRIX``)
once per process and state of the file, validates every entry and returns
:class:`~phantora_assets.lib.run.spec.RunSpec` objects; an invalid entry raises
:class:`~phantora_assets.lib.errors.RunMatrixError` naming it and the rule (the rules:
:func:`~phantora_assets.lib.run.spec.validate`; the names a run may use:
:mod:`~phantora_assets.lib.run.catalog`, which takes the file in use from :func:`run_matrix_path`).
With imports: ``imported_runs.matrix_for``.
"""

from __future__ import annotations

import os
import tomllib
from importlib import resources
from pathlib import Path
from typing import Any

from phantora_assets.lib.bins.width import DEFAULT_BIN_S
from phantora_assets.lib.errors import RunMatrixError
from phantora_assets.lib.net.fabric import resolve_files
from phantora_assets.lib.run import catalog
from phantora_assets.lib.run.catalog import package_toml, shipped_gpu_specs, shipped_workloads
from phantora_assets.lib.run.spec import RunSpec, validate
from phantora_assets.lib.workload import tables
from phantora_assets.lib.workload.spec import WorkloadSpec, got_repr

RUN_MATRIX_ENV = "PHANTORA_ASSETS_RUN_MATRIX"
_ENTRY_KEYS: tuple[str, ...] = ("workload", "gpu", "nodes", "gpus_per_node", "source", "published", "topology")
_ENTRY_KEYS += ("path", "name", "rank", "bin_s", "ep", "reconfig")


def run_matrix_path() -> Path | None:
    """The user's run matrix file from ``PHANTORA_ASSETS_RUN_MATRIX``, or None for the shipped one."""
    value = os.environ.get(RUN_MATRIX_ENV)
    return Path(value) if value else None


# the workloads and GPUs a run may name are the shipped ones and this file's (lib/run/catalog.py)
catalog.use_matrix_file(run_matrix_path)


def parse_entries(
    entries: object,
    source_name: str = "runs.toml",
    workloads: dict[str, WorkloadSpec] | None = None,
    gpus: dict[str, dict[str, Any]] | None = None,
    folder: Path | None = None,
) -> list[RunSpec]:
    """Turn ``[[run]]`` tables into validated RunSpecs (values as written: nothing is coerced);
    run_ids must be unique. ``entries`` is the file's ``run`` value: an array of tables;
    ``workloads`` / ``gpus`` the file's own ``[workloads.NAME]`` / ``[gpus.NAME]`` (a run naming
    one carries its definition); ``folder`` the file's folder, against which a relative file a
    topology names (``fabric_file``) is read (``lib/net/fabric.resolve_files``; None: the working
    directory, for tables not read from a file)."""
    workloads, gpus = workloads or {}, gpus or {}
    if not isinstance(entries, list):
        hint = " (write [[run]], not [run])" if isinstance(entries, dict) else ""
        raise RunMatrixError(
            f"{source_name}: run must be an array of tables ([[run]] entries){hint}, {got_repr(entries)}"
        )
    specs: list[RunSpec] = []
    seen: dict[str, str] = {}
    for i, raw in enumerate(entries):
        entry = f"{source_name} [[run]] #{i + 1}"
        if not isinstance(raw, dict):
            raise RunMatrixError(
                f"{entry}: an entry must be a table ([[run]] with workload, gpu, ...), {got_repr(raw)}"
            )
        missing = {"workload", "gpu", "nodes", "gpus_per_node"} - set(raw)
        if missing:
            raise RunMatrixError(f"{entry}: missing keys {sorted(missing)}")
        extra = set(raw) - set(_ENTRY_KEYS)
        if extra:
            raise RunMatrixError(f"{entry}: unknown keys {sorted(extra)}")
        label = f"{entry} ({tables._describe(raw['workload'], raw['gpu'], raw['nodes'], raw['gpus_per_node'])})"
        topology = raw.get("topology", {})
        if not isinstance(topology, dict):
            raise RunMatrixError(
                f"{label}: topology must be a table ({{ host_bw_gbps = 400, ... }}), {got_repr(topology)}"
            )
        topology = resolve_files(topology, folder)
        reconfig = raw.get("reconfig", {})
        if not isinstance(reconfig, dict):
            raise RunMatrixError(
                f"{label}: reconfig must be a table ({{ mode = 'provisioned', delay_ms = 10 }}), {got_repr(reconfig)}"
            )
        reconfig = {k: tuple(v) if isinstance(v, list) else v for k, v in reconfig.items()}
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
            reconfig=tuple(sorted(reconfig.items())),
            workload_def=workloads.get(raw["workload"]) if isinstance(raw["workload"], str) else None,
            gpu_def=tuple(sorted(gpus[raw["gpu"]].items()))
            if isinstance(raw["gpu"], str) and raw["gpu"] in gpus
            else (),
            matrix_dir=str(Path(folder).absolute()) if folder is not None else "",
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
            raise RunMatrixError(f"{source_name} #{i + 1}: not a RunSpec, {got_repr(spec)}")
        entry = (
            f"{source_name} #{i + 1} ({tables._describe(spec.workload, spec.gpu, spec.n_nodes, spec.gpus_per_node)})"
        )
        validate(spec, entry)
        if spec.run_id in seen:
            raise RunMatrixError(f"{entry}: duplicate run_id {spec.run_id}")
        seen.add(spec.run_id)


_PARSED: dict[str, tuple[tuple[int, ...] | None, list[RunSpec]]] = {}


def load_run_matrix(path: str | Path | None = None) -> list[RunSpec]:
    """Load and validate a run matrix (default: ``$PHANTORA_ASSETS_RUN_MATRIX``, else the shipped ``runs.toml``).
    Parsed once per process and state of the file (inode, size, mtime, ctime); a new list of the same specs each call.

    Raises:
        RunMatrixError: an entry is invalid; the message names the file, the entry and the rule.
    """
    path = Path(path) if path else run_matrix_path()
    key = str(path.absolute()) if path is not None else ""  # its relative files resolve against its folder
    stamp = tables.file_stamp(path) if path is not None else None
    hit = _PARSED.get(key)
    if hit is not None and hit[0] == stamp and (path is None or stamp is not None):
        return list(hit[1])
    if path is None:
        data, name = package_toml("runs.toml"), "runs.toml"
        folder = Path(str(resources.files("phantora_assets")))
    else:
        folder = path.parent
        try:
            data = tomllib.loads(path.read_text())
        except (OSError, tomllib.TOMLDecodeError) as exc:
            raise RunMatrixError(f"{path}: cannot read run matrix ({exc})") from exc
        name = str(path)
    wls, gpus = (
        tables.file_tables(data, name, shipped_workloads(), shipped_gpu_specs()) if path is not None else ({}, {})
    )
    specs = parse_entries(data.get("run", []), name, wls, gpus, folder)
    _PARSED[key] = (stamp, specs)
    return list(specs)


def spec_from_run_id(run_id: str, matrix: list[RunSpec] | None = None) -> RunSpec:
    """The RunSpec of ``run_id`` from the matrix (KeyError naming it if absent)."""
    for spec in matrix if matrix is not None else load_run_matrix():
        if spec.run_id == run_id:
            return spec
    raise KeyError(f"run_id {run_id!r} is not in the run matrix")
