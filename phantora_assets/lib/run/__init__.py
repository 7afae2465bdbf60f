"""A run as data: one training configuration (a partition of the run matrix) and the names it may use.

* ``catalog``: the shipped tables a run names (``presets.toml``, ``gpus.toml``, the W1..W5
  workloads) and the ``[workloads.NAME]`` / ``[gpus.NAME]`` of the run-matrix file in use (which
  file that is, the application says: :func:`~phantora_assets.lib.run.catalog.use_matrix_file`);
* ``spec``: :class:`~phantora_assets.lib.run.spec.RunSpec` and the rules a run must meet
  (:func:`~phantora_assets.lib.run.spec.validate`, ``RunMatrixError`` naming the entry and the rule).

Reading and parsing a run-matrix file into partitions is the application's (``matrix.py``). No Dagster import.
"""
