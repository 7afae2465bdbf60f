"""PyTorch profiler (Kineto) traces: decode one file per rank in batches (``stream``), keep its
collectives, kernels and steps (``reader``), turn the collectives into Phantora's ring flows and a
raw timeline (``collectives``), and a folder of rank traces into one run (``run``). No Dagster import."""
