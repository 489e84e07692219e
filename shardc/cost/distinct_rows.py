"""Price each distinct branch shape once per batch of strategies.

A branch's cost (:func:`shardc.cost.layer_costs.branch_cost`) is a row-wise function of the
strategy's degrees (tp, ep, pp, sp, batch: every per-row quantity of the
:class:`~shardc.cost.layer_costs.Batch` derives from them), the prompt chunk a decode step
carries and the branch's own op-choice combination. A batch of strategies that the search or
the exact ceiling evaluates holds few distinct (degrees, chunk) contexts and few combinations
per branch, but many rows (the cross product over the other branches' choices, the
scheduler's budget candidates): :func:`distinct_branch_cost` prices each distinct
(context, combination) once and copies its time and bytes to the rows that share it. Every
op is element-wise over rows, so the result is the same floats as pricing every row.

Units: as :mod:`shardc.cost.layer_costs` (seconds, bytes).
"""

from __future__ import annotations

from dataclasses import fields, replace

import numpy as np

from shardc.cost.layer_costs import Batch, BranchCost, branch_cost
from shardc.cost.moe_dispatch import GatherView
from shardc.cost.topology import CommGroup

DENSE_KEYS = 1 << 22  # key spaces up to this size dedupe by a dense table (no sort)


def context_ids(degree_actions: np.ndarray, chunk) -> tuple[np.ndarray, int]:
    """([B] id of each row's (degree indices, chunk) context in 0..n-1, n): rows with equal
    ids have equal per-row Batch quantities. ``degree_actions`` [B, d] small non-negative
    ints (the action's degree columns), ``chunk`` [B] or a scalar (prompt tokens)."""
    d = np.atleast_2d(np.asarray(degree_actions, dtype=np.int64))
    code = np.zeros(d.shape[0], dtype=np.int64)
    for j in range(d.shape[1]):
        code = code * (int(d[:, j].max(initial=0)) + 1) + d[:, j]
    _, ids = np.unique(code, return_inverse=True)
    ids = ids.reshape(-1)
    if np.ndim(chunk) and np.size(chunk) == len(ids):
        _, cid = np.unique(np.asarray(chunk, dtype=np.float64), return_inverse=True)
        _, ids = np.unique(ids * (int(cid.max(initial=0)) + 1) + cid.reshape(-1),
                           return_inverse=True)
        ids = ids.reshape(-1)
    return ids.astype(np.int64), int(ids.max(initial=-1)) + 1


def distinct_keys(key: np.ndarray, space: int) -> tuple[np.ndarray, np.ndarray]:
    """(first row of each distinct key [U], index into those of every row [B]) for
    non-negative int keys below ``space``; the distinct keys in increasing order."""
    if space <= DENSE_KEYS:
        first = np.full(space, -1, dtype=np.int64)
        first[key[::-1]] = np.arange(len(key) - 1, -1, -1)  # the last write is the first row
        present = np.flatnonzero(first >= 0)
        slot = np.zeros(space, dtype=np.int64)
        slot[present] = np.arange(len(present))
        return first[present], slot[key]
    _, first, inv = np.unique(key, return_index=True, return_inverse=True)
    return first, inv.reshape(-1)


def _take(x, rows: np.ndarray, n: int):
    """``x`` restricted to ``rows`` where it is a per-row array (length ``n``), else ``x``."""
    if isinstance(x, np.ndarray) and x.ndim >= 1 and x.shape[0] == n:
        return x[rows]
    if isinstance(x, CommGroup):
        return CommGroup(_take(x.size, rows, n), _take(x.per_node, rows, n),
                         _take(x.nodes, rows, n))
    if isinstance(x, GatherView):
        return GatherView(_take(x.tokens, rows, n), _take(x.tp_group, rows, n),
                          _take(x.ep_group, rows, n))
    if isinstance(x, dict):
        return {k: _take(v, rows, n) for k, v in x.items()}
    return x


def take_rows(b: Batch, rows: np.ndarray) -> Batch:
    """The Batch of strategies ``rows`` of ``b`` (every per-row field indexed)."""
    n = b.tp.shape[0]
    return replace(b, **{f.name: _take(getattr(b, f.name), rows, n) for f in fields(b)
                         if f.name != "fallbacks"})


def distinct_branch_cost(branch: str, ops: list, table, combo: np.ndarray, b: Batch,
                         in_width: int, ctx: np.ndarray, n_ctx: int) -> BranchCost:
    """:func:`~shardc.cost.layer_costs.branch_cost` of every row, pricing each distinct
    (``ctx`` context id [B] below ``n_ctx``, ``combo``) once. Detail mode (one strategy,
    its op list) prices the rows directly."""
    B = combo.shape[0]
    n_combo = int(table.modes.shape[0])
    if b.detail or B < 2:
        return branch_cost(branch, ops, table, combo, b, in_width)
    first, inv = distinct_keys(ctx * n_combo + combo, n_ctx * n_combo)
    if len(first) == B:
        return branch_cost(branch, ops, table, combo, b, in_width)
    bc = branch_cost(branch, ops, table, combo[first], take_rows(b, first), in_width)
    return BranchCost(bc.time_s[inv], bc.weight_bytes[inv], bc.kv_bytes[inv])
