"""Issue 13, finding 3: importing a run folder never reaches outside it.

Every file and directory the import takes (run.log, timeline.bin, timeline.json(.gz), config/ and
everything under it, perfdb_missing/) must be a regular file or a directory itself: a symlink is
refused (not followed, not resolved, even when it points inside the folder), and so is a FIFO. The
run folders are real (tests/fixtures/run_folders.py), the links are real symlinks in tmp_path pointing at
files of another tmp directory with known content, and the partition is really materialized
(``register``, ``assets_for(effective_matrix(...))``, ``dg.materialize``, as tests/integration/test_import.py
does). Before the fix the linked file was copied into the data root (a ``config`` linked to a
directory copied all of it), a FIFO in ``config/`` crashed with a raw ``shutil.Error``, and a
failed copy left ``.config.tmp/`` behind.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import dagster as dg
import pytest
from fixtures.materialize import materialize_run
from fixtures.run_folders import analytic, megatron_log, write_run_folder

from phantora_assets.cli import main
from phantora_assets.imported_runs import register
from phantora_assets.lib.errors import FileRuleError
from phantora_assets.lib.phantora.run_folder import discover
from phantora_assets.paths import DataPaths
from phantora_assets.sources import phantora_import

W1 = "phantora_a100_40g_W1_2x2"
SECRET = b"SECRET: outside the run folder, must never be copied 7f3a9c\n"
LINK = "symlink in run folder"


@pytest.fixture
def outside(tmp_path) -> Path:
    """Another directory, with known content: a file, a subdirectory, a netconfig and a trace."""
    out = tmp_path / "outside"
    (out / "sub").mkdir(parents=True)
    (out / "secret.txt").write_bytes(SECRET)
    (out / "sub" / "deep.txt").write_bytes(SECRET)
    (out / "netconfig.toml").write_bytes(b'# SECRET 7f3a9c\nhost_mapping = ["host-1", "host-2", "host-3"]\n')
    spec, raw, _ = analytic(W1)
    write_run_folder(out / "other", spec, raw.iloc[::-1], run_log=None, timeline_bin=False, netconfig=False)
    return out


@pytest.fixture
def folder(tmp_path) -> Path:
    spec, raw, its = analytic(W1)
    f = write_run_folder(tmp_path / "src", spec, raw, run_log=megatron_log(its, 4, 16000.0))
    (f / "config" / "sub").mkdir()
    (f / "config" / "sub" / "hostfile").write_text("host-1 slots=2\nhost-2 slots=2\n")
    (f / "perfdb_missing").mkdir()
    (f / "perfdb_missing" / "compute.csv").write_text("")  # nothing missing: perfdb_complete passes
    return f


def _link(path: Path, target: Path) -> Path:
    """Replace ``path`` (file or directory) with a symlink to ``target``; returns ``path``."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    else:
        path.unlink(missing_ok=True)
    path.symlink_to(target)
    return path


def _other_trace(outside: Path) -> Path:
    return outside / "other" / "traces" / "a100_40g" / "W1_2x2" / "timeline.json.gz"


# each case edits the run folder after registration and returns (offending entry, rule)
CASES = {
    "run.log -> outside file": lambda f, o: (_link(f / "run.log", o / "secret.txt"), LINK),
    "timeline.bin -> outside file": lambda f, o: (_link(f / "timeline.bin", o / "secret.txt"), LINK),
    "timeline.json.gz -> outside trace": lambda f, o: (_link(f / "timeline.json.gz", _other_trace(o)), LINK),
    "config -> outside directory": lambda f, o: (_link(f / "config", o), LINK),
    "config/sub/file -> outside file": lambda f, o: (_link(f / "config" / "sub" / "leak.txt", o / "secret.txt"), LINK),
    "config/dir -> outside directory": lambda f, o: (_link(f / "config" / "sub" / "linked", o / "sub"), LINK),
    "config/netconfig.toml -> outside": lambda f, o: (
        _link(f / "config" / "netconfig.toml", o / "netconfig.toml"),
        LINK,
    ),
    "config/file -> inside (relative)": lambda f, o: (_link(f / "config" / "run.log", Path("../run.log")), LINK),
    "config/fifo": lambda f, o: (os.mkfifo(f / "config" / "pipe") or f / "config" / "pipe", "not a regular file"),
    "perfdb_missing -> outside directory": lambda f, o: (_link(f / "perfdb_missing", o / "sub"), LINK),
}


