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
own number). Term tables for all degree tuples come from ``CostModel.branch_term_grid`` (one
vectorised call per branch; ``CostModel.branch_tables`` is the same grid at one row). The
evaluation reads each candidate's branch costs off that grid (``term_costs``,
``CostModel.grid_term_costs``: the numbers the cost model would price,
bit for bit; tests/test_search_exact_terms.py) and computes the rest of the step as always.
"""

from __future__ import annotations

import numpy as np

from shardc.search.legal import BATCH, N_DEG, LegalSampler
from shardc.search.objective import Budget

BLOCK_ROWS = 256  # degree rows whose candidates are built in one vectorised step


def _degree_rows(sampler: LegalSampler) -> np.ndarray:
    from shardc.search.exact import degree_tuples

    rows = []
    for t, e, p, s in degree_tuples(sampler):
        for b in range(sampler.nvec[BATCH]):
            rows.append((t, e, p, s, b))
    return np.array(rows, dtype=np.int64)


def _pareto_rows(t: np.ndarray, m: np.ndarray, key: np.ndarray, valid: np.ndarray) -> np.ndarray:
    """[R, N] bool: per row, the valid points not dominated in (t, m) by a point with the
    same key -- a point is kept when its m is below every m of the same key ordered before it
    by (t, m), ties broken by position (the first of equal points is kept)."""
    t = np.where(valid, t, np.inf)
    m = np.where(valid, m, np.inf)
    order = np.lexsort((m, t), axis=-1)
    ms = np.take_along_axis(m, order, axis=1)  # m in (t, m) order
    ks = np.take_along_axis(key, order, axis=1)
    vs = np.take_along_axis(valid, order, axis=1)
    keep_sorted = np.zeros(t.shape, dtype=bool)
    for k in np.unique(key[valid]):
        mk = np.where(ks == k, ms, np.inf)
        before = np.minimum.accumulate(mk, axis=1)
        before = np.concatenate([np.full((len(mk), 1), np.inf), before[:, :-1]], axis=1)
        keep_sorted |= (ks == k) & vs & (mk < before)
    keep = np.zeros(t.shape, dtype=bool)
    np.put_along_axis(keep, order, keep_sorted, axis=1)
    return keep


def _compact(keep: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per row, the positions of ``keep`` in order, left-aligned: (index [R, F], valid [R, F])
    with F the largest kept count (at least 1)."""
    width = max(int(keep.sum(axis=1).max(initial=0)), 1)
    idx = np.argsort(~keep, axis=1, kind="stable")[:, :width]
    return idx, np.take_along_axis(keep, idx, axis=1)


def _parts(lo: int, hi: int, terms: list, space) -> list[tuple[np.ndarray, np.ndarray]]:
    """The candidate parts of degree rows ``lo:hi``, in crossing order: per layer kind its
    Pareto front over its branches (merged branch by branch), per global term its legal
    combinations. Each part is (ops [R, F, n_slots] with -1 = unset, count [R])."""
    n_slots = len(space.op_slots)
    slot_col = {s: i for i, s in enumerate(space.op_slots)}
    rows = hi - lo
    parts = []
    for kname in dict.fromkeys(t.kind for t in terms):
        kterms = [t for t in terms if t.kind == kname]
        if kname == "global":
            for t in kterms:
                idx, valid = _compact(t.legal[lo:hi])
                ops = np.full((rows, idx.shape[1], n_slots), -1, dtype=np.int64)
                for j, s in enumerate(t.slots):
                    ops[:, :, slot_col[s]] = np.where(valid, t.combos[idx, j], -1)
                parts.append((ops, valid.sum(axis=1)))
            continue
        ft = np.zeros((rows, 1))
        fm = np.zeros((rows, 1))
        fk = np.zeros((rows, 1), dtype=np.int64)
        fv = np.ones((rows, 1), dtype=bool)
        fops = np.full((rows, 1, n_slots), -1, dtype=np.int64)
        for t in kterms:
            n = t.combos.shape[0]
            legal = t.legal[lo:hi]
            tt = (ft[:, :, None] + t.time_ms[lo:hi][:, None, :]).reshape(rows, -1)
            mm = (fm[:, :, None] + (t.weight_bytes + t.kv_bytes)[lo:hi][:, None, :]
                  ).reshape(rows, -1)
            kk = (fk[:, :, None] | t.needs[lo:hi][:, None, :]).reshape(rows, -1)
            vv = (fv[:, :, None] & legal[:, None, :]).reshape(rows, -1)
            idx, fv = _compact(_pareto_rows(tt, mm, kk, vv))
            src, combo = idx // n, idx % n
            ft = np.take_along_axis(tt, idx, axis=1)
            fm = np.take_along_axis(mm, idx, axis=1)
            fk = np.take_along_axis(kk, idx, axis=1)
            fops = np.take_along_axis(fops, src[:, :, None], axis=1)
            for j, s in enumerate(t.slots):
                fops[:, :, slot_col[s]] = t.combos[combo, j]
            fops = np.where(fv[:, :, None], fops, -1)
        parts.append((fops, fv.sum(axis=1)))
    return parts


