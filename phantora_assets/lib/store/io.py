"""Atomic file writes: write to a temporary name in the target folder, then rename.

A process killed mid-write (``kill -9``) can leave a ``.<name>.p<pid>.<8 chars>.tmp`` file (or a
``.<name>.p<pid>.{dir,del,old}.tmp`` folder, see :func:`install_dir`, :func:`remove_output`) beside
the target, never a partial target.

The rule for every output a stage replaces (issue 39 item 13): **an output is never removed before
its replacement is in place.** A file is written to a temporary name and renamed over the old one
(:func:`atomic_path`); a folder is written complete under a temporary name and exchanged with the old
one in one ``renameat2(RENAME_EXCHANGE)`` (:func:`install_dir`); an output the new build does not
write is removed after the step ran (:func:`replacing_outputs`), a folder by renaming it away first
(:func:`remove_output`). So a step killed at any point leaves each of its outputs whole: the old one
or the new one. (Was: ``reconfig`` unlinked its four tables before computing them, and a build killed
in between lost ``nic_phases.parquet``; folders were ``rmtree``'d and then renamed into place.)

Temporary names carry the writer's pid, so :func:`sweep_temp_files` (the build command
runs it when it starts) removes only the leftovers of writers that are gone, never the live
temporary file of another process writing under the same root.

Durability: ``durable=True`` also fsyncs the file before the rename, so that the new content
survives an OS crash or a power loss too (a rename alone only protects against a killed
process). The published dataset and the imports registry are written durably; per-run
intermediate files are not (they are rebuilt from the run matrix, and an fsync per file cost
about 2 s of a 30-run build here, waiting on the disk).
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import shutil
import tempfile
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import IO

from phantora_assets.lib.errors import OutputWriteError

_DISK_FULL = {errno.ENOSPC, errno.EDQUOT}


def _file_mode() -> int:
    """Mode of a newly created file under the process umask (``mkstemp`` alone gives 0600).

    The umask is read from ``/proc/self/status`` where there is one (setting it to read it back
    would briefly change it for every thread)."""
    try:
        with open("/proc/self/status", "rb") as fh:
            for line in fh:
                if line.startswith(b"Umask:"):
                    return 0o666 & ~int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return 0o666 & ~mask


@contextlib.contextmanager
def atomic_path(path: str | Path, durable: bool = False) -> Iterator[Path]:
    """Yield a temporary path beside ``path``; rename it onto ``path`` on success.

    On any exception the temporary file is removed and ``path`` keeps its previous
    content (or stays absent), so no half-written output is ever visible (a process killed
    mid-write leaves at most a ``.<name>.*.tmp`` file, never a partial ``path``).

    Raises:
        OutputWriteError: an ``OSError`` while writing, syncing or renaming (rule ``disk full``
            for ENOSPC / EDQUOT, else ``write failed``), naming ``path``.
    """
    path = Path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.p{os.getpid()}.", suffix=".tmp", dir=path.parent)
    except OSError as exc:
        raise write_error(path, exc) from exc
    tmp_path = Path(tmp)
    try:
        try:
            os.fchmod(fd, _file_mode())  # readable as any other output file (e.g. by the Dagster UI's user)
        finally:
            os.close(fd)
        yield tmp_path
        if durable:
            with open(tmp_path, "rb") as fh:
                os.fsync(fh.fileno())
        os.replace(tmp_path, path)
        if durable:  # the rename itself, too
            dir_fd = os.open(path.parent, os.O_RDONLY)
            try:
                os.fsync(dir_fd)
            finally:
                os.close(dir_fd)
    except BaseException as exc:
        with contextlib.suppress(FileNotFoundError):
            tmp_path.unlink()
        if isinstance(exc, OSError) and not isinstance(exc, OutputWriteError):
            raise write_error(path, exc) from exc
        raise


def write_error(path: Path, exc: OSError) -> OutputWriteError:
    rule = "disk full" if exc.errno in _DISK_FULL else "write failed"
    return OutputWriteError(path, rule, exc.strerror or str(exc), exc.errno)


@contextlib.contextmanager
def atomic_open(path: str | Path, mode: str = "w", durable: bool = False, **kwargs) -> Iterator[IO]:
    """Open a temporary file for writing; it replaces ``path`` only if the block succeeds."""
    with atomic_path(path, durable) as tmp, open(tmp, mode, **kwargs) as fh:
        yield fh


def atomic_write_bytes(path: str | Path, data: bytes, durable: bool = False) -> None:
    """Write ``data`` to ``path`` atomically."""
    with atomic_open(path, "wb", durable) as fh:
        fh.write(data)


def atomic_write_text(path: str | Path, text: str, durable: bool = False) -> None:
    """Write ``text`` (UTF-8) to ``path`` atomically."""
    atomic_write_bytes(path, text.encode("utf-8"), durable)


#: Names of the temporary files and folders made here: ``.<name>.p<pid>.<8 chars>.tmp``
#: (:func:`atomic_path`), ``.<name>.p<pid>.link.tmp`` (:func:`link_or_copy`),
#: ``.<name>.p<pid>.dir.tmp`` (a folder being written, or the one :func:`install_dir` replaced),
#: ``.<name>.p<pid>.del.tmp`` (a folder :func:`remove_output` is deleting) and
#: ``.<name>.p<pid>.old.tmp`` (the previous folder while :func:`install_dir` swaps with two renames,
#: where the file system cannot exchange: :func:`sweep_temp_files` puts it back if ``<name>`` is missing).
TEMP_NAME = re.compile(r"^\.(?P<name>.+)\.p(?P<pid>\d+)\.(?P<kind>[a-z0-9_]{8}|link|dir|del|old)\.tmp$")
#: Names made before temporary names carried the pid (swept only when older than an hour).
LEGACY_TEMP_NAME = re.compile(r"^\..+\.(?:[a-z0-9_]{8}|link)\.tmp$")
LEGACY_MAX_AGE_S = 3600.0


def _started_at(pid: int) -> float | None:
    """Start time of process ``pid`` (epoch s), None if there is no such process or it has exited
    (a zombie: killed, not yet reaped by its parent, still answers ``kill(pid, 0)``)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return None
    except PermissionError:
        pass  # alive, owned by another user
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return None  # exited since the kill(pid, 0)
    except OSError:
        return 0.0
    try:
        fields = stat.rsplit(")", 1)[1].split()
        if fields[0] in ("Z", "X"):  # exited
            return None
        ticks = int(fields[19])
        for line in Path("/proc/stat").read_text().splitlines():
            if line.startswith("btime "):
                return int(line.split()[1]) + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        pass
    return 0.0  # alive, start unknown: treat as the writer


