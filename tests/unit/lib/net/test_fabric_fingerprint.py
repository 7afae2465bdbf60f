"""The files a run's network reads are inputs of the run (issue 39, item 6): an Arbitrary fabric file is in
the run's fingerprint by its bytes (an edit in place makes the run stale), and a relative ``fabric_file``
in a run-matrix file is read from that file's folder, not the working directory."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from phantora_assets.lib.net.fabric import build_fabric
from phantora_assets.matrix import load_run_matrix
from phantora_assets.paths import DataPaths
from phantora_assets.records import write_record
from phantora_assets.stages.simulation import build_reason, run_spec_record, stale_reason


def _fabric(gbps: int) -> str:
    """Two hosts, a NIC each at ``gbps``, on one switch."""
    text = '[[switch]]\nname = "tor"\n'
    return text + "".join(f'[[nic]]\nhost = {h}\nnic = 0\nswitch = "tor"\ngbps = {gbps}\n' for h in (1, 2))


def _matrix(folder: Path, fabric_file: str) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    text = '[[run]]\nworkload = "W4"\ngpu = "a100_40g"\nnodes = 2\ngpus_per_node = 1\n'
    text += f'topology = {{ topology = "Arbitrary", fabric_file = "{fabric_file}" }}\n'
    (folder / "runs.toml").write_text(text)
    return folder / "runs.toml"


def test_a_relative_fabric_file_is_read_from_the_matrix_files_folder(tmp_path, monkeypatch):
    matrix = _matrix(tmp_path / "study", "fabrics/two.toml")
    (tmp_path / "study" / "fabrics").mkdir()
    (tmp_path / "study" / "fabrics" / "two.toml").write_text(_fabric(400))
    elsewhere = tmp_path / "elsewhere"  # the working directory has a file of that name too, at 100 Gbps
    (elsewhere / "fabrics").mkdir(parents=True)
    (elsewhere / "fabrics" / "two.toml").write_text(_fabric(100))
    monkeypatch.chdir(elsewhere)
    (spec,) = load_run_matrix(matrix)
    assert spec.cluster["fabric_file"] == str(tmp_path / "study" / "fabrics" / "two.toml")
    fab = build_fabric(spec.cluster, spec.n_nodes, spec.gpus_per_node)
    assert set(fab.cap.tolist()) == {400 / 8}  # bytes per ns: the matrix folder's file, not the cwd's
    monkeypatch.chdir(tmp_path)  # the same file from another working directory: the same run
    assert load_run_matrix(tmp_path / "study" / "runs.toml")[0].cluster["fabric_file"] == spec.cluster["fabric_file"]


def test_an_absolute_fabric_file_is_kept_and_a_missing_relative_one_is_named(tmp_path, monkeypatch):
    (tmp_path / "abs.toml").write_text(_fabric(400))
    (spec,) = load_run_matrix(_matrix(tmp_path / "a", str(tmp_path / "abs.toml")))
    assert spec.cluster["fabric_file"] == str(tmp_path / "abs.toml")
    monkeypatch.chdir(tmp_path)  # abs.toml is in the cwd, not beside the matrix: refused, the resolved path named
    with pytest.raises(Exception, match=str(tmp_path / "b" / "abs.toml")):
        load_run_matrix(_matrix(tmp_path / "b", "abs.toml"))


def test_editing_the_fabric_file_in_place_makes_the_run_stale(tmp_path):
    fabric = tmp_path / "fabric.toml"
    fabric.write_text(_fabric(400))
    (spec,) = load_run_matrix(_matrix(tmp_path, str(fabric)))  # absolute: the path is the same either way
    built = run_spec_record(spec)
    paths = DataPaths(tmp_path / "data")
    paths.partition_dir(spec.run_id).mkdir(parents=True)
    write_record(paths.partition_dir(spec.run_id) / "run_spec.json", built)
    assert stale_reason(spec, paths) is None
    fabric.write_text(_fabric(100))  # same path, same entry: only the bytes differ
    assert stale_reason(spec, paths) == (
        "stale: built from another fabric_file than the run matrix now gives; rebuild the run"
    )
    assert run_spec_record(spec).fingerprint != built.fingerprint
    assert built.inputs["fabric_file"] == "sha256:" + hashlib.sha256(_fabric(400).encode()).hexdigest()
    assert build_reason(spec, paths) == stale_reason(spec, paths)
    fabric.write_text(_fabric(400))  # the bytes the run was built from: current again
    assert stale_reason(spec, paths) is None
    fabric.unlink()  # gone: no fingerprint of a build matches, the rebuild names the file
    assert run_spec_record(spec).inputs["fabric_file"].startswith("unreadable: ")
    assert stale_reason(spec, paths) is not None


def _fat_tree(tmp_path: Path, oversubscription: str) -> object:
    text = '[[run]]\nworkload = "W4"\ngpu = "a100_40g"\nnodes = 2\ngpus_per_node = 1\n'
    text += f'topology = {{ topology = "FatTree", fattree_k = 4, oversubscription = {oversubscription} }}\n'
    (tmp_path / f"o{oversubscription}.toml").write_text(text)
    (spec,) = load_run_matrix(tmp_path / f"o{oversubscription}.toml")
    return spec


def test_a_number_written_as_int_or_float_is_the_same_run(tmp_path):
    """Issue 39 item 18: ``oversubscription = 2`` and ``= 2.0`` build the same network (the fabric reads
    the number as a float) and are one run id, but the fingerprint held the value as written, so the run
    built from one was stale under the other. The settings are fingerprinted by value; 2.5 is another run."""
    two, two_f, other = (_fat_tree(tmp_path, o) for o in ("2", "2.0", "2.5"))
    assert two.run_id == two_f.run_id
    fab = [build_fabric(s.cluster, s.n_nodes, s.gpus_per_node) for s in (two, two_f)]
    assert fab[0].cap.tolist() == fab[1].cap.tolist()
    assert run_spec_record(two).fingerprint == run_spec_record(two_f).fingerprint
    assert run_spec_record(other).fingerprint != run_spec_record(two).fingerprint
    paths = DataPaths(tmp_path / "data")
    paths.partition_dir(two.run_id).mkdir(parents=True)
    write_record(paths.partition_dir(two.run_id) / "run_spec.json", run_spec_record(two))
    assert stale_reason(two_f, paths) is None
    assert stale_reason(other, paths) is not None


def test_the_record_holds_the_fabric_path_relative_to_the_matrix_and_moves_with_it(tmp_path):
    """run_spec.json held the resolved absolute path of ``fabric_file`` (in the entry's topology and in the
    network): a data root and its matrix moved to another folder or machine went stale, and the record
    named a path of the machine that built it. It holds the path relative to the matrix file's folder and
    the file's sha256: the same record from either place, and no absolute path in it."""
    recs = []
    for where in ("machine_a", "machine_b/deeper"):
        matrix = _matrix(tmp_path / where / "study", "fabrics/two.toml")
        (matrix.parent / "fabrics").mkdir()
        (matrix.parent / "fabrics" / "two.toml").write_text(_fabric(400))
        (spec,) = load_run_matrix(matrix)
        assert spec.cluster["fabric_file"] == str(matrix.parent / "fabrics" / "two.toml")  # read from there
        recs.append(run_spec_record(spec))
    assert recs[0] == recs[1]
    assert recs[0].inputs["entry"]["topology"]["fabric_file"] == "fabrics/two.toml"
    assert recs[0].inputs["network"]["fabric_file"] == "fabrics/two.toml"
    assert recs[0].inputs["fabric_file"] == "sha256:" + hashlib.sha256(_fabric(400).encode()).hexdigest()
    assert str(tmp_path) not in json.dumps(recs[0].inputs)
    # written absolute in the matrix: still recorded relative to the matrix's folder
    (tmp_path / "shared.toml").write_text(_fabric(400))
    (spec,) = load_run_matrix(_matrix(tmp_path / "c", str(tmp_path / "shared.toml")))
    rec = run_spec_record(spec)
    assert rec.inputs["network"]["fabric_file"] == "../shared.toml"
    assert str(tmp_path) not in json.dumps(rec.inputs)