def candidates_block(lo: int, hi: int, deg_rows: np.ndarray, terms: list, space
                     ) -> tuple[np.ndarray, np.ndarray]:
    """The pruned candidate actions of degree rows ``lo:hi`` (module docstring), row by row
    and, within a row, the parts' fronts crossed lexicographically (the first part varies
    slowest): (actions [M, A], candidates per row [hi - lo])."""
    parts = _parts(lo, hi, terms, space)
    sizes = np.stack([c for _, c in parts], axis=1) if parts else np.ones((hi - lo, 0), np.int64)
    counts = sizes.prod(axis=1)
    row_of = np.repeat(np.arange(hi - lo), counts)
    j = np.arange(len(row_of)) - np.repeat(np.cumsum(counts) - counts, counts)
    ops = np.full((len(row_of), len(space.op_slots)), -1, dtype=np.int64)
    stride = np.ones(len(row_of), dtype=np.int64)
    for p in range(len(parts) - 1, -1, -1):  # the last part varies fastest
        size = sizes[row_of, p]
        digit = (j // stride) % np.maximum(size, 1)
        stride = stride * size
        val = parts[p][0][row_of, digit]
        ops = np.where(ops >= 0, ops, val)  # a later part's setting wins
    acts = np.empty((len(row_of), N_DEG + len(space.op_slots)), dtype=np.int64)
    acts[:, :N_DEG] = deg_rows[lo:hi][row_of]
    acts[:, N_DEG:] = ops
    return acts, counts


def candidates_for(d: int, deg_row: np.ndarray, terms: list, space) -> np.ndarray:
    """[N, A] the pruned candidate actions at degree row ``d`` (``deg_row``)."""
    rows = np.broadcast_to(np.asarray(deg_row, dtype=np.int64), (d + 1, N_DEG))
    return candidates_block(d, d + 1, rows, terms, space)[0]


def search_exact_decomposed(cm, sampler: LegalSampler, budget: Budget,
                            chunk: int = 65536, time_limit_s: float | None = None,
                            clock=None) -> int:
    """Evaluate every Pareto candidate of every degree row through ``budget``; returns the
    number of candidates (the full legal space size is ``sampler.count_legal()``).
    Raises :class:`~shardc.search.exact.ExactIncomplete` after ``time_limit_s`` seconds of
    ``clock`` (default wall time; ``time.process_time`` counts CPU time)."""
    import time

    clock = clock or time.perf_counter

    from shardc.search.exact import EXACT_TIME_LIMIT_S, ExactIncomplete

    limit = EXACT_TIME_LIMIT_S if time_limit_s is None else time_limit_s
    t0 = clock()
    space = sampler.space
    deg_rows = _degree_rows(sampler)
    terms = cm.branch_term_grid(deg_rows, space)
    objective = budget.objective
    reuse = getattr(objective, "cost_model", None) is cm and budget.budget is None

    def flush(parts: list) -> None:
        acts = np.concatenate([p for p, _ in parts])
        if reuse:  # the grid priced every branch of these rows: read, not re-priced
            objective.term_costs = cm.grid_term_costs(terms, np.concatenate([r for _, r in parts]))
        try:
            budget(acts)
        finally:
            if reuse:
                objective.term_costs = None

    pending, n_pending, total = [], 0, 0
    for lo in range(0, len(deg_rows), BLOCK_ROWS):
        hi = min(lo + BLOCK_ROWS, len(deg_rows))
        acts, counts = candidates_block(lo, hi, deg_rows, terms, space)
        assert (acts >= 0).all()
        rows = lo + np.repeat(np.arange(hi - lo), counts)  # each candidate's degree row
        ends = np.cumsum(counts)
        start = 0
        for i in range(hi - lo):  # flushed at the same rows as one row at a time
            n_pending += int(counts[i])
            total += int(counts[i])
            if n_pending >= chunk:
                pending.append((acts[start:ends[i]], rows[start:ends[i]]))
                start = int(ends[i])
                flush(pending)
                pending, n_pending = [], 0
            if clock() - t0 > limit:
                raise ExactIncomplete(f"decomposed exact stopped after {limit:.0f} s "
                                      f"({lo + i} of {len(deg_rows)} degree rows)")
        if start < len(acts):
            pending.append((acts[start:], rows[start:]))
    if pending:
        flush(pending)
    return total
