"""Storage: atomic files, the DuckDB database, plots."""