def _writer_gone(p: Path, now: float) -> bool:
    m = TEMP_NAME.match(p.name)
    try:
        mtime = p.lstat().st_mtime
    except FileNotFoundError:
        return False
    if m is None:
        return LEGACY_TEMP_NAME.match(p.name) is not None and now - mtime > LEGACY_MAX_AGE_S
    started = _started_at(int(m.group("pid")))
    # gone, or the pid now belongs to a process started after the file was last written
    return started is None or started > mtime + 1.0


def sweep_temp_files(root: str | Path) -> list[Path]:
    """Remove temporary files and folders left under ``root`` by writers that are gone (their pid
    is not running, or now belongs to a process started after the file was written); returns them.

    Safe while other processes write under ``root``: their live temporary names are kept. A
    writer killed between the two renames of :func:`install_dir`'s fallback left the previous folder
    as ``.<name>.p<pid>.old.tmp`` and no ``<name>``: it is put back (and not listed).
    """
    removed: list[Path] = []
    root = Path(root)
    if not root.is_dir():
        return removed
    now = time.time()
    for p in sorted(root.rglob(".*.tmp")):
        if not (p.is_file() or p.is_dir()) or p.is_symlink() or not _writer_gone(p, now):
            continue
        m = TEMP_NAME.match(p.name)
        back = p.with_name(m.group("name")) if m and m.group("kind") == "old" else None
        if back is not None and not os.path.lexists(back):
            with contextlib.suppress(OSError):
                os.rename(p, back)
            continue
        with contextlib.suppress(FileNotFoundError):
            if p.is_dir():
                shutil.rmtree(p)
            else:
                p.unlink()
            removed.append(p)
    return removed


