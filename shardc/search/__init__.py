"""shardc.search: the RL agent (the paper's method) and the baseline searchers.

Entry point::

    result = run_search("rl", space, objective, budget=4000, seed=0, progress=None)

The budgeted searchers keep one evaluation per batch candidate for last: their best strategy
at every batch of the grid (:func:`_refine_batch`; the grid is fine near the SLO).

``objective(actions[B, A]) -> (tok_s_per_gpu[B], feasible[B])`` (see
:mod:`shardc.search.objective`; :func:`cost_model_objective` adapts shardc.cost's
CostModel). Policies: ``rl``, ``sa``, ``rw``, ``ga`` (spend exactly ``budget`` evaluations),
``megatron`` (an exhaustive sweep of Megatron-dims strategies), ``best_practice`` (the same
sweep over the per-op rules SGLang / Megatron-Core deploy, :mod:`shardc.search.baselines`)
and ``exact`` (every legal strategy; the ceiling). Every searcher evaluates and returns only
legal actions (see :mod:`shardc.search.legal`). Same seed and inputs, same result.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np

from shardc.search.objective import (
    Budget,
    BudgetExhausted,
    CostModelObjective,
    Objective,
    Progress,
    cost_model_objective,
)

POLICIES = ("rl", "sa", "rw", "ga", "megatron", "best_practice", "exact")
SWEEPS = ("megatron", "best_practice", "exact")  # deterministic; evaluations = sweep size


@dataclass
class SearchResult:
    """Outcome of one search. ``best_value`` in tokens/s per GPU (0.0 and ``best_action``
    None when no feasible strategy was seen); ``curve`` = [(evaluations, best_value)];
    ``complete`` is False only for an ``exact`` sweep stopped by its time limit;
    ``space``: see the field."""

    best_action: np.ndarray | None
    best_value: float
    evaluations: int
    curve: list[tuple[int, float]]
    wall_s: float
    policy: str
    seed: int
    complete: bool = True
    extra: dict = field(default_factory=dict)
    # the space ``best_action`` decodes in when it is not the searched space (an experts
    # re-split copy, :func:`shardc.ir.space.with_experts_split`); None: the searched space
    space: object = None

    @property
    def found(self) -> bool:
        return self.best_action is not None


def run_search(policy: str, space, objective: Objective, budget: int = 4000, seed: int = 0,
               progress: Progress | None = None, **options) -> SearchResult:
    """Search ``space`` for the action maximising ``objective``.

    ``budget`` caps simulator evaluations (every one counts, infeasible included) for
    rl/sa/rw/ga; megatron, best_practice and exact are sweeps whose size is reported in
    ``evaluations``.
    ``options`` go to the searcher (e.g. ``cfg=RLConfig(...)`` for rl,
    ``time_limit_s`` for exact). ``exact`` uses the cost model's branch decomposition
    (:mod:`shardc.search.exact_decomposed`) when ``objective`` is a
    :func:`cost_model_objective` of this space (``decompose=False`` forces the plain sweep)."""
    from shardc.search import baselines, exact
    from shardc.search.legal import LegalSampler

    if policy == "rl":  # imported only when it runs (torch, gymnasium), outside the timing
        from shardc.search import rl

    if policy not in POLICIES:
        raise ValueError(f"unknown search policy {policy!r} (expected one of {', '.join(POLICIES)})")
    sampler = LegalSampler(space)
    rng = np.random.default_rng(seed)
    sweep = policy in SWEEPS
    reserve = _batch_reserve(sampler, budget) if not sweep else 0
    meter = Budget(objective, None if sweep else budget - reserve, progress)
    complete = True
    extra: dict = {}
    t0 = time.perf_counter()
    if policy == "rl":
        extra = rl.search_rl(sampler, meter, rng, seed, **options)
    elif policy == "exact":
        if isinstance(objective, CostModelObjective) and objective.space is space \
                and options.pop("decompose", True):
            from shardc.search.exact_decomposed import search_exact_decomposed

            try:
                search_exact_decomposed(objective.cost_model, sampler, meter, **options)
            except exact.ExactIncomplete:
                complete = False
        else:
            try:
                exact.search_exact(sampler, meter, rng, **options)
            except exact.ExactIncomplete:
                complete = False
    else:
        fn = {"sa": baselines.search_sa, "rw": baselines.search_rw, "ga": baselines.search_ga,
              "megatron": baselines.search_megatron,
              "best_practice": baselines.search_best_practice}[policy]
        fn(sampler, meter, rng, **options)
    if reserve:
        meter.budget += reserve
        _refine_batch(sampler, meter)
    wall = time.perf_counter() - t0
    if meter.best_action is not None:
        assert sampler.legal(meter.best_action[None])[0], "searcher produced an illegal action"
    return SearchResult(best_action=meter.best_action, best_value=meter.best_value,
                        evaluations=meter.evaluations, curve=meter.curve, wall_s=wall,
                        policy=policy, seed=seed, complete=complete, extra=extra)


def _batch_reserve(sampler, budget: int) -> int:
    """Evaluations kept back for :func:`_refine_batch`: one per batch candidate, when the
    budget is at least four times that (else 0: the searcher spends it all)."""
    from shardc.search.legal import BATCH

    n = int(sampler.nvec[BATCH])
    return n if n > 1 and budget >= 4 * n else 0


def _refine_batch(sampler, meter: Budget) -> None:
    """The best strategy found, at every batch candidate (its degrees and op choices kept):
    the batch grid is fine near the SLO (neighbours <= 25% apart), so a searcher that
    stopped a step or two short of the largest feasible batch of its plan reaches it here."""
    from shardc.search.legal import BATCH

    if meter.best_action is None:
        return
    rows = np.repeat(meter.best_action[None, :], sampler.nvec[BATCH], axis=0)
    rows[:, BATCH] = np.arange(sampler.nvec[BATCH])
    try:
        meter(rows)
    except BudgetExhausted:
        return


def plot_search_curve(path, curves: dict, megatron: float | None = None,
                      exact: float | None = None, title: str = "",
                      best_practice: float | None = None) -> str:
    """Write ``search.png``: best-so-far tok/s/GPU against evaluations for each searcher in
    ``curves`` ({name: [(evals, best)]}), with horizontal Megatron / exact lines if given;
    returns the title drawn."""
    from shardc.search.plot import plot_search_curve as _plot

    return _plot(path, curves, megatron=megatron, exact=exact, title=title,
                 best_practice=best_practice)


__all__ = ["POLICIES", "SearchResult", "run_search", "plot_search_curve", "cost_model_objective",
           "Budget"]
