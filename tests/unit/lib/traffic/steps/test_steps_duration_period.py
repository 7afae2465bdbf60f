"""Issue 39 item 11: ``evidence.duration_period``, steady steps whose durations differ every k-th step
although the two populations overlap under jitter (``duration_cycle`` needs every short step shorter than
every long one). Durations built here in closed form (a regular length ``T`` times ``1 + U(-j, j)``, plus an
extra length every k-th), never from the code under test."""

from __future__ import annotations

import numpy as np
import pytest

from phantora_assets.lib.traffic.steps.evidence import _chi2_sf, _kruskal_wallis, duration_period
from phantora_assets.lib.traffic.steps.rule import RULE

T = 10_000.0


def _steps(n: int, jitter: float, seed: int, k: int = 0, extra: float = 0.0) -> np.ndarray:
    d = T * (1.0 + np.random.default_rng(seed).uniform(-jitter, jitter, n))
    if k:
        d[k - 1 :: k] += extra * T
    return d


def test_chi2_tail_matches_its_closed_forms():
    # df = 1: erfc(sqrt(x / 2)); df = 2: exp(-x / 2); df = 3: erfc(sqrt(x/2)) + sqrt(2x/pi) exp(-x/2)
    assert _chi2_sf(3.841458820694124, 1) == pytest.approx(0.05, rel=1e-9)
    assert _chi2_sf(10.0, 2) == pytest.approx(np.exp(-5.0), rel=1e-12)
    assert _chi2_sf(7.814727903251178, 3) == pytest.approx(0.05, rel=1e-9)
    assert _chi2_sf(0.0, 4) == 1.0


def test_kruskal_wallis_of_two_separated_halves_is_its_closed_form():
    """Phases 0 and 1 of 2 x 11 steps, every odd step longer: ranks 1..11 and 12..22, H = 12 / (22 * 23) *
    (66^2 + 187^2) / 11 - 3 * 23 = 15.7826..."""
    d = np.array([1.0 + (i % 2) + 1e-3 * i for i in range(22)])
    h, p = _kruskal_wallis(d, 2)
    assert h == pytest.approx(12.0 / (22 * 23) * (66**2 + 187**2) / 11 - 69.0, rel=1e-12)
    assert p == pytest.approx(_chi2_sf(h, 1))


@pytest.mark.parametrize("family", ["moe", "grad_accum"])
def test_the_attack_durations_are_refused(family):
    """The 22 timed steps of issue 39's attack (an eval pass every 2nd iteration under +-10 % jitter,
    ``fixtures.training_runs`` seed 1), as the step rule timed them before the fix."""
    d = {
        "moe": [10833, 10163, 11483, 9420, 11599, 9358, 11904, 9676, 11257, 9877, 11989, 9102, 11523, 10353, 10438,
                10246, 10307, 9747, 11921, 9090, 11840, 10362],
        "grad_accum": [10794, 10146, 11552, 9347, 11659, 9287, 11969, 9640, 11278, 9822, 12087, 9032, 11535, 10393,
                       10392, 10302, 10285, 9682, 12009, 8999, 11869, 10412],
    }[family]  # fmt: skip
    why = duration_period(np.array(d, dtype=float))
    assert why is not None and "k = 2" in why


@pytest.mark.parametrize("seed", [2, 3, 4])
def test_an_eval_pass_every_second_step_within_the_jitters_reach_is_refused(seed):
    """Every 2nd of 36 steps 15 % longer under +-10 % jitter: the populations overlap, half the steps long."""
    d = _steps(36, 0.10, seed=seed, k=2, extra=0.15)
    assert not d[1::2].min() > d[0::2].max()  # overlapping: no full separation (duration_cycle says nothing)
    why = duration_period(d)
    assert why is not None and "k = 2" in why


def test_an_eval_pass_every_third_step_that_leaves_the_median_is_kept():
    """Every 3rd of 36 steps 15 % longer under +-10 % jitter: a third of the steps, their median is within
    2 % of the regular ones' (the step time the regular iterations give), so nothing to refuse."""
    d = _steps(36, 0.10, seed=3, k=3, extra=0.15)
    regular = float(np.median(np.delete(d, np.s_[2::3])))
    assert abs(float(np.median(d[d <= 1.2 * d.min()])) - regular) < 0.02 * regular
    assert duration_period(d) is None


def test_jitter_without_a_period_is_kept():
    """The false-refusal bound: 300 runs of 12-60 steps of +-10 % jitter, none refused (the rule's bound is
    RULE.period_alpha = 1e-3 a run)."""
    assert RULE.period_alpha == 1e-3
    refused = [s for s in range(300) if duration_period(_steps(12 + s % 49, 0.10, seed=s)) is not None]
    assert refused == []


@pytest.mark.parametrize("k", [2, 3])
def test_a_checkpoint_every_kth_step_beyond_the_window_is_kept(k):
    """A stall of 0.5 T every k-th step: the longer phase is all outliers (beyond the 20 % window), the step
    time is the regular steps' median; periodic, but nothing to refuse."""
    assert duration_period(_steps(30, 0.10, seed=5, k=k, extra=0.5)) is None


def test_fewer_steps_than_two_phases_of_the_minimum_say_nothing():
    n = 2 * RULE.period_min_per_phase - 1
    assert duration_period(_steps(n, 0.0, seed=0, k=2, extra=0.15)) is None
