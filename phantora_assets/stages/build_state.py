"""What ``phantora-assets build`` built, so that its next build builds only what is missing or stale.

After each Dagster run of a build that succeeded, the build records ``<root>/build_state/<what>.json``
(``what``: ``run.<run_id>``, ``perf_db.<gpu>`` or ``dataset``): the assets the run materialized, the
:func:`code_key` of the process that built them, a digest of what they were built from, and the
size and mtime (ns) of every file they left (:func:`listing`). A later build skips a target
(:func:`why_rebuild` says None) only when all of these are as recorded:

* the inputs: a run's ``build_reason`` is None (``stages/simulation.build_reason``: its
  ``run_spec.json`` fingerprint is the one the run matrix, preset, GPU, perf DB, fabric file and
  source files give now -- what ``phantora-assets runs`` and the sensors read); a perf DB's files;
  the dataset's: every run of the matrix, its build reason and the files of its folders;
* the code: :func:`code_key` -- the bytes of the ``phantora_assets`` package, the versions of
  the libraries that write the outputs, the ``PHANTORA_ASSETS_*`` environment (its data root
  aside). A run is never skipped as built by other code;
* the outputs: every file the run left has its recorded size and mtime (one deleted, written
  over or touched is a rebuild), and the assets asked for are among those recorded (a build
  with plots after one ``--no-plots``).

A run that failed (a step raised, a blocking check failed) records nothing and is built again.
A target materialized outside the build (the UI, the daemon) has no record, or its files differ
from the record: the build rebuilds it once. ``phantora-assets build --force`` rebuilds
everything. Pure: no Dagster import.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterable, Mapping
from functools import cache
from importlib import metadata
from pathlib import Path

from phantora_assets.lib.store import generations
from phantora_assets.lib.store.io import atomic_write_text
from phantora_assets.paths import DATA_DIR_ENV, DataPaths

#: The folder of the records under the data root.
STATE_DIR = "build_state"
#: The libraries whose version is part of :func:`code_key` (each writes or shapes output bytes).
LIBRARIES = ("dagster", "duckdb", "matplotlib", "msgspec", "numpy", "pandas", "pandera", "pyarrow")
#: The record format; another version is no record.
VERSION = 1

Listing = dict[str, list[int]]


@cache
def _package_digest() -> str:
    """sha256 over the ``phantora_assets`` package's files (relative path and bytes, in path
    order; ``__pycache__`` left out): any edit of its code or data files changes it."""
    pkg = Path(__file__).resolve().parent.parent
    h = hashlib.sha256()
    for f in sorted(p for p in pkg.rglob("*") if p.is_file() and "__pycache__" not in p.parts):
        h.update(f.relative_to(pkg).as_posix().encode() + b"\0" + f.read_bytes() + b"\0")
    return h.hexdigest()


def code_key(environ: Mapping[str, str] | None = None) -> str:
    """What the outputs depend on beyond a run's inputs, as a sha256: the package's bytes, the
    versions of :data:`LIBRARIES` and the ``PHANTORA_ASSETS_*`` variables of ``environ`` (default
    ``os.environ``) but the data root's."""
    env = os.environ if environ is None else environ
    versions: dict[str, str | None] = {}
    for lib in LIBRARIES:
        try:
            versions[lib] = metadata.version(lib)
        except metadata.PackageNotFoundError:
            versions[lib] = None
    settings = sorted((k, v) for k, v in env.items() if k.startswith("PHANTORA_ASSETS_") and k != DATA_DIR_ENV)
    text = json.dumps([_package_digest(), versions, settings])
    return hashlib.sha256(text.encode()).hexdigest()


def listing(root: Path, tops: Iterable[Path]) -> Listing:
    """``root-relative path -> [size, mtime_ns]`` of every file under each of ``tops`` (a file, or a
    folder walked recursively; a link to a folder followed, as ``phantora_v0`` to its generation)."""
    out: Listing = {}
    for top in tops:
        if top.is_file():
            files = [top]
        elif top.is_dir():
            files = sorted(p for p in top.rglob("*") if p.is_file())
        else:
            continue
        for f in files:
            try:
                st = f.stat()
            except OSError:
                continue
            out[f.relative_to(root).as_posix()] = [st.st_size, st.st_mtime_ns]
    return out


