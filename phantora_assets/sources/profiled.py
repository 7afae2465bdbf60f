"""What the sources of profiled runs (``kineto``, ``chakra``: a folder of traces, one per rank, no
workload preset) share: their RunSpec, the start and the end of their ``raw_timeline``, their
``chrome_trace``, the sidecar ``import.toml`` and the files their fingerprint covers. No Dagster
import.

``import.toml`` (optional, in the folder of traces) gives the placement that ``phantora-assets
import`` takes as options, so that a folder dropped into ``$PHANTORA_ASSETS_IMPORT_DIR`` can be a
partition without the command line (``imported_runs.discover_imports``)::

    gpus_per_node = 8        # rank r on host r // 8 + 1 (default 1)
    world_size = 16          # the job's GPU count (required for PyTorch profiler traces in a watched folder)
    run_id = "llama_probe"   # the partition (default <folder name>_<nodes>x<gpus_per_node>)
    rank = 3                 # one trace without distributedInfo: its rank

Options on the command line win over the file.
"""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Any

import pandas as pd

from phantora_assets.checks import record_note, reset_checks
from phantora_assets.lib.errors import FileRuleError, TraceFormatError
from phantora_assets.lib.kineto.run import default_run_id
from phantora_assets.lib.phantora import trace_writer
from phantora_assets.lib.run.spec import RunSpec, validate
from phantora_assets.lib.store.io import atomic_write_text
from phantora_assets.lib.store.parquet import write_parquet
from phantora_assets.outcomes import Outcome, StageResult, record
from phantora_assets.paths import DataPaths
from phantora_assets.records import RunLogRecord, write_record
from phantora_assets.sources.base import SourceContext

#: The checks.json entry that holds a profiled source's assumptions (status ``note``).
NOTE_NAME = "source_assumptions"
#: The sidecar of a folder of traces (module docstring) and its keys with their types.
SIDECAR = "import.toml"
SIDECAR_KEYS: dict[str, type] = {"gpus_per_node": int, "world_size": int, "run_id": str, "rank": int}


def read_sidecar(folder: str | Path) -> dict[str, Any] | None:
    """The folder's ``import.toml`` as ``{key: value}`` (only :data:`SIDECAR_KEYS`), or None
    when it has none.

    Raises:
        FileRuleError: ``import.toml`` is a link, not TOML, has an unknown key or a value of the
            wrong type or below 0 (rule ``import.toml``).
    """
    path = Path(folder) / SIDECAR
    if not path.exists() and not path.is_symlink():
        return None
    if path.is_symlink() or not path.is_file():
        raise FileRuleError(path, "import.toml", "not a regular file (the import does not follow links)")
    try:
        data = tomllib.loads(path.read_text())
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as exc:
        raise FileRuleError(path, "import.toml", f"cannot be read as TOML ({exc})") from None
    unknown = sorted(set(data) - set(SIDECAR_KEYS))
    if unknown:
        raise FileRuleError(path, "import.toml", f"unknown keys {unknown} (known: {', '.join(SIDECAR_KEYS)})")
    for key, value in data.items():
        kind = SIDECAR_KEYS[key]
        if not (isinstance(value, str) if kind is str else (type(value) is int and value >= 0)):
            want = "an integer >= 0" if kind is int else "a string"
            raise FileRuleError(path, "import.toml", f"{key} must be {want}, got {value!r}")
    return data


def make_spec(source: str, folder: Path, world: int, gpus_per_node: int, run_id: str | None, rank: int | None = None):
    """The RunSpec of a folder of ``world`` ranks' traces of ``source``: run_id ``run_id`` or
    ``<folder name>_<nodes>x<gpus_per_node>`` (``lib/kineto/run.default_run_id``).

    Raises:
        RunMatrixError: ``run_id`` is not a valid name, or the layout breaks a rule (lib/run/spec.validate).
    """
    n_nodes = world // gpus_per_node if gpus_per_node > 0 else 0
    name = run_id or default_run_id(folder, n_nodes, gpus_per_node)
    spec = RunSpec("", "", n_nodes, gpus_per_node, source=source, path=str(folder), name=name, rank=rank)
    validate(spec, f"--run-id {name!r} ({folder})")
    return spec


def start_raw_timeline(spec: RunSpec, paths: DataPaths, what: str) -> tuple[Path, Path]:
    """Start the ``raw_timeline`` of a profiled run: its checks reset; ``(run folder, source folder)``.

    Raises:
        FileNotFoundError: the registered folder (of ``what``, e.g. ``profiler traces``) does not exist.
    """
    folder = paths.run_folder(spec)
    reset_checks(folder, "raw_timeline")
    src = Path(spec.path)
    if not src.is_dir():
        raise FileNotFoundError(f"{spec.run_id}: folder of {what} {src} does not exist")
    return folder, src


def check_world(spec: RunSpec, world: int, path: Path, what: str = "world size") -> None:
    """Raise ``TraceFormatError(path, "layout")`` when the traces' ``world`` is not the spec's."""
    if world != spec.world_size:
        raise TraceFormatError(path, "layout", f"{what} {world}, but {spec.run_id} is {spec.layout}")


def finish_raw_timeline(
    spec: RunSpec, paths: DataPaths, raw: pd.DataFrame, title: str, notes: list[str], outcomes: list[Outcome]
) -> Path:
    """Write a profiled run's raw timeline, ``run_log.json`` (no run log: format = the source),
    its ``outcomes``, the ``notes`` as the :data:`NOTE_NAME` note of checks.txt and as the
    ``run.log`` (``# <title>`` then a line a note). Returns the raw timeline's path."""
    out = paths.table(spec.run_id, "raw_timeline")
    write_parquet(raw, out)
    pdir, folder = paths.partition_dir(spec.run_id), paths.run_folder(spec)
    write_record(pdir / "run_log.json", RunLogRecord(run_id=spec.run_id, present=False, format=spec.source))
    record(paths, spec, "raw_timeline", outcomes)
    record_note(folder, "raw_timeline", NOTE_NAME, "; ".join(notes))
    atomic_write_text(folder / "run.log", "".join(f"# {line}\n" for line in [title, *notes]))
    return out


def chrome_trace(spec: RunSpec, paths: DataPaths, ctx: SourceContext) -> StageResult:
    """chrome_trace of a profiled run: its raw timeline as ``timeline.json.gz`` (Phantora schema)."""
    out = paths.chrome_trace(spec)
    stats = trace_writer.write_chrome_trace(pd.read_parquet(paths.table(spec.run_id, "raw_timeline")), out)
    return StageResult(out, {k: int(v) for k, v in stats.items()})
