"""Per-link traffic on the run's leaf-spine network, no Dagster import.

routes     the directed links of a TwoLayerMultiPath topology and each flow's path over them (ECMP)
link_bins  bytes per (directed link, bin) of the 180 s window, and its conservation per link class
"""
