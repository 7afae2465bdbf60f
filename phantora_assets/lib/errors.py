"""Exception types. Every error names the file (or run-matrix entry) and the rule it broke."""

from __future__ import annotations

from pathlib import Path


class PhantoraAssetsError(Exception):
    """Base class of every error raised by phantora_assets."""


class FileRuleError(PhantoraAssetsError):
    """An error about one file: ``path``, the ``rule`` broken, and the ``detail`` found.

    The message is ``"<path>: <rule> (<detail>)"``.
    """

    def __init__(self, path: str | Path, rule: str, detail: str = "") -> None:
        self.path = str(path)
        self.rule = rule
        self.detail = detail
        msg = f"{self.path}: {rule}"
        if detail:
            msg += f" ({detail})"
        super().__init__(msg)


class TraceFormatError(FileRuleError):
    """A trace file breaks a format rule (PHANTORA_FORMATS.md section 3).

    Args:
        path: the offending file.
        rule: short name of the rule broken, e.g. ``"invalid JSON"``.
        detail: what was found (line number, value).
    """


class StepDetectionError(TraceFormatError):
    """The collective sequence of a communicator never repeats, so no steady step exists."""


class RunMatrixError(PhantoraAssetsError):
    """An entry of the run matrix is invalid (unknown workload or GPU, indivisible layout)."""


class PerfDBError(PhantoraAssetsError):
    """A performance database file is missing, corrupt, or breaks the perf DB schema."""


class OutputWriteError(FileRuleError, OSError):
    """An output file could not be written (e.g. the disk is full); the previous file, if any,
    is unchanged and no temporary file is left.

    Args:
        path: the output file.
        rule: ``disk full`` (ENOSPC / EDQUOT) or ``write failed``.
        detail: the operating system's message.
    """

    def __init__(self, path: str | Path, rule: str, detail: str = "", errno_: int | None = None) -> None:
        super().__init__(path, rule, detail)
        if errno_ is not None:
            self.errno = errno_
