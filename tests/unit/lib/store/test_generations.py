"""lib/store/generations: the grace period readers get is read strictly (an invalid
``$PHANTORA_ASSETS_DATASET_GRACE_S`` is refused before anything is published)."""

from __future__ import annotations

from pathlib import Path

import pytest

from phantora_assets.lib.store.generations import GRACE_S, current, grace_s, publish, staging_dir


def _staged(target: Path, text: str) -> Path:
    staging = staging_dir(target)
    staging.mkdir(parents=True)
    (staging / "runs.csv").write_text(text)
    return staging


@pytest.mark.parametrize(
    ("raw", "seconds"), [("", GRACE_S), ("0", 0.0), ("2.5", 2.5), ("600", 600.0)], ids=["unset", "0", "2.5", "600"]
)
def test_a_valid_grace_period_is_read_as_seconds(monkeypatch, raw, seconds):
    monkeypatch.setenv("PHANTORA_ASSETS_DATASET_GRACE_S", raw)
    assert grace_s() == seconds


@pytest.mark.parametrize("raw", ["abc", "-5", "nan", "inf"])
def test_an_invalid_grace_period_is_refused_before_the_link_moves(tmp_path, monkeypatch, raw):
    target = tmp_path / "phantora_v0"
    first = publish(_staged(target, "one\n"), target, grace=600)
    monkeypatch.setenv("PHANTORA_ASSETS_DATASET_GRACE_S", raw)
    with pytest.raises(ValueError, match=r"PHANTORA_ASSETS_DATASET_GRACE_S=.*not a number of seconds >= 0"):
        publish(_staged(target, "two\n"), target)
    assert current(target) == first and (target / "runs.csv").read_text() == "one\n"
