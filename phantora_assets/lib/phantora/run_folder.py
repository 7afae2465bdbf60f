"""Run folders of a Phantora dataset: find them and read what they say about the run.

No Dagster import. A run folder is laid out like the published dataset
(PHANTORA_FORMATS.md section 1)::

    traces/<gpu>/<workload>_<nodes>x<gpus_per_node>/
        timeline.json.gz   (or timeline.json)   the Chrome trace (required unless run.log
                                                reports out of memory)
        timeline.bin       optional raw timeline
        run.log            optional training stdout
        config/            optional compose.yaml, netconfig.toml, hostfile, command.txt

:func:`discover` finds them; the imports registry and the merge into the run matrix are in
:mod:`phantora_assets.imported_runs`.

Symlinks: the import never reaches outside a run folder. Every file and directory it takes
(:data:`IMPORT_FILES`, :data:`IMPORT_DIRS` and everything under those directories) must be a
regular file or a directory *itself*: a symlink is refused, never followed nor resolved (not
even one whose target lies inside the folder: there is no target to check when nothing is
followed, and a check of a resolved target could be raced), and so is a FIFO, socket or device
(:func:`refuse_links`, :func:`refusal`). Discovery does not read through a link either (a
linked ``config/netconfig.toml`` is not read). The run folder itself is the one registered
(``inspect_folder`` resolves it once).
"""

from __future__ import annotations

import os
import re
import stat
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from phantora_assets.lib.errors import FileRuleError, RunMatrixError
from phantora_assets.lib.run.catalog import gpu_specs, presets
from phantora_assets.lib.run.spec import RunSpec, validate
from phantora_assets.lib.store.io import walk

TRACE_NAMES = ("timeline.json.gz", "timeline.json")
#: The files and directories of a run folder the import copies or links (all optional).
IMPORT_FILES = ("run.log", "timeline.bin", *TRACE_NAMES)
IMPORT_DIRS = ("config", "perfdb_missing")
#: Directory levels allowed under an ``IMPORT_DIRS`` entry (Phantora writes one or two).
MAX_DEPTH = 32
_LAYOUT = re.compile(r"^(W\d+)_(\d+)x(\d+)$")

#: netconfig.toml key (under [simulator] or [topology.args]) -> presets [cluster] key.
_NETCONFIG_KEYS = {
    "loopback_speed": "loopback_gbps",
    "fairness": "fairness",
    "nspines": "nspines",
    "rack_size": "rack_size",
    "host_bw": "host_bw_gbps",
    "rack_uplink_port_bw": "rack_uplink_port_bw_gbps",
    "load_balancer_type": "load_balancer",
}


@dataclass(frozen=True)
class RunFolder:
    """One run folder found on disk.

    Attributes:
        path: the folder (absolute).
        spec: its RunSpec (``source = "import"``, ``path`` set).
        trace: the Chrome trace file in it, or None (a run without trace, e.g. out of memory).
    """

    path: Path
    spec: RunSpec
    trace: Path | None


@dataclass(frozen=True)
class Skipped:
    """A directory that looked like a run folder but cannot be imported, and why."""

    path: Path
    reason: str


def trace_file(folder: Path) -> Path | None:
    """The folder's ``timeline.json.gz`` (preferred) or ``timeline.json``, or None."""
    for name in TRACE_NAMES:
        if (folder / name).is_file():
            return folder / name
    return None


def refusal(path: Path, mode: int, target: str | None = None) -> FileRuleError | None:
    """The error for a run-folder entry of file type ``mode`` (an ``lstat``) that the import does
    not take, or None for a regular file or a directory. ``target``: a symlink's target (read
    from ``path`` when not given)."""
    if stat.S_ISLNK(mode):
        if target is None:
            try:
                target = os.readlink(path)
            except OSError:
                target = "?"
        return FileRuleError(
            path,
            "symlink in run folder",
            f"it links to {target}; the import takes only regular files and directories inside the run folder "
            "and never follows a link: replace it with the file itself",
        )
    if not (stat.S_ISREG(mode) or stat.S_ISDIR(mode)):
        return FileRuleError(
            path, "not a regular file", "a FIFO, socket or device: the import takes only regular files and directories"
        )
    return None


def too_deep(path: Path, name: str) -> FileRuleError:
    """The error for directory ``path``, more than :data:`MAX_DEPTH` levels below ``name``/."""
    return FileRuleError(path, "too deep", f"more than {MAX_DEPTH} levels of directories under {name}/ of a run folder")


def refuse_links(folder: Path, names: tuple[str, ...] = IMPORT_FILES + IMPORT_DIRS) -> None:
    """Check, before anything is copied, that the entries ``names`` of ``folder`` (absent ones
    are fine) and everything under those that are directories are regular files or directories
    (the policy of the module docstring); links are not followed.

    Raises:
        FileRuleError: naming the first offending entry, rule ``symlink in run folder``,
            ``not a regular file`` (also a directory named as one of ``IMPORT_FILES``) or ``not a
            directory`` (a file named as one of ``IMPORT_DIRS``), ``too deep`` (more than
            :data:`MAX_DEPTH` directory levels under one of ``IMPORT_DIRS``).
    """
    for name in names:
        top = folder / name
        try:
            mode = top.lstat().st_mode
        except FileNotFoundError:
            continue
        if (err := refusal(top, mode)) is not None:
            raise err
        if name in IMPORT_DIRS and not stat.S_ISDIR(mode):  # was: a config file was ignored, the run built
            raise FileRuleError(top, "not a directory", f"{name} of a run folder is a directory, not a file")
        if name in IMPORT_FILES and stat.S_ISDIR(mode):  # was: a run.log directory was ignored, run.log unread
            raise FileRuleError(top, "not a regular file", f"{name} of a run folder is a file, not a directory")
        if not stat.S_ISDIR(mode):
            continue
        for dirpath, dirnames, filenames in walk(top):  # a linked directory is listed, never entered
            for entry in sorted(dirnames + filenames):
                path = Path(dirpath) / entry
                if (err := refusal(path, path.lstat().st_mode)) is not None:
                    raise err
            if dirnames and len(Path(dirpath).relative_to(top).parts) >= MAX_DEPTH:
                raise too_deep(Path(dirpath) / sorted(dirnames)[0], name)


