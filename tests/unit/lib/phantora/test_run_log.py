"""run.log parsing: the Megatron, DeepSpeed and analytic formats, out of memory, odd lines."""

from __future__ import annotations

import pytest
from fixtures.run_folders import deepspeed_log, megatron_log

from phantora_assets.lib.phantora.run_log import parse_run_log

TIMES = [0.5123456, 0.4511111, 0.4522222, 0.4500001]


def test_megatron_full_precision_list_wins_and_peak_is_max_over_ranks():
    log = parse_run_log(megatron_log(TIMES, ranks=2, peak_mib=30512.25, model_params=1923125248))
    assert log.format == "megatron"
    assert log.iteration_s == TIMES and log.precise
    assert log.per_rank_s == {0: TIMES, 1: TIMES}
    assert log.peak_memory_mib == {0: 30512.25, 1: 30502.25}
    assert log.peak_memory_gib == pytest.approx(30512.25 / 1024)
    assert log.model_params == 1923125248
    assert log.steady_iteration_s == pytest.approx(0.4511111)
    assert not log.out_of_memory
    meta = log.metadata()
    assert meta["run_log_iterations"] == 4 and meta["run_log_first_iteration_ms"] == pytest.approx(512.346)


def test_megatron_iteration_lines_only_take_the_slowest_rank():
    text = "\n".join(
        [
            "rank 0 iter 0 time: 0.52 wall: 10.00",
            "rank 1 iter 0 time: 0.53 wall: 10.00",
            "rank 1 iter 1 time: 0.46 wall: 1.00",
            "rank 0 iter 1 time: 0.45 wall: 1.00",
        ]
    )
    log = parse_run_log(text)
    assert log.iteration_s == [0.53, 0.46] and not log.precise
    assert log.peak_memory_gib is None


def test_deepspeed_with_pdsh_prefix_and_loss():
    log = parse_run_log(deepspeed_log(TIMES, ranks=4))
    assert log.format == "deepspeed"
    assert log.iteration_s == TIMES
    assert set(log.per_rank_s) == {0, 1, 2, 3}
    assert log.peak_memory_gib is None


def test_deepspeed_older_format_without_rank():
    text = (
        "time: 0.52 wall: 10.00\ntime: 0.45 wall: 1.00\n"
        "Time: [0.5213, 0.4499] Avg time: 0.4499\nWall: [10.0, 1.0] Avg wall: 1.0\n"
    )
    log = parse_run_log(text)
    assert log.format == "deepspeed"
    assert log.iteration_s == [0.5213, 0.4499]


def test_analytic_format():
    text = (
        "# analytic simulation of x\npeak memory estimate: 16.84 GiB of 40.00 GiB\n"
        "iteration   1/3 | simulated time (ms): 96.509 | peak memory (GiB): 16.84\n"
        "iteration   2/3 | simulated time (ms): 61.560 | peak memory (GiB): 16.84\n"
        "iteration   3/3 | simulated time (ms): 61.625 | peak memory (GiB): 16.84\n"
    )
    log = parse_run_log(text)
    assert log.format == "analytic"
    assert log.iteration_s == pytest.approx([0.096509, 0.06156, 0.061625])
    assert log.peak_memory_gib == 16.84


@pytest.mark.parametrize(
    "line",
    [
        "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB",
        "[rank1]: torch.cuda.OutOfMemoryError: boom",
        "OUT OF MEMORY: estimated peak 49.70 GiB exceeds the card (46.00 GiB)",
    ],
)
def test_out_of_memory_is_detected(line):
    log = parse_run_log("rank 0 iter 0 time: 0.52 wall: 10.00\n" + line + "\n")
    assert log.out_of_memory and log.oom_line == line.strip()


def test_unrecognised_and_garbled_text_never_raises():
    log = parse_run_log("hello\nRank 0 Time: [not, a, list] Avg Time: x\n\x00\x01binary\n")
    assert log.format == "unknown" and log.iteration_s == [] and log.metadata()["run_log_steady_iteration_ms"] is None


@pytest.mark.parametrize(
    "text",
    ["rank 1 iter 1 " * 16000, "Time: [" * 32000, "Rank 1 Time: [1.0, " * 16000],
    ids=["iter-prefix", "time-list-open", "time-list-unclosed"],
)
def test_hostile_lines_parse_in_linear_time(text):
    """Issue 13 (finding 4): a 224 KB line of repeated prefixes took 35 s (the regex rescanned the
    rest of the line from every match start). A hang guard, not a speed target: the bound is ~100x
    what it takes now (~0.2 s)."""
    import time

    t0 = time.perf_counter()
    log = parse_run_log(text)
    assert time.perf_counter() - t0 < 5.0
    assert log.iteration_s == []
