"""Simulation sources behind one interface (:class:`~phantora_assets.sources.base.Source`).

A new source is one module here (with ``NAME``, ``DESCRIPTION``, ``raw_timeline`` and
``chrome_trace``), one line in :data:`REGISTRY` and its name in ``lib/run/spec.SOURCES`` (the
``source = "..."`` names a run may give; the registry has exactly those, in that order). Modules
are imported when first used, so that reading the run matrix imports no simulator.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, cast

if TYPE_CHECKING:
    from phantora_assets.sources.base import Source

#: ``source`` name -> module implementing it.
REGISTRY: dict[str, str] = {
    "analytic": "phantora_assets.sources.analytic",  # the embedded analytic simulator (default)
    "docker": "phantora_assets.sources.phantora_docker",  # Phantora in Docker
    "import": "phantora_assets.sources.phantora_import",  # run folders of a Phantora dataset
    "kineto": "phantora_assets.sources.kineto",  # a folder of PyTorch profiler traces, one per rank
    "chakra": "phantora_assets.sources.chakra",  # a folder of Chakra execution traces, one per rank
}

#: The accepted ``source`` names, in registry order.
SOURCE_NAMES: tuple[str, ...] = tuple(REGISTRY)


def get_source(name: str) -> Source:
    """The source module registered as ``name``.

    Raises:
        KeyError: ``name`` is not in :data:`REGISTRY` (the run matrix refuses such entries first).
    """
    if name not in REGISTRY:
        raise KeyError(f"unknown source {name!r} (known: {', '.join(SOURCE_NAMES)})")
    return cast("Source", importlib.import_module(REGISTRY[name]))