def topology_from_netconfig(path: Path) -> dict[str, Any]:
    """Cluster overrides (presets ``[cluster]`` keys) read from a ``netconfig.toml``.

    Only values that differ from the presets are returned; an unreadable file gives ``{}``.
    """
    try:
        cfg = tomllib.loads(path.read_text())
    except (OSError, tomllib.TOMLDecodeError):
        return {}
    found: dict[str, Any] = {}
    topo = cfg.get("topology", {})
    if "type" in topo:
        found["topology"] = topo["type"]
    for section in (cfg.get("simulator", {}), topo.get("args", {})):
        for key, value in section.items():
            if key in _NETCONFIG_KEYS:
                found[_NETCONFIG_KEYS[key]] = value
    cluster = presets()["cluster"]
    return {k: v for k, v in sorted(found.items()) if cluster.get(k) != v}


def _netconfig_hosts(path: Path) -> int | None:
    try:
        return len(tomllib.loads(path.read_text()).get("host_mapping", [])) or None
    except (OSError, tomllib.TOMLDecodeError):
        return None


def inspect_folder(folder: Path) -> RunFolder | Skipped:
    """Turn one ``<gpu>/<workload>_<N>x<G>`` directory into a RunFolder, or say why not."""
    folder = folder.resolve()
    m = _LAYOUT.match(folder.name)
    if not m:
        return Skipped(folder, f"name is not <workload>_<nodes>x<gpus_per_node> ({folder.name!r})")
    workload, nodes, gpn = m.group(1), int(m.group(2)), int(m.group(3))
    gpu = folder.parent.name
    trace = trace_file(folder)
    if trace is None and not (folder / "run.log").is_file():
        return Skipped(folder, "no timeline.json.gz, timeline.json or run.log")
    netconfig = folder / "config" / "netconfig.toml"
    topology: dict[str, Any] = {}
    # never read through a link (the import refuses such a folder: raw_timeline fails, naming it)
    if netconfig.is_file() and not netconfig.is_symlink() and not netconfig.parent.is_symlink():
        try:  # an unreadable netconfig is no "same network as the matrix": the run's nic_bw would be a guess
            tomllib.loads(netconfig.read_text())
        except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as exc:
            return Skipped(folder, f"config/netconfig.toml is not readable TOML ({exc})")
        hosts = _netconfig_hosts(netconfig)
        if hosts is not None and hosts != nodes:
            return Skipped(folder, f"config/netconfig.toml maps {hosts} hosts but the folder name says {nodes} nodes")
        topology = topology_from_netconfig(netconfig)
    spec = RunSpec(
        workload=workload,
        gpu=gpu,
        n_nodes=nodes,
        gpus_per_node=gpn,
        source="import",
        topology=tuple(sorted(topology.items())),
        path=str(folder),
    )
    try:
        validate(spec, f"run folder {folder}")
    except RunMatrixError as exc:
        return Skipped(folder, str(exc).split(": ", 1)[-1])
    return RunFolder(folder, spec, trace)


def discover(root: str | Path) -> tuple[list[RunFolder], list[Skipped]]:
    """Every run folder under ``root``, sorted by run_id.

    ``root`` may be a dataset root (holding ``traces/``), the ``traces/`` folder, one GPU's
    folder, or a run folder itself. Candidates are directories named
    ``<workload>_<N>x<G>`` whose parent is named after a GPU of ``gpus.toml``; a candidate
    that cannot be imported is returned in the second list with the reason.

    Raises:
        FileNotFoundError: ``root`` is not a directory.
    """
    root = Path(root)
    if not root.is_dir():
        raise FileNotFoundError(f"{root}: not a directory")
    gpus = set(gpu_specs())
    candidates: list[Path] = []
    if _LAYOUT.match(root.resolve().name):
        candidates = [root]
    else:
        for dirpath, dirnames, _files in walk(root):  # any depth (os.walk of Python 3.11 recursed)
            dirnames.sort()
            here = Path(dirpath)
            for d in list(dirnames):
                if _LAYOUT.match(d) and (
                    here.name in gpus
                    or (here / d / "timeline.json.gz").exists()
                    or (here / d / "timeline.json").exists()
                ):
                    candidates.append(here / d)
                    dirnames.remove(d)  # a run folder holds no run folders
    found: list[RunFolder] = []
    skipped: list[Skipped] = []
    seen: dict[str, Path] = {}
    for c in candidates:
        r = inspect_folder(c)
        if isinstance(r, Skipped):
            skipped.append(r)
        elif r.spec.run_id in seen:
            skipped.append(Skipped(r.path, f"run_id {r.spec.run_id} also found at {seen[r.spec.run_id]}"))
        else:
            seen[r.spec.run_id] = r.path
            found.append(r)
    return sorted(found, key=lambda r: r.spec.run_id), skipped
