"""Traffic rules (docs/DATASET.md, "How a trace becomes the dataset"), no Dagster import.

ring            Phantora's ring model: bytes per hop, flows of one collective
steps           steady-step detection from repeating collective sequences (the rules, the entry point)
step_cut        its primitive-period cut (periods of each sequence, anchors, by-time sequences)
step_coarse     its fallback when every communicator repeats its pattern within a step
trace_checks    the four trace rules (step 3)
binning         the 180 s / 100 ms flows_100ms build and its conservation (steps 4-5)
window_features detector features per 1 s and 15 s window (the feature registry)
periodicity     dominant period, spectral peak and aliasing of a bin series
anatomy         step anatomy: compute vs exposed communication per step and host
cross_check     network bytes per steady step versus the workload model, by collective kind
"""
