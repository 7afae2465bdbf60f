"""Rank placement: each framework's mesh order, the communicators of a layout, their groups.

* :func:`rank_coords`: a global rank's coordinates (tp innermost, then cp, dp, pp outermost;
  torchtitan's dp as dp_shard inner x dp_replicate outer; the expert mesh of a stage as etp, ep, edp);
* :func:`groups_of`: the communicators of one kind (ranks equal outside the kind's coordinates);
* :data:`GROUP_OF_KIND`: the parallelism group (the flows' ``group`` column) of each kind.

docs/WORKLOADS.md "Rank placement" and "Groups" state the rules and their sources. No Dagster import.
"""

from __future__ import annotations

from phantora_assets.lib.sim.workload_types import Communicator
from phantora_assets.lib.workload.spec import Parallel

#: a communicator kind -> the parallelism group of its flows (docs/WORKLOADS.md "Groups")
GROUP_OF_KIND: dict[str, str] = {
    "tp": "tp",
    "cp": "cp",
    "pp": "pp",
    "ep": "ep",
    "dp": "dp",
    "dp_cp": "dp",
    "edp": "dp",
    "dp_rep": "dp",
}


def rank_coords(par: Parallel, rank: int) -> dict[str, int]:
    """Coordinates of global ``rank``: tp, cp, dp, pp (rank = tp + TP*(cp + CP*(dp + DP*pp))),
    dp_shard / dp_rep (dp = dp_shard + dp_shard_size * dp_rep), and the expert mesh's etp, ep,
    edp (stage-local rank = etp + ETP*(ep + EP*edp))."""
    tp, cp, dp = par.tp, par.cp, par.dp
    c = {"tp": rank % tp, "cp": (rank // tp) % cp, "dp": (rank // (tp * cp)) % dp, "pp": rank // (tp * cp * dp)}
    shard = dp // par.dp_replicate
    c["dp_shard"], c["dp_rep"] = c["dp"] % shard, c["dp"] // shard
    local = rank % (tp * cp * dp)
    c["etp"], c["ep"], c["edp"] = local % par.etp, (local // par.etp) % par.ep, local // (par.etp * par.ep)
    return c


def groups_of(par: Parallel, kind: str, dims: tuple[str, ...]) -> list[Communicator]:
    """The communicators of ``kind``: global ranks grouped by equal coordinates outside ``dims``
    (:func:`rank_coords`), each group ascending, groups in order of their first rank."""
    dims_all = (
        ("tp", "cp", "dp_shard", "dp_rep", "pp") if "dp_shard" in dims or "dp_rep" in dims else ("tp", "cp", "dp", "pp")
    )
    if dims[0] in ("ep", "edp"):
        dims_all = ("etp", "ep", "edp", "pp")
    keep = [d for d in dims_all if d not in dims and not (d == "dp" and "dp" in dims)]
    found: dict[tuple[int, ...], list[int]] = {}
    for r in range(par.world):
        c = rank_coords(par, r)
        found.setdefault(tuple(c[d] for d in keep), []).append(r)
    return [Communicator(f"{kind}{i}", kind, tuple(g)) for i, g in enumerate(found.values())]
