"""The embedded analytic simulator: workloads, torch ops, kernels, memory, network."""
