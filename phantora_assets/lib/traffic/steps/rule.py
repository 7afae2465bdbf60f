"""The one rule of step detection, its invariants and its tolerances (docs/STEPS.md).

**Rule.** A step is the finest time-ordered partition of the trace in which every communicator issues
the same sequence of calls (op, count, dtype, communicator) in every steady step.

**Evidence, in order of strength.** (1) Explicit iteration boundaries decide: a Kineto run's
``ProfilerStep#N`` spans (``lib/kineto/step_spans.py``, upstream of this package) and run.log's iteration
records (``iteration_s``: their count and median time select the candidate; as many as the steps, they say the
trace ends with the job's last iteration: a 3-iteration job's last step is whole, its second steady step). (2)
The communicators' own periods give the candidates: each communicator rank's primitive period, then steps of
several periods on every communicator, finest first. (3) The compute rhythm and the gaps between steps never
coarsen or re-cut a step the communicators repeat exactly: they say why a step is an outlier, and steps
lasting a whole number of compute periods are refused.

**Invariants** (each a function of a candidate returning a violation or None; ``detect._decide`` applies them):
the communicators agree on the number of steps (``steps disagree``); the steps are ordered in time (no call
of a step after a call of the next); a communicator rank that never repeats calls only before the first
steady step (``steps never repeat``); the steps do not last a whole ``g >= 2`` compute periods
(``steps disagree with compute``); no period broken inside the run (``steps irregular``); a send/recv
compared without its count moves bytes within ``p2p_bytes_rel_tol`` of the median steady step; at least
one timed steady step (``no steady step``); run.log's iterations, when given, agree with the steps; the
steady steps' durations do not alternate (``steps ambiguous``: an iteration of two steps, a communicator
issuing its calls twice an iteration, or a longer iteration every second one; the trace cannot tell;
run.log, when given, decides); without run.log, no communicator rank repeats its whole pattern ``g >= 2``
times evenly across most of a step (``steps ambiguous``: ``g`` iterations and an evaluation pass, or ``g``
micro-batches; ``StepRule.repeat_gap_rel_tol``).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class StepRule:
    """Tolerances of the rule (module docstring). Times relative to the median steady step.

    Attributes:
        min_repeats: full periods a communicator rank's periodic tail must cover (3).
        warmup_steps: full leading steps that are warm-up, on top of the calls before the first full period.
        outlier_rel_tol: a steady step longer or shorter than the step time by more than this share is kept
            and flagged as an outlier (eval pass, checkpoint, straggler), never merged into a coarser step;
            the step time is the median of the typical steps, the most within ``2 x`` this share above the
            shortest of them.
        p2p_bytes_rel_tol: a send/recv (an MoE all-to-all's transfers) whose element count varies with
            routing is compared by (op, communicator, dtype, peer); its steady steps' bytes per
            communicator must stay within this share of the median step's.
        log_rel_tol: run.log's median iteration and the median step agree within this share.
        log_missing_steps: run.log may report up to this many iterations more than the trace holds steps
            (warm-up calls that form no full period, a trace cut at an end).
        max_repetitions: steps of several periods are searched up to this many periods of the reference
            communicator rank (beyond it the search is quadratic in the trace; refused with the reason).
        compute_rel_tol: a host's compute periods last within this share of their median (else no rhythm);
            steps lasting a whole ``g >= 2`` compute periods within it are refused (``steps disagree with
            compute``: an occasional collective or a ``g``-iteration step).
        compute_token_rel_tol: Computation events whose durations are within this share are one token.
        repeat_gap_rel_tol, repeat_span_share: without an iteration source (run.log, step markers), a step in
            which a communicator rank issues its whole pattern ``g >= 2`` times, the repetitions evenly spaced
            (every gap between their starts within ``repeat_gap_rel_tol`` of the median gap) and together
            lasting at least ``repeat_span_share`` of the step, is ``g`` iterations with a pass of their own
            (an evaluation every ``g``-th iteration: its forward's TP calls, its loss all-reduce) or one step
            of ``g`` micro-batches with per-micro-batch reductions: the trace cannot tell, refused (``steps
            ambiguous``); run.log or ProfilerStep markers decide.
        cycle_min_per_phase, cycle_separation, cycle_min_share: steady steps alternating short, long are
            refused as ambiguous: at least ``cycle_min_per_phase`` steps at each parity, every step of the
            shorter parity shorter than every step of the longer, their medians ``cycle_separation`` robust
            spreads and ``cycle_min_share`` of the step time apart (``evidence.duration_cycle``).
        period_min_per_phase, period_max, period_alpha: without run.log, steady steps whose durations differ
            every ``k``-th step (``k = 2 ..`` up to ``period_max``, at least ``period_min_per_phase`` steps at
            each phase), overlapping under jitter, are refused as ambiguous when the phases' Kruskal-Wallis
            p-value is below ``period_alpha`` over the ``k`` tried and the longest phase's steps are typical
            (``evidence.duration_period``: an eval pass every ``k``-th iteration within the jitter's reach).
    """

    min_repeats: int = 3
    warmup_steps: int = 1
    outlier_rel_tol: float = 0.10
    p2p_bytes_rel_tol: float = 0.25
    log_rel_tol: float = 0.10
    log_missing_steps: int = 2
    max_repetitions: int = 64
    compute_rel_tol: float = 0.05
    compute_token_rel_tol: float = 0.01
    repeat_gap_rel_tol: float = 0.25
    repeat_span_share: float = 0.75
    cycle_min_per_phase: int = 6
    cycle_separation: float = 4.0
    cycle_min_share: float = 0.02
    period_min_per_phase: int = 6
    period_max: int = 10
    period_alpha: float = 1e-3


RULE = StepRule()
