"""The one registry of checks, and the per-run record of their outcomes.

:data:`CHECKS` lists every asset check of the graph once: its name, its asset, whether it is
blocking (a failure stops everything downstream of the asset), whether it gates the dataset (a
run enters ``phantora_v0`` only if every gating check passed) and what it means. The Dagster
check specs (``assets/``), ``checks.txt``/``checks.json``, the README's checks table and the tests'
lists (``RUN_CHECKS``, ``TRACE_CHECKS``, ...) all come from it (``tests/unit/test_checks.py`` compares
the README table and the Dagster specs with it).

The record of a run is ``checks.json`` (machine) and ``checks.txt`` (plain words) in its run
folder. Each asset resets its own checks to "not evaluated" when it starts and records each
outcome when it finishes, so a run is in the dataset only if every gating check has passed in the
latest materialization of its asset. Advisory checks (WARN severity in Dagster, not gating) are
recorded too, as ``passed`` or ``warning``; they never keep a run out of the dataset. One gating
check is not blocking: ``fits_in_memory`` (WARN in Dagster). A run that does not fit is an
outcome, not an error: its Dagster run succeeds, the check is recorded as ``failed`` (so the run
stays out of the dataset) and ``chrome_trace`` materializes nothing, so Dagster skips the run's
assets below it as not applicable. Both files are written atomically. No Dagster import.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from phantora_assets.lib.store.io import atomic_write_text
from phantora_assets.lib.traffic.rule_names import (
    FLOWS_EXIST,
    RING_BYTES_MATCH,
    STEADY_STEPS_STABLE,
    STEPS_MATCH,
    STEPS_MATCH_RUN_LOG,
)
from phantora_assets.records import RecordError


@dataclass(frozen=True)
class CheckDef:
    """One asset check.

    Attributes:
        name: the check's name (Dagster check name, key in ``checks.json``).
        asset: the asset it belongs to.
        blocking: blocking in Dagster: on a failure nothing downstream of the asset runs.
        gates_dataset: the run is kept out of ``phantora_v0`` unless this check passed
            (per-run checks only).
        description: what the check means, in plain words (shown in the UI and the README).
        severity: the Dagster severity of a failure: ``error`` (ERROR) or ``warn`` (WARN, never
            blocks). A ``warn`` check that does not gate the dataset is advisory (recorded as
            ``warning``); one that gates it (``fits_in_memory``) is recorded as ``failed`` and
            keeps the run out of the dataset without failing the Dagster run.
    """

    name: str
    asset: str
    blocking: bool
    gates_dataset: bool
    description: str
    severity: str = "error"

    @property
    def kind(self) -> str:
        """One word for tables: gating (blocking), gating_warn (non-blocking, WARN), blocking, error
        (non-blocking) or advisory."""
        if self.gates_dataset:
            return "gating" if self.blocking else "gating_warn"
        if self.blocking:
            return "blocking"
        return "advisory" if self.severity == "warn" else "error"


#: The names of the checks recorded or read outside this module (Dagster check names, keys of
#: ``checks.json``); the trace rules of validated_flows are named in ``lib/traffic/rule_names.py``.
FITS_IN_MEMORY = "fits_in_memory"
PERFDB_COMPLETE = "perfdb_complete"
MATCHES_WORKLOAD_MODEL = "matches_workload_model"
BINS_CONSERVE_BYTES = "bins_conserve_bytes"
LINK_BINS_CONSERVE_BYTES = "link_bins_conserve_bytes"
WINDOWS_CONTRACT = "windows_contract"
RUNS_CONTRACT = "runs_contract"
ANATOMY_ADDS_UP = "anatomy_adds_up"
DATASET_CONTRACT = "dataset_contract"
DUCKDB_MATCHES_DATASET = "duckdb_matches_dataset"


CHECKS: tuple[CheckDef, ...] = (
    CheckDef(
        FITS_IN_MEMORY,
        "raw_timeline",
        False,
        True,
        "The run fits the simulated card: the analytic peak memory estimate, or Phantora's run.log "
        "(no CUDA out-of-memory error, reported peak <= card). A run that does not fit is an outcome, "
        "not an error: its Dagster run succeeds, raw_timeline records the estimate, the run is kept out "
        "of the dataset and its assets from chrome_trace on are skipped as not applicable.",
        severity="warn",
    ),
    CheckDef(
        PERFDB_COMPLETE,
        "raw_timeline",
        True,
        True,
        "A perf-DB replay met no kernel shape missing from the database (Phantora's <db>.missing/ is "
        "empty); otherwise the run's timings are invalid.",
    ),
    CheckDef(
        FLOWS_EXIST,
        "validated_flows",
        True,
        True,
        "The trace has at least one network flow (src host != dst host), and its network bytes sum within int64.",
    ),
    CheckDef(
        STEPS_MATCH,
        "validated_flows",
        True,
        True,
        "Every steady step issues the same collectives on every communicator.",
    ),
    CheckDef(
        RING_BYTES_MATCH,
        "validated_flows",
        True,
        True,
        "Every flow's bytes follow Phantora's ring rule for its op, with one group size per communicator.",
    ),
    CheckDef(
        STEADY_STEPS_STABLE,
        "validated_flows",
        True,
        True,
        "Steady steps carry identical network bytes (an MoE all-to-all's routed sizes: within 25 %) and "
        "durations within 10 % of the step time.",
    ),
    CheckDef(
        STEPS_MATCH_RUN_LOG,
        "validated_flows",
        True,
        True,
        "The steps agree with the iterations run.log reports (as many steps, up to 2 fewer; the step time "
        "within 10 % of the median iteration), when it reports them.",
    ),
    CheckDef(
        MATCHES_WORKLOAD_MODEL,
        "validated_flows",
        False,
        False,
        severity="warn",
        description="Advisory (WARN, non-blocking): network bytes per steady step of the trace versus the workload "
        "model of the same workload and layout, by collective kind (DP, TP, MoE all-to-all, ZeRO-3 "
        "gathers); warns above 1 % and lists the breakdown (e.g. a published MoE trace missing its "
        "all-to-all flows).",
    ),
    CheckDef(
        BINS_CONSERVE_BYTES,
        "binned_flows",
        True,
        True,
        "Sum of binned bytes = placed flow bytes + control bytes, exactly.",
    ),
    CheckDef(
        LINK_BINS_CONSERVE_BYTES,
        "link_bins",
        True,
        False,
        "Per link class (host_up, leaf_spine, spine_leaf, host_down): the bytes of link_bins over its links and "
        "bins = the in-window bytes of the network flows x the links of that class on their paths, exactly.",
    ),
    CheckDef(WINDOWS_CONTRACT, "window_features", True, True, "The rows satisfy the windows.csv pandera model."),
    CheckDef(RUNS_CONTRACT, "run_summary", True, True, "The row satisfies the runs.csv (v1) pandera model."),
    CheckDef(
        ANATOMY_ADDS_UP,
        "step_anatomy",
        False,
        False,
        "Every (step, host) row: compute + exposed communication + idle = step time, and every host "
        "has a row for every step.",
    ),
    CheckDef(
        DATASET_CONTRACT, "phantora_v0", True, False, "runs, flows_100ms and windows satisfy the v1 pandera contract."
    ),
    CheckDef(
        DUCKDB_MATCHES_DATASET,
        "dataset_duckdb",
        False,
        False,
        "The database holds exactly the runs and rows of phantora_v0.",
    ),
)

BY_NAME: dict[str, CheckDef] = {c.name: c for c in CHECKS}

#: Every check a run must pass to enter the dataset, in pipeline order, with its asset.
RUN_CHECKS: dict[str, str] = {c.name: c.asset for c in CHECKS if c.gates_dataset}

#: Advisory checks (non-blocking, WARN severity, not gating), with their asset.
ADVISORY_CHECKS: dict[str, str] = {c.name: c.asset for c in CHECKS if c.severity == "warn" and not c.gates_dataset}

#: The trace rules of validated_flows (docs/DATASET.md, "How a trace becomes the dataset", step 3), in order.
TRACE_CHECKS: tuple[str, ...] = tuple(c.name for c in CHECKS if c.asset == "validated_flows" and c.gates_dataset)


def checks_of(asset: str) -> list[CheckDef]:
    """The checks of ``asset``, in registry order."""
    return [c for c in CHECKS if c.asset == asset]


def markdown_table() -> str:
    """The README's checks table (one row per check), generated from :data:`CHECKS`."""
    words = {
        "gating": "blocking; gates the dataset",
        "gating_warn": "WARN, non-blocking; gates the dataset",
        "blocking": "blocking",
        "error": "ERROR, non-blocking",
        "advisory": "advisory (WARN)",
    }
    rows = ["| check | asset | kind | what it means |", "|---|---|---|---|"]
    for c in CHECKS:
        rows.append(f"| `{c.name}` | `{c.asset}` | {words[c.kind]} | {c.description} |")
    return "\n".join(rows) + "\n"


