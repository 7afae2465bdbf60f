"""Source ``import``: run folders of a Phantora dataset, registered by ``phantora-assets import``
(``lib/phantora/run_folder.py``); no simulator needed.

    raw_timeline -> run folder run.log, timeline.bin, config/, perfdb_missing/ copied in;
                    import.json and partitions/<run_id>/run_log.json
    chrome_trace -> run folder timeline.json.gz (the folder's trace, validated, gzip-compressed)

The import never reaches outside the run folder: a symlink (or FIFO, socket, device) among the
files it takes is refused with a ``FileRuleError`` naming it, never followed nor resolved
(``run_folder.refuse_links``). The whole folder is checked before anything is copied, and the
copies open every entry relative to its directory without following a link, so a link swapped
in meanwhile is refused too; a refused copy leaves no temporary file or directory behind.
"""

from __future__ import annotations

import errno
import os
import shutil
import stat
from pathlib import Path

from phantora_assets.checks import reset_checks
from phantora_assets.lib.errors import FileRuleError, TraceFormatError
from phantora_assets.lib.phantora.docker_config import missing_listing
from phantora_assets.lib.phantora.run_folder import (
    IMPORT_DIRS,
    IMPORT_FILES,
    MAX_DEPTH,
    refusal,
    refuse_links,
    too_deep,
    trace_file,
)
from phantora_assets.lib.phantora.run_log import read_run_log
from phantora_assets.lib.run.spec import RunSpec
from phantora_assets.lib.store.io import atomic_path, install_dir, replace_dir, same_path, walk
from phantora_assets.outcomes import StageResult, record
from phantora_assets.paths import DataPaths
from phantora_assets.records import ImportRecord, RecordError, read_record_or_none, write_record
from phantora_assets.sources.base import SourceContext
from phantora_assets.sources.phantora_run import (
    fits_from_log,
    install_trace,
    perfdb_from_missing,
    write_run_log_summary,
)

NAME = "import"
DESCRIPTION = "a Phantora run folder imported from disk (phantora-assets import, $PHANTORA_ASSETS_IMPORT_DIR)"
DATASET_SOURCE = "phantora_v0"
ROOFLINE_TIMING = False

_NOFOLLOW = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC  # O_NONBLOCK: a FIFO does not block


def _open(name: str, dir_fd: int, path: Path, directory: bool = False) -> int:
    """File descriptor of entry ``name`` of the directory open at ``dir_fd`` (``path``: its full
    name, for errors), opened without following a symlink.

    Raises:
        FileRuleError: the entry is a symlink, or not a regular file (a directory) (``refusal``).
    """
    try:
        fd = os.open(name, _NOFOLLOW | (os.O_DIRECTORY if directory else 0), dir_fd=dir_fd)
    except OSError as exc:
        if exc.errno not in (errno.ELOOP, errno.ENOTDIR):
            raise
        mode = os.lstat(name, dir_fd=dir_fd).st_mode
        target = os.readlink(name, dir_fd=dir_fd) if stat.S_ISLNK(mode) else None
        raise refusal(path, mode, target) or FileRuleError(path, "not a directory", "changed while imported") from None
    mode = os.fstat(fd).st_mode
    if not (stat.S_ISDIR(mode) if directory else stat.S_ISREG(mode)):
        os.close(fd)
        raise refusal(path, mode) or FileRuleError(path, "not a regular file", "changed while imported")
    return fd


def _copy_fd(fd: int, dst: Path) -> None:
    with open(fd, "rb", closefd=False) as fi, open(dst, "wb") as fo:
        shutil.copyfileobj(fi, fo, 1 << 20)


def _copy_stat(fd: int, dst: Path) -> None:
    """Permission bits and times of the file open at ``fd`` onto ``dst`` (as ``shutil.copystat``)."""
    st = os.fstat(fd)
    os.chmod(dst, stat.S_IMODE(st.st_mode))
    os.utime(dst, ns=(st.st_atime_ns, st.st_mtime_ns))


