"""Every registered source implements the interface (sources/base.py), under its registry name."""

from __future__ import annotations

import inspect

import pytest

from phantora_assets import contracts
from phantora_assets.lib.run.spec import SOURCES
from phantora_assets.sources import REGISTRY, SOURCE_NAMES, get_source


@pytest.mark.parametrize("name", SOURCE_NAMES)
def test_registered_module_implements_the_source_interface(name):
    src = get_source(name)
    assert src.NAME == name
    assert isinstance(src.DESCRIPTION, str) and src.DESCRIPTION
    assert src.DATASET_SOURCE in ("phantora_v0", "phantora_analytic", "kineto", "chakra")
    assert isinstance(src.ROOFLINE_TIMING, bool)
    for fn in ("raw_timeline", "chrome_trace"):
        params = list(inspect.signature(getattr(src, fn)).parameters)
        assert params == ["spec", "paths", "ctx"], (name, fn, params)


def test_unknown_source_is_refused_by_name():
    with pytest.raises(KeyError, match="unknown source 'bogus'"):
        get_source("bogus")


def test_runs_contract_accepts_exactly_the_registered_sources():
    check = next(c for c in contracts.RUNS.columns["simulator"].checks)
    assert sorted(check.statistics["allowed_values"]) == sorted(REGISTRY)


def test_registry_has_exactly_the_source_names_a_run_may_give():
    assert SOURCE_NAMES == SOURCES == ("analytic", "docker", "import", "kineto", "chakra")
