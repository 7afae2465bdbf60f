"""Generations of a published folder: each export is a new, complete folder; the published name
is a symbolic link to the newest one, moved in one step; older ones stay for a grace period.

Layout beside the published name ``<root>/<name>`` (``phantora_v0``)::

    <root>/<name>                     -> .<name>.gens/g<publish time, ns>   (relative symlink)
    <root>/.<name>.gens/g<ns>/        one complete generation a folder (its tables never change once
                                      linked; dataset_plots adds plots/ to it)
    <root>/.<name>.gens/.g<ns>.p<pid>.dir.tmp/   a generation being written (io.sweep_temp_files
                                                  removes it when its writer is gone)

Why (issue 29): the export used to exchange the new folder with the old one and delete the old one
at once, under readers that had just listed it (``pyarrow.dataset.dataset("phantora_v0/flows_100ms")``
then ``.to_table()``: ``FileNotFoundError`` for a listed ``part-*.parquet``). Now:

* a reader that resolved the link once (``os.path.realpath("phantora_v0")``, a folder handle, a
  file already open) reads its generation whole for :data:`GRACE_S` after the next publication:
  a generation is removed only when it was replaced more than ``grace_s`` ago (never the current
  one);
* a reader that goes through the link on every open (the plain path above) resolves each folder
  and file in the generation current at that open: a file it listed that the new generation does
  not hold (files are named by their content, ``part-<sha256[:16]>``, ``lib/store/export.TableWriter``)
  is ``FileNotFoundError``, and a listing that straddles the swap combines run folders of two
  generations (pyarrow opens each folder by its path). Not supported while exports run: the
  dataset card's code and the docs resolve the link once (issue 39; docs/DATASET_STORAGE.md).

The link is replaced with ``rename(2)`` over it (atomic); the first publication over a plain folder
(the layout before generations) exchanges the two (``renameat2(RENAME_EXCHANGE)``) and keeps the
old folder as the oldest generation. No Dagster import.
"""

from __future__ import annotations

import contextlib
import os
import re
import time
from pathlib import Path

from phantora_assets.lib.store.io import exchange_paths, remove_output, write_error

#: Seconds a replaced generation is kept for the readers that resolved it (then removed by the
#: next publication). ``$PHANTORA_ASSETS_DATASET_GRACE_S`` overrides it.
GRACE_S = 600.0
#: A generation's folder name: ``g`` and its publication time (ns since the epoch, 20 digits).
GEN_NAME = re.compile(r"^g(?P<ns>\d{20})$")


def grace_s() -> float:
    """:data:`GRACE_S`, or ``$PHANTORA_ASSETS_DATASET_GRACE_S`` when set (a number of seconds >= 0).

    Raises:
        ValueError: the variable is set to something else (named with its value): a grace period
            read wrong would remove generations readers still hold, or keep them forever.
    """
    raw = os.environ.get("PHANTORA_ASSETS_DATASET_GRACE_S", "")
    if not raw:
        return GRACE_S
    try:
        v = float(raw)
    except ValueError:
        v = float("nan")
    if not v >= 0 or v == float("inf"):  # NaN, negative, infinite
        raise ValueError(f"$PHANTORA_ASSETS_DATASET_GRACE_S={raw!r}: not a number of seconds >= 0")
    return v


def generations_dir(target: Path) -> Path:
    """``<root>/.<name>.gens``: where the generations of ``target`` live."""
    return target.with_name(f".{target.name}.gens")


def staging_dir(target: Path) -> Path:
    """A fresh folder name to write the next generation of ``target`` in (not created)."""
    return generations_dir(target) / f".g{time.time_ns():020d}.p{os.getpid()}.dir.tmp"


def generations(target: Path) -> list[Path]:
    """The generation folders of ``target``, oldest first."""
    gens = generations_dir(target)
    if not gens.is_dir():
        return []
    return sorted(p for p in gens.iterdir() if GEN_NAME.match(p.name) and p.is_dir() and not p.is_symlink())


def current(target: Path) -> Path | None:
    """The generation ``target`` links to (None when it is not a link into its generations)."""
    if not target.is_symlink():
        return None
    dest = (target.parent / os.readlink(target)).resolve()
    return dest if dest.parent == generations_dir(target).resolve() else None


def _fsync_dir(d: Path) -> None:
    fd = os.open(d, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def publish(staging: Path, target: Path, grace: float | None = None) -> Path:
    """Make the complete folder ``staging`` (from :func:`staging_dir`) the generation ``target``
    links to, at once; then remove the generations replaced more than ``grace`` s ago (default
    :func:`grace_s`). Returns the new generation's folder.

    Raises:
        OutputWriteError: a rename or the link failed (naming ``target``; rule ``disk full`` when
            the file system is full).
        ValueError: ``$PHANTORA_ASSETS_DATASET_GRACE_S`` is invalid (:func:`grace_s`), before
            anything is published.
    """
    grace = grace_s() if grace is None else grace
    gens = generations_dir(target)
    try:
        gens.mkdir(parents=True, exist_ok=True)
        have = generations(target)
        ns = time.time_ns()
        if have:
            ns = max(ns, int(GEN_NAME.match(have[-1].name)["ns"]) + 1)  # type: ignore[index]
        final = gens / f"g{ns:020d}"
        os.rename(staging, final)
        _fsync_dir(gens)
        link = target.with_name(f".{target.name}.p{os.getpid()}.link.tmp")
        with contextlib.suppress(FileNotFoundError):
            link.unlink()
        os.symlink(f"{gens.name}/{final.name}", link)
        if target.is_dir() and not target.is_symlink():  # the layout before generations
            oldest = gens / f"g{0:020d}"
            if exchange_paths(link, target):
                os.rename(link, oldest)  # ``link`` is the old folder now
            else:
                os.rename(target, oldest)
                os.rename(link, target)
        else:
            os.replace(link, target)
        _fsync_dir(target.parent)
    except OSError as exc:
        raise write_error(target, exc) from exc
    retire(target, grace)
    return final


def retire(target: Path, grace: float, now_ns: int | None = None) -> list[Path]:
    """Remove the generations of ``target`` replaced more than ``grace`` s ago (a generation is
    replaced when the next one is published), never the current one; returns them. A folder that
    cannot be removed stays (the next publication tries again)."""
    now_ns = time.time_ns() if now_ns is None else now_ns
    cur = current(target)
    gens = generations(target)
    removed = []
    for old, new in zip(gens, gens[1:], strict=False):
        replaced_ns = int(GEN_NAME.match(new.name)["ns"])  # type: ignore[index]
        if cur is not None and old.resolve() == cur:
            continue
        if now_ns - replaced_ns > grace * 1e9:
            remove_output(old)  # renamed away first: never a partial g<ns>/ listed as a generation
            if not old.exists():
                removed.append(old)
    return removed
