"""What the two Phantora sources (Docker, import) share (no Dagster import): a run timed by
Phantora itself, whose ``run.log`` is the evidence for ``fits_in_memory`` and whose
``perfdb_missing/`` listing is the evidence for ``perfdb_complete``; and :func:`install_trace`,
which puts a converted or imported trace in place only after parsing it.
"""

from __future__ import annotations

import errno
import gzip
import json
import os
import shutil
import stat
from pathlib import Path
from typing import Any, BinaryIO

from phantora_assets.checks import FITS_IN_MEMORY, PERFDB_COMPLETE
from phantora_assets.lib.errors import FileRuleError, TraceFormatError
from phantora_assets.lib.phantora import chrome_trace as ct
from phantora_assets.lib.phantora.run_folder import refusal
from phantora_assets.lib.phantora.run_log import RunLog, read_run_log
from phantora_assets.lib.run.spec import RunSpec
from phantora_assets.lib.store.io import atomic_path, same_path
from phantora_assets.outcomes import Outcome, StageResult
from phantora_assets.paths import DataPaths
from phantora_assets.records import RunLogRecord, write_record


def write_run_log_summary(paths: DataPaths, spec: RunSpec) -> RunLog:
    """Parse the run folder's run.log (if any) into partitions/<run_id>/run_log.json."""
    log_path = paths.run_folder(spec) / "run.log"
    parsed = read_run_log(log_path) if log_path.is_file() else RunLog()
    write_record(
        paths.partition_dir(spec.run_id) / "run_log.json",
        RunLogRecord(run_id=spec.run_id, present=log_path.is_file(), **parsed.as_dict()),
    )
    return parsed


def fits_from_log(spec: RunSpec, log: RunLog, log_present: bool, origin: str) -> Outcome:
    """fits_in_memory of a run timed by Phantora itself (its run.log is the evidence)."""
    card_gib = float(spec.gpu_spec["memory_gb"])  # PHANTORA_VRAM_MIB / 1024
    meta: dict[str, Any] = {"card_gib": card_gib, "peak_gib": log.peak_memory_gib}
    if log.out_of_memory:
        return Outcome(
            FITS_IN_MEMORY,
            False,
            f"does not fit: the {origin} run.log reports a CUDA out-of-memory error ({log.oom_line[:200]})",
            meta,
        )
    if log.peak_memory_gib is not None:
        ok = log.peak_memory_gib <= card_gib
        return Outcome(
            FITS_IN_MEMORY,
            ok,
            f"{'fits' if ok else 'does not fit'}: the {origin} run.log reports a peak of "
            f"{log.peak_memory_gib:.2f} GiB {'<=' if ok else '>'} card {card_gib:.2f} GiB",
            meta,
        )
    how = "its run.log reports no out-of-memory error" if log_present else "it has no run.log"
    return Outcome(FITS_IN_MEMORY, True, f"fits: the {origin} run completed and {how} (peak memory not reported)", meta)


def perfdb_from_missing(missing: dict[str, int] | None, when_none: str) -> Outcome:
    """perfdb_complete from Phantora's ``<db>.missing/`` listing (None: no replay record)."""
    if missing is None:
        return Outcome(PERFDB_COMPLETE, True, when_none, {"missing_entries": 0})
    n = int(sum(missing.values()))
    if n:
        files = ", ".join(f"{k} ({v})" for k, v in sorted(missing.items()))
        return Outcome(
            PERFDB_COMPLETE,
            False,
            f"the perf-DB replay met {n} kernel shape(s) missing from the database ({files}); Phantora "
            "charged them zero time, so this run's timings are invalid: record them and simulate again",
            {"missing_entries": n, "missing_files": json.dumps(missing)},
        )
    return Outcome(
        PERFDB_COMPLETE,
        True,
        "the perf-DB replay found every kernel shape in the database (<db>.missing/ is empty)",
        {"missing_entries": 0},
    )


def _open_source(src: Path) -> BinaryIO:
    """``src`` open for reading, never through a symlink (the last component: an imported run
    folder's trace must be the file itself, ``run_folder.refuse_links``).

    Raises:
        FileRuleError: ``src`` is a symlink, or not a regular file.
    """
    try:
        fd = os.open(src, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        if exc.errno != errno.ELOOP:
            raise
        raise (refusal(src, os.lstat(src).st_mode) or exc) from None
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        raise refusal(src, mode) or FileRuleError(src, "not a regular file", "a directory")
    return open(fd, "rb")


def _check_hosts(spec: RunSpec, parsed: ct.ParsedTrace, src: Path) -> None:
    nodes = [int(parsed.flows["src_node"].max()), int(parsed.flows["dst_node"].max())] if len(parsed.flows) else []
    nodes += [int(h.split("-", 1)[1]) - 1 for h in parsed.compute["host"]]
    if nodes and max(nodes) >= spec.n_nodes:
        raise TraceFormatError(
            src,
            "host outside the layout",
            f"the trace has host-{max(nodes) + 1} but {spec.run_id} has {spec.n_nodes} hosts",
        )


def install_trace(spec: RunSpec, paths: DataPaths, src: Path, origin: str) -> StageResult:
    """Put ``src`` (``.json`` or ``.json.gz``) at the run folder's ``timeline.json.gz``, atomically.

    The copy is parsed (:func:`ct.read_trace`) and its hosts checked against the
    layout before it replaces the destination, so a broken trace never becomes visible.
    ``src`` is opened without following a symlink.

    Raises:
        TraceFormatError: naming ``src`` and the rule it breaks.
        FileRuleError: ``src`` is a symlink (``symlink in run folder``) or not a regular file.
    """
    dst = paths.chrome_trace(spec)
    try:
        if dst.exists() and same_path(src, dst):
            parsed = ct.read_trace(dst)
            _check_hosts(spec, parsed, src)
        else:
            with atomic_path(dst) as tmp, _open_source(src) as fi:
                is_gzip = fi.read(2) == b"\x1f\x8b"
                fi.seek(0)
                with open(tmp, "wb") as fo:
                    if is_gzip:
                        shutil.copyfileobj(fi, fo, 1 << 20)
                    else:
                        with gzip.GzipFile(filename="", mode="wb", fileobj=fo, mtime=0) as gz:
                            shutil.copyfileobj(fi, gz, 1 << 20)
                parsed = ct.read_trace(tmp)
                _check_hosts(spec, parsed, src)
    except TraceFormatError as exc:
        if exc.path == str(src):
            raise
        raise TraceFormatError(src, exc.rule, exc.detail) from exc
    flows = parsed.flows
    net = flows["src_node"].to_numpy() != flows["dst_node"].to_numpy()
    meta = {
        "origin": origin,
        "n_events": int(parsed.n_events),
        "n_communication": int(len(flows)),
        "n_network_flows": int(net.sum()),
        "n_loopback_flows": int((~net).sum()),
        "n_communicators": int(flows["comm_id"].nunique()),
        "bytes_written": int(dst.stat().st_size),
    }
    return StageResult(dst, meta)