def _copy_file(dir_fd: int, name: str, src: Path, dst: Path) -> int:
    """Copy regular file ``name`` (of ``src``, open at ``dir_fd``) to ``dst`` atomically; its size."""
    fd = _open(name, dir_fd, src / name)
    try:
        with atomic_path(dst) as tmp:
            _copy_fd(fd, tmp)
        return os.fstat(fd).st_size
    finally:
        os.close(fd)


def _link_or_copy(dir_fd: int, name: str, src: Path, dst: Path) -> int:
    """Hard-link (same file system), else copy, regular file ``name`` to ``dst``; its size."""
    fd = _open(name, dir_fd, src / name)
    try:
        st = os.fstat(fd)
        try:
            if os.path.samestat(os.stat(dst), st):
                return st.st_size
        except FileNotFoundError:
            pass
        dst.parent.mkdir(parents=True, exist_ok=True)
        tmp = dst.with_name(f".{dst.name}.p{os.getpid()}.link.tmp")
        tmp.unlink(missing_ok=True)
        try:
            os.link(name, tmp, src_dir_fd=dir_fd, follow_symlinks=False)
            if not os.path.samestat(os.lstat(tmp), st):  # swapped since it was opened: copy what was checked
                raise OSError(errno.ESTALE, "changed while it was imported")
            os.replace(tmp, dst)
        except OSError:
            tmp.unlink(missing_ok=True)
            with atomic_path(dst) as t:
                _copy_fd(fd, t)
        return st.st_size
    finally:
        os.close(fd)


def _copy_tree(dir_fd: int, src: Path, dst: Path, top: str, depth: int = 0) -> int:
    """Copy the directory open at ``dir_fd`` (``src``, ``depth`` levels below ``top``/) to a new
    ``dst`` (permission bits and times kept, as ``shutil.copytree``); the number of regular files
    copied. A directory grown deeper than ``MAX_DEPTH`` since it was checked is refused (``too deep``)."""
    dst.mkdir()
    n = 0
    for name in sorted(os.listdir(dir_fd)):
        is_dir = stat.S_ISDIR(os.lstat(name, dir_fd=dir_fd).st_mode)
        if is_dir and depth >= MAX_DEPTH:
            raise too_deep(src / name, top)
        fd = _open(name, dir_fd, src / name, directory=is_dir)
        try:
            if is_dir:
                n += _copy_tree(fd, src / name, dst / name, top, depth + 1)
            else:
                _copy_fd(fd, dst / name)
                _copy_stat(fd, dst / name)
                n += 1
        finally:
            os.close(fd)
    _copy_stat(dir_fd, dst)
    return n


