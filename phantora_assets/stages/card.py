"""The dataset card, ``phantora_v0/README.md``, written with every export (no Dagster import).

A Hugging Face dataset card: YAML front matter (``license``, ``configs``: one config per table,
its Parquet files) so that ``datasets.load_dataset("<dir>/phantora_v0", "runs")`` (and
``flows_100ms``, ``windows``) reads the folder offline, then the data dictionary generated from
the pandera contracts (``contracts.py``: every column's type, unit from ``metadata["unit"]``,
nullability, checks and description), the build procedure (with the 180 s construction, the
docstring of ``lib/traffic/binning.py``), how to read it, known limits and the license.
Deterministic text: a rebuild of the same runs writes the same bytes.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping

from phantora_assets import contracts
from phantora_assets.lib.store import bin_table
from phantora_assets.lib.store.export import ARROW_TYPES
from phantora_assets.lib.store.generations import GRACE_S
from phantora_assets.lib.traffic import binning
from phantora_assets.stages.common import BIN_S, CONTROL_BYTES_PER_S, WINDOW_S
from phantora_assets.stages.export import EXPORT_TABLES, ExportTable

LICENSE = "apache-2.0"  # the project's license (pyproject.toml); the L40S perf DB is Phantora's, Apache-2.0

_CHECK_TEXT = {
    "greater_than_or_equal_to": lambda s: f">= {s['min_value']}",
    "greater_than": lambda s: f"> {s['min_value']}",
    "less_than_or_equal_to": lambda s: f"<= {s['max_value']}",
    "less_than": lambda s: f"< {s['max_value']}",
    "in_range": lambda s: f"in [{s['min_value']}, {s['max_value']}]",
    "isin": lambda s: "one of " + ", ".join(str(v) for v in s["allowed_values"]),
    "str_matches": lambda s: f"matches `{s['pattern']}`",
    "str_startswith": lambda s: f"starts with `{s['string']}`",
    "str_length": lambda s: f"length >= {s.get('min_value')}",
}


def _config_glob(t: ExportTable) -> str:
    """The table's Parquet files, relative to the dataset folder (``<run_id>/part-<h>.parquet`` for a per-run table)."""
    return f"{t.name}/*/*.parquet" if t.per_run else f"{t.name}.parquet"


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _checks(col) -> str:
    parts = [_CHECK_TEXT.get(c.name, lambda s, n=c.name: n)(c.statistics or {}) for c in col.checks]
    if col.unique:
        parts.append("unique")
    return "; ".join(parts)


def data_dictionary() -> str:
    """Markdown: one table per published table, one row per column (name, type, unit, nullable,
    checks, description), from the pandera contracts."""
    out = []
    for t in EXPORT_TABLES:
        schema = t.schema()
        keys = ", ".join(schema.unique or [])  # type: ignore[attr-defined]
        out.append(f"### `{t.name}` ({t.config_doc})\n")
        if keys:
            out.append(f"Key: ({keys}), unique.\n")
        out.append("| column | type | unit | nullable | checks | description |")
        out.append("|---|---|---|---|---|---|")
        for name, col in schema.columns.items():  # type: ignore[attr-defined]
            arrow = str(ARROW_TYPES[t.columns[name]])
            unit = contracts.unit(col) or "-"
            row = [f"`{name}`", arrow, unit, "yes" if col.nullable else "no", _checks(col), col.description or ""]
            out.append("| " + " | ".join(_cell(c) for c in row) + " |")
        frame = [c.error for c in schema.checks if getattr(c, "error", None)]  # type: ignore[attr-defined]
        if frame:
            out.append("\nRow rules (each a violation when true): " + "; ".join(f"`{_cell(e)}`" for e in frame) + ".")
        out.append("")
    return "\n".join(out)


def _has_files(t: ExportTable, rows: Mapping[str, int] | None) -> bool:
    """A per-run table of no rows has no Parquet file (``flows_100ms`` when no run is at 100 ms): its
    config's glob would match nothing and ``load_dataset`` would fail, so the card leaves it out."""
    return rows is None or not t.per_run or rows.get(t.name, 0) > 0


def front_matter(rows: Mapping[str, int] | None = None, digests: Mapping[str, str] | None = None) -> str:
    """The YAML header: license and one ``configs`` entry per table that has Parquet files (every
    table when ``rows``, the rows per table, is not given); with ``digests`` (sha256 of each table's
    Parquet files), a ``dataset_info`` entry per config whose description holds it. ``datasets``
    keys its cache of a local folder on the configs and ``dataset_info`` only, not on the files:
    without the digest, a ``load_dataset`` after a rebuild returned the previous build's rows."""
    lines = ["---", f"license: {LICENSE}", "pretty_name: phantora_v0 node-to-node traffic of LLM training", "configs:"]
    for t in EXPORT_TABLES:
        if _has_files(t, rows):
            lines += [f"- config_name: {t.name}", f'  data_files: "{_config_glob(t)}"']
    if digests:
        lines.append("dataset_info:")
        for t in EXPORT_TABLES:
            if _has_files(t, rows):
                sha = f'  description: "sha256 of the Parquet files: {digests[t.name]}"'
                lines += [f"- config_name: {t.name}", sha]
    return "\n".join(lines + ["---", ""])