def _materialize(data: Path) -> dg.ExecuteInProcessResult:
    return materialize_run(data, W1)


def _assert_nothing_reached_outside(data: Path, outside: Path) -> None:
    """No byte of the outside directory is in the data root, and no temporary entry is left."""
    other = _other_trace(outside).read_bytes()
    for p in data.rglob("*"):
        assert not p.name.endswith(".tmp"), f"left behind: {p}"
        # the one link the data root holds by design is the dataset's generation link
        # (phantora_v0 -> .phantora_v0.gens/g<ns>, docs/DATASET_STORAGE.md): it must stay inside the root
        if p.is_symlink():
            assert p.resolve().is_relative_to(data.resolve()), f"a link out of the data root: {p}"
            assert p.name == "phantora_v0", f"a link in the data root: {p}"
            continue
        if p.is_file():
            content = p.read_bytes()
            assert b"7f3a9c" not in content and content != other, f"outside content copied into {p}"


@pytest.mark.parametrize("case", list(CASES))
def test_a_link_fails_the_partition_naming_the_file_and_nothing_is_copied(case, tmp_path, folder, outside):
    data = tmp_path / "data"
    spec = discover(folder)[0][0].spec
    register(data, [spec])
    bad, rule = CASES[case](folder, outside)
    res = _materialize(data)
    assert not res.success
    failure = next(e for e in res.all_events if e.is_step_failure)
    assert failure.step_key == "raw_timeline"  # refused before anything is copied
    error = failure.event_specific_data.error.to_string()
    assert f"FileRuleError: {bad}: {rule} (" in error, error
    if rule == LINK:
        assert f"it links to {os.readlink(bad)}" in error
    run = DataPaths(data).run_folder(spec)
    for name in ("run.log", "timeline.bin", "timeline.json.gz", "config", "perfdb_missing", "import.json"):
        assert not (run / name).exists(), name  # nothing was copied, not even the regular files
    _assert_nothing_reached_outside(data, outside)


def test_a_refused_reimport_keeps_the_earlier_copy_and_leaves_no_temp_dir(tmp_path, folder, outside):
    data = tmp_path / "data"
    spec = discover(folder)[0][0].spec
    paths = DataPaths(data)
    phantora_import.import_run_folder(spec, paths)
    run = paths.run_folder(spec)
    before = {p.relative_to(run): p.read_bytes() for p in (run / "config").rglob("*") if p.is_file()}
    assert len(before) == 3  # netconfig.toml, command.txt, sub/hostfile
    _link(folder / "config" / "sub" / "leak.txt", outside / "secret.txt")
    with pytest.raises(FileRuleError) as ei:
        phantora_import.import_run_folder(spec, paths)
    assert ei.value.path == str(folder / "config" / "sub" / "leak.txt") and ei.value.rule == LINK
    assert {p.relative_to(run): p.read_bytes() for p in (run / "config").rglob("*") if p.is_file()} == before
    _assert_nothing_reached_outside(data, outside)


