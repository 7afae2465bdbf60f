"""Traffic rules (docs/DATASET.md, "How a trace becomes the dataset"), no Dagster import.

ring            Phantora's ring model: bytes per hop, flows of one collective
steps/          steady-step detection from repeating collective sequences (the rules, the entry point;
                its cut, coarse and verify modules)
trace_checks    the four trace rules (step 3)
binning         the 180 s / 100 ms flows_100ms build and its conservation (steps 4-5)
window_features detector features per 1 s and 15 s window (the feature registry)
periodicity     dominant period, spectral peak and aliasing of a bin series
anatomy         step anatomy: compute vs exposed communication per step and host
cross_check     network bytes per steady step versus the workload model, by collective kind
"""
