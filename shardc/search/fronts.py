"""Fronts and per-key bests over arrays of evaluated rows (pure numpy, no decoding).

The serving solve (:mod:`shardc.serving.search`) reads up to millions of recorded rows (an exact
sweep's); these pick the few rows worth turning into strategies, so only those are decoded.
"""

from __future__ import annotations

import numpy as np


def latency_front(latency: np.ndarray, value: np.ndarray, rows: np.ndarray) -> np.ndarray:
    """The rows of ``rows`` (indices) on the (lower latency, higher value) front, fastest
    first: sorted by latency ascending, then value descending, then index; a row is kept when
    its value beats every row before it (strictly, so of equal points the first is kept)."""
    rows = np.asarray(rows, dtype=np.int64)
    if not len(rows):
        return rows
    order = rows[np.lexsort((rows, -value[rows], latency[rows]))]
    v = value[order]
    before = np.concatenate([[-np.inf], np.maximum.accumulate(v)[:-1]])
    return order[v > before]


def best_per_key(keys: np.ndarray, value: np.ndarray, rows: np.ndarray) -> np.ndarray:
    """Per distinct key row (``keys`` [N, K] ints) among ``rows``, the index of its highest
    value (the first index on a tie); returned best value first (ties: key order)."""
    rows = np.asarray(rows, dtype=np.int64)
    if not len(rows):
        return rows
    _, inverse = np.unique(keys[rows], axis=0, return_inverse=True)
    inverse = inverse.ravel()
    order = np.lexsort((rows, -value[rows], inverse))  # per key: best value, first index
    first = np.ones(len(order), dtype=bool)
    first[1:] = inverse[order][1:] != inverse[order][:-1]
    best = rows[order[first]]
    return best[np.lexsort((inverse[order[first]], -value[best]))]