def run_outputs(paths: DataPaths, spec) -> Listing:
    """The files of run ``spec``: its partition folder and its run folder (``traces/...``)."""
    return listing(paths.root, [paths.partition_dir(spec.run_id), paths.run_folder(spec)])


def perf_db_outputs(paths: DataPaths, gpu: str) -> Listing:
    """The summary the ``perf_db`` asset of ``gpu`` writes."""
    return listing(paths.root, [paths.perfdb_summary(gpu)])


def dataset_outputs(paths: DataPaths) -> Listing:
    """The dataset (the generation ``phantora_v0`` links to, plots included) and the database;
    the link's target is part of it (another generation published since is another dataset)."""
    out = listing(paths.root, [paths.dataset_dir, paths.duckdb_path])
    gen = generations.current(paths.dataset_dir)
    out["phantora_v0 ->" + (gen.name if gen is not None else "")] = [0, 0]
    return out


def perf_db_inputs(folder: Path) -> str:
    """sha256 over a perf DB folder's files (relative path and bytes)."""
    h = hashlib.sha256()
    if folder.is_dir():
        for f in sorted(p for p in folder.rglob("*") if p.is_file()):
            h.update(f.relative_to(folder).as_posix().encode() + b"\0" + f.read_bytes() + b"\0")
    return h.hexdigest()


def digest(value: object) -> str:
    """sha256 of ``value`` as sorted JSON."""
    return hashlib.sha256(json.dumps(value, sort_keys=True, default=str).encode()).hexdigest()


def _path(paths: DataPaths, what: str) -> Path:
    return paths.root / STATE_DIR / f"{what}.json"


def record(paths: DataPaths, what: str, key: str, inputs: str, assets: Iterable[str], outputs: Listing) -> None:
    """Record that target ``what`` was built (module docstring) by code ``key`` from ``inputs``,
    materializing ``assets``, leaving ``outputs``."""
    rec = {"version": VERSION, "code": key, "inputs": inputs, "assets": sorted(assets), "outputs": outputs}
    path = _path(paths, what)
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(path, json.dumps(rec, sort_keys=True, indent=0) + "\n")


def forget(paths: DataPaths, what: str) -> None:
    """Drop the record of ``what`` (before it is rebuilt: a build stopped half-way leaves none). A
    record that cannot be removed (a read-only data root) stays: the rebuild then fails writing
    its outputs, and whatever it changed has another size or mtime than the record lists."""
    try:
        _path(paths, what).unlink()
    except OSError:
        pass


def why_rebuild(
    paths: DataPaths, what: str, key: str, inputs: str, assets: Iterable[str], outputs: Listing
) -> str | None:
    """Why target ``what`` is not current, or None when its record says it was built by code
    ``key`` from ``inputs``, with every one of ``assets``, and left exactly ``outputs``."""
    try:
        rec = json.loads(_path(paths, what).read_bytes())
    except FileNotFoundError:
        return "no record of a completed build"
    except (OSError, ValueError) as exc:
        return f"unreadable build record ({exc})"
    if not isinstance(rec, dict) or rec.get("version") != VERSION:
        return "build record of another version"
    if rec.get("code") != key:
        return "built by other code or settings"
    if rec.get("inputs") != inputs:
        return "built from other inputs"
    missing = sorted(set(assets) - set(rec.get("assets", [])))
    if missing:
        return f"{', '.join(missing)} not built"
    before = rec.get("outputs", {})
    changed = sorted(set(before) ^ set(outputs) | {k for k in before if k in outputs and before[k] != outputs[k]})
    if changed:
        return f"files changed since: {', '.join(changed[:3])}{' ...' if len(changed) > 3 else ''}"
    return None
