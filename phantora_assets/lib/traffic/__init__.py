"""Traffic rules: steps, ring rules, trace checks, binning, windows, anatomy, workload cross-check."""