NOT_EVALUATED = "not evaluated"

_ORDER = list(RUN_CHECKS) + list(ADVISORY_CHECKS)


def read_checks(folder: Path) -> dict[str, dict]:
    """``check name -> {status, asset, message}`` from ``folder/checks.json`` ({} if absent).

    Raises:
        RecordError: the file is not a JSON object of such records (names the file).
    """
    p = folder / "checks.json"
    if not p.exists():
        return {}
    try:
        data = json.loads(p.read_bytes())
    except (OSError, ValueError) as exc:
        raise RecordError(p, "invalid checks record", str(exc)) from exc
    if not isinstance(data, dict) or not all(
        isinstance(v, dict) and isinstance(v.get("status"), str) for v in data.values()
    ):
        raise RecordError(p, "invalid checks record", "expected an object of {status, asset, message} objects")
    return data


def _write(folder: Path, data: dict[str, dict]) -> None:
    ordered = {k: data[k] for k in sorted(data, key=lambda k: (_ORDER.index(k) if k in _ORDER else 99, k))}
    atomic_write_text(folder / "checks.json", json.dumps(ordered, indent=1, sort_keys=False) + "\n")
    lines = ["Checks of this run (latest materialization of each asset)", ""]
    for name, rec in ordered.items():
        lines.append(f"[{rec['status'].upper()}] {name} ({rec.get('asset', '')}): {rec.get('message', '')}")
    atomic_write_text(folder / "checks.txt", "\n".join(lines) + "\n")


