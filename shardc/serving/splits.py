"""The serving search over the experts splits (``moe_tp x moe_ep``, docs/deploy.md
"Attention data parallel with the experts split their own way"): with a MoE model the whole
serving search (:func:`shardc.serving.search.serve_search`) runs once at the default split and once
per ``moe_tp`` value giving some re-split the runtime runs (:func:`shardc.ir.engines.
searched_splits`: an engine's flags, all-TP, all-EP and mixed splits alike; dtensor:
:func:`shardc.ir.engines.dtensor_runs_split`, when switched on), each a fixed-split search,
and the best deployment (tok/s/GPU) is kept -- the default's on a tie, its baselines
reported. Every pool of one deployment has the same ``moe_tp`` (``moe_ep = tp x dp_attn /
moe_tp`` at each pool's degrees)."""

from __future__ import annotations

from shardc.cost import load_hardware
from shardc.errors import InfeasibleError, InputError
from shardc.ir import engines
from shardc.ir.space import StrategySpace, nvlink_tp_domain
from shardc.serving.pool_models import pool_workload


def serve_splits(graph, mesh, hardware, wl, fixed, runtime: str,
                 allow_cross_node_tp: bool) -> list[int]:
    """The moe_tp values the serving search sweeps besides the default split (none for a
    dense model, a split fixed in ``fixed``, or dtensor unless
    :data:`shardc.ir.engines.DTENSOR_SEARCH_SWEEPS_RESPLITS`)."""
    if not int(graph.config.get("num_experts", 0) or 0):
        return []
    domain = nvlink_tp_domain(mesh, load_hardware(hardware).nvlink_domain, allow_cross_node_tp)
    space = StrategySpace(graph, mesh, pool_workload(wl, "mixed"), fixed=dict(fixed or {}),
                          tp_domain=domain)
    return engines.searched_splits(space, runtime)


def best_over_splits(search_one, fixed: dict | None, splits):
    """``search_one(fixed)`` (a ServeOutcome) at ``fixed`` and at ``fixed`` plus each
    ``moe_tp`` of ``splits()`` (called after the default's search, so its errors come
    first); the best by ``choice.tok_s_per_gpu``. A re-split that is infeasible or bad input
    is skipped; the default's InfeasibleError is raised only when no re-split fits either
    (an engine may have flags for a re-split only). The baselines reported (Megatron,
    best practice) are each the best over the same splits, as the plan's (each split's
    search ran them at the same budget; a tie keeps the default split's)."""
    best, infeasible, outcomes = None, None, []
    try:
        best = search_one(fixed)
        outcomes.append(best)
    except InfeasibleError as e:
        infeasible = e
    for moe_tp in splits():
        try:
            out = search_one({**(fixed or {}), "moe_tp": int(moe_tp)})
        except (InfeasibleError, InputError):
            continue
        outcomes.append(out)
        if best is None or out.choice.tok_s_per_gpu > best.choice.tok_s_per_gpu:
            best = out
    if best is None:
        raise infeasible
    for name in ("megatron", "best_practice"):
        got = [getattr(o, name) for o in outcomes if getattr(o, name) is not None]
        setattr(best, name, max(got, key=lambda c: c.tok_s_per_gpu) if got else None)
    return best


__all__ = ["serve_splits", "best_over_splits"]
