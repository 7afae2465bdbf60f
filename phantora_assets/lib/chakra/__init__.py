"""Chakra execution traces (MLCommons' ET, the input of ASTRA-sim): read and write them with this
project's own description of Chakra's schema (``schema``) and framing (``et_io``), a built run's
Chrome trace as one ET per rank (``export``, with the per-rank Computation events of ``compute``),
and a folder of ETs as one run's raw timeline (``ingest``). No Dagster import."""