_JITTER = float((binning.build_bins.__kwdefaults__ or {})["jitter"])
_PROCEDURE = f"""\
1. **Trace.** Each run is one training configuration (a workload: W1-W5 or a `[workloads.NAME]` of the run
   matrix; GPU, nodes x GPUs per node),
   simulated (the embedded analytic simulator, or Phantora in Docker) or imported (Phantora run
   folders, PyTorch profiler traces, Chakra ETs), as a Chrome trace in Phantora's visualizer schema.
2. **Network flows**: the trace's Communication events whose source and destination hosts differ
   (host-k is node k-1).
3. **Steps**: each communicator repeats its sequence of collectives; the run is cut into steps, the
   warm-up step(s) dropped; the step time is the median steady step.
4. **Checks** (a run enters the dataset only when every gating check passed; `run_status.csv`
   says why each other run is out): network flows exist; every steady step issues the same
   collectives; every flow's bytes follow the ring rule of its op; steady steps carry identical
   bytes and nearly identical durations; the binned bytes are conserved exactly; every table
   satisfies its contract.
5. **The {WINDOW_S:g} s construction** (`flows_100ms`): one steady step's network flows are repeated back
   to back over a {WINDOW_S:g} s window, each repetition up to {_JITTER:.0%} shorter or longer at random
   (length factor uniform in [{1 - _JITTER:g}, {1 + _JITTER:g}]), the window starting at a random
   phase inside a step; each node adds {CONTROL_BYTES_PER_S / 1000:g} kB/s of control traffic; everything is
   summed into bins of the run's width (`runs.bin_s`; in this build {{widths}}). The sum of a run's
   bins equals the bytes of the flows placed in the window plus the control bytes, exactly.
   `flows_100ms` holds the runs of {BIN_S * 1000:g} ms bins only{{others}}. The rules, as
   `lib/traffic/binning.py` states them:

{{binning_doc}}
6. **Windows**: detector features per 1 s and 15 s window (aligned to t = 0) of each run's bin series.
7. **Export**: runs in run_id order, rows in bin order; this folder is written to a staging folder
   and swapped in whole, and a rebuild from the same runs writes the same bytes (every file here).
"""

_LIMITS = """\
- Endpoints are hosts (nodes), not GPUs or NICs; intra-host (loopback) traffic is not network traffic
  and is absent.
- Each ring hop is one bulk flow at the rate of max-min fair sharing; no packets, congestion control
  or retransmissions. The files hold traffic per node pair; bytes per directed link and bin (routes
  from the network model, ECMP as configured) are in the database's `link_bins`, not in this folder.
- The 180 s window repeats one steady step: there is no warm-up, checkpointing, evaluation or
  failure in it, and the jitter is synthetic (+-2 %).
- Bins cannot show a step shorter than two bins ({two_bins}): `dominant_period_s` then reads its
  alias (`runs.step_time_s < 2 * runs.bin_s` flags those runs).
- The shipped workloads W1-W5 are 4-layer slices of the named models (sequence 1024, micro-batch 1); a
  workload of the run matrix (`[workloads.NAME]`) has the layers, sequence and batch its table gives, and
  a profiled run is the job as it was profiled (`runs.workload`, `runs.model` name each run's); MoE
  experts are balanced; kernel timings come from
  one GPU of each type (perf DB) or a roofline (`runs.perf_db_fraction`).
- `flops_per_step`, `mfu`, `peak_flops` and `alpha` are null where timing is not a roofline.
- The per-pair bins are dense, every bin x every ordered node pair (zeros included), for a run whose
  table has at most {max_cells} cells (bins x pairs; at 100 ms bins, up to {max_nodes} nodes; every
  shipped run). A larger run's `flows_100ms` is sparse: it omits the rows of the
  (bin, pair) cells that carry no flow bytes, whose bytes are the pair's control traffic alone (0 for
  a pair with none); such a run has fewer rows than bins x n_nodes x (n_nodes - 1). The dense form is
  `phantora_assets.lib.store.bin_table.densify` of its file, or the DuckDB query of docs/QUERIES.md
  ("The dense form of a sparse run"). Its windows are computed as from the dense form.
"""


def _limits(two_bins: str) -> str:
    """:data:`_LIMITS` with the run's numbers: the two-bin alias, the dense table's bound
    (``lib/store/bin_table.MAX_DENSE_CELLS``, above it a run's table is sparse) and the node count it
    allows at 100 ms bins."""
    cells, n_bins = bin_table.MAX_DENSE_CELLS, int(round(WINDOW_S / BIN_S))
    max_nodes = max(n for n in range(2, 4097) if n_bins * n * (n - 1) <= cells)
    return (
        _LIMITS.replace("{two_bins}", two_bins)
        .replace("{max_cells}", f"{cells:,}")
        .replace("{max_nodes}", str(max_nodes))
    )


