"""Imported Phantora run folders: the registry, the environment's folders, and the merge of both
into the run matrix (no Dagster import).

Imported runs are kept in a registry, ``<data root>/imports.toml`` (``[[run]]`` entries of the
run-matrix format with ``source = "import"`` and ``path`` = the folder, or ``source = "kineto"``,
``path`` = a folder of PyTorch profiler traces and ``name`` = the run_id, or ``source =
"chakra"`` for a folder of Chakra ETs), written by
``phantora-assets import``. Directories named in ``$PHANTORA_ASSETS_IMPORT_DIR``
(``os.pathsep``-separated) are scanned as well (:func:`discover_imports`: Phantora run folders,
and folders of profiler traces or Chakra ETs with an ``import.toml``): that is how the Dagster UI
gets imported runs without running the CLI.

Removal is only ever explicit (:func:`forget`, ``phantora-assets forget``): a run of the watched
folder is registered too once a build, an import or the ``import_dir`` sensor has seen it
(:func:`remember_watched`), so a later import or build without ``$PHANTORA_ASSETS_IMPORT_DIR``
set keeps it in the run matrix and the dataset (before, it dropped it silently: issue 29).

:func:`effective_matrix` (alias :func:`matrix_for`) merges both into the run matrix. Replacement
rule: an imported run whose run_id equals a matrix entry replaces that entry's source (analytic or
docker) and keeps its ``published`` status; the topology comes from the folder's
``config/netconfig.toml`` when it has one, else from the matrix entry. Among imports, the
environment's directories override the registry, and a later registration of the same run_id
replaces an earlier one.

This module sits above both ``matrix`` (RunSpec, the matrix file) and ``lib/phantora/run_folder``
(discovery), so neither imports the other's caller.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import os
import tomllib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import tomli_w

from phantora_assets.lib.bins.width import DEFAULT_BIN_S, bin_s_override
from phantora_assets.lib.errors import FileRuleError, RunMatrixError
from phantora_assets.lib.phantora.run_folder import TRACE_NAMES, RunFolder, Skipped, discover
from phantora_assets.lib.run.spec import RunSpec
from phantora_assets.lib.store.io import atomic_write_text, walk
from phantora_assets.matrix import load_run_matrix, parse_entries

IMPORT_DIR_ENV = "PHANTORA_ASSETS_IMPORT_DIR"
REGISTRY_NAME = "imports.toml"
#: The sources of registered runs: Phantora run folders, folders of PyTorch profiler traces.
IMPORT_SOURCES = ("import", "kineto", "chakra")


def registry_path(data_root: str | Path) -> Path:
    return Path(data_root) / REGISTRY_NAME


def _entry(spec: RunSpec) -> dict[str, Any]:
    e: dict[str, Any] = {
        "workload": spec.workload,
        "gpu": spec.gpu,
        "nodes": spec.n_nodes,
        "gpus_per_node": spec.gpus_per_node,
        "source": spec.source,
        "path": spec.path,
    }
    if spec.name:
        e["name"] = spec.name
    if spec.rank is not None:
        e["rank"] = spec.rank
    if spec.topology:
        e["topology"] = dict(spec.topology)
    if spec.bin_s != DEFAULT_BIN_S:
        e["bin_s"] = spec.bin_s
    return e


def read_registry(data_root: str | Path) -> list[RunSpec]:
    """Imported runs registered under ``data_root`` (``[]`` when there is no registry).

    Raises:
        RunMatrixError: the registry cannot be parsed or holds an invalid entry (named).
    """
    path = registry_path(data_root)
    if not path.is_file():
        return []
    try:
        data = tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as exc:
        raise RunMatrixError(f"{path}: cannot read the imports registry ({exc})") from exc
    specs = parse_entries(data.get("run", []), str(path), folder=path.parent)
    for s in specs:
        if s.source not in IMPORT_SOURCES:
            raise RunMatrixError(f"{path}: entry {s.run_id} has source {s.source!r}; the registry holds imports only")
    return specs


@contextlib.contextmanager
def _registry_lock(data_root: str | Path) -> Iterator[None]:
    """An exclusive lock on ``<data root>/.imports.lock`` for a read-modify-write of the registry
    (the CLI and the ``import_dir`` sensor may write it at the same time)."""
    root = Path(data_root)
    root.mkdir(parents=True, exist_ok=True)
    with open(root / ".imports.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _write_registry(data_root: str | Path, current: dict[str, RunSpec]) -> Path:
    path = registry_path(data_root)
    header = (
        "# Imported run folders (written by `phantora-assets import`, and for the runs of\n"
        "# $PHANTORA_ASSETS_IMPORT_DIR by the build and the import_dir sensor once they saw them).\n"
        "# One [[run]] per folder; merged into the run matrix. Remove one with `phantora-assets forget RUN_ID`.\n\n"
    )
    body = tomli_w.dumps({"run": [_entry(current[k]) for k in sorted(current)]})
    atomic_write_text(path, header + body, durable=True)
    return path


def register(data_root: str | Path, specs: list[RunSpec]) -> Path:
    """Add or replace ``specs`` (by run_id) in the registry; written atomically, under a lock.
    Returns its path."""
    with _registry_lock(data_root):
        current = {s.run_id: s for s in read_registry(data_root)}
        for s in specs:
            current[s.run_id] = s
        return _write_registry(data_root, current)


def remember_watched(data_root: str | Path) -> list[RunSpec]:
    """Register the runs of ``$PHANTORA_ASSETS_IMPORT_DIR`` whose registry entry is absent or
    differs (another folder, layout or topology), so that the data root keeps them when the
    variable is unset later. Returns the specs written (``[]``: nothing changed, no write).

    Raises:
        RunMatrixError: a directory of the variable is not one, or the registry is invalid (named).
    """
    watched = _watched_specs()
    if not watched:
        return []
    known = {s.run_id: s for s in read_registry(data_root)}
    new = [s for s in watched if s.run_id not in known or _entry(known[s.run_id]) != _entry(s)]
    if new:
        register(data_root, new)
    return new


def forget(data_root: str | Path, run_ids: list[str]) -> list[RunSpec]:
    """Remove ``run_ids`` from the registry: the explicit way a run leaves the run matrix (and,
    at the dataset's next materialization, the dataset). Returns the removed entries.

    Raises:
        RunMatrixError: a run_id is not in the registry, or is still found under
            ``$PHANTORA_ASSETS_IMPORT_DIR`` (it would be registered again: remove the folder first).
    """
    with _registry_lock(data_root):
        current = {s.run_id: s for s in read_registry(data_root)}
        unknown = [r for r in run_ids if r not in current]
        if unknown:
            raise RunMatrixError(
                f"{registry_path(data_root)}: {', '.join(unknown)}: not an imported run of this data root"
            )
        still = [s for s in _watched_specs() if s.run_id in run_ids]
        if still:
            raise RunMatrixError(
                f"${IMPORT_DIR_ENV}: "
                + ", ".join(f"{s.run_id} ({s.path})" for s in still)
                + ": still in the watched folder; remove the folder first, or it is registered again"
            )
        removed = [current.pop(r) for r in run_ids]
        _write_registry(data_root, current)
    return removed


def env_import_dirs() -> list[Path]:
    """Directories named in ``$PHANTORA_ASSETS_IMPORT_DIR``."""
    value = os.environ.get(IMPORT_DIR_ENV, "")
    return [Path(p) for p in value.split(os.pathsep) if p.strip()]


def _watched_specs() -> list[RunSpec]:
    """The runs found under the directories of ``$PHANTORA_ASSETS_IMPORT_DIR`` (a later directory
    wins per run_id).

    Raises:
        RunMatrixError: one of them is not a directory.
    """
    out: dict[str, RunSpec] = {}
    for d in env_import_dirs():
        if not d.is_dir():
            raise RunMatrixError(f"${IMPORT_DIR_ENV}: {d} is not a directory")
        folders, _ = discover_imports(d)
        for f in folders:
            out[f.spec.run_id] = f.spec
    return list(out.values())


def imported_specs(data_root: str | Path) -> list[RunSpec]:
    """Registry entries, then the environment's directories (later wins per run_id)."""
    out: dict[str, RunSpec] = {s.run_id: s for s in read_registry(data_root)}
    for s in _watched_specs():
        out[s.run_id] = s
    return list(out.values())


def _profiled_candidates(root: Path) -> list[Path]:
    """The folders under ``root`` (``root`` too) that hold PyTorch profiler traces or Chakra ETs
    directly; hidden folders, Phantora run folders and what lies below a candidate are not searched."""
    from phantora_assets.sources import chakra, kineto

    out: list[Path] = []
    for dirpath, dirnames, _files in walk(root):  # any depth (os.walk of Python 3.11 recursed)
        here = Path(dirpath)
        if kineto.is_trace_folder(here) or chakra.is_et_folder(here):
            out.append(here)
            dirnames.clear()
            continue
        if any((here / n).exists() for n in (*TRACE_NAMES, "run.log")):
            dirnames.clear()  # a Phantora run folder: its config/ and perfdb_missing/ hold no traces
        dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
    return out


def profiled_folder(folder: Path) -> RunFolder | Skipped:
    """A watched folder of PyTorch profiler traces or Chakra ETs as a partition, from its
    ``import.toml`` (``sources/profiled.py``; nothing else is read: the sensor asks every tick), or
    why not: no ``import.toml``, a broken one, no ``world_size`` for profiler traces (a Chakra
    folder: its number of ``*.<rank>.et``), a layout or run_id the matrix rules refuse. The traces
    themselves are read by the run's ``raw_timeline`` (a trace that cannot give flows fails it,
    naming the file and the reason)."""
    from phantora_assets.lib.chakra.et_io import et_files
    from phantora_assets.sources import chakra, kineto
    from phantora_assets.sources.profiled import SIDECAR, make_spec, read_sidecar

    folder = folder.resolve()
    source = chakra if chakra.is_et_folder(folder) else kineto
    try:
        opts = read_sidecar(folder)
        world = opts.get("world_size") if opts else None
        if opts is not None and world is None and source is chakra:
            world = len(et_files(folder))
    except FileRuleError as exc:
        return Skipped(folder, str(exc))
    if opts is None:
        what = "Chakra ETs" if source is chakra else "PyTorch profiler traces"
        return Skipped(folder, f"a folder of {what} needs an {SIDECAR} (gpus_per_node, world_size; run_id, rank)")
    if world is None:
        return Skipped(folder, f"{SIDECAR} gives no world_size (the job's GPU count)")
    gpn = opts.get("gpus_per_node", 1)
    if gpn < 1 or world % gpn:
        return Skipped(folder, f"{SIDECAR}: gpus_per_node {gpn} does not divide world_size {world}")
    try:
        spec = make_spec(source.NAME, folder, world, gpn, opts.get("run_id"), opts.get("rank"))
    except RunMatrixError as exc:
        return Skipped(folder, f"{SIDECAR}: {str(exc).split(': ', 1)[-1]}")
    return RunFolder(folder, spec, None)


def discover_imports(root: str | Path) -> tuple[list[RunFolder], list[Skipped]]:
    """Every importable folder under ``root``: the Phantora run folders (``run_folder.discover``)
    and the folders of profiler traces or Chakra ETs (:func:`profiled_folder`), sorted by run_id,
    with the folders that cannot be imported and why (a run_id found twice: the later one).

    Raises:
        FileNotFoundError: ``root`` is not a directory.
    """
    found, skipped = discover(root)
    seen = {f.spec.run_id: f.path for f in found}
    for c in _profiled_candidates(Path(root)):
        r = profiled_folder(c)
        if isinstance(r, RunFolder) and r.spec.run_id in seen:
            r = Skipped(r.path, f"run_id {r.spec.run_id} also found at {seen[r.spec.run_id]}")
        if isinstance(r, Skipped):
            skipped.append(r)
        else:
            seen[r.spec.run_id] = r.path
            found.append(r)
    return sorted(found, key=lambda r: r.spec.run_id), skipped


def merge_imports(matrix: list[RunSpec], imports: list[RunSpec]) -> list[RunSpec]:
    """The run matrix with ``imports`` applied (see the module docstring's replacement rule).

    Matrix order is kept; imports of new run_ids follow, sorted by run_id.
    """
    by_id = {s.run_id: s for s in imports}
    merged: list[RunSpec] = []
    for s in matrix:
        imp = by_id.pop(s.run_id, None)
        if imp is None:
            merged.append(s)
        else:
            merged.append(dataclasses.replace(s, source="import", path=imp.path, topology=imp.topology or s.topology))
    merged += [by_id[k] for k in sorted(by_id)]
    return merged


def effective_matrix(data_root: str | Path, matrix: list[RunSpec] | None = None) -> list[RunSpec]:
    """The run matrix (default: :func:`~phantora_assets.matrix.load_run_matrix`, parsed once per
    state of its file) merged with the imports of ``data_root`` and ``$PHANTORA_ASSETS_IMPORT_DIR``
    (read on every call: they are small, and a cache keyed on their files' stamps went stale), with
    every run's ``bin_s`` set to ``$PHANTORA_ASSETS_BIN_S`` when that is set (``build --bin-s``).

    Raises:
        RunMatrixError: an entry, an import or ``$PHANTORA_ASSETS_BIN_S`` is invalid (named).
    """
    base = load_run_matrix() if matrix is None else matrix
    merged = merge_imports(base, imported_specs(data_root))
    try:
        override = bin_s_override()
    except ValueError as exc:
        raise RunMatrixError(str(exc)) from exc
    return merged if override is None else [dataclasses.replace(s, bin_s=override) for s in merged]


def matrix_for(data_dir: str | Path) -> list[RunSpec]:
    """The run matrix as seen from ``data_dir`` (:func:`effective_matrix` with the default matrix).

    Raises:
        RunMatrixError: an entry of the matrix, the registry or an import folder is invalid (named).
    """
    return effective_matrix(data_dir)


def runs_by_id(data_dir: str | Path) -> dict[str, RunSpec]:
    """``run_id -> RunSpec`` of :func:`matrix_for`."""
    return {s.run_id: s for s in matrix_for(data_dir)}
