"""The stages of the asset graph as plain functions (no Dagster import), one module per asset
group, paired by name with ``assets/<group>.py``.

Each stage reads the files of the stages before it under a ``paths.DataPaths`` root, writes its own
files atomically, records its check outcomes in the run folder and returns a
``outcomes.StageResult`` (metadata and outcomes). The simulation and trace stages hand the run to
its source (``sources/``).

    simulation.perf_db          -> perfdb/<gpu>/perf_db.json
    simulation.raw_timeline     -> the source's raw timeline, run.log, config/, run_log.json
    traces.chrome_trace         -> run folder timeline.json.gz
    flows.validate_flows        -> partitions/<run_id>/{flows,steps,step_flows,compute_events}.parquet,
                                   trace_summary.json, cross_check.json
    flows.bin_flows             -> partitions/<run_id>/flows_100ms.parquet
    links.link_bins_stage       -> partitions/<run_id>/link_bins.parquet
    dataset.window_features     -> partitions/<run_id>/windows.parquet
    dataset.summarize_run       -> partitions/<run_id>/run_summary.parquet
    dataset.export_dataset      -> phantora_v0/ (export.py: CSVs, runs.parquet, per-run Parquet, README.md card)
    dataset.dataset_duckdb_stage-> phantora.duckdb
    analysis.step_anatomy_stage -> partitions/<run_id>/{step_anatomy,step_spans}.parquet
    analysis.run_plots_stage    -> run folder plots/*.png
    analysis.dataset_plots_stage-> phantora_v0/plots/*.png
"""