def atomic_write_csv(df, path: str | Path, float_format: str = "%.10g", durable: bool = False) -> None:
    """Write ``df`` as CSV, atomically, byte for byte what ``df.to_csv(path, index=False,
    float_format=float_format, lineterminator="\\n")`` writes, ~5x faster on large tables.

    pyarrow's CSV writer writes the rows; float columns are formatted with ``float_format``
    beforehand, once per distinct value (NaN as an empty field, as pandas does). Tables pyarrow
    cannot write unquoted the way pandas does (a string holding a comma, quote or line break;
    booleans; dates; nullable extension dtypes; a single column, where pandas quotes an empty
    field; duplicate or non-string column names) are written by pandas itself.

    Raises:
        OutputWriteError: as :func:`atomic_path`.
    """
    import pyarrow as pa
    import pyarrow.csv as pacsv

    with atomic_path(path, durable) as tmp:
        columns = _csv_columns(df, float_format)
        if columns is not None:
            try:
                pacsv.write_csv(
                    pa.table(columns), str(tmp), pacsv.WriteOptions(quoting_style="none", quoting_header="none")
                )
                return
            except pa.ArrowInvalid:  # a value that needs quoting: pandas quotes it
                pass
        df.to_csv(tmp, index=False, float_format=float_format, lineterminator="\n")


def _csv_columns(df, float_format: str) -> dict | None:
    """The columns of ``df`` as Arrow arrays that pyarrow writes as pandas would, or None when
    pandas must write the table (see :func:`atomic_write_csv`)."""
    import numpy as np
    import pyarrow as pa

    if len(df.columns) < 2 or df.columns.has_duplicates or not all(isinstance(c, str) for c in df.columns):
        return None
    columns = {}
    for name in df.columns:
        col = df[name]
        kind = col.dtype.kind if isinstance(col.dtype, np.dtype) else ""  # not nullable extension types
        if kind == "f":
            values = np.ascontiguousarray(col.to_numpy(np.float64))
            # distinct bit patterns, so that -0.0 and 0.0 keep their own text
            bits, index = np.unique(values.view(np.int64), return_inverse=True)
            text = np.array(["" if v != v else float_format % v for v in bits.view(np.float64)], dtype=object)
            columns[name] = pa.array(text[index.reshape(-1)], type=pa.string())
        elif kind in ("i", "u") or (kind == "O" and all(isinstance(v, str) for v in col)):
            columns[name] = pa.array(col.to_numpy())
        else:
            return None
    return columns


def walk(top: str | Path) -> Iterator[tuple[str, list[str], list[str]]]:
    """``os.walk(top)`` (top-down, the caller may prune ``dirnames``, a linked directory listed but
    never entered, an unreadable directory skipped), without recursion: Python 3.11's ``os.walk``
    takes a stack frame a level, so a tree 1,000 directories deep raised ``RecursionError``."""
    stack = [os.fspath(top)]
    while stack:
        here = stack.pop()
        try:
            with os.scandir(here) as it:
                entries = list(it)
        except OSError:
            continue
        dirnames: list[str] = []
        filenames: list[str] = []
        for e in entries:
            try:
                is_dir = e.is_dir()
            except OSError:
                is_dir = False
            (dirnames if is_dir else filenames).append(e.name)
        yield here, dirnames, filenames
        for d in reversed(dirnames):
            sub = os.path.join(here, d)
            if not os.path.islink(sub):
                stack.append(sub)


def same_path(a: Path, b: Path) -> bool:
    try:
        return a.resolve() == b.resolve()
    except OSError:
        return False


def copy_file(src: Path, dst: Path) -> None:
    with atomic_path(dst) as tmp:
        shutil.copyfile(src, tmp)


def link_or_copy(src: Path, dst: Path) -> None:
    """Hard-link ``src`` to ``dst`` (same file system), else copy; atomic either way."""
    if dst.exists() and same_path(src, dst):
        return
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = dst.with_name(f".{dst.name}.p{os.getpid()}.link.tmp")
    tmp.unlink(missing_ok=True)
    try:
        os.link(src, tmp)
        os.replace(tmp, dst)
    except OSError:
        tmp.unlink(missing_ok=True)
        copy_file(src, dst)


