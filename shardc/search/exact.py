"""``exact``: the true optimum of the objective over every legal action (the ceiling).

Generic method: enumerate every legal action (degrees that tile the mesh x batch x the op
choices legal at that tp) in chunks and evaluate them with the vectorised objective.
Two exact reductions keep it tractable without assumptions beyond those stated:

* **Batch pruning** (``monotone_batch=True``): a larger batch never uses less memory and
  never lowers TPOT/TTFT (invariants the cost model's tests pin), so batch sizes are swept
  ascending per degree tuple along each doubling chain of the grid (:func:`_batch_order`)
  and an op combination that was feasible at some batch of the chain and is infeasible at
  batch b is not evaluated at larger batches of it. (Combinations never yet feasible stay
  in: a small batch can be infeasible for other reasons, e.g. divisibility.)
* **Branch decomposition** (when the objective offers ``decomposed(...)``; see
  :mod:`shardc.search.decomposed`): op choices of independent branches are optimised apart.

A wall-clock limit (default 600 s, the issue's "finishes in 10 minutes") stops the sweep;
the result then says ``complete=False`` and is a lower bound only.
"""

from __future__ import annotations

import itertools
import time

import numpy as np

from shardc.search.legal import BATCH, EP, N_DEG, PP, SP, TP, LegalSampler
from shardc.search.objective import Budget

EXACT_TIME_LIMIT_S = 600.0


class ExactIncomplete(Exception):
    """The sweep hit its wall-clock limit; the best found so far is a lower bound."""


def op_combinations(sampler: LegalSampler, tp_idx: int) -> np.ndarray:
    """[N, n_slots] every legal combination of op choices at candidate ``tp_idx``."""
    legal = [np.flatnonzero(row) for row in sampler.op_mask[tp_idx]]
    if not legal:
        return np.zeros((1, 0), dtype=np.int64)
    return np.array(list(itertools.product(*legal)), dtype=np.int64)


def degree_tuples(sampler: LegalSampler) -> list[tuple[int, int, int, int]]:
    """Every legal (tp_idx, ep_idx, pp_idx, sp_idx) (batch excluded)."""
    out = []
    for t in range(sampler.nvec[TP]):
        for e in np.flatnonzero(sampler.ep_mask[t]):
            for p in np.flatnonzero(sampler.pp_mask[t, e]):
                for s in range(sampler.nvec[SP]):
                    out.append((t, int(e), int(p), s))
    return out


def _batch_order(sampler: LegalSampler, monotone_batch: bool):
    """Batch indices in sweep order, each doubling chain (values with the same odd part:
    1, 2, 4, ...; 3, 6, 12, ...; 5, 10, 20, ...) ascending after a ``None`` marker. Batch
    pruning is exact along a chain only: there a batch that divides evenly stays divisible at
    the next value (twice it), so a combination feasible at b and infeasible at a larger
    value of its chain failed a monotone check (memory, latency). Without pruning: one chain."""
    values = list(sampler.space.values["batch"])
    if not monotone_batch:
        return [None, *sorted(range(len(values)), key=lambda i: values[i])]
    chains: dict[int, list[int]] = {}
    for i, v in enumerate(values):
        odd = v
        while odd % 2 == 0:
            odd //= 2
        chains.setdefault(odd, []).append(i)
    out: list = []
    for odd in sorted(chains):
        out += [None, *sorted(chains[odd], key=lambda i: values[i])]
    return out


def search_exact(sampler: LegalSampler, budget: Budget, rng=None, *,
                 time_limit_s: float = EXACT_TIME_LIMIT_S, monotone_batch: bool = True,
                 chunk: int = 65536, clock=time.perf_counter) -> None:
    """Evaluate every legal action (with batch pruning); raises ExactIncomplete on timeout
    (``clock``: the seconds the limit counts, e.g. ``time.process_time`` for CPU time)."""
    t0 = clock()
    n_comp = sampler.n_comp
    combos_by_tp = {}
    for t, e, p, s in degree_tuples(sampler):
        if t not in combos_by_tp:
            combos_by_tp[t] = op_combinations(sampler, t)
        for b in _batch_order(sampler, monotone_batch):
            if b is None:  # a new doubling chain: every combination alive again
                alive = combos_by_tp[t]
                seen = np.zeros(alive.shape[0], dtype=bool)
                continue
            if alive.shape[0] == 0:
                continue
            acts = np.zeros((alive.shape[0], n_comp), dtype=np.int64)
            acts[:, [TP, EP, PP, SP, BATCH]] = (t, e, p, s, b)
            acts[:, N_DEG:] = alive
            feas = np.zeros(alive.shape[0], dtype=bool)
            for i in range(0, acts.shape[0], chunk):
                _, f = budget(acts[i:i + chunk])
                feas[i:i + len(f)] = f
                if clock() - t0 > time_limit_s:
                    raise ExactIncomplete(
                        f"exact sweep stopped after {time_limit_s:.0f} s "
                        f"({budget.evaluations} evaluations)")
            if monotone_batch:
                keep = feas | ~seen
                alive, seen = alive[keep], (seen | feas)[keep]
