"""A PyTorch profiler process group must list each rank once, all inside the world: a group that
lists a rank twice (``"[0, 0, 1]"``) or a rank >= the world size is refused when the trace is read
(``phantora-assets import`` and the ``raw_timeline`` stage of a registered folder, before
``chrome_trace``), naming the file, the group and the rule ``process group`` (the Chakra import
refuses the same groups, rule ``comm groups``)."""

from __future__ import annotations

import pytest
from fixtures.kineto_traces import Coll, rank_trace, write_traces
from fixtures.materialize import materialize_run

from phantora_assets.cli import main
from phantora_assets.imported_runs import read_registry
from phantora_assets.lib.errors import TraceFormatError
from phantora_assets.lib.kineto.reader import read_rank_trace
from phantora_assets.paths import DataPaths


def _one(tmp_path, group, world=4, **kw):
    coll = Coll("allreduce", 1000, 1000, "BFloat16", group, **kw)
    folder = write_traces(tmp_path / "job", {0: rank_trace(0, world, [coll])})
    return next(folder.iterdir())


@pytest.mark.parametrize(
    ("group", "why"),
    [
        ((0, 0, 1), "lists rank 0 twice"),
        ((0, 1, 1, 2), "lists rank 1 twice"),
        ((0, 1, 5), "lists rank 5, outside the world of 4 ranks (0..3)"),
    ],
)
def test_a_group_with_a_rank_twice_or_outside_the_world_is_refused(tmp_path, group, why):
    path = _one(tmp_path, group)
    with pytest.raises(TraceFormatError) as exc:
        read_rank_trace(path)
    e = exc.value
    assert e.rule == "process group" and e.path == str(path)
    assert f"Process Group Ranks {list(group)} of group '0'" in str(e) and why in str(e)


def test_the_pg_config_and_stride_forms_are_held_to_the_same_rule(tmp_path):
    # Process Group Ranks truncated: the ranks come from distributedInfo.pg_config (a duplicate there)
    coll = Coll("allreduce", 8, 8, "Float", (0, 1, 2), extra={"Process Group Ranks": "[0, 1, ...]"})
    t = rank_trace(0, 4, [coll])
    t["distributedInfo"]["pg_config"] = [{"pg_name": "0", "pg_size": 3, "ranks": [0, 1, 1]}]
    folder = write_traces(tmp_path / "a", {0: t})
    with pytest.raises(TraceFormatError, match=r"process group .*lists rank 1 twice"):
        read_rank_trace(next(folder.iterdir()))
    # no ranks at all: start 0, stride 3, size 3 -> ranks 0, 3, 6 in a world of 4
    extra = {"Process Group Ranks": None, "Global rank start": 0, "Global rank stride": 3}
    coll = Coll("allreduce", 8, 8, "Float", (0, 1, 2), extra=extra)
    folder = write_traces(tmp_path / "b", {0: rank_trace(0, 4, [coll])})
    with pytest.raises(TraceFormatError, match=r"process group .*lists rank 6, outside the world of 4 ranks"):
        read_rank_trace(next(folder.iterdir()))


def test_a_good_group_still_reads(tmp_path):
    rt = read_rank_trace(_one(tmp_path, (0, 1, 2, 3)))
    assert [c.group for c in rt.collectives] == [(0, 1, 2, 3)] * 4


def test_import_refuses_the_folder_and_registers_nothing(tmp_path, capsys):
    path = _one(tmp_path, (0, 0, 1))
    data = tmp_path / "data"
    assert main(["import", str(tmp_path / "job"), "--data-dir", str(data), "--no-build"]) == 2
    err = capsys.readouterr().err
    assert f"{path}: process group" in err and "[0, 0, 1]" in err and "twice" in err
    assert read_registry(data) == []


def test_a_registered_folder_whose_group_turns_bad_fails_before_chrome_trace(tmp_path):
    path = _one(tmp_path, (0, 1, 2, 3))
    data = tmp_path / "data"
    assert main(["import", str(tmp_path / "job"), "--data-dir", str(data), "--no-build"]) == 0
    (spec,) = read_registry(data)
    bad = rank_trace(0, 4, [Coll("allreduce", 1000, 1000, "BFloat16", (0, 1, 2, 7))])
    path.unlink()
    write_traces(tmp_path / "job", {0: bad})
    res = materialize_run(data, spec.run_id)
    assert not res.success
    errors = [e.event_specific_data.error for e in res.all_events if e.event_type_value == "STEP_FAILURE"]
    assert len(errors) == 1
    text = errors[0].message if errors[0].cause is None else errors[0].cause.message
    assert "process group" in text and "[0, 1, 2, 7]" in text and "outside the world of 4 ranks" in text
    assert not DataPaths(data).chrome_trace(spec).exists()
