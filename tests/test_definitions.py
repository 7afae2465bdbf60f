"""The code location: asset and check keys, workspace loading, domain code free of Dagster."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
EXPECTED = Path(__file__).parent / "data" / "asset_keys.txt"


def current_keys() -> list[str]:
    from phantora_assets.definitions import defs

    graph = defs.resolve_asset_graph()
    keys = [f"asset {k.to_user_string()}" for k in graph.get_all_asset_keys()]
    keys += [f"check {c.asset_key.to_user_string()}:{c.name}" for c in graph.asset_check_keys]
    return sorted(keys)


def test_asset_and_check_keys_match_checked_in_list():
    assert current_keys() == EXPECTED.read_text().split("\n")[:-1]


def test_domain_code_imports_without_dagster():
    code = (
        "import sys\n"
        "import phantora_assets.runs, phantora_assets.pipeline, phantora_assets.paths, phantora_assets.analysis\n"
        "from phantora_assets.lib import analytic, binning, chrome_trace, steps, trace_checks, window_features, "
        "workloads, memory, perfdb, ring, netconfig, run_folder, run_log, docker_config, phantora_docker, "
        "cross_check, anatomy, database, plots\n"
        "assert 'dagster' not in sys.modules, sorted(m for m in sys.modules if m.startswith('dagster'))\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)


def test_workspace_loads_with_dagster_cli():
    out = subprocess.run(
        [sys.executable, "-m", "dagster", "definitions", "validate", "-w", str(ROOT / "workspace.yaml")],
        capture_output=True, text=True, cwd=ROOT,
    )
    assert out.returncode == 0, out.stdout + out.stderr
