"""The published folder as a user reads it: pandas' default reader on each per-run table's folder, and
the dataset card's own code block, run as written from inside the folder and, with ``here`` set to the
folder's path, from outside it (DuckDB, pyarrow, pandas and Hugging Face ``datasets``, offline)."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pandas as pd
import pytest
from fixtures.builds import FITS


@pytest.mark.parametrize("table", ["flows_100ms", "windows"])
def test_pandas_reads_a_per_run_folder_with_its_defaults(small_build, table):
    folder = small_build / "phantora_v0" / table
    csv = pd.read_csv(small_build / "phantora_v0" / f"{table}.csv")
    got = pd.read_parquet(folder)  # was: ArrowTypeError, run_id string (file) vs dictionary (hive folder)
    assert list(got.columns) == list(csv.columns) and len(got) == len(csv) > 0
    assert set(got["run_id"]) == {FITS}
    assert len(pd.read_parquet(folder, filters=[("run_id", "==", FITS)])) == len(csv)


def _card_code(small_build) -> str:
    card = (small_build / "phantora_v0" / "README.md").read_text()
    (code,) = re.findall(r"```python\n(.*?)```", card, flags=re.S)
    return code


def _run(code: str, cwd, tmp_path) -> list[str]:
    env = dict(os.environ, HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1", HF_HOME=str(tmp_path / "hf"))
    check = "print(per_run, one_run.num_rows, len(frame), table.num_rows)\n"
    out = subprocess.run([sys.executable, "-c", code + check], cwd=cwd, env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout.split()


def test_the_cards_code_runs_from_inside_the_folder(small_build, tmp_path):
    rows = len(pd.read_csv(small_build / "phantora_v0" / "flows_100ms.csv"))  # 1800 bins x 2 directed pairs
    code = _card_code(small_build)
    assert f'here, run = os.path.realpath("."), "{FITS}"' in code  # one generation (DATASET_STORAGE.md)
    # was: load_dataset("<this folder>") (a placeholder), and "." failed: "dataset_name should be specified"
    assert _run(code, small_build / "phantora_v0", tmp_path) == [f"[('{FITS}',", f"{rows})]", *[str(rows)] * 3]


def test_the_cards_code_runs_from_outside_with_the_folders_path(small_build, tmp_path):
    folder = str(small_build / "phantora_v0")
    code = _card_code(small_build).replace('os.path.realpath(".")', f"os.path.realpath({folder!r})")
    rows = len(pd.read_csv(small_build / "phantora_v0" / "flows_100ms.csv"))
    assert _run(code, tmp_path, tmp_path) == [f"[('{FITS}',", f"{rows})]", *[str(rows)] * 3]
