"""The dtensor search's experts re-splits, cheaply: re-price its best rows at every split.

RL's action vector has no experts-split component, so sweeping the re-splits
(:func:`shardc.ir.engines.split_spaces`) means one more whole search per split. Instead, after
the search at the default split (``moe_tp = tp``), :func:`reprice_at_splits` takes a few seed
strategies -- the search's best degree rows (RL's ``extra["top_rows"]``), its best, and the
baselines' bests (a re-split baseline's as it is) -- and:

1. re-prices each at every split copy the DTensor backend runs and plan.json places
   (:func:`shardc.ir.engines.dtensor_runs_split`, :func:`~shardc.ir.engines.plan_places_split`:
   all-TP ``moe_tp = tp x ep``, all-EP ``moe_ep = tp x ep`` and mixed, both > 1, at the
   seed's own (tp, ep)), legalised for that copy:
   sp off, and every op choice the copy forbids (the router is replicated under a re-split)
   set to Megatron's, else replicated; one batched call per copy;
2. polishes the best re-priced strategy in its copy (:class:`~shardc.search.polish.
   RowPolisher`: the op choices were tuned at the default split) with a small budget
   (:data:`POLISH_BUDGET`, about 4% of the default RL budget).

The best strategy seen is returned with its copy (``SearchResult.space``); the caller keeps it
only when it beats the default-split plan. Deterministic: no randomness, copies in ascending
``moe_tp``, seeds in the order given.
"""

from __future__ import annotations

import numpy as np

from shardc.ir.engines import split_spaces
from shardc.ir.space import megatron_op_choices
from shardc.search import SearchResult
from shardc.search.legal import N_DEG, SP, TP, LegalSampler
from shardc.search.objective import Budget, BudgetExhausted, cost_model_objective
from shardc.search.polish import Archive, RowPolisher

POLISH_BUDGET = 160  # evaluations of the polish in the winning re-split copy


def legalise_for(space, actions: np.ndarray) -> np.ndarray:
    """``actions`` [B, A] of the default-split space as strategies of the re-split copy
    ``space``: sp off and every op choice the copy forbids at the row's tp set to Megatron's
    (replicated where that is illegal too); rows still illegal there are dropped, duplicates
    kept once (first occurrence)."""
    a = np.array(np.atleast_2d(actions), dtype=np.int64)
    if not len(a):
        return a
    a[:, SP] = 0
    mask = space.op_mask_by_tp[a[:, TP]]  # [B, n_slots, 3]
    ops = a[:, N_DEG:]
    ok = np.take_along_axis(mask, ops[:, :, None], axis=2)[:, :, 0]
    for i in np.flatnonzero(~ok.all(axis=1)):
        meg = megatron_op_choices(space, int(a[i, TP]))
        a[i, N_DEG:] = np.where(ok[i], ops[i], meg)
    a = a[LegalSampler(space).legal(a)]
    _, first = np.unique(a, axis=0, return_index=True)
    return a[np.sort(first)]


def reprice_at_splits(space, cost_model, seeds: list, seed: int = 0) -> SearchResult | None:
    """The best strategy at an experts re-split the DTensor backend runs, from ``seeds``
    (actions of ``space``; module docstring), polished in its copy; None for a dense model,
    a fixed split, sp fixed on, or when no seed is legal and feasible at any re-split.
    ``evaluations`` counts every evaluation (the copies' re-pricing and the polish)."""
    copies = split_spaces(space, "dtensor", sweep_dtensor=True)[1:]
    seeds = [np.asarray(s, dtype=np.int64) for s in seeds if s is not None]
    if not copies or not seeds:
        return None
    best, evals = None, 0
    for copy in copies:
        acts = legalise_for(copy, np.stack(seeds))
        if not len(acts):
            continue
        objective = cost_model_objective(cost_model, copy)
        meter = Budget(objective, len(acts))
        values, feasible = meter(acts)
        evals += meter.evaluations
        if meter.best_action is not None and (best is None or meter.best_value > best[0]):
            best = (meter.best_value, copy, objective, acts, values, feasible)
    if best is None:
        return None
    value, copy, objective, acts, values, feasible = best
    archive = Archive(copy)
    archive.record(acts, values, feasible)
    meter = Budget(objective, POLISH_BUDGET)
    meter.best_value = value
    meter.best_action = acts[int(np.argmax(np.where(feasible, values, -np.inf)))].copy()
    try:  # from the best re-priced row (the op choices tuned at the default split)
        RowPolisher(LegalSampler(copy), meter, archive,
                    getattr(objective, "op_choices_free_at_tp1", False)).run()
    except BudgetExhausted:
        pass
    evals += meter.evaluations
    value, action = meter.best_value, meter.best_action
    return SearchResult(best_action=action, best_value=float(value), evaluations=evals,
                        curve=[], wall_s=0.0, policy="resplit", seed=seed, space=copy)
