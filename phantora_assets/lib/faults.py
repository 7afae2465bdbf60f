"""Resource faults: a full disk, a read-only or unwritable data root, a failing disk -- told apart
from the project's own errors so that a build ends with one line naming the step and the path
(``cli/build.py``), not a traceback. No Dagster import.

:func:`resource_fault` reads an exception and its chain (``__cause__`` / ``__context__``):
``OSError`` by errno (:data:`FAULT_ERRNOS`), and the texts SQLite (the Dagster instance's
storages), DuckDB and Dagster's serialized step errors carry (:data:`FAULT_TEXTS`).
:func:`fault_from_text` reads one such text (a failed step's error as the event log keeps it).
"""

from __future__ import annotations

import errno
import re
from dataclasses import dataclass

#: errno -> the rule a build names.
FAULT_ERRNOS = {
    errno.ENOSPC: "disk full",
    errno.EDQUOT: "disk full",
    errno.EROFS: "read-only file system",
    errno.EFBIG: "file too large",
    errno.EIO: "disk I/O error",
    errno.EACCES: "permission denied",
}
#: Lower-case text of a message -> the rule (SQLite, DuckDB, OSError's own words, this project's
#: ``OutputWriteError`` rules).
FAULT_TEXTS = (
    ("database or disk is full", "disk full"),
    ("no space left on device", "disk full"),
    ("disk quota exceeded", "disk full"),
    ("[errno 28]", "disk full"),
    (": disk full (", "disk full"),
    ("attempt to write a readonly database", "read-only file system"),
    ("read-only file system", "read-only file system"),
    ("[errno 30]", "read-only file system"),
    ("disk i/o error", "disk I/O error"),
    ("unable to open database file", "cannot open database file"),
    ("file too large", "file too large"),
    ("permission denied", "permission denied"),
)
_QUOTED_PATH = re.compile(r"""["'](/[^"'\n]+)["']""")
_LEADING_PATH = re.compile(r"^(?:[\w.]+: )?(/[^:\n]+): ")


@dataclass(frozen=True)
class ResourceFault:
    """What a build says of a resource fault: the ``rule`` (:data:`FAULT_ERRNOS` values), the
    ``path`` it hit (None when the error does not say: the caller names the store it wrote) and
    the system's ``detail`` (one line)."""

    rule: str
    path: str | None
    detail: str

    def line(self, step: str, default_path: str | None = None) -> str:
        """``<step>: <path>: <rule> (<detail>)``: the one line a build ends with."""
        path = self.path or default_path or "?"
        return f"{step}: {path}: {self.rule} ({self.detail})"


def _one_line(text: str, limit: int = 200) -> str:
    first = next((ln.strip() for ln in str(text).splitlines() if ln.strip()), "")
    return first[:limit]


def _path_in(text: str) -> str | None:
    m = _QUOTED_PATH.search(text) or _LEADING_PATH.search(text)
    return m.group(1) if m else None


def fault_from_text(text: str) -> ResourceFault | None:
    """The fault a message tells of (:data:`FAULT_TEXTS`), with the path it names (a quoted
    absolute path, or the leading ``<path>: `` of this project's file errors), else None."""
    low = str(text).lower()
    for needle, rule in FAULT_TEXTS:
        if needle in low:
            return ResourceFault(rule, _path_in(str(text)), _one_line(text))
    return None


def _chain(exc: BaseException) -> list[BaseException]:
    out: list[BaseException] = []
    cur: BaseException | None = exc
    while cur is not None and cur not in out and len(out) < 20:
        out.append(cur)
        cur = cur.__cause__ or cur.__context__
    return out


def resource_fault(exc: BaseException) -> ResourceFault | None:
    """The resource fault ``exc`` (or an exception in its chain) is, else None. An ``OSError``
    with an errno counts by it (``EACCES`` only with a file name: a file the build could not
    write); any other exception (an ``OSError`` without errno: pyarrow's) by its message
    (SQLite's ``database or disk is full``, DuckDB's ``No space left on device``, ...)."""
    chain = _chain(exc)
    for e in chain:
        if isinstance(e, OSError) and e.errno in FAULT_ERRNOS:
            if e.errno == errno.EACCES and not e.filename:
                continue
            path = e.filename if e.filename else getattr(e, "path", None)
            detail = e.strerror or str(e)
            return ResourceFault(FAULT_ERRNOS[e.errno], str(path) if path else None, _one_line(detail))
    for e in chain:
        if isinstance(e, KeyboardInterrupt):
            return None
        if isinstance(e, OSError) and e.errno is not None:  # judged by its errno above
            continue
        found = fault_from_text(f"{e}")
        if found is not None:
            return found
    return None
