"""Step detection: cut a run's flows into training steps (docs/STEPS.md; ``rule.py``: the rule, its
invariants and tolerances as one object). ``detect.py``: evidence -> candidates -> invariants -> decision.

Definitions (documented choices):

* **Call**: one row of the flows table, except that the ``n - 1`` flows a broadcast root issues at one
  ``ts_us`` for one call are merged. Calls of one communicator rank (``comm_id``, ``comm_rank``: a
  **sequence**) are ordered by ``(ts_us, flow_id)``.
* **Call token**: ``(op, count, dtype, root, peer)``; ``peer`` is the node offset of a send/recv's other
  end (flows carry no peer rank), 0 otherwise. When a sequence issuing send/recv never repeats, the tokens
  leave the send/recv count out (MoE routing) and the bytes are checked instead (``RULE.p2p_bytes_rel_tol``).
* **Period** of a sequence: among the periods whose periodic tail covers at least ``min_repeats`` (3) full
  periods, the one with the LONGEST tail (its primitive period, by Fine and Wilf); ties to the smallest.
  A sequence whose last call comes in the first half of the run's span is start-up: it never repeats.
* **Sub-periods** (``cut.primary_periods``): a sequence with more full periods than the fewest (``C``) by
  more than ``warmup_steps + 1`` takes the one multiple of its period whose count is within that slack of
  ``C``; with several (identical calls: MoE sends, a TP group's all-reduces) its calls are assigned to the
  others' steps by time (``cut.cut_steps``: a call between two steps goes to the earlier one, unless the run's
  first step shows such calls open a step); with none, the multiple whose periods last the reference's
  (10 %: more steps than the others, a ramp-up or a longer warm-up).
* **Steps**: every other sequence's full periods are numbered from its END (the last step ends with the
  last call); calls before a sequence's first full period belong to no step. Steps before the last
  sequence's first full period, and ``warmup_steps`` more, are warm-up; so are leading steps whose calls
  differ from the steady ones (``detect._steady_calls``). A trace cut short or inside a pattern is aligned
  to the run's first step instead (``align.py``).
* **Several repetitions per step on every communicator** (``coarse.py``): when the primitive cut's steps
  are not ordered in time, steps of ``k`` periods of the reference sequence (fewest periods), ``k = 2 ..
  RULE.max_repetitions``, each other sequence at the multiple whose calls sit at the same places among
  the reference's; the smallest ``k`` that holds and is indivisible; two that hold: ``steps ambiguous``.
* **Timing**: a step starts with its first flow and ends where the next starts; the last steady step is
  untimed (its end is its last flow's), so ``step_time_us`` is the median of the typical ones among the
  other steady steps (``evidence.typical_step_us``); a steady step more than ``RULE.outlier_rel_tol`` off it
  is named in ``steps.outlier``.
"""

from phantora_assets.lib.traffic.steps.detect import MIN_REPEATS, StepResult, detect_steps
from phantora_assets.lib.traffic.steps.rule import RULE, StepRule

__all__ = ["MIN_REPEATS", "RULE", "StepResult", "StepRule", "detect_steps"]
