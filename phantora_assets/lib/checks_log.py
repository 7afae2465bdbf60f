"""The per-run record of check outcomes: ``checks.json`` (machine) and ``checks.txt`` (plain words).

Each asset resets its own checks to "not evaluated" when it starts and records each outcome
when it finishes, so a run is in the dataset only if every expected check has passed in the
latest materialization of its asset. Advisory checks (``ADVISORY_CHECKS``, WARN severity in
Dagster) are recorded too, as ``passed`` or ``warning``; they never keep a run out of the
dataset. Both files are written atomically.
"""

from __future__ import annotations

import json
from pathlib import Path

from phantora_assets.lib.io import atomic_write_text

NOT_EVALUATED = "not evaluated"

#: Every check a run must pass to enter the dataset, in pipeline order, with its asset.
RUN_CHECKS: dict[str, str] = {
    "fits_in_memory": "raw_timeline",
    "perfdb_complete": "raw_timeline",
    "flows_exist": "validated_flows",
    "steps_match": "validated_flows",
    "ring_bytes_match": "validated_flows",
    "steady_steps_stable": "validated_flows",
    "bins_conserve_bytes": "binned_flows",
    "windows_contract": "window_features",
    "runs_contract": "run_summary",
}

#: Advisory checks (non-blocking, WARN severity), with their asset.
ADVISORY_CHECKS: dict[str, str] = {
    "matches_workload_model": "validated_flows",
}

_ORDER = list(RUN_CHECKS) + list(ADVISORY_CHECKS)


def read_checks(folder: Path) -> dict[str, dict]:
    """``check name -> {status, message}`` from ``folder/checks.json`` ({} if absent)."""
    p = folder / "checks.json"
    if not p.exists():
        return {}
    return json.loads(p.read_text())


def _write(folder: Path, data: dict[str, dict]) -> None:
    ordered = {k: data[k] for k in sorted(data, key=lambda k: (_ORDER.index(k) if k in _ORDER else 99, k))}
    atomic_write_text(folder / "checks.json", json.dumps(ordered, indent=1, sort_keys=False) + "\n")
    lines = ["Checks of this run (latest materialization of each asset)", ""]
    for name, rec in ordered.items():
        lines.append(f"[{rec['status'].upper()}] {name} ({rec.get('asset', '')}): {rec.get('message', '')}")
    atomic_write_text(folder / "checks.txt", "\n".join(lines) + "\n")


def reset_checks(folder: Path, asset: str, names: tuple[str, ...] = ()) -> None:
    """Mark every check of ``asset`` as not evaluated (called when the asset starts).

    ``names``: checks of ``asset`` that are not in RUN_CHECKS (they do not gate the dataset).
    """
    data = read_checks(folder)
    for name, owner in {**RUN_CHECKS, **ADVISORY_CHECKS}.items():
        if owner == asset:
            data[name] = {"status": NOT_EVALUATED, "asset": asset, "message": "asset started; not yet evaluated"}
    for name in names:
        data[name] = {"status": NOT_EVALUATED, "asset": asset, "message": "asset started; not yet evaluated"}
    _write(folder, data)


def record_check(folder: Path, asset: str, name: str, passed: bool, message: str, *, warn: bool = False) -> None:
    """Record one outcome with its plain-words message: ``passed``, else ``failed`` (or
    ``warning`` for an advisory check, ``warn=True``)."""
    record_checks(folder, asset, [(name, passed, message, warn)])


def record_checks(folder: Path, asset: str, outcomes: list[tuple[str, bool, str, bool]]) -> None:
    """Record several outcomes of ``asset`` at once, ``(name, passed, message, warn)`` each (one
    write of the two files instead of one per outcome)."""
    data = read_checks(folder)
    for name, passed, message, warn in outcomes:
        status = "passed" if passed else ("warning" if warn else "failed")
        data[name] = {"status": status, "asset": asset, "message": message}
    _write(folder, data)


def blocking_failures(folder: Path) -> dict[str, dict]:
    """Checks of RUN_CHECKS not recorded as passed (missing ones as ``not evaluated``)."""
    data = read_checks(folder)
    return {n: data.get(n, {"status": NOT_EVALUATED, "message": "never evaluated"})
            for n in RUN_CHECKS if data.get(n, {}).get("status") != "passed"}


def run_passed(folder: Path) -> bool:
    """True iff every check of RUN_CHECKS is recorded as passed."""
    data = read_checks(folder)
    return all(data.get(n, {}).get("status") == "passed" for n in RUN_CHECKS)
