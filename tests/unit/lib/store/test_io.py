"""lib/store/io: the fast CSV writer writes exactly what pandas writes."""

import math

import numpy as np
import pandas as pd
import pytest

from phantora_assets.lib.store.io import atomic_write_csv


def _pandas_csv(df: pd.DataFrame, fmt: str = "%.10g") -> bytes:
    return df.to_csv(index=False, float_format=fmt, lineterminator="\n").encode()


@pytest.mark.parametrize("fmt", ["%.10g", "%.6g"])
def test_csv_is_byte_identical_to_pandas(tmp_path, fmt) -> None:
    rng = np.random.default_rng(7)
    n = 5000
    df = pd.DataFrame(
        {
            "run_id": [f"phantora_a100_40g_W{i % 5 + 1}_2x4" for i in range(n)],
            "t": np.round(np.arange(n) * 0.1, 1),
            "x": rng.normal(size=n) * 10.0 ** rng.integers(-12, 15, size=n),
            "bytes": rng.integers(0, 2**62, size=n, dtype=np.int64),
            "u": rng.integers(0, 255, size=n).astype(np.uint8),
        }
    )
    df.loc[::97, "x"] = math.nan
    df.loc[1, "x"], df.loc[2, "x"], df.loc[3, "x"] = -0.0, math.inf, -math.inf
    out = tmp_path / "t.csv"
    atomic_write_csv(df, out, fmt)
    assert out.read_bytes() == _pandas_csv(df, fmt)


def test_csv_values_that_need_quotes_are_quoted_as_pandas_does(tmp_path) -> None:
    df = pd.DataFrame({"parallelism": ["tp=2,dp=1", 'say "hi"', "plain"], "ok": [True, False, True], "n": [1, 2, 3]})
    out = tmp_path / "q.csv"
    atomic_write_csv(df, out)
    assert out.read_bytes() == _pandas_csv(df)
    assert b'"tp=2,dp=1"' in out.read_bytes()


def test_csv_of_an_empty_table_is_its_header(tmp_path) -> None:
    df = pd.DataFrame({"a": pd.Series([], dtype="int64"), "b": pd.Series([], dtype="float64")})
    out = tmp_path / "e.csv"
    atomic_write_csv(df, out)
    assert out.read_bytes() == _pandas_csv(df) == b"a,b\n"


def test_atomic_writes_get_the_mode_of_a_plain_open(tmp_path) -> None:
    """Not mkstemp's 0600: the mode a plain ``open(..., "w")`` gives under the umask."""
    from phantora_assets.lib.store.io import atomic_write_text

    atomic_write_text(tmp_path / "a.txt", "x")
    (tmp_path / "b.txt").write_text("x")
    assert (tmp_path / "a.txt").stat().st_mode & 0o777 == (tmp_path / "b.txt").stat().st_mode & 0o777


@pytest.mark.parametrize(
    "df",
    [
        pd.DataFrame({"run_id": ["a", "b", "c"], "x": [0.0, -0.0, 0.0]}),  # signed zeros
        pd.DataFrame({"run_id": ["a", "b"], "x": pd.array([1, None], "Int64")}),  # nullable ints
        pd.DataFrame({"x": ["", "y"]}),  # one column
        pd.DataFrame([[1, 2.5]], columns=["a", "a"]),  # duplicate names
        pd.DataFrame({0.0: [1.5], 1: [2]}),  # non-str names
    ],
)
def test_csv_edge_cases_match_pandas(tmp_path, df) -> None:
    out = tmp_path / "e.csv"
    atomic_write_csv(df, out)
    assert out.read_bytes() == _pandas_csv(df)