def replace_dir(src: Path | None, dst: Path) -> None:
    """Make ``dst`` a copy of directory ``src`` (or remove it when ``src`` is None). The copy is
    made in ``.<dst>.p<pid>.dir.tmp`` beside it and put in place by :func:`install_dir`; if the copy
    fails, that folder is removed and ``dst`` is left as it was. At no point is ``dst`` missing or
    partial (was: ``rmtree(dst)``, then the rename)."""
    if src is not None and same_path(src, dst):
        return
    if src is None:
        remove_output(dst)
        return
    tmp = dst.with_name(f".{dst.name}.p{os.getpid()}.dir.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        shutil.copytree(src, tmp)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    install_dir(tmp, dst)


def install_dir(tmp: Path, dst: Path) -> None:
    """Put the complete folder ``tmp`` (a ``.<dst>.p<pid>.dir.tmp`` beside ``dst``) at ``dst`` in
    one step, then delete the folder it replaced: ``renameat2(RENAME_EXCHANGE)`` swaps the two
    (the old one is then at ``tmp``'s name, removed afterwards; a kill before that leaves it for
    :func:`sweep_temp_files`). Where the file system cannot exchange, two renames: the old folder to
    ``.<dst>.p<pid>.old.tmp``, then ``tmp`` to ``dst``; a kill between them leaves no ``dst``, and
    :func:`sweep_temp_files` puts the old one back.

    Raises:
        OutputWriteError: a rename failed (naming ``dst``); ``tmp`` is removed, ``dst`` unchanged.
    """
    try:
        dst.parent.mkdir(parents=True, exist_ok=True)
        if not os.path.lexists(dst):
            os.rename(tmp, dst)
            return
        if exchange_paths(tmp, dst):
            old = tmp
        else:
            old = dst.with_name(f".{dst.name}.p{os.getpid()}.old.tmp")
            shutil.rmtree(old, ignore_errors=True)
            os.rename(dst, old)
            try:
                os.rename(tmp, dst)
            except BaseException:
                os.rename(old, dst)
                raise
    except OSError as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        raise write_error(dst, exc) from exc
    _remove_tree(old)


def _remove_tree(p: Path) -> None:
    if p.is_dir() and not p.is_symlink():
        shutil.rmtree(p, ignore_errors=True)
    else:
        with contextlib.suppress(FileNotFoundError):
            p.unlink()


def remove_output(path: Path) -> None:
    """Remove the output ``path`` (a file, link or folder; nothing when absent) in one step: a
    folder is renamed to ``.<name>.p<pid>.del.tmp`` first and deleted there (a kill mid-way
    leaves it for :func:`sweep_temp_files`, never a partial ``path``)."""
    if path.is_dir() and not path.is_symlink():
        gone = path.with_name(f".{path.name}.p{os.getpid()}.del.tmp")
        shutil.rmtree(gone, ignore_errors=True)
        try:
            os.rename(path, gone)
        except FileNotFoundError:
            return
        shutil.rmtree(gone, ignore_errors=True)
    else:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()


@contextlib.contextmanager
def replacing_outputs(outputs: Iterable[Path]) -> Iterator[set[Path]]:
    """The outputs a step owns (``outputs``), replaced by the block: it writes each one it makes
    atomically (:func:`atomic_path`, :func:`install_dir`) and adds its path to the yielded set; when
    the block returns or raises an ``Exception`` (the step failed), each output it did not write is
    removed (:func:`remove_output`), so nothing stale of an earlier build stays. Nothing is removed
    before that, nor when the block is interrupted (``KeyboardInterrupt``, Dagster's termination,
    ``SystemExit``: as a kill): a step stopped at any point leaves every output whole, the previous
    one or the new one (the module docstring's rule).

    Raises:
        ValueError: the block added a path that is not one of ``outputs`` (when it ends).
    """
    declared = [Path(p) for p in outputs]
    written: set[Path] = set()

    def stale() -> None:
        if unknown := written - set(declared):
            raise ValueError(f"not an output of this step: {', '.join(sorted(map(str, unknown)))}")
        for p in declared:
            if p not in written:
                remove_output(p)

    try:
        yield written
    except Exception:
        stale()
        raise
    stale()


def exchange_paths(a: Path, b: Path) -> bool:
    """Swap two directory entries in one step (Linux ``renameat2(RENAME_EXCHANGE)``); False where
    the call is not available (other OS, old libc, a file system that refuses it)."""
    import ctypes

    try:
        libc = ctypes.CDLL(None, use_errno=True)
        fn = libc.renameat2
    except (OSError, AttributeError):
        return False
    at_fdcwd, rename_exchange = -100, 2
    if fn(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.ENOSYS, errno.EINVAL, errno.EXDEV, errno.EPERM):
        return False
    raise OSError(err, os.strerror(err), str(b))
