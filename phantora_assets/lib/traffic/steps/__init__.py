"""Step detection: cut a run's flows into training steps without step markers.

docs/DATASET.md, "How a trace becomes the dataset", step 2. Each communicator rank
(``comm_id``, ``comm_rank``) issues a repeating sequence of NCCL calls; its period is one
training step (or a whole fraction of one: "Sub-periods" and "Several repetitions per step
on every communicator" below). Periods are cut aligned to the END of each sequence (the
last step ends with the last call), so a warm-up that differs from the steady steps only
affects the beginning.

Definitions used here (all documented choices):

* **Call**: one row of the flows table, except that the ``n - 1`` flows a broadcast root
  issues at the same ``ts_us`` for one call are merged (the fan-out of a communicator's
  broadcasts is the gcd of its same-``ts`` broadcast group sizes). Calls of one sequence
  are ordered by ``(ts_us, flow_id)``.
* **Call token**: ``(op, count, dtype, root, peer)`` where ``peer`` is the node offset of
  the other end for send/recv (``dst_node - src_node`` for send, ``src_node - dst_node``
  for recv; flows carry no peer rank) and 0 otherwise.
* **Period** of a sequence: among the periods ``p`` whose periodic tail covers at least
  ``min_repeats`` (3) full periods, the one whose periodic tail is the LONGEST; ties go to
  the smallest ``p``. (Taking simply the smallest ``p`` with 3 repetitions would pick
  ``p = 1`` for any step that ends with three identical calls, e.g. three 1-element loss
  all-reduces; the longest tail is the step's primitive period, by Fine and Wilf.)
* **Sub-periods**: a communicator whose step holds its pattern k times (two identical
  gradient buckets) has a primitive period of 1/k step. When exactly one multiple of its
  period brings its number of full periods within ``[C, C + slack]`` (``C`` the smallest
  count over all sequences, ``slack = warmup_steps + 1``) it uses that multiple. When
  several do (e.g. the 16 identical all-to-all sends of a MoE step), the boundary inside
  it is ambiguous: its calls are assigned to steps **by time**, using the step starts of
  the other ("anchor") sequences, and the last step, cut short by the end of the trace,
  is not steady. When none does, :class:`StepDetectionError` ("steps disagree"), unless
  the steps of several periods below hold.
* **Steps**: with ``N`` the largest count, a sequence with ``N_i`` full periods numbers
  them ``N - N_i ... N - 1``; calls before its first full period belong to no step.
  Steps ``0 .. (N - C) + warmup_steps - 1`` are warm-up; the rest are steady (for the
  typical 20-iteration run: 20 steps, step 0 warm-up, steps 1..19 steady, i.e. 19 steady
  steps). The last step is steady but untimed: its end is the end of its last flow, not
  the next step's start, so ``step_time_us`` is the median over the steady steps except
  the last (18 for a 20-iteration run); a run whose only steady step is the last one is
  refused (``"no steady step"``).
* A communicator rank that never repeats is tolerated only if every one of its flows
  starts before the first steady step (e.g. a parameter broadcast on a group used only
  at start-up); its flows get step -1. Otherwise :class:`StepDetectionError` with rule
  ``"steps never repeat"``.
* Every sequence's first call of steady step ``k`` must come before step ``k + 1`` starts,
  else the communicators disagree on the steps (:class:`StepDetectionError` "steps
  disagree", unless the steps of several periods below hold).
* **Several repetitions per step on every communicator**: when every communicator repeats
  its pattern within a step (two equal gradient buckets on the DP group and two equal
  all-reduces on the TP group), no sequence has the step as its primitive period, and the
  cut above is wrong: it fails ("steps disagree"), or its steps overlap in time (a call of
  one step starts after a call of the next step started; any step, warm-up included). The
  calls' times then tell the step. The reference sequence ``R`` (fewest full periods; the
  first in (``comm_id``, ``comm_rank``) order on a tie) is given the period ``k * p_R``
  for ``k = 2, 3, ...``. Every other sequence takes, among the multiples of its period
  whose number of full periods is within ``slack`` of ``R``'s (and at least
  ``min_repeats``), the one nearest ``R``'s count (the smaller multiple on a tie) whose
  steps do not overlap ``R``'s and whose calls sit at the same places among ``R``'s calls
  in each of the last ``min(N_i, N_R) - warmup_steps`` steps (the place of a call: how
  many of the step's calls of ``R`` start before it); if none does, this ``k`` fails. The
  steps are then numbered as above and must pass the rules above, not overlap, include at
  least 2 steady steps, and be indivisible: for every prime ``g`` dividing every
  sequence's multiple (period / primitive period), no steady step splits into ``g`` equal
  parts that would be steps themselves (not overlapping, passing the check above, calls at
  the same places), so one late call does not turn two iterations into one step. The
  smallest ``k`` that holds gives the steps; when a larger ``k`` that is not a multiple of
  it holds too, the data are ambiguous: :class:`StepDetectionError` "steps ambiguous".
  ``k`` is searched up to ``coarse.MAX_REPETITIONS`` (64): beyond it the search would be
  quadratic in the trace, so a step of more repetitions is refused with that reason and an
  ambiguous cut beyond it is not looked for. When none holds, a failed cut above raises its
  "steps disagree" error with the reason the first ``k`` failed, and a cut above that overlaps
  is kept. A single communicator, or
  several whose primitive cut passes the check and does not overlap, keep their primitive
  periods, unless the compute rhythm below shows a longer step.
* **A period broken inside the run**: the calls before a sequence's periodic tail holding
  ``min_repeats`` copies of its period's block are steps the period missed (an extra call in some
  steps on that communicator), not warm-up: ``"steps irregular"``, naming the call that breaks it;
  so are anchors that open their steps at wandering places or whose uneven repeats make an evenly
  repeating sequence take several periods a step (``coarse.offbeat_anchor``, ``unjustified_multiple``).
* **Start-up repeats**: a sequence whose last call comes in the first half of the run's time
  span (e.g. a start-up barrier issued 4 times) is treated as never repeating (the rule above:
  allowed inside the warm-up only), so it cannot make 1-us steps.
* **A trace cut short** (:func:`~phantora_assets.lib.traffic.steps.cut._start_aligned`): an anchor
  sequence with fewer full periods than the most and no call before its first full period (every
  communicator is used in the run's first step) lacks its LAST steps, not its first: it is numbered
  from step 0 and the steps it lacks are not steady (the last steady step is then timed by the
  next step's start). Kept only when that cut passes the time check and its steps are ordered in
  time.
* **A trace cut inside a pattern** (:func:`~phantora_assets.lib.traffic.steps.align._head_aligned`):
  the run starts with a step, its end can be anywhere. An anchor sequence whose periodic tail is no
  whole number of periods ends inside its last period (the last iteration holds the first calls of
  its pattern): counted from the end, each of its periods would hold the end of one iteration and the
  start of the next. When its tail covers it (periodic from its first call), or when it has warm-up
  calls before its tail and another anchor is periodic from its first call, every anchor periodic from
  its first call is numbered from step 0 (its calls after its last full period are the last step, not
  steady), and an anchor with warm-up calls from the step whose start its tail's first call follows
  (step 0 if none). Kept only when that cut passes the time check and its steps are ordered in time
  (a first step lacking its first calls fails it when another communicator calls before them), else the
  cut from the end stands. When that cut holds for an anchor with warm-up calls, both cuts fit its calls
  (a trace cut inside its pattern after warm-up calls, or a whole trace whose warm-up calls replace its
  first calls) and another anchor's periods do not tell its phase: ``"steps ambiguous"``.
  Steps of several periods (``g`` times as many calls: "Steps in rhythm",
  "Compute rhythm") are aligned the same way and by "A trace cut short". Left open: such a tail after
  warm-up calls when no anchor is periodic from its first call (one communicator with a warm-up) keeps
  the cut from the end: nothing in the flows tells a trace cut inside its pattern from a warm-up in place
  of its first calls (a real trace, W5 2x2, has 130 warm-up calls, then a tail of 19 periods of 131 calls
  and 2), and the compute rhythm's phase is not read.
* **Time-assigned calls between the anchors' steps** go to the earlier step, unless the sequence's
  first call precedes the anchors' first step (its calls open a step, as the first step shows; the
  anchors' warm-up calls before their first full period left out): then the calls ending the gap that
  repeat the end of that head (calls of a kind it lacks passed over: a logging call inside it) open the
  later step, the others (an occasional call just before the next step's head) stay in the earlier one.
  Calls of a kind that comes within 1 % of a step time of the anchors' step start, just after it in some
  steps and just before it in others, are issued with the call that opens the step: they open it too.
* **Occasional collectives** (:func:`~phantora_assets.lib.traffic.steps.verify.occasional`): the
  sequences with the fewest full periods, when the others alone cut steps (sub-period rule, none by
  time) that last the compute rhythm (the few at any steps), or, without one, are a rhythm in time
  (gaps within 10 % of the median, warm-up left out) with 2+ kinds of call on one of them or 2+ of
  them, and the few repeat every whole ``g >= 2`` of those steps, each a call or a period repeating a
  kind (a logging all-reduce every 5th step): the step is the others', the few are assigned
  by time and occur in some steps only (the blocking ``steps_match`` names them). Without a compute
  rhythm, a period of ``q`` calls that ends with a block of ``b`` calls (``2 <= b <= q/3``, 2 kinds)
  repeated 3+ times (one communicator with an extra call every few steps) is refused:
  ``"steps ambiguous"`` (:func:`~phantora_assets.lib.traffic.steps.verify.repeated_block`).
* **Steps in rhythm** (no compute rhythm; :func:`~phantora_assets.lib.traffic.steps.verify.steps_in_rhythm`):
  the steady steps must be a rhythm in time (every gap between step starts within 10 % of their
  median). Gaps that repeat every ``g >= 2`` steps (at most 64; each within 10 % of the gap ``g``
  steps later, or of the median gap for a shorter one: a call's jitter), the off-median ones taking
  at least a quarter of the cycle (two calls 120 us apart in a 1000 us iteration give steps of 120 and
  880 us), are a step of ``g`` times as many calls, kept when those steps are a rhythm, else
  ``"steps ambiguous"``; other gaps are kept as late steps (a straggler, a checkpoint step, also every
  20th) when at most 15 % of at least 12 are off their median, else refused (``"steps ambiguous"``).
* **Steps of equal parts** (no compute rhythm; ``coarse.split_with_extras``, ``parts_of_a_step``):
  an anchor whose step is ``g >= 2`` copies of one block, evenly spaced in time, plus a few other calls
  (a call every 2nd iteration on a communicator that calls every iteration), or a sequence whose step
  is ``g >= 2`` blocks evenly spaced in time (gaps within 10 %, not told apart by gaps cycling every
  ``g``) because another repeats once a step (a rare call on its own communicator), is refused:
  ``"steps ambiguous"``, a step of several iterations or an occasional collective.
* **Compute rhythm** (``compute`` given; :mod:`~phantora_assets.lib.traffic.steps.verify`): each
  host's Computation events, as a sequence of durations, have a period (the same longest-tail
  rule); its length in time is the compute rhythm (none when a host's periods, the first (warm-up)
  left out, differ by more than 5 % or hosts disagree). The steady steps must last it (10 %). Steps of a whole
  ``g >= 2`` compute periods (an irregular collective, e.g. a logging all-reduce every 5th
  iteration, made the period 5 iterations) are re-cut at the compute periods, the phase kept
  (every communicators' step start is a step start; each boundary half-way into the shortest quiet
  time before an iteration's first call, so a call between two iterations stays in its own): the
  extra collective then sits in some steady steps only, and the blocking ``steps_match`` check
  names them. A re-cut with a step boundary inside a communicator's own period (its primitive period,
  at most its calls a step, a whole number of them in its periodic tail, so their phase is known;
  :func:`~phantora_assets.lib.traffic.steps.align.split_period`) would start every step mid-iteration
  (the phase taken from an irregular collective's steps): ``"steps disagree with compute"``.
  Steps of ``1/g`` compute period by their mean (two equal gradient buckets per step read as two
  steps) are replaced by the steps of ``g`` times as many calls of the reference sequence when those
  agree with the rhythm. Any other disagreement, or a re-cut whose steady steps mostly differ, is
  :class:`StepDetectionError` ``"steps disagree with compute"``.
"""

from phantora_assets.lib.traffic.steps.detect import MIN_REPEATS, StepResult, detect_steps

__all__ = ["MIN_REPEATS", "StepResult", "detect_steps"]
