"""Workloads as data: the schema of a training job and the framework rules that turn it into steps.

* ``spec``: the ``[workloads.NAME]`` schema (model / parallel / train), parsed and validated;
  ``gpus``: the ``[gpus.NAME]`` tables;
* ``pipeline``: pipeline schedules (GPipe, 1F1B, interleaved) and micro-batches in flight;
* ``megatron``, ``torchtitan``: the step programs of those frameworks (DeepSpeed's are in
  ``lib/sim/workloads.py``, with the dispatch);
* ``dag``: the simulator's DAG of a run's stage programs;
* ``collectives``: the per-step collectives per communicator (docs/WORKLOADS.md "Python API").

Imports: ``spec``/``gpus``/``pipeline`` import no simulator module; ``megatron``/``torchtitan``
import ``lib/sim`` (torch ops, layout, item types); ``lib/sim/workloads`` imports them. No Dagster.
"""