def _replace_tree(dir_fd: int, name: str, src: Path, dst: Path) -> int:
    """Make ``dst`` a copy of directory ``name`` of ``src`` (open at ``dir_fd``); files copied.
    On any error ``dst`` is unchanged and no ``.<name>.p<pid>.dir.tmp`` is left; the copy replaces
    ``dst`` in one step (``io.install_dir``: was ``rmtree(dst)``, then the rename)."""
    tmp = dst.with_name(f".{dst.name}.p{os.getpid()}.dir.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    dst.parent.mkdir(parents=True, exist_ok=True)
    try:
        fd = _open(name, dir_fd, src / name, directory=True)
        try:
            n = _copy_tree(fd, src / name, tmp, name)
        finally:
            os.close(fd)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    install_dir(tmp, dst)
    return n


def _copy_in(src: Path, folder: Path) -> dict[str, int]:
    """Copy run.log, timeline.bin, config/ and perfdb_missing/ of ``src`` into ``folder`` (what
    ``src`` lacks is removed there); the copied entries and their sizes / file counts."""
    copied: dict[str, int] = {}
    dir_fd = os.open(src, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        for name in ("run.log", "timeline.bin", *IMPORT_DIRS):
            try:
                mode = os.lstat(name, dir_fd=dir_fd).st_mode
            except FileNotFoundError:
                mode = 0
            is_dir = name in IMPORT_DIRS
            if stat.S_ISLNK(mode) or (stat.S_ISDIR(mode) if is_dir else stat.S_ISREG(mode)):  # a link: refused
                if is_dir:
                    copied[f"{name}/"] = _replace_tree(dir_fd, name, src, folder / name)
                else:
                    copy = _link_or_copy if name == "timeline.bin" else _copy_file
                    copied[name] = copy(dir_fd, name, src, folder / name)
            elif is_dir:
                replace_dir(None, folder / name)
            else:
                (folder / name).unlink(missing_ok=True)
    finally:
        os.close(dir_fd)
    return copied


def source_folder(spec: RunSpec, paths: DataPaths) -> Path:
    """The folder an imported run is built from: its registered folder ``spec.path``, or, when that
    folder is gone, the data root's copy of it (``paths.run_folder(spec)``, which holds every file
    the import takes: run.log, timeline.bin, config/, perfdb_missing/ and the validated
    ``timeline.json.gz``), so a run stays as built until ``phantora-assets forget`` removes it
    (docs/IMPORTS.md: removal is only ever explicit). The copy counts only when its
    ``import.json`` says it was imported from ``spec.path`` and, when that folder had a trace, the
    trace copy is there.

    Raises:
        FileNotFoundError: the registered folder is gone and the data root holds no complete copy
            of it (names both).
    """
    src = Path(spec.path)
    if src.is_dir():
        return src
    folder = paths.run_folder(spec)
    where = f"registered in {paths.root / 'imports.toml'} or $PHANTORA_ASSETS_IMPORT_DIR"
    try:
        rec = read_record_or_none(folder / "import.json", ImportRecord)
    except RecordError:
        rec = None
    if rec is None or rec.source != str(src) or (rec.trace is not None and trace_file(folder) is None):
        raise FileNotFoundError(
            f"{spec.run_id}: imported run folder {src} does not exist ({where}), and the data root "
            f"holds no complete copy of it ({folder / 'import.json'}); restore the folder or "
            f"`phantora-assets forget {spec.run_id}`"
        )
    return folder


def check_inputs(spec: RunSpec, paths: DataPaths) -> Path:
    """The folder to build ``spec`` from (:func:`source_folder`), checked before anything of the
    run is replaced (``stages/simulation.raw_timeline`` calls it before it invalidates the run's
    files): no symlink among the files the import takes, and a trace there, or a run.log that
    reports the run did not fit (an empty or half-copied folder must not replace the data root's
    copy with nothing).

    Raises:
        FileNotFoundError: :func:`source_folder`.
        FileRuleError: a link, FIFO, socket or device among the files (``refuse_links``).
        TraceFormatError: no timeline.json.gz or timeline.json in the folder, and no run.log that
            reports the run did not fit (the rule ``missing trace``).
    """
    src = source_folder(spec, paths)
    refuse_links(src)  # also a folder registered in place: nothing is read through a link
    if trace_file(src) is None:
        log = src / "run.log"
        if not log.is_file():
            raise TraceFormatError(src, "missing trace", "no timeline.json.gz, timeline.json or run.log")
        if not fits_from_log(spec, read_run_log(log), True, "imported").passed:
            return src  # a run that did not fit has no trace: its run.log is the evidence
        raise TraceFormatError(
            src, "missing trace", "no timeline.json.gz or timeline.json, and run.log reports no out-of-memory error"
        )
    return src


def import_run_folder(spec: RunSpec, paths: DataPaths) -> StageResult:
    """raw_timeline of an imported run: copy its run folder's files into the data root's run folder.

    Copies ``run.log``, ``config/`` and ``perfdb_missing/`` and hard-links (else copies)
    ``timeline.bin``; a file the source lacks is removed from the destination. Symlinks are
    refused (module docstring): the folder is checked first, then nothing is copied. Writes
    ``import.json`` (source folder, files and sizes) and ``run_log.json``. Outcomes:
    ``fits_in_memory`` from run.log, ``perfdb_complete`` from ``perfdb_missing/`` (written by
    this project's Docker runs; a folder without it has no replay record and passes).

    Raises:
        FileNotFoundError: the registered folder is gone and the data root holds no complete copy
            of it (:func:`source_folder`); the run's files are left as they were.
        FileRuleError: a file or directory the import takes is a symlink (rule ``symlink in run
            folder``) or a FIFO, socket or device (``not a regular file``); nothing was copied.
        TraceFormatError: the folder has no trace and its run.log reports no out-of-memory error.
    """
    folder = paths.run_folder(spec)
    src = check_inputs(spec, paths)  # before anything is reset: a refused build changes nothing
    registered = str(Path(spec.path))
    reset_checks(folder, "raw_timeline")
    copied = {} if same_path(src, folder) else _copy_in(src, folder)
    trace = trace_file(src)
    log_present = (folder / "run.log").is_file()
    log = write_run_log_summary(paths, spec)
    fits = fits_from_log(spec, log, log_present, "imported")
    missing_dir = folder / "perfdb_missing"  # the checked copy
    perfdb = perfdb_from_missing(
        missing_listing(missing_dir) if missing_dir.is_dir() else None,
        "imported run folder without a perf-DB replay record (no perfdb_missing/): nothing to check",
    )
    outcomes = [fits, perfdb]
    record(paths, spec, "raw_timeline", outcomes)
    if trace is None:
        paths.chrome_trace(spec).unlink(missing_ok=True)  # no stale trace of an earlier source
    if trace is None and fits.passed:
        raise TraceFormatError(
            src, "missing trace", "no timeline.json.gz or timeline.json, and run.log reports no out-of-memory error"
        )
    write_record(
        folder / "import.json",
        ImportRecord(run_id=spec.run_id, source=registered, trace=trace.name if trace else None, copied=copied),
    )
    meta = {
        "status": "imported" if fits.passed else "out_of_memory",
        "source_folder": registered,
        **({"built_from": f"the data root's copy ({src}): the folder is gone"} if str(src) != registered else {}),
        "trace_file": trace.name if trace else None,
        "copied_files": len(copied),
        **log.metadata(),
    }
    return StageResult(folder, meta, outcomes)


def import_trace(spec: RunSpec, paths: DataPaths) -> StageResult:
    """chrome_trace of an imported run: its folder's trace, validated and copied (gzip-compressed).

    Raises:
        FileRuleError: the trace is a symlink (``symlink in run folder``) or no regular file.
        TraceFormatError: no trace, or a format rule broken (names the file and the rule).
    """
    src_dir = source_folder(spec, paths)
    src = trace_file(src_dir)
    if src is None:
        raise TraceFormatError(src_dir, "missing trace", "no timeline.json.gz or timeline.json")
    refuse_links(src_dir, (src.name,))  # install_trace opens it without following a link, too
    return install_trace(spec, paths, src, f"imported from {src}")


def input_files(folder: Path) -> list[str]:
    """The files of an imported run folder its build reads (what its fingerprint covers):
    ``IMPORT_FILES`` (the trace, run.log, timeline.bin) and every entry under ``IMPORT_DIRS``
    (``config/...``, ``perfdb_missing/...``, which ``raw_timeline`` copies; a link is listed, not
    followed), so an edited netconfig or command file makes the build stale too."""
    names = list(IMPORT_FILES)
    for sub in IMPORT_DIRS:
        for dirpath, dirnames, files in walk(folder / sub):  # any depth, no RecursionError
            dirnames.sort()
            here = Path(dirpath)
            links = [d for d in dirnames if (here / d).is_symlink()]  # os.walk does not enter them
            names += [str((here / f).relative_to(folder)) for f in sorted(files + links)]
    return names


def raw_timeline(spec: RunSpec, paths: DataPaths, ctx: SourceContext) -> StageResult:
    """The ``raw_timeline`` of an imported run (:func:`import_run_folder`)."""
    return import_run_folder(spec, paths)


def chrome_trace(spec: RunSpec, paths: DataPaths, ctx: SourceContext) -> StageResult:
    """The ``chrome_trace`` of an imported run (:func:`import_trace`)."""
    return import_trace(spec, paths)
