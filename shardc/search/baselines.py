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
* ``best_practice`` -- what SGLang / Megatron-Core deploy, swept the same way: per op slot a
  rule picks among the choices legal at each tp (:func:`best_practice_op_choices`), so
  options the space gains (e.g. a heads split made legal by KV-head replication, sp in
  decode) are taken up without changes here.
"""

from __future__ import annotations

import math

import numpy as np

from shardc.ir.space import StrategySpace, megatron_op_choices
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


def sweep_actions(sampler: LegalSampler, templates) -> np.ndarray:
    """[N, A] every legal (tp, ep, pp, sp, batch) crossed with the op-choice rows
    ``templates(tp_idx)`` ([K, n_slots]) of its tp, in a fixed order (determinism)."""
    nv = sampler.nvec
    rows = []
    for t in range(nv[TP]):
        ops_rows = np.atleast_2d(templates(t))
        for e in np.flatnonzero(sampler.ep_mask[t]):
            for p in np.flatnonzero(sampler.pp_mask[t, e]):
                for s in range(nv[3]):
                    for b in range(nv[4]):
                        deg = np.zeros(N_DEG, dtype=np.int64)
                        deg[[TP, EP, PP, 3, 4]] = (t, e, p, s, b)
                        rows.extend(np.concatenate([deg, ops]) for ops in ops_rows)
    acts = np.array(rows, dtype=np.int64).reshape(-1, len(nv))
    # a runtime's restricted space (shardc.ir.engines) masks rows the templates propose
    return acts[sampler.legal(acts)] if len(acts) else acts


def megatron_actions(sampler: LegalSampler) -> np.ndarray:
    """[N, A] every legal (tp, ep, pp, sp, batch) with Megatron's per-op choices."""
    return sweep_actions(sampler, lambda t: megatron_op_choices(sampler.space, t))


def search_megatron(sampler: LegalSampler, budget: Budget, rng: np.random.Generator,
                    chunk: int = 4096) -> None:
    _evaluate_all(megatron_actions(sampler), budget, chunk)


def _evaluate_all(acts: np.ndarray, budget: Budget, chunk: int) -> None:
    try:
        for i in range(0, acts.shape[0], chunk):
            budget(acts[i:i + chunk])
    except BudgetExhausted:
        return


# ------------------------------------------------------------------ best practice
# Choice indices of the contract (shardc.ir.contract): 0 = col / heads, 1 = row / batch,
# 2 = replicated (follows its input: token-split on a sequence-parallel residual).
COL, ROW, REP = 0, 1, 2
# DP-attention inside the tp group (SGLang --enable-dp-attention): attention weights
# replicated, every rank serves its own sequences (attn_core split by batch)
DP_ATTENTION = {"qkv": REP, "attn_core": ROW, "out_proj": REP}
# expert tp 1 (experts unsplit; ep carries the expert parallelism, as SGLang --ep-size /
# Megatron-Core --expert-tensor-parallel-size 1)
EXPERT_TP1 = {"expert_ffn1": REP, "expert_ffn2": REP}
# Megatron's attention dims (column qkv, heads, row out-proj): with tp > KV heads the space
# makes them legal by replicating KV heads (as vLLM does), which Megatron's rule does not use
HEADS_SPLIT = {"qkv": COL, "attn_core": COL, "out_proj": ROW}


def _kv_cache_per_head(space: StrategySpace) -> bool:
    """False when some attention core's KV cache is not split by heads (MLA's latent
    cache: a heads split would hold the whole cache on every tp rank)."""
    for kind in space.graph.layer_kinds:
        core = kind.op("attn_core")
        if core is not None and not (core.attrs or {}).get("kv_cache_split_by_heads", True):
            return False
    return True


def best_practice_op_choices(space: StrategySpace, tp_idx: int) -> np.ndarray:
    """[K, n_slots] the op-choice rows the best-practice baseline tries at candidate
    ``tp_idx`` (K <= 4, distinct rows, fixed order), chosen by rule among the legal options:

    * every op starts from Megatron's dims (:func:`megatron_op_choices`); where the space
      makes the heads split legal (tp | KV heads, or KV-head replication) attention is split
      by heads (besides Megatron's own row, which replicates attention when tp > KV heads);
    * attention is also tried data-parallel inside the tp group (:data:`DP_ATTENTION`) when
      the heads split would duplicate the KV cache: MLA (the latent cache is not split by
      heads) or a heads split illegal at this tp (GQA with tp > KV heads and no replication);
    * expert TP is chosen independently of attention TP: the experts split over tp
      (Megatron) and unsplit (:data:`EXPERT_TP1`, ep carries them) are both tried.

    Degrees (tp, ep, pp, sp, batch) are swept exhaustively by the caller, so sequence
    parallelism and DP-attention over the ep group (tp = 1, ep > 1) are covered wherever
    the space has them. At tp = 1 every choice costs the same: one row (Megatron's)."""
    base = megatron_op_choices(space, tp_idx)
    if space.values["tp"][tp_idx] == 1:
        return base[None, :]
    mask = space.op_masks(np.array([tp_idx]))[0]
    ops = [slot.split(".")[-1] for slot in space.op_slots]

    def variant(row: np.ndarray, changes: dict[str, int]) -> np.ndarray | None:
        """``row`` with every op named in ``changes`` set to its choice; None when one is
        illegal here or nothing changes."""
        out = row.copy()
        for i, op in enumerate(ops):
            if op in changes:
                if not mask[i, changes[op]]:
                    return None
                out[i] = changes[op]
        return None if np.array_equal(out, row) else out

    heads_illegal = any(not mask[i, COL] for i, op in enumerate(ops) if op == "attn_core")
    # KV heads replicated, not all of attention (Megatron's own row stays: never below it)
    heads = None if heads_illegal else variant(base, HEADS_SPLIT)
    attention = [heads, base]
    if heads_illegal or not _kv_cache_per_head(space):
        attention.append(variant(base, DP_ATTENTION))
    rows = []
    for att in (a for a in attention if a is not None):
        rows += [r for r in (att, variant(att, EXPERT_TP1)) if r is not None]
    return np.stack(rows)  # distinct: each variant changes a different set of ops


def best_practice_actions(sampler: LegalSampler) -> np.ndarray:
    """[N, A] every legal (tp, ep, pp, sp, batch) with each best-practice op-choice row."""
    return sweep_actions(sampler, lambda t: best_practice_op_choices(sampler.space, t))


def search_best_practice(sampler: LegalSampler, budget: Budget, rng: np.random.Generator,
                         chunk: int = 4096) -> None:
    _evaluate_all(best_practice_actions(sampler), budget, chunk)
