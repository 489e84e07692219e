"""Exact optimum of shardc's cost model by per-(layer kind, branch) decomposition.

At fixed degrees and batch (tp, ep, pp, sp, batch), the cost model's step is a sum over
(layer kind x branch) terms with non-negative coefficients (:mod:`shardc.cost.decomposition`):
per layer of kind k, ``time_k = norms_k + sum_b time(k, b, c_b)`` and
``bytes_k = other_k + sum_b (weight + kv)(k, b, c_b)``, and every stage's time and resident
bytes are non-decreasing in each ``time_k`` / ``bytes_k``; throughput is decreasing in the
step latency. So a branch-choice vector that is no faster and no smaller in both sums than
another of the same kind can be dropped (Pareto pruning) without losing the optimum --
provided the two are interchangeable for feasibility. The only choice-dependent feasibility
conditions besides time and memory are the op masks (illegal combinations are excluded) and
the token-split divisibility (a replicated op on a sequence-split residual needs the tokens,
batch-split attention the sequences, divisible by tp); combinations are therefore pruned only
against others with the same split requirements.

Per degree tuple: the kind's Pareto front over its branches (merged branch by branch), the
product of the kinds' fronts and every legal embedding / lm_head choice are the candidates;
they are evaluated with the public ``CostModel.evaluate`` (so the answer is the cost model's
own number). Term tables for all degree tuples come from ``CostModel.branch_term_grid`` (one vectorised
simulator call per branch; ``CostModel.branch_tables`` is the same grid at one row).
"""

from __future__ import annotations

import numpy as np

from shardc.search.legal import BATCH, N_DEG, LegalSampler
from shardc.search.objective import Budget


def _pareto(t: np.ndarray, m: np.ndarray, key: np.ndarray) -> np.ndarray:
    """Indices of points not dominated in (t, m) by a point with the same key."""
    keep = []
    for k in np.unique(key):
        idx = np.flatnonzero(key == k)
        order = idx[np.lexsort((m[idx], t[idx]))]
        best_m = np.inf
        for i in order:
            if m[i] < best_m:
                keep.append(i)
                best_m = m[i]
    return np.array(sorted(keep), dtype=np.int64)


def _degree_rows(sampler: LegalSampler) -> np.ndarray:
    from shardc.search.exact import degree_tuples

    rows = []
    for t, e, p, s in degree_tuples(sampler):
        for b in range(sampler.nvec[BATCH]):
            rows.append((t, e, p, s, b))
    return np.array(rows, dtype=np.int64)


def candidates_for(d: int, deg_row: np.ndarray, terms: list[dict], space) -> np.ndarray:
    """[N, A] the pruned candidate actions at degree row ``d``."""
    col = {s: N_DEG + i for i, s in enumerate(space.op_slots)}
    parts = []  # list of [n_i, A-N_DEG] partial op assignments (-1 = unset), to cross
    kinds = [k for k in dict.fromkeys(t.kind for t in terms)]
    for kname in kinds:
        kterms = [t for t in terms if t.kind == kname]
        if kname == "global":
            for t in kterms:
                ok = np.flatnonzero(t.legal[d])
                part = np.full((len(ok), len(space.op_slots)), -1, dtype=np.int64)
                for j, s in enumerate(t.slots):
                    part[:, col[s] - N_DEG] = t.combos[ok, j]
                parts.append(part)
            continue
        ft = np.zeros(1)
        fm = np.zeros(1)
        fk = np.zeros(1, dtype=np.int64)
        fa = np.full((1, len(space.op_slots)), -1, dtype=np.int64)
        for t in kterms:
            ok = np.flatnonzero(t.legal[d])
            tt = (ft[:, None] + t.time_ms[d, ok][None, :]).ravel()
            mm = (fm[:, None] + (t.weight_bytes + t.kv_bytes)[d, ok][None, :]).ravel()
            kk = (fk[:, None] | t.needs[d, ok][None, :]).ravel()
            aa = np.repeat(fa, len(ok), axis=0)
            for j, s in enumerate(t.slots):
                aa[:, col[s] - N_DEG] = np.tile(t.combos[ok, j], len(fa))
            keep = _pareto(tt, mm, kk)
            ft, fm, fk, fa = tt[keep], mm[keep], kk[keep], aa[keep]
        parts.append(fa)
    ops = np.full((1, len(space.op_slots)), -1, dtype=np.int64)
    for part in parts:
        crossed = np.repeat(ops, len(part), axis=0)
        tiled = np.tile(part, (len(ops), 1))
        ops = np.where(tiled >= 0, tiled, crossed)
    acts = np.empty((len(ops), N_DEG + len(space.op_slots)), dtype=np.int64)
    acts[:, :N_DEG] = deg_row
    acts[:, N_DEG:] = ops
    return acts


def search_exact_decomposed(cm, sampler: LegalSampler, budget: Budget,
                            chunk: int = 65536, time_limit_s: float | None = None) -> int:
    """Evaluate every Pareto candidate of every degree row through ``budget``; returns the
    number of candidates (the full legal space size is ``sampler.count_legal()``).
    Raises :class:`~shardc.search.exact.ExactIncomplete` after ``time_limit_s``."""
    import time

    from shardc.search.exact import EXACT_TIME_LIMIT_S, ExactIncomplete

    limit = EXACT_TIME_LIMIT_S if time_limit_s is None else time_limit_s
    t0 = time.perf_counter()
    space = sampler.space
    deg_rows = _degree_rows(sampler)
    terms = cm.branch_term_grid(deg_rows, space)
    pending, n_pending, total = [], 0, 0
    for d in range(len(deg_rows)):
        acts = candidates_for(d, deg_rows[d], terms, space)
        assert (acts >= 0).all()
        pending.append(acts)
        n_pending += len(acts)
        total += len(acts)
        if n_pending >= chunk:
            budget(np.concatenate(pending))
            pending, n_pending = [], 0
        if time.perf_counter() - t0 > limit:
            raise ExactIncomplete(f"decomposed exact stopped after {limit:.0f} s "
                                  f"({d} of {len(deg_rows)} degree rows)")
    if pending:
        budget(np.concatenate(pending))
    return total
