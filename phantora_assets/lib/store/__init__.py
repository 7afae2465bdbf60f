"""Storage, no Dagster import.

io        atomic (and optionally durable) file writes, copies, the sweep of stale temp files
database  the cross-run DuckDB database, rebuilt from per-run Parquet files; its views
plots     PNG plots of a run and of the dataset (matplotlib Agg)
"""
