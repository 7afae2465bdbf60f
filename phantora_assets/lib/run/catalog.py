"""The names a run may use: the shipped tables and those of the run-matrix file in use.

* :func:`presets`, :func:`shipped_gpu_specs`, :func:`shipped_workloads`: the package's
  ``presets.toml`` (common settings, ``[cluster]``, the W1..W5 workloads) and ``gpus.toml``, read
  once per process;
* :func:`workload_specs`, :func:`gpu_specs`: those and the ``[workloads.NAME]`` / ``[gpus.NAME]``
  tables of the run-matrix file in use (:func:`~phantora_assets.lib.workload.tables.tables_of_file`,
  parsed once per state of the file).

Which run-matrix file is in use is the application's to say (``matrix.py`` reads
``$PHANTORA_ASSETS_RUN_MATRIX``): it hands a function returning that file's path (None: the shipped
matrix, which has no tables of its own) to :func:`use_matrix_file`. Until it does, the names are the
shipped ones. No Dagster import.
"""

from __future__ import annotations

import tomllib
from collections.abc import Callable
from functools import cache
from importlib import resources
from pathlib import Path
from typing import Any

from phantora_assets.lib.workload import tables
from phantora_assets.lib.workload.spec import WorkloadSpec, parse_workloads


def package_toml(name: str) -> dict[str, Any]:
    """The TOML file ``name`` shipped in the ``phantora_assets`` package, parsed."""
    return tomllib.loads(resources.files("phantora_assets").joinpath(name).read_text())


@cache
def presets() -> dict[str, Any]:
    """``presets.toml``: common settings, GPUs, cluster and the W1..W5 workloads."""
    return package_toml("presets.toml")


@cache
def shipped_gpu_specs() -> dict[str, dict[str, Any]]:
    """``gpus.toml``: one dict per GPU key (memory_gb, peak_bf16_flops, mem_bw_bytes_per_s, ...)."""
    return package_toml("gpus.toml")


@cache
def shipped_workloads() -> dict[str, WorkloadSpec]:
    """The shipped workloads W1..W5 (``presets.toml [workloads.*]``, the same schema as a user's)."""
    return parse_workloads(presets()["workloads"], "presets.toml")


def _no_matrix_file() -> Path | None:
    return None


_matrix_file: list[Callable[[], Path | None]] = [_no_matrix_file]


def use_matrix_file(locate: Callable[[], Path | None]) -> None:
    """Take the run-matrix file in use from ``locate()`` (called at each look-up; None: the shipped one)."""
    _matrix_file[0] = locate


def _file_tables() -> tuple[dict[str, WorkloadSpec], dict[str, dict[str, Any]]]:
    return tables.tables_of_file(_matrix_file[0](), shipped_workloads(), shipped_gpu_specs())


def gpu_specs() -> dict[str, dict[str, Any]]:
    """The GPUs a run may name: ``gpus.toml``'s and the ``[gpus.NAME]`` tables of the run-matrix
    file in use (:func:`use_matrix_file`; :func:`~phantora_assets.lib.workload.tables.parse_gpu`)."""
    extra = _file_tables()[1]
    return {**shipped_gpu_specs(), **extra} if extra else shipped_gpu_specs()


def workload_specs() -> dict[str, WorkloadSpec]:
    """The workloads a run may name: the shipped ones and the run-matrix file's ``[workloads.NAME]``."""
    extra = _file_tables()[0]
    return {**shipped_workloads(), **extra} if extra else shipped_workloads()
