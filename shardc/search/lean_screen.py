"""The row polisher's lean screen: every degree tuple the agent left without a feasible row,
tried with its tp's *memory-leanest* op choices at the largest batch they fit.

Why: on a model that barely fits the mesh (a 1T-class MoE on 32-64 GPUs), a tuple's best
row sits at the largest batch its op choices leave room for, and only a few joint choices
(e.g. attention split by sequences, so the MLA latent KV cache is not held whole on every
tp rank) leave room for more than a token batch. The agent's samples at such a tuple are all
over the HBM limit; its best feasible rows elsewhere are polished at *their* batch, where
memory does not bind, so neither the best-first polish nor a violation repair started from
the agent's random choices reaches them. Ranking the tuples by a feasible value at a token
batch would not either: the value of a decode row grows with its batch.

The screen (:func:`lean_screen`, once, after the best row is polished):

1. **Lean op choices** (:func:`lean_ops`), once, at the largest tp with an unscreened
   tuple: at one reference row (the tuple of that tp with the fewest replicas, dp smallest,
   then pp smallest; sequence parallelism off; its smallest batch that splits evenly),
   every combination of each branch's op choices with the other branches at Megatron's, one
   batched call; per branch the combination with the least memory (model bytes / usable
   HBM, which the objective reports for every strategy, feasible or not; a tie keeps
   Megatron's). The memory of a strategy at a fixed row is a sum over its branches
   (weights, KV cache, activations), so the per-branch minima combine. What a choice
   shards (which weight dim, the KV cache by heads or by sequences) is the same at every
   tp > 1, so the other tps take the same choices where legal (else Megatron's); at a tp
   whose op choices are free (tp = 1) Megatron's choices are the lean ones.
2. **Largest feasible batch per tuple** (the fewest replicas first): with the lean
   choices, the tuple's smallest splitting batch first (infeasible: the tuple is left to
   the agent and the repair step -- the lean choices at the smallest batch are the least
   memory the tuple can hold), then a bisection over its splitting batches for the largest
   feasible one (memory and step time grow with the batch). About ``log2(batches)``
   evaluations per tuple that fits; the tuples of one replica count are bisected in lock
   step, one batched call per round.

The rows found enter the archive, so the best-first polish (:class:`RowPolisher`) then
takes the best of them: value-optimal choices at a batch where the tuple's memory binds.
Deterministic: tuples by replicas then index, ties by row order. Every evaluation counts
against the budget; at most :data:`SCREEN_SHARE` of what is left is spent here.
"""

from __future__ import annotations

import numpy as np

from shardc.search.legal import BATCH, EP, N_DEG, PP, SP, TP

SCREEN_SHARE = 0.5  # at most this fraction of the budget left goes to the lean screen


def _tuples(polisher) -> np.ndarray:
    """[K, 4] legal (tp, ep, pp, sp) index tuples (sp at tp = 1: one spelling)."""
    s, space = polisher.sampler, polisher.space
    n_sp = int(s.nvec[SP])
    rows = [(t, e, p, sp) for t, e, p in np.argwhere(s.pp_mask) for sp in range(n_sp)
            if space.values["tp"][t] > 1 or space.values["sp"][sp] == 0 or n_sp == 1]
    return np.array(rows, dtype=np.int64).reshape(-1, 4)


def _splitting_batches(polisher, tup: np.ndarray) -> np.ndarray:
    """Batch indices (ascending) that split evenly over ``tup``'s work units and then over
    its tp ranks (decode: pp micro-batches x ep attention groups x tp; prefill: ep groups x
    tp), so every op choice -- a split by tokens or sequences included -- can take them."""
    space = polisher.space
    tp, ep, pp = (space.values[k][int(i)] for k, i in zip(("tp", "ep", "pp"), tup[:3]))
    units = tp * ep * (pp if space.workload.phase == "decode" else 1)
    batches = np.asarray(space.values["batch"], dtype=np.int64)
    return np.flatnonzero(batches % units == 0)