@pytest.mark.parametrize(
    "case",
    [
        "run.log -> outside file",
        "timeline.bin -> outside file",
        "config -> outside directory",
        "config/sub/file -> outside file",
        "config/dir -> outside directory",
        "config/fifo",
    ],
)
def test_the_copy_itself_refuses_a_link_swapped_in_after_the_check(case, tmp_path, folder, outside, monkeypatch):
    """The check before copying is not the only guard: the copies open every entry relative to
    its directory without following a link (a link made between the check and the copy)."""
    spec = discover(folder)[0][0].spec
    bad, rule = CASES[case](folder, outside)
    monkeypatch.setattr(phantora_import, "refuse_links", lambda *a, **k: None)  # as if raced past the check
    with pytest.raises(FileRuleError) as ei:
        phantora_import.import_run_folder(spec, DataPaths(tmp_path / "data"))
    assert ei.value.path == str(bad) and ei.value.rule == rule, str(ei.value)
    _assert_nothing_reached_outside(tmp_path / "data", outside)


def test_the_trace_copy_refuses_a_link_swapped_in_after_the_check(tmp_path, folder, outside, monkeypatch):
    spec = discover(folder)[0][0].spec
    bad, _ = CASES["timeline.json.gz -> outside trace"](folder, outside)
    monkeypatch.setattr(phantora_import, "refuse_links", lambda *a, **k: None)
    with pytest.raises(FileRuleError) as ei:
        phantora_import.import_trace(spec, DataPaths(tmp_path / "data"))
    assert ei.value.path == str(bad) and ei.value.rule == LINK
    assert not DataPaths(tmp_path / "data").chrome_trace(spec).exists()
    _assert_nothing_reached_outside(tmp_path / "data", outside)


def test_discovery_does_not_read_a_linked_netconfig(folder, outside):
    """The linked netconfig maps 3 hosts: read, it would skip the 2-host folder."""
    _link(folder / "config" / "netconfig.toml", outside / "netconfig.toml")
    found, skipped = discover(folder)
    assert [f.spec.run_id for f in found] == [W1] and skipped == []
    assert found[0].spec.topology == ()


def test_cli_import_of_a_config_linked_to_a_directory_names_the_file_and_rule(tmp_path, folder, outside, capsys):
    """The issue's ``config -> /etc``: refused at once, nothing copied, no .config.tmp/."""
    _link(folder / "config", outside)
    data = tmp_path / "data"
    assert main(["import", str(folder), "--data-dir", str(data)]) == 1
    line = next(ln for ln in capsys.readouterr().out.splitlines() if ln.startswith(W1))
    assert "FAILED: raw_timeline: " in line and f"{folder / 'config'}: {LINK} (it links to " in line, line
    _assert_nothing_reached_outside(data, outside)


def test_a_netconfig_that_is_not_toml_is_refused_not_read_as_the_matrix_network(folder):
    """was: an unparseable ``config/netconfig.toml`` gave no topology overrides, so the run was built
    and exported with the matrix's network (its ``nic_bw`` a guess), every check passing."""
    nc = folder / "config" / "netconfig.toml"
    nc.write_text(nc.read_text() + "\n[simulator\n")  # one broken table header
    found, skipped = discover(folder)
    assert found == [] and len(skipped) == 1
    assert skipped[0].reason.startswith("config/netconfig.toml is not readable TOML (")


@pytest.mark.parametrize(
    ("entry", "rule"), [("run.log", "not a regular file"), ("config", "not a directory")], ids=["run.log", "config"]
)
def test_an_entry_of_the_wrong_kind_fails_the_partition_naming_it(entry, rule, tmp_path, folder, capsys):
    """was: a ``run.log`` that is a directory, or a ``config`` that is a file, was ignored and the run
    imported ``ok`` (without its run.log, peak_memory_gib empty and steps_match_run_log not run)."""
    path = folder / entry
    shutil.rmtree(path) if path.is_dir() else path.unlink()
    path.mkdir() if entry == "run.log" else path.write_text("not a folder\n")
    data = tmp_path / "data"
    assert main(["import", str(folder), "--data-dir", str(data)]) == 1
    line = next(ln for ln in capsys.readouterr().out.splitlines() if ln.startswith(W1))
    assert "FAILED: raw_timeline: " in line and f"{path}: {rule}" in line, line
    assert not list((data / "traces").rglob("run.log")), "nothing is copied"
