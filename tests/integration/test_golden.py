"""Golden guard: the build of the shipped matrix is byte-identical to the checked-in manifest.

``tests/data/golden_manifest.sha256`` holds the sha256 of the published tables
(``phantora_v0/{runs,flows_100ms,windows,run_status}.csv``) and of every run's
``timeline.json.gz``, as produced by the build at a86f02d (before the layout change), and of every
sidecar record (``partitions/*/*.json``, ``perfdb/*/perf_db.json``; its header says why those
differ from a86f02d's). A change that alters any of them on purpose updates the manifest in the
same commit and says why.
"""

from __future__ import annotations

import hashlib

import pytest
from fixtures.paths import DATA

MANIFEST = DATA / "golden_manifest.sha256"


def _manifest() -> dict[str, str]:
    out: dict[str, str] = {}
    for line in MANIFEST.read_text().splitlines():
        if line.startswith("#") or not line.strip():
            continue
        digest, rel = line.split(maxsplit=1)
        out[rel] = digest
    return out


EXPECTED = _manifest()


def test_manifest_covers_every_trace_table_and_record(built):
    traces = {str(p.relative_to(built)) for p in (built / "traces").rglob("timeline.json.gz")}
    assert traces == {k for k in EXPECTED if k.startswith("traces/")}
    assert len(traces) == 26
    records = {str(p.relative_to(built)) for d in ("partitions", "perfdb") for p in (built / d).rglob("*.json")}
    assert records == {k for k in EXPECTED if k.startswith(("partitions/", "perfdb/"))}
    assert len(records) == 136


@pytest.mark.parametrize("rel", sorted(EXPECTED))
def test_file_matches_golden_sha256(built, rel):
    got = hashlib.sha256((built / rel).read_bytes()).hexdigest()
    assert got == EXPECTED[rel], f"{rel} differs from the golden build (tests/data/golden_manifest.sha256)"