def lean_ops(polisher, tp_idx: int, tuples: np.ndarray) -> np.ndarray | None:
    """The memory-leanest op choices at candidate ``tp_idx`` (step 1 of the module
    docstring); None when the objective reports no memory or no reference row splits."""
    mega = polisher.megatron[tp_idx]
    if tp_idx == polisher.free_tp:
        return mega
    space = polisher.space
    cand = tuples[tuples[:, 0] == tp_idx]
    if not len(cand):
        return None
    ep = np.asarray(space.values["ep"])[cand[:, 1]]
    pp = np.asarray(space.values["pp"])[cand[:, 2]]
    sp_off = np.asarray(space.values["sp"])[cand[:, 3]] <= 1
    order = np.lexsort((cand[:, 3], pp, -(ep * pp), ~sp_off))
    ref = cand[order[0]]
    batches = _splitting_batches(polisher, ref)
    if not len(batches):
        return None
    base = np.zeros(polisher.sampler.n_comp, dtype=np.int64)
    base[[TP, EP, PP, SP]] = ref
    base[BATCH] = batches[0]
    base[N_DEG:] = mega
    if not polisher.sampler.legal(base[None])[0]:  # e.g. an engine's mode space
        return None
    blocks, owner = polisher.group_neighbours(base, tp_idx)
    acts, owner = np.concatenate([base[None], *blocks]), [-1, *owner]
    polisher.evaluate(acts)
    mem = np.array([polisher.archive.memory.get(a.tobytes(), np.nan) for a in acts])
    if not np.isfinite(mem[0]):
        return None
    owner = np.array(owner)
    lean = base.copy()
    for g in np.unique(owner[owner >= 0]):
        sel = np.flatnonzero((owner == g) & np.isfinite(mem))
        if len(sel):
            i = sel[int(np.argmin(mem[sel]))]
            if mem[i] < mem[0]:
                lean[polisher.groups[g]] = acts[i, polisher.groups[g]]
    return lean[N_DEG:]


def _lean_at(polisher, tp_idx: int, found: np.ndarray | None) -> np.ndarray | None:
    """The lean choices ``found`` at the largest tp, taken at ``tp_idx`` where legal there
    (an illegal one: Megatron's); Megatron's at a tp whose choices are free."""
    if tp_idx == polisher.free_tp:
        return polisher.megatron[tp_idx]
    if found is None:
        return None
    legal = polisher.sampler.op_mask[tp_idx, np.arange(len(found)), found]
    return np.where(legal, found, polisher.megatron[tp_idx])


def lean_screen(polisher) -> None:
    """Steps 1-2 of the module docstring over the tuples with no feasible row yet."""
    archive, budget = polisher.archive, polisher.budget
    if not archive.memory:  # the objective reports no memory
        return
    stop = budget.evaluations + int(SCREEN_SHARE * budget.remaining)
    tuples = _tuples(polisher)
    probe = np.zeros((len(tuples), polisher.sampler.n_comp), dtype=np.int64)
    probe[:, [TP, EP, PP, SP]] = tuples
    keys = [k[:4] for k in archive.row_keys(probe)]
    # the fewest replicas first (the least memory per GPU), then index order
    dp = polisher.space.degree_arrays(probe)["dp"]
    todo = [i for i in np.argsort(dp, kind="stable") if keys[i] not in archive.feasible_tuples]
    tps = sorted({int(tuples[i, 0]) for i in todo} - {polisher.free_tp})
    found = lean_ops(polisher, tps[-1], tuples) if tps else None
    jobs = []  # [base, its splitting batches, lo, hi, dp]: batches[lo] fits, [hi] does not
    for i in todo:
        t = int(tuples[i, 0])
        ops = _lean_at(polisher, t, found)
        batches = _splitting_batches(polisher, tuples[i])
        if ops is not None and len(batches):
            base = np.zeros(polisher.sampler.n_comp, dtype=np.int64)
            base[[TP, EP, PP, SP]] = tuples[i]
            base[N_DEG:] = ops
            if not polisher.sampler.legal(base[None])[0]:
                continue
            jobs.append([base, batches, -1, len(batches), int(dp[i])])
    # per replica count, fewest first: the smallest splitting batch of every tuple, then a
    # bisection, in lock step (one call per round; rows in the order above, cut at the
    # screen's share)
    while budget.evaluations < stop:
        active = [j for j in jobs if j[3] - j[2] > 1]
        if not active:
            return
        active = [j for j in active if j[4] == active[0][4]]
        active = active[:stop - budget.evaluations]
        rows = np.array([j[0] for j in active])
        mids = [0 if j[2] < 0 else (j[2] + j[3]) // 2 for j in active]
        rows[:, BATCH] = [j[1][m] for j, m in zip(active, mids)]
        ok = np.isfinite(polisher.evaluate(rows))
        for j, m, fit in zip(active, mids, ok):
            if fit:
                j[2] = m
            elif j[2] < 0:  # the smallest batch does not fit: the tuple is left out
                j[2], j[3] = 0, 0
            else:
                j[3] = m
