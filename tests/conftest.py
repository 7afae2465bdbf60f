"""Shared fixtures (one real build of the whole dataset per test session), the hypothesis profiles and
the opt-in Docker marker. Builders and helpers shared by test files are in tests/fixtures/."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from fixtures.builds import small_build  # noqa: F401  (a session fixture: one small real build)
from hypothesis import settings

# Property tests: CI (and a plain `pytest`) run the "ci" profile: derandomized, no example
# database, so a run is the same on every machine and a failure cannot stick to one checkout.
# Every example hypothesis ever found failing is pinned with @example on its test. "random"
# explores (new examples every run, e.g. `--hypothesis-seed=N`); "soak" explores 20x longer:
# `HYPOTHESIS_PROFILE=soak python benchmarks/soak_properties.py` (README: Tests).
settings.register_profile("ci", derandomize=True, database=None, print_blob=True, deadline=None)
settings.register_profile("random", derandomize=False, database=None, print_blob=True, deadline=None)
settings.register_profile("soak", derandomize=False, database=None, print_blob=True, deadline=None, max_examples=2000)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


def pytest_addoption(parser):
    parser.addoption(
        "--run-docker",
        action="store_true",
        default=False,
        help="run tests that need a Docker engine and the Phantora image",
    )


TESTS = Path(__file__).resolve().parent
# the folders whose every test is `slow`: real Dagster runs and builds, real processes (daemons, the
# webserver, PostgreSQL); `pytest -m "not slow"` (the quick loop) runs tests/unit/ and tests/properties/
SLOW_FOLDERS = ("integration", "system")


def pytest_collection_modifyitems(config, items):
    for item in items:
        if Path(item.path).resolve().relative_to(TESTS).parts[0] in SLOW_FOLDERS:
            item.add_marker(pytest.mark.slow)
    if config.getoption("--run-docker"):
        return
    skip = pytest.mark.skip(reason="needs a Docker engine and the Phantora image; opt in with --run-docker")
    for item in items:
        if item.get_closest_marker("docker") is not None:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def built(tmp_path_factory) -> Path:
    """Data root of a full `phantora-assets build` (every run, every asset and check)."""
    from phantora_assets.cli import main

    root = tmp_path_factory.mktemp("build1") / "data"
    rc = main(["build", "--data-dir", str(root), "--quiet"])
    assert rc == 0, "phantora-assets build failed"
    return root
