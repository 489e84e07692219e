"""The plan's walks as data for the fast runtime (:mod:`shardc.runtime.fast`): per layer
kind and branch, each op's choice and the placements it needs and produces on the tp dim,
and the branch end, from the contract's one :func:`shardc.ir.contract.walk` -- the walk
the cost model charges, so the runtime issues the charged collectives and re-derives
nothing. Written into ``parallelize.py`` as ``WALKS`` (plain data)."""

from __future__ import annotations

from shardc.ir.contract import BRANCHES, CHOICE_NAMES, branch_ends, walk
from shardc.ir.strategy import Degrees, residual_placement


def gather_split(deg):
    """The ``split`` argument of :class:`~shardc.runtime.gathered_experts.GatheredExperts`
    (and the fast runtime walk's ``gather``) for re-split degrees ``deg``: ``"tp"`` (moe_ep
    = 1), ``"ep"`` (moe_tp = 1) or the int moe_tp of a mixed split."""
    return "tp" if deg.moe_ep == 1 else "ep" if deg.moe_tp == 1 else int(deg.moe_tp)


def _steps(w) -> list[list[str]]:
    return [[s.op, s.choice.name, s.need, s.produced] for s in w.steps]


def plan_walks(choices: dict[str, str], degrees: Degrees) -> dict:
    """``WALKS`` for ``choices`` (plan.json / ``CHOICES`` names: ``"kind.op" -> "col"``, a
    missing op is ``rep``) at ``degrees``; see :mod:`shardc.runtime.fast`."""
    res = residual_placement(degrees)

    def index(key: str, op: str) -> int:
        name = choices.get(key, CHOICE_NAMES[op][2])
        return CHOICE_NAMES[op].index(name)

    kinds: dict[str, dict] = {}
    for key in choices:
        if "." in key:
            kinds.setdefault(key.split(".", 1)[0], {})
    for kind, branches in kinds.items():
        for branch, ops in BRANCHES.items():
            if not all(f"{kind}.{op}" in choices for op in ops):
                continue
            start, end = branch_ends(branch, res)
            idx = [index(f"{kind}.{op}", op) for op in ops]
            branches[branch] = {"steps": _steps(walk(ops, idx, start, end)), "end": end}
            if branch == "experts" and degrees.experts_resplit:  # the all-gather dispatch
                branches[branch]["gather"] = gather_split(degrees)
            elif branch == "experts" and res != "R":  # the tp ranks' routed rows gathered
                branches[branch]["whole_rows"] = _steps(walk(ops, idx, "R", "R"))
    out = {"residual": res, "kinds": kinds}
    for op in ("embedding", "lm_head"):
        start, end = branch_ends(op, res)
        w = walk((op,), [index(op, op)], start, end)
        out[op] = {"steps": _steps(w), "end": end}
    return out