def _ms(bin_s: float) -> str:
    return f"{bin_s * 1000:g} ms"


def bin_widths(widths: Mapping[str, float]) -> str:
    """The bin widths of the runs ``widths`` (run_id -> ``bin_s``) in words, widest first:
    ``100 ms (2 runs)``, ``100 ms (1 run) and 10 ms (1 run)``; ``no run`` when there is none."""
    parts = [f"{_ms(b)} ({n} run{'' if n == 1 else 's'})" for b, n in sorted(Counter(widths.values()).items())[::-1]]
    return " and ".join([", ".join(parts[:-1]), parts[-1]] if len(parts) > 1 else parts) or "no run"


def dataset_card(
    rows: dict[str, int], included: list[str], widths: Mapping[str, float], digests: Mapping[str, str] | None = None
) -> str:
    """The text of ``phantora_v0/README.md`` for an export of ``included`` runs with ``rows`` per table;
    ``widths``: each included run's ``bin_s``, from which every statement of the card about its bins
    is written; ``digests``: sha256 of each table's Parquet files (:func:`front_matter`)."""
    widths = {r: widths[r] for r in included}
    others = {r: b for r, b in widths.items() if b != BIN_S}
    widths_text = bin_widths(widths)
    other_text = (
        f" (the runs at other widths, {bin_widths(others)}, are in `runs` and `windows`, and in the "
        "database's `flows_binned`)"
        if others
        else ""
    )
    two_bins = ", ".join(f"{_ms(2 * b)} at {_ms(b)}" for b in sorted(set(widths.values()))[::-1]) or "2 x bin_s"
    procedure = _PROCEDURE.replace("{widths}", widths_text).replace("{others}", other_text)
    doc = (binning.__doc__ or "").strip().split("\n\n", 1)[-1]
    binning_doc = "\n".join(("   " + line).rstrip() for line in doc.splitlines()) + "\n"
    counts = ", ".join(f"`{t.name}` {rows.get(t.name, 0):,} rows" for t in EXPORT_TABLES)
    files = "\n".join(
        (f"- `{t.name}`: `{_config_glob(t)}`" if _has_files(t, rows) else f"- `{t.name}`: no run, no Parquet file;")
        + (" (one file per run, in a folder named by its run_id)" if t.per_run and _has_files(t, rows) else "")
        + f" and `{t.name}.csv`"
        + ("" if _has_files(t, rows) else " (its header only)")
        for t in EXPORT_TABLES
    )
    configs = ", ".join(t.name for t in EXPORT_TABLES if _has_files(t, rows))
    example = "flows_100ms" if "flows_100ms" in configs else "windows"
    run = included[0] if included else "<run_id>"
    return f"""{front_matter(rows, digests)}
# phantora_v0: node-to-node network traffic of distributed LLM training

Bytes per (source node, destination node) per bin of the run's width ({widths_text}) over a
{WINDOW_S:g} s window, one summary row per run and detector features per window, for {len(included)} run(s)
of simulated or traced training configurations. {counts}. Written by `phantora-assets build` (asset `phantora_v0`).

## Files

{files}
- `run_status.csv`: every run of the run matrix, `included` or `excluded` with the reason.

Parquet is the primary form; every Parquet file holds its `run_id` column (its folder is named by
the run, not `run_id=...`: no reader sees a partition column beside the file's own). The CSVs are the
v1 contract (same rows and columns; floats as `%.10g`, empty field = null). Join the tables on `run_id`.
Run from inside this folder, or give `realpath` its path. `here` is resolved once: `phantora_v0` is
a link that a re-export moves to a new folder in one step; the folder resolved stays whole for
{GRACE_S / 60:g} minutes (by default) after that, while a reader that goes through the link at
every open can find a file it listed gone, or list folders of two exports.

```python
import os, duckdb, pandas as pd, pyarrow.dataset as ds, datasets
here, run = os.path.realpath("."), "{run}"
per_run = duckdb.sql(f"SELECT run_id, count(*) FROM '{{here}}/{example}/*/*.parquet' GROUP BY 1").fetchall()
one_run = ds.dataset(f"{{here}}/{example}").to_table(filter=ds.field("run_id") == run)
frame = pd.read_parquet(f"{{here}}/{example}", filters=[("run_id", "==", run)])
table = datasets.load_dataset(here, "{example}")["train"]  # configs: {configs}
```

## Data dictionary

Types are the Parquet (Arrow) types; the CSVs hold the same values as text.

{data_dictionary()}
## How the dataset is built

{procedure.replace("{binning_doc}", binning_doc)}
## Known limits

{_limits(two_bins)}
## License

Apache-2.0 (`{LICENSE}`), as the project that builds it. The L40S kernel timings come from Phantora's
perf DB (Apache-2.0).
"""
