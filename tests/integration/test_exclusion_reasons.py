"""Why a run is out of the dataset, in one wording wherever it is said (checks.exclusion_reason):
phantora_v0/run_status.csv, the database's run_status table and `phantora-assets runs`; and
`phantora-assets chakra` of a run that does not fit in GPU memory says so (a rebuild cannot help)."""

from __future__ import annotations

import duckdb
import pandas as pd
import pytest
from fixtures.builds import FITS, NOT_BUILT, OOM
from fixtures.memory import peak_gib

from phantora_assets.cli import main

OOM_REASON = (
    "fits_in_memory: failed, flows_exist: not evaluated, steps_match: not evaluated, ring_bytes_match: not evaluated, "
    "steady_steps_stable: not evaluated, steps_match_run_log: not evaluated, bins_conserve_bytes: not evaluated, "
    "windows_contract: not evaluated, runs_contract: not evaluated"
)


@pytest.fixture(scope="module")
def said(small_build) -> dict[str, dict[str, tuple[str, str]]]:
    """run_id -> (status, reason) as run_status.csv, the database and `runs` (its "built" column) say it."""
    csv = pd.read_csv(small_build / "phantora_v0" / "run_status.csv", keep_default_na=False)
    with duckdb.connect(str(small_build / "phantora.duckdb"), read_only=True) as con:
        db = con.execute("SELECT run_id, status, reason FROM run_status").fetchall()
    return {
        "csv": {r: (s, why) for r, s, why in csv.itertuples(index=False)},
        "database": {r: (s, why) for r, s, why in db},
    }


def _runs_column(data, capsys) -> dict[str, str]:
    assert main(["runs", "--data-dir", str(data)]) == 0
    header, *lines = capsys.readouterr().out.splitlines()
    at = header.index("built")
    return {line.split()[0]: line[at:] for line in lines}


@pytest.mark.parametrize(
    ("run_id", "status", "reason"),
    [(OOM, "excluded", OOM_REASON), (NOT_BUILT, "excluded", "not built"), (FITS, "included", "")],
    ids=["does not fit", "not built", "included"],
)
def test_each_place_gives_the_same_status_and_reason(said, small_build, capsys, run_id, status, reason):
    assert said["csv"][run_id] == said["database"][run_id] == (status, reason)
    assert _runs_column(small_build, capsys)[run_id] == (reason or "all checks passed")


def test_chakra_of_a_run_that_does_not_fit_says_so(small_build, tmp_path, capsys):
    assert main(["chakra", OOM, str(tmp_path / "et"), "--data-dir", str(small_build)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(
        f"chakra: {OOM}: does not fit: estimated peak {peak_gib(OOM)} GiB > card 40.00 GiB (fits_in_memory failed): "
        "a run that does not fit in GPU memory is not simulated, so it has no trace to export, "
        "and a rebuild gives the same"
    )
    assert "build --run" not in err and not (tmp_path / "et").exists()


def test_chakra_of_a_run_not_built_names_the_build(small_build, tmp_path, capsys):
    assert main(["chakra", NOT_BUILT, str(tmp_path / "et"), "--data-dir", str(small_build)]) == 2
    assert capsys.readouterr().err.endswith(f"phantora-assets build --run {NOT_BUILT}\n")
