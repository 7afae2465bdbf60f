# Names vulture (the dead-code check of .ci/run, settings in pyproject.toml's [tool.vulture]) reports
# although they are used: by a framework, by a file format, or as a documented public name. Each
# entry says which. A name that is really dead is deleted, not listed here.
# ruff: noqa
_ = object()

# Dagster calls these on a ConfigurableClass / RunLauncher it loads from dagster.yaml
_.from_config_value  # instance/launcher.py, instance/sqlite.py
_.supports_check_run_worker_health  # instance/launcher.py
# SQLAlchemy calls the listener it registers (@db.event.listens_for)
_pragmas  # instance/sqlite.py
_owner  # instance/postgres.py
_same_process  # instance/postgres.py
_.dbapi_connection  # instance/postgres.py: SQLAlchemy's pool record, cleared for a forked child
# Python calls a module's __getattr__ for a missing name (instance/__init__.py: the PostgreSQL storages)
__getattr__
# dagster.yaml names it (storage: custom:); Dagster reads its storages and storage data
PooledPostgresStorage  # instance/postgres.py
_._run_storage  # instance/postgres.py: read by dagster_postgres's DagsterPostgresStorage.run_storage
_._event_log_storage  # instance/postgres.py: ... .event_log_storage
_._schedule_storage  # instance/postgres.py: ... .schedule_storage
_.event_storage_data  # instance/postgres.py: DagsterStorage's serialized storages
_.schedule_storage_data  # instance/postgres.py
_.run_storage_data  # instance/postgres.py
# protobuf and matplotlib attributes set for the library to read
_.syntax  # lib/chakra/schema.py: the FileDescriptorProto's proto3
_.oneof_index  # lib/chakra/schema.py: AttributeProto's oneof value
_.ignore_existing_data_limits  # lib/store/figures.py: matplotlib Axes
# fields of the records and file formats written and read whole (msgspec structs, dataclasses): a
# field no code reads by name is still part of the record
Communication  # lib/phantora/trace_decode.py: the JSON key of a Communication event's args
network_bytes_by_group  # records.py: TraceSummaryRecord's field of trace_summary.json (issue 26)
mem_bytes  # lib/sim/workload_types.py: an Item's memory traffic
compute_entries  # records.py
memcpy_entries  # records.py
compute_ms_per_step  # records.py
kernels_from_perf_db  # records.py
ranks_present  # records.py
n_network_flows  # records.py
compute_busy_us  # records.py
tolerance  # records.py
# documented public names
DECLINE_RULES  # lib/kineto/reader.py: the rules a KinetoDeclined names (docstrings point to it)
MAX_NSPINES  # lib/run/spec.py: the run matrix's limit, which lib/sim/network.py's TOPOLOGY_COUNTS repeats
DATASET_ASSETS  # definitions.py: the dataset assets of the code location
# pytest hooks and marks; fakes whose signatures are the Docker SDK's
pytest_addoption  # tests/conftest.py
pytest_collection_modifyitems  # tests/conftest.py
pytestmark  # tests/integration/test_real_kineto.py
detach  # tests/unit/lib/phantora/test_docker_runner.py
labels  # tests/unit/lib/phantora/test_docker_runner.py
# column contracts that document a table's columns for readers (lib/net: issue 27's NIC tables)
NIC_INPUT_COLUMNS  # lib/net/nics.py: the flows' columns nic_flows reads
NIC_FLOW_COLUMNS  # lib/net/reconfig.py: the columns of the NIC-level flows nic_phases reads
