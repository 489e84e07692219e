"""Legal actions of a :class:`~shardc.ir.space.StrategySpace`: masks, sampling, repair.

Every searcher in :mod:`shardc.search` proposes only *legal* actions: an action is legal when

* the degrees tile the mesh (``tp * ep * pp`` divides the GPU count, so ``dp`` is integral) --
  detected statically and masked, in the order tp -> ep (given tp) -> pp (given tp, ep);
* every op choice is allowed at the chosen tp (``space.op_masks``) -- masked given tp.

What is *not* detectable statically (memory, SLOs, batch divisibility) is the cost model's
verdict: such actions are evaluated, come back infeasible, and count against the budget.

:class:`LegalSampler` precomputes the conditional masks once per space; all methods are
vectorised over a batch of actions ``[B, A]`` and draw from a caller-owned
``numpy.random.Generator`` (determinism).
"""

from __future__ import annotations

import numpy as np

from shardc.ir.space import DEGREE_COMPONENTS, StrategySpace
from shardc.validate import is_prime

TP, EP, PP, SP, BATCH = range(5)
N_DEG = len(DEGREE_COMPONENTS)


class LegalSampler:
    """Conditional masks and uniform legal sampling over one strategy space."""

    def __init__(self, space: StrategySpace):
        self.space = space
        self.nvec = np.asarray(space.nvec, dtype=np.int64)
        self.n_comp = len(self.nvec)
        self.offsets = np.concatenate([[0], np.cumsum(self.nvec)])  # one-hot layout
        world = space.mesh.gpus
        tp = np.asarray(space.values["tp"], dtype=np.int64)
        ep = np.asarray(space.values["ep"], dtype=np.int64)
        pp = np.asarray(space.values["pp"], dtype=np.int64)
        self.tp_mask = (world % tp) == 0  # [n_tp]
        self.ep_mask = (world % (tp[:, None] * ep[None, :])) == 0  # [n_tp, n_ep]
        prod = tp[:, None, None] * ep[None, :, None] * pp[None, None, :]
        self.pp_mask = ((world % prod) == 0) & space.fixed_degrees_fit(  # [n_tp, n_ep, n_pp]
            tp[:, None, None], ep[None, :, None], pp[None, None, :])
        # a tp (ep) value is legal only if some ep (pp) completes it (matters for a fixed dp)
        self.ep_mask &= self.pp_mask.any(axis=2)
        self.tp_mask &= self.ep_mask.any(axis=1)
        self.op_mask = space.op_mask_by_tp  # [n_tp, n_slots, 3]
        self.max_n = int(self.nvec.max())
        self._factor_moves = self._factor_move_table(tp, ep, pp, world)

    def _factor_move_table(self, tp, ep, pp, world) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Legal (tp, ep, pp) index triples and, per triple, the triples one *factor move*
        away: a prime factor p of one of tp, ep, pp, dp moved to another of them
        (e.g. ep 4 -> 8 with pp 8 -> 4, or tp 2 -> 4 with dp 4 -> 2). Returns
        (triples [K, 3], adjacency [K, K] bool, row of each (tp, ep, pp) index triple in
        ``triples`` or -1 [n_tp * n_ep * n_pp], indexed by the raveled triple)."""
        idx = np.argwhere(self.pp_mask)  # [K, 3] index triples that tile the mesh
        deg = np.stack([tp[idx[:, 0]], ep[idx[:, 1]], pp[idx[:, 2]]], axis=1)
        deg = np.concatenate([deg, world // deg.prod(axis=1, keepdims=True)], axis=1)  # + dp
        ratio = deg[None, :, :] / deg[:, None, :]  # [K, K, 4] new / old per dim
        up = ratio > 1
        down = ratio < 1
        same = ratio == 1
        one_up = up.sum(axis=2) == 1
        one_down = down.sum(axis=2) == 1
        factor = np.where(up, ratio, 1.0).prod(axis=2)
        factor = np.round(factor).astype(np.int64)
        primes = [f for f in np.unique(factor).tolist() if is_prime(f)]  # few distinct values
        prime = np.isin(factor, np.array(primes, dtype=np.int64))
        adj = one_up & one_down & (same.sum(axis=2) == 2) & prime
        lookup = np.full(self.pp_mask.size, -1, dtype=np.int64)
        lookup[np.ravel_multi_index(idx.T, self.pp_mask.shape)] = np.arange(len(idx))
        return idx, adj, lookup

    def factor_move(self, actions: np.ndarray, rng: np.random.Generator) -> np.ndarray:
        """Neighbours on the degree lattice: per row, (tp, ep, pp) replaced by a uniformly
        chosen triple one factor move away (:meth:`_factor_move_table`; rows without one are
        unchanged), then :meth:`repair` (op choices illegal at the new tp are redrawn)."""
        a = np.array(np.atleast_2d(actions), dtype=np.int64)
        idx, adj, lookup = self._factor_moves
        row = lookup[np.ravel_multi_index(a[:, [TP, EP, PP]].T, self.pp_mask.shape)]
        ok = row >= 0
        if ok.any():
            cand = adj[row[ok]]
            has = cand.any(axis=1)
            pick = self._pick(cand[has], rng)
            sel = np.flatnonzero(ok)[has]
            a[np.ix_(sel, [TP, EP, PP])] = idx[pick]
        return self.repair(a, rng)

    def factor_neighbours(self, tp: int, ep: int, pp: int) -> np.ndarray:
        """[K, 3] every legal (tp, ep, pp) index triple one factor move away from the given
        index triple (:meth:`_factor_move_table`); empty when it has none or is illegal."""
        idx, adj, lookup = self._factor_moves
        row = lookup[np.ravel_multi_index((tp, ep, pp), self.pp_mask.shape)]
        return idx[adj[row]] if row >= 0 else idx[:0]

    # ------------------------------------------------------------------ masks
    def component_mask(self, actions: np.ndarray, j: int) -> np.ndarray:
        """[B, nvec[j]] legal values of component ``j`` given the earlier components of
        ``actions`` (tp for ep; tp and ep for pp; tp for the op slots)."""
        a = np.atleast_2d(actions)
        b = a.shape[0]
        if j == TP:
            return np.broadcast_to(self.tp_mask, (b, self.nvec[j])).copy()
        if j == EP:
            return self.ep_mask[a[:, TP]]
        if j == PP:
            return self.pp_mask[a[:, TP], a[:, EP]]
        if j < N_DEG:
            return np.ones((b, self.nvec[j]), dtype=bool)
        return self.op_mask[a[:, TP], j - N_DEG]

    def full_mask(self, actions: np.ndarray) -> np.ndarray:
        """[B, sum(nvec)] concatenated masks of every component (the one-hot layout)."""
        a = np.atleast_2d(actions)
        return np.concatenate([self.component_mask(a, j) for j in range(self.n_comp)], axis=1)

    def legal(self, actions: np.ndarray) -> np.ndarray:
        """[B] bool: in range, degrees tile the mesh, op choices unmasked."""
        a = np.atleast_2d(actions)
        ok = ((a >= 0) & (a < self.nvec[None, :])).all(axis=1)
        if not ok.all():
            a = np.where(ok[:, None], a, 0)
        return ok & self.space.actions_legal(a)

    # --------------------------------------------------------------- sampling
    @staticmethod
    def _pick(mask: np.ndarray, rng: np.random.Generator) -> np.ndarray:
        """One uniformly random True index per row of ``mask`` [B, n]."""
        w = mask.astype(np.float64)
        cum = np.cumsum(w, axis=1)
        u = rng.random(mask.shape[0]) * cum[:, -1]
        return (cum <= u[:, None]).sum(axis=1).astype(np.int64)

    def sample(self, n: int, rng: np.random.Generator) -> np.ndarray:
        """[n, A] legal actions, each component uniform over its legal values given the
        earlier ones (not uniform over the joint legal set)."""
        a = np.zeros((n, self.n_comp), dtype=np.int64)
        for j in range(self.n_comp):
            a[:, j] = self._pick(self.component_mask(a, j), rng)
        return a

    def repair(self, actions: np.ndarray, rng: np.random.Generator) -> np.ndarray:
        """Make every row legal, changing as few components as the conditional order allows:
        a value that is illegal given the (already repaired) earlier components is redrawn
        uniformly among the legal ones; legal values are kept."""
        a = np.array(np.atleast_2d(actions), dtype=np.int64)
        a = np.clip(a, 0, self.nvec[None, :] - 1)
        for j in range(self.n_comp):
            m = self.component_mask(a, j)
            bad = ~m[np.arange(a.shape[0]), a[:, j]]
            if bad.any():
                a[bad, j] = self._pick(m[bad], rng)
        return a

    def mutate(self, actions: np.ndarray, rng: np.random.Generator, n_changes: int = 1
               ) -> np.ndarray:
        """Neighbours: per row, ``n_changes`` random components set to a different legal
        value (when one exists), then :meth:`repair` for components that depend on them."""
        a = np.array(np.atleast_2d(actions), dtype=np.int64)
        b = a.shape[0]
        rows = np.arange(b)
        changeable = self.nvec > 1
        cols = np.flatnonzero(changeable)
        if cols.size == 0:
            return a
        for _ in range(n_changes):
            j = cols[rng.integers(0, cols.size, size=b)]
            for comp in np.unique(j):
                sel = rows[j == comp]
                m = self.component_mask(a[sel], comp).copy()
                m[np.arange(sel.size), a[sel, comp]] = False  # a different value
                has = m.any(axis=1)
                if has.any():
                    a[sel[has], comp] = self._pick(m[has], rng)
            a = self.repair(a, rng)
        return a

    def count_legal(self) -> int:
        """Number of legal joint actions (exact, as a Python int)."""
        s = self.space
        n_other = 1
        for j in range(N_DEG):
            if j not in (TP, EP, PP):
                n_other *= int(self.nvec[j])
        total = 0
        for t in range(self.nvec[TP]):
            ops = 1
            for row in self.op_mask[t]:
                ops *= int(row.sum())
            n_deg = int(self.pp_mask[t].sum())
            total += n_deg * ops
        del s
        return total * n_other
