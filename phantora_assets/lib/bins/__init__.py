"""The bin width of a run (``bin_s``): its rule, and what must stay exact at any width (no Dagster import)."""