def reset_checks(folder: Path, asset: str, names: tuple[str, ...] = ()) -> None:
    """Mark every check of ``asset`` that the run folder records as not evaluated (called when the
    asset starts): the gating and advisory checks of :data:`CHECKS`, and ``names`` (other checks
    of ``asset`` that a stage records in the run folder, e.g. ``anatomy_adds_up``).
    """
    data = read_checks(folder)
    for name, owner in {**RUN_CHECKS, **ADVISORY_CHECKS}.items():
        if owner == asset:
            data[name] = {"status": NOT_EVALUATED, "asset": asset, "message": "asset started; not yet evaluated"}
    for name in names:
        data[name] = {"status": NOT_EVALUATED, "asset": asset, "message": "asset started; not yet evaluated"}
    _write(folder, data)


def invalidate_checks(folder: Path, keep: tuple[str, ...], message: str) -> None:
    """Mark every check the run folder records for an asset not in ``keep`` as not evaluated with
    ``message``, and drop those assets' recorded step failures (called when an upstream asset is
    rebuilt from other inputs, so the downstream outcomes no longer describe the run). No write
    when the folder records nothing."""
    data = read_checks(folder)
    if not data:
        return
    for name, rec in list(data.items()):
        if rec.get("asset") in keep:
            continue
        if name.startswith(STEP_FAILED):
            del data[name]
        else:
            data[name] = {"status": NOT_EVALUATED, "asset": rec.get("asset", ""), "message": message}
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


