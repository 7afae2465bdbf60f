"""Shared fixtures: one real build of the whole dataset per test session."""

from __future__ import annotations

import csv
from pathlib import Path

import pytest

DATA = Path(__file__).parent / "data"


def pytest_addoption(parser):
    parser.addoption("--run-docker", action="store_true", default=False,
                     help="run tests that need a Docker engine and the Phantora image")


def pytest_collection_modifyitems(config, items):
    if config.getoption("--run-docker"):
        return
    skip = pytest.mark.skip(reason="needs a Docker engine and the Phantora image; opt in with --run-docker")
    for item in items:
        if "docker" in item.keywords:
            item.add_marker(skip)


def published_rows() -> list[dict[str, str]]:
    """Rows of tests/data/published_runs.csv (a copy of the published phantora_v0 figures)."""
    with open(DATA / "published_runs.csv", newline="") as fh:
        return list(csv.DictReader(fh))


@pytest.fixture(scope="session")
def built(tmp_path_factory) -> Path:
    """Data root of a full `phantora-assets build` (every run, every asset and check)."""
    from phantora_assets.cli import main

    root = tmp_path_factory.mktemp("build1") / "data"
    rc = main(["build", "--data-dir", str(root), "--quiet"])
    assert rc == 0, "phantora-assets build failed"
    return root
