"""Phantora's formats (docs/PHANTORA_FORMATS.md), no Dagster import.

chrome_trace    timeline.json(.gz) reader (read_trace, ParsedTrace) and the public face of the writer
trace_writer    write_chrome_trace: the visualizer's layout from a raw timeline
trace_batches   inflate (ISA-L) on a thread and cut the text into batches of whole events
trace_decode    code tables, the typed msgspec schema, BatchDecoder (+ the compiled _tracescan.c)
trace_helpers   forked helper processes that decode batches through shared memory
run_log         run.log: per-iteration simulated time and peak memory
perfdb          the perf DB of a GPU (compute.csv, memcpy.csv, manifest.md)
netconfig       netconfig.toml: build and parse
run_folder      run folders of a Phantora dataset: discovery (the registry is in imported_runs.py)
docker_config   compose.yaml, netconfig, hostfile and exact commands of a Phantora Docker run
docker_runner   the Docker SDK launcher (container lifecycle, visualizer, concurrency slots)
"""
