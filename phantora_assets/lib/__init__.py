"""Domain code of phantora_assets: no Dagster import anywhere under this package.

Modules:
    errors          exception types (each names the file or entry and the rule broken)
    ring            Phantora's ring model: bytes per hop, flows of one collective
    chrome_trace    Phantora visualizer JSON (timeline.json.gz): writer and fast reader
    trace_decode    the reader's engine: streaming batches, typed msgspec decoding, helper process
    steps           steady-step detection from repeating collective sequences
    trace_checks    the four trace rules of DATASET.md section 3
    binning         the 180 s / 100 ms flows_100ms build (DATASET.md section 4)
    window_features detector features per 1 s and 15 s window
    anatomy         step anatomy: compute vs exposed communication per step and host
    database        the cross-run DuckDB database, rebuilt from per-run Parquet files
    plots           PNG plots of a run and of the dataset (matplotlib Agg)
    workloads       collectives each workload issues per step (presets.toml rules)
    analytic        the embedded analytic simulator
    io              atomic file writes
    run_folder      run folders of a Phantora dataset: discovery, the imports registry, merging
    run_log         run.log: per-iteration simulated time and peak memory
    cross_check     network bytes per steady step versus the workload model, by collective kind
    docker_config   compose.yaml, netconfig, hostfile and exact commands of a Phantora Docker run
    phantora_docker the Docker SDK launcher (container lifecycle, visualizer, concurrency slots)
"""
