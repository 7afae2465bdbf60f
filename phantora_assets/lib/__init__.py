"""Domain code of phantora_assets: no Dagster import anywhere under this package.

Packages:
    errors     exception types (each names the file or entry and the rule broken)
    run/       a run as data: RunSpec, its rules and the names it may use (workloads, GPUs, sources)
    phantora/  Phantora's formats: the Chrome trace (writer, reader, compiled scanner), run.log,
               perf DB, netconfig, run folders, the Docker configs and launcher of a Phantora run
    sim/       the embedded analytic simulator: workloads, torch ops, kernels, memory, network
    traffic/   traffic rules: steps, ring rules, trace checks, binning, window features, step
               anatomy, the cross-check against the workload model
    store/     atomic file writes, the cross-run DuckDB database, plots

Each package's ``__init__`` lists its modules; docs/DATASET.md and docs/PHANTORA_FORMATS.md are
the formats and procedures the modules cite.
"""
