"""An output is never removed before its replacement is in place (issue 39 item 13): each writer of
``lib/store/io`` killed (SIGKILL) before each of its file-system changes leaves its output whole,
the previous one or the new one (``tests/fixtures/kill_points.py``)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from fixtures.kill_points import every_kill_point

from phantora_assets.lib.store.io import (
    TEMP_NAME,
    remove_output,
    replace_dir,
    replacing_outputs,
    sweep_temp_files,
)
from phantora_assets.lib.store.parquet import write_parquet


def _tree(d: Path) -> dict[str, bytes] | None:
    if not d.exists():
        return None
    return {str(p.relative_to(d)): p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file()}


def _make(d: Path, files: dict[str, bytes]) -> None:
    shutil.rmtree(d, ignore_errors=True)
    for rel, data in files.items():
        (d / rel).parent.mkdir(parents=True, exist_ok=True)
        (d / rel).write_bytes(data)


OLD = {"a.csv": b"old a\n", "sub/b.csv": b"old b\n", "sub/c.csv": b"old c\n"}
NEW = {"a.csv": b"new a\n", "sub/b.csv": b"new b\n", "d.csv": b"new d\n"}


@pytest.mark.parametrize("exchange", [True, False], ids=["renameat2", "two-renames"])
def test_replace_dir_killed_anywhere_leaves_the_old_folder_or_the_new(tmp_path, exchange):
    src, dst = tmp_path / "src", tmp_path / "out" / "perfdb_missing"
    _make(src, NEW)
    _make(dst, OLD)
    seen = []

    def check(k: int) -> None:
        if not exchange:  # a kill between the two renames: the build's sweep puts the old one back
            sweep_temp_files(tmp_path / "out")
        got = _tree(dst)
        assert got in (OLD, NEW), (
            f"killed before change {k}: {dst} is {got}"
        )  # was: a partial folder (rmtree, then the rename)
        seen.append(got == NEW)
        sweep_temp_files(tmp_path / "out")
        assert [p.name for p in (tmp_path / "out").iterdir()] == ["perfdb_missing"]
        _make(dst, OLD)

    n = every_kill_point(lambda: replace_dir(src, dst), check, exchange=exchange)
    assert n >= 2 and seen[-1] and not seen[0]  # it ran to the end, and was killed before the swap too


def test_remove_output_killed_anywhere_leaves_the_folder_whole_or_gone(tmp_path):
    dst = tmp_path / "plots"
    _make(dst, OLD)

    def check(k: int) -> None:
        assert _tree(dst) in (OLD, None), f"killed before change {k}: a partial {dst}"
        sweep_temp_files(tmp_path)
        assert [p.name for p in tmp_path.iterdir()] in (["plots"], [])
        _make(dst, OLD)

    assert every_kill_point(lambda: remove_output(dst), check) >= 2


def test_replacing_outputs_removes_nothing_before_the_block_wrote(tmp_path):
    """A step of three tables, a rebuild of which writes two: killed anywhere, each table is the
    old file or the new one (the third one too until the step ended); after it, the third is gone."""
    import pandas as pd

    out = {n: tmp_path / f"{n}.parquet" for n in ("pairs", "phases", "sweep")}
    old = {n: pd.DataFrame({"x": [1, 2]}) for n in out}
    new = {n: pd.DataFrame({"x": [3, 4, 5]}) for n in ("pairs", "phases")}

    def reset() -> None:
        for n, df in old.items():
            write_parquet(df, out[n])

    reset()
    old_bytes = {n: p.read_bytes() for n, p in out.items()}

    def step() -> None:
        with replacing_outputs(out.values()) as written:
            for n, df in new.items():
                write_parquet(df, out[n])
                written.add(out[n])

    def check_end(k: int) -> None:
        if k:
            for n, p in out.items():
                assert p.exists(), f"killed before change {k}: {p.name} is gone"
                assert p.read_bytes() == old_bytes[n] or (n in new and pd.read_parquet(p).equals(new[n]))
        else:  # ran to its end: the table it did not write is removed, the others are new
            assert not out["sweep"].exists()
            assert all(pd.read_parquet(out[n]).equals(df) for n, df in new.items())
        sweep_temp_files(tmp_path)
        assert not [p for p in tmp_path.iterdir() if TEMP_NAME.match(p.name)]
        reset()

    assert every_kill_point(step, check_end) >= 3


def test_replacing_outputs_on_a_failure_removes_what_it_did_not_write_on_an_interrupt_nothing(tmp_path):
    a, b = tmp_path / "a.txt", tmp_path / "b.txt"
    for p in (a, b):
        p.write_text("old")
    with pytest.raises(ZeroDivisionError), replacing_outputs([a, b]) as written:
        a.write_text("new")
        written.add(a)
        1 / 0  # noqa: B018
    assert a.read_text() == "new" and not b.exists()  # nothing stale beside what the failed step wrote
    b.write_text("old")
    with pytest.raises(KeyboardInterrupt), replacing_outputs([a, b]):
        raise KeyboardInterrupt  # as a kill: every output stays
    assert a.read_text() == "new" and b.read_text() == "old"
    with pytest.raises(ValueError, match="not an output of this step"), replacing_outputs([a]) as written:
        written.add(b)
