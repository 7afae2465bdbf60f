"""The embedded analytic simulator. Imports run one way (no cycles, no function-level imports):

* ``analytic`` (DAG and event loop) -> ``timeline`` (result, raw-timeline assembly), ``keys``
  (seeds, communicator ids, perf-DB key helpers), ``network`` (flow-level network), ``memory``
  (peak memory of a layout), ``kernels`` (perf-DB keys and kernel times) and ``workloads``;
* ``workloads`` (step programs) -> ``torch_ops`` (torch-call lists of the layers) ->
  ``optimizer_ops`` (gradient and optimizer calls) -> ``workload_layout`` (dimensions, parameters,
  communicators, buckets) -> ``workload_types`` (data types, constants).
"""
