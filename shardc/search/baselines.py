"""Baseline searchers at the same evaluation budget as the agent, and the Megatron heuristic.

Each ``search_*`` function spends ``budget`` (a :class:`~shardc.search.objective.Budget`)
until it raises :class:`~shardc.search.objective.BudgetExhausted` or the method ends; the
best feasible action is whatever the Budget saw. All proposals come from
:class:`~shardc.search.legal.LegalSampler`, so only legal strategies are ever evaluated.

* ``rw`` -- random walk: from a random legal start, every step moves to a random neighbour
  (one component changed, dependants repaired), always accepted.
* ``sa`` -- simulated annealing: the same neighbourhood, Metropolis acceptance
  ``exp((v_new - v_cur) / T)`` on raw tok/s/GPU, ``T = T0 * (1 + cos(pi * k / N)) / 2``
  (cosine schedule over each chain's N steps), ``T0 = 100`` (tok/s/GPU) as in the paper;
  infeasible proposals are never accepted once a feasible point is held.

rw and sa run ``chains`` (default 8) independent chains side by side, one batched simulator
call per step (budget / chains steps each): the cost model's per-call overhead (several ms)
would otherwise dominate 4000 single evaluations. ``chains=1`` is the classic single chain.
* ``ga`` -- genetic algorithm: (mu + lambda) with mu = lambda = 32, binary tournaments,
  uniform crossover, one-component mutation, legality repaired after each operator.
* ``megatron`` -- Megatron's fixed per-op dims with an exhaustive sweep over every legal
  (tp, ep, pp, sp, batch); its evaluation count is the size of that sweep, not the budget.
"""

from __future__ import annotations

import math

import numpy as np

from shardc.ir.space import megatron_op_choices
from shardc.search.legal import EP, N_DEG, PP, TP, LegalSampler
from shardc.search.objective import Budget, BudgetExhausted

SA_T0 = 100.0  # initial temperature, tok/s/GPU
CHAINS = 8  # independent rw / sa chains advanced together (one batched simulator call)
GA_POP = 32
INFEASIBLE = -np.inf


def _fitness(value: np.ndarray, feasible: np.ndarray) -> np.ndarray:
    return np.where(feasible, value, INFEASIBLE)


def search_rw(sampler: LegalSampler, budget: Budget, rng: np.random.Generator,
              chains: int = CHAINS) -> None:
    cur = sampler.sample(chains, rng)
    try:
        budget(cur)
        while True:
            cur = sampler.mutate(cur, rng)
            budget(cur)
    except BudgetExhausted:
        return


def search_sa(sampler: LegalSampler, budget: Budget, rng: np.random.Generator,
              t0: float = SA_T0, chains: int = CHAINS) -> None:
    steps = max(budget.remaining // chains, 1) if budget.budget is not None else 500
    cur = sampler.sample(chains, rng)
    try:
        v, f = budget(cur)
        cur, cur_fit = cur[: len(v)], _fitness(v, f)
        step = 1
        while True:
            temp = t0 * 0.5 * (1.0 + math.cos(math.pi * min(step / steps, 1.0)))
            cand = sampler.mutate(cur, rng)
            v, f = budget(cand)
            n = len(v)
            new_fit = _fitness(v, f)
            old = cur_fit[:n]
            with np.errstate(invalid="ignore", over="ignore"):
                p = np.exp(np.minimum((new_fit - old) / max(temp, 1e-12), 0.0))
            p = np.where(np.isfinite(p), p, 0.0)
            u = rng.random(n)
            accept = (new_fit >= old) | (old == INFEASIBLE) | ((new_fit > INFEASIBLE) & (u < p))
            cur[:n][accept] = cand[:n][accept]
            cur_fit[:n][accept] = new_fit[accept]
            step += 1
    except BudgetExhausted:
        return


def search_ga(sampler: LegalSampler, budget: Budget, rng: np.random.Generator,
              pop_size: int = GA_POP, mutation_changes: int = 1) -> None:
    try:
        pop = sampler.sample(pop_size, rng)
        v, f = budget(pop)
        pop, fit = pop[: len(v)], _fitness(v, f)
        while True:
            n = pop.shape[0]

            def tournament(k: int) -> np.ndarray:
                i, j = rng.integers(0, n, size=k), rng.integers(0, n, size=k)
                return np.where(fit[i] >= fit[j], i, j)

            pa, pb = pop[tournament(pop_size)], pop[tournament(pop_size)]
            take_a = rng.random(pa.shape) < 0.5
            children = sampler.repair(np.where(take_a, pa, pb), rng)
            children = sampler.mutate(children, rng, mutation_changes)
            v, f = budget(children)
            children, cfit = children[: len(v)], _fitness(v, f)
            allp = np.concatenate([pop, children])
            allf = np.concatenate([fit, cfit])
            order = np.argsort(-allf, kind="stable")[:pop_size]
            pop, fit = allp[order], allf[order]
    except BudgetExhausted:
        return


def megatron_actions(sampler: LegalSampler) -> np.ndarray:
    """[N, A] every legal (tp, ep, pp, sp, batch) with Megatron's per-op choices."""
    space = sampler.space
    nv = sampler.nvec
    rows = []
    for t in range(nv[TP]):
        ops = megatron_op_choices(space, t)
        for e in np.flatnonzero(sampler.ep_mask[t]):
            for p in np.flatnonzero(sampler.pp_mask[t, e]):
                for s in range(nv[3]):
                    for b in range(nv[4]):
                        deg = np.zeros(N_DEG, dtype=np.int64)
                        deg[[TP, EP, PP, 3, 4]] = (t, e, p, s, b)
                        rows.append(np.concatenate([deg, ops]))
    return np.array(rows, dtype=np.int64).reshape(-1, len(nv))


def search_megatron(sampler: LegalSampler, budget: Budget, rng: np.random.Generator,
                    chunk: int = 4096) -> None:
    acts = megatron_actions(sampler)
    try:
        for i in range(0, acts.shape[0], chunk):
            budget(acts[i:i + chunk])
    except BudgetExhausted:
        return