#: Status of a ``checks.json`` entry that is no check but a statement about the run's inputs.
NOTE = "note"


def record_note(folder: Path, asset: str, name: str, message: str) -> None:
    """Record ``message`` (e.g. the assumptions a source made) as entry ``name`` with status
    :data:`NOTE`: shown in ``checks.txt`` as ``[NOTE]``, never counted as a check."""
    data = read_checks(folder)
    data[name] = {"status": NOTE, "asset": asset, "message": message}
    _write(folder, data)


#: Prefix of the checks.json entries that record a failed step (``step_failed:<asset>``).
STEP_FAILED = "step_failed:"


def record_step_error(folder: Path, asset: str, message: str) -> None:
    """Record that ``asset``'s step raised (``message``: the error's type, file, rule and detail),
    as ``checks.json`` entry ``step_failed:<asset>`` with status ``error``; ``checks.txt`` shows it."""
    folder.mkdir(parents=True, exist_ok=True)
    data = read_checks(folder)
    data[STEP_FAILED + asset] = {"status": "error", "asset": asset, "message": message}
    _write(folder, data)


def clear_step_error(folder: Path, asset: str) -> None:
    """Forget a failure of ``asset``'s step recorded by an earlier materialization (no write when
    there is none)."""
    data = read_checks(folder)
    if data.pop(STEP_FAILED + asset, None) is not None:
        _write(folder, data)


def step_errors(data: dict[str, dict]) -> list[str]:
    """``"<asset>: <message>"`` of every failed step recorded in ``data`` (a ``read_checks`` result)."""
    return [
        f"{v.get('asset', k[len(STEP_FAILED) :])}: {v['message']}" for k, v in data.items() if k.startswith(STEP_FAILED)
    ]


def blocking_failures(folder: Path) -> dict[str, dict]:
    """Checks of RUN_CHECKS (the gating checks, blocking or not) not recorded as passed (missing
    ones as ``not evaluated``)."""
    data = read_checks(folder)
    return {
        n: data.get(n, {"status": NOT_EVALUATED, "message": "never evaluated"})
        for n in RUN_CHECKS
        if data.get(n, {}).get("status") != "passed"
    }


#: The exclusion reason of a run whose folder records no check (its assets never ran).
NOT_BUILT = "not built"


def exclusion_reason(data: dict[str, dict]) -> str | None:
    """Why a run whose ``checks.json`` holds ``data`` (a ``read_checks`` result) is out of the dataset,
    in the one wording ``run_status.csv``, the database's ``run_status`` and ``phantora-assets runs``
    all print; None when every gating check passed.

    Returns:
        :data:`NOT_BUILT` when nothing is recorded; else ``<check>: <status>`` for each check of
        :data:`RUN_CHECKS` not recorded as passed, in their order, joined by ``", "``: ``failed``,
        ``not evaluated`` (:data:`NOT_EVALUATED`, also for a check never recorded: its asset did not
        run or did not apply, e.g. every check below a run that does not fit in GPU memory), or the
        status recorded. E.g. ``fits_in_memory: failed, flows_exist: not evaluated, ...``. A step
        whose latest materialization raised (``step_failed:<asset>``) comes first, as ``step
        <asset>: <error>``: a run whose rebuild failed is out although its earlier checks passed.
    """
    if not data:
        return NOT_BUILT
    status = {n: data.get(n, {}).get("status", NOT_EVALUATED) for n in RUN_CHECKS}
    failed_steps = [f"step {e}" for e in step_errors(data)]  # the cause first: the checks follow from it
    return ", ".join(failed_steps + [f"{n}: {s}" for n, s in status.items() if s != "passed"]) or None
