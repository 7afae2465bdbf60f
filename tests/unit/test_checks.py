"""The check registry (``checks.CHECKS``) is the one list: the Dagster specs, the run folder's
record and the README table all come from it."""

from __future__ import annotations

import re

from fixtures.paths import ROOT

from phantora_assets import checks
from phantora_assets import definitions as d

OUTPUTS_DOC = ROOT / "docs" / "OUTPUTS.md"


def test_outputs_doc_table_is_the_registry():
    text = OUTPUTS_DOC.read_text()
    m = re.search(r"<!-- checks:start -->\n(.*?)<!-- checks:end -->", text, re.S)
    assert m, "docs/OUTPUTS.md has no generated checks table"
    assert m.group(1) == checks.markdown_table()


def test_dagster_specs_match_the_registry():
    graph = d.defs().resolve_asset_graph()
    specs = {(k.asset_key.to_user_string(), k.name) for k in graph.asset_check_keys}
    assert specs == {(c.asset, c.name) for c in checks.CHECKS}
    for a in d.ALL_ASSETS:
        for spec in a.check_specs:
            c = checks.BY_NAME[spec.name]
            assert spec.blocking == c.blocking, spec.name
            assert spec.description == c.description


def test_gating_and_advisory_lists():
    assert list(checks.RUN_CHECKS) == [
        "fits_in_memory",
        "perfdb_complete",
        "flows_exist",
        "steps_match",
        "ring_bytes_match",
        "steady_steps_stable",
        "steps_match_run_log",
        "bins_conserve_bytes",
        "windows_contract",
        "runs_contract",
    ]
    assert checks.ADVISORY_CHECKS == {"matches_workload_model": "validated_flows"}
    assert set(checks.TRACE_CHECKS) == {c.name for c in checks.checks_of("validated_flows") if c.gates_dataset}
    # every gating check blocks but fits_in_memory: a run that does not fit is an outcome (WARN), and its
    # assets from chrome_trace on are skipped as not applicable (tests/integration/test_honest_outcomes.py)
    assert [c.name for c in checks.CHECKS if c.gates_dataset and not c.blocking] == ["fits_in_memory"]
    assert checks.BY_NAME["fits_in_memory"].severity == "warn"


def test_record_orders_and_words(tmp_path):
    checks.reset_checks(tmp_path, "validated_flows")
    checks.record_check(tmp_path, "validated_flows", "matches_workload_model", False, "off by 3 %", warn=True)
    checks.record_check(tmp_path, "raw_timeline", "fits_in_memory", True, "fits")
    data = checks.read_checks(tmp_path)
    assert list(data)[:1] == ["fits_in_memory"]
    assert data["matches_workload_model"]["status"] == "warning"
    assert data["flows_exist"]["status"] == checks.NOT_EVALUATED
    assert checks.blocking_failures(tmp_path).keys() == set(checks.RUN_CHECKS) - {"fits_in_memory"}
    txt = (tmp_path / "checks.txt").read_text().splitlines()
    assert txt[2] == "[PASSED] fits_in_memory (raw_timeline): fits"
    assert "[WARNING] matches_workload_model (validated_flows): off by 3 %" in txt
