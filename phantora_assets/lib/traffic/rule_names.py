"""The names of the trace rules of ``trace_checks`` (docs/DATASET.md, "How a trace becomes the
dataset", step 3), one constant each: the check names of validated_flows in Dagster and the keys
of a run folder's ``checks.json`` (``phantora_assets.checks`` registers them). No import, so that
the check registry names them without importing numpy or pandas."""

FLOWS_EXIST = "flows_exist"
STEPS_MATCH = "steps_match"
RING_BYTES_MATCH = "ring_bytes_match"
STEADY_STEPS_STABLE = "steady_steps_stable"
STEPS_MATCH_RUN_LOG = "steps_match_run_log"
