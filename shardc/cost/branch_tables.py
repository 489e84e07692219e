"""Static tables of every branch's collectives and per-op execution modes, for all choices.

A branch (:data:`shardc.ir.contract.BRANCHES`, plus the global ``embedding`` and ``lm_head``
branches) with ``m`` fused ops has ``3**m`` choice combinations; combination index
``sum(c_j * 3**j)``. For each combination and each residual placement (``R`` or ``S(0)``),
:func:`branch_table` walks :func:`shardc.ir.contract.walk` -- the same walk the
annotation pass uses -- and records

* the collective repairing the placement before each op and at the branch end (a code into
  :data:`shardc.cost.collectives.COLLECTIVE_KINDS`), and
* the execution mode of each op on the tp dim (:data:`shardc.ir.contract.MODES`): how its
  tokens, FLOPs, weight and activation bytes divide over the tp group.

Branch ends: layer branches start and end at the residual placement; ``embedding`` starts at
``R`` (token ids are replicated) and ends at the residual; ``lm_head`` starts at the residual
and ends at ``R`` (logits gathered).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np

from shardc.cost.collectives import COLLECTIVE_KINDS
from shardc.ir.contract import TOKEN_SPLIT, branch_ends, walk

RESIDUALS = ("R", "S(0)")


@dataclass
class BranchTable:
    """Tables of one branch over its ``3**m`` combinations x 2 residual placements."""

    name: str
    ops: tuple[str, ...]
    modes: np.ndarray  # [n_combo, 2, m] int (index into MODES)
    collectives: np.ndarray  # [n_combo, 2, m + 1] int (index into COLLECTIVE_KINDS)
    walks: list  # [n_combo][2] -> branch_collectives(...) list, for explain

    @property
    def n_combos(self) -> int:
        return self.modes.shape[0]

    def combos(self) -> np.ndarray:
        """[n_combo, m] the choice of each op in each combination."""
        m = len(self.ops)
        return np.array([[(i // 3**j) % 3 for j in range(m)] for i in range(3**m)],
                        dtype=np.int64).reshape(3**m, m)


def branch_table(branch: str, ops: tuple[str, ...]) -> BranchTable:
    m = len(ops)
    n = 3**m
    modes = np.zeros((n, 2, m), dtype=np.int64)
    colls = np.zeros((n, 2, m + 1), dtype=np.int64)
    walks: list = [[None, None] for _ in range(n)]
    for idx, combo in enumerate(itertools.product(range(3), repeat=m)):
        choices = list(reversed(combo))  # combo index = sum c_j 3**j
        for r, residual in enumerate(RESIDUALS):
            w = walk(ops, choices, *branch_ends(branch, residual))
            walks[idx][r] = w.collectives()
            for j, step in enumerate(w.steps):
                modes[idx, r, j] = step.mode
                colls[idx, r, j] = COLLECTIVE_KINDS.index(step.repair[2]) if step.repair else 0
            colls[idx, r, m] = COLLECTIVE_KINDS.index(w.end_repair[2]) if w.end_repair else 0
    return BranchTable(branch, tuple(ops), modes, colls, walks)


NEEDS_TOKENS_SPLIT = 1  # some op runs token-split over tp: tokens % tp == 0
NEEDS_SEQUENCES_SPLIT = 2  # batch-split attention: sequences % tp == 0


def split_requirements(branch: str, fops, modes: np.ndarray) -> np.ndarray:
    """Divisibility a branch's op modes ``[..., m]`` impose, as a bit set per combination
    (:data:`NEEDS_TOKENS_SPLIT` | :data:`NEEDS_SEQUENCES_SPLIT`). Expert tokens are routed,
    not split over tp sequences, so the ``experts`` branch needs neither."""
    needs = np.zeros(modes.shape[:-1], dtype=np.int64)
    if branch == "experts":
        return needs
    needs |= np.where((modes == TOKEN_SPLIT).any(axis=-1), NEEDS_TOKENS_SPLIT, 0)
    for j, f in enumerate(fops):
        if f.name == "attn_core":
            needs |= np.where(modes[..., j] == TOKEN_SPLIT, NEEDS_SEQUENCES_SPLIT, 0)
    return needs
