"""The agent's last phase: best-first polishing of *degree rows* with branch best responses.

A degree row is the first five action components (tp, ep, pp, sp, batch); the rest are the
per-op choices. Two facts about the space make a cheap, exhaustive local search possible
once the agent has mapped the landscape:

* degree rows are few (hundreds to a few thousand) and the agent visits most of them, but
  it samples each row's op choices jointly with the degrees, so the best value it saw in a
  row is a noisy lower bound of what the row can do (a row's optimum often differs from
  every sample the agent drew there in 3-4 op choices at once);
* at a fixed row, the step time is a sum of one term per (layer kind x branch) with
  non-negative coefficients (:mod:`shardc.cost.decomposition`; the branches are the IR's
  :data:`~shardc.ir.contract.BRANCHES` plus the embedding and the lm_head), so the op
  choices of one branch can be optimised with the others held fixed, and the per-branch best
  responses combine -- except through the memory limit, which couples them.

:class:`RowPolisher` therefore spends the budget left after the agent's chunks on:

1. **Branch best responses** (:meth:`RowPolisher.polish`): at the row of the best unpolished
   strategy, every legal combination of each branch's op choices is evaluated with the
   other branches held (one batched call); the improving branches' best combinations are
   applied together (falling back to the single best one when the combination does not
   fit); repeated until no branch improves (at most ``sweeps`` times).
2. **Row expansion** (:meth:`RowPolisher.expand`): the polished strategy's op choices are
   carried to the neighbouring rows -- batch one step up or down, sequence parallelism
   toggled, and every factor move of the degrees (:meth:`LegalSampler.factor_move`'s
   lattice) with the per-replica batch rescaled so dp * batch stays about the same
   (x 2**j, j in {-1, 0, 1}; the legal batch nearest in log2) -- once with the polished choices (an illegal one replaced by
   Megatron's) and once with Megatron's choices at the new tp; one batched call.
3. The next row is the unpolished row with the best value seen (by the agent or by steps
   1-2); repeat until the budget is spent or every row seen is polished. Once, after the
   first row, the lean screen (:mod:`shardc.search.lean_screen`) adds rows for the degree
   tuples the agent left without a feasible one.

When the agent found nothing feasible (a feasible set of a few in ten thousand, e.g. a long
context under tight SLOs), the rows start from a screen (:meth:`RowPolisher.screen`): every
row with Megatron's op choices, smallest batches first (in serving, a row can also be too
small for its SLOs, so feasibility is not monotone in the batch).

Every evaluation goes through the :class:`~shardc.search.objective.Budget`; an action
already evaluated (by the agent or here) is never evaluated twice. Deterministic: no
randomness, ties broken by row order.
"""

from __future__ import annotations

import itertools

import numpy as np

from shardc.ir.contract import BRANCHES
from shardc.ir.space import megatron_op_choices
from shardc.search.lean_screen import lean_screen
from shardc.search.legal import BATCH, EP, N_DEG, PP, SP, TP, LegalSampler
from shardc.search.objective import Budget

OP_OF_BRANCH = {op: branch for branch, ops in BRANCHES.items() for op in ops}
SCREEN_CHUNK = 128  # rows per screening call
REPAIR_VIOLATION = 0.25  # a row this close to feasible (25% over a limit) ranks its tuple
REPAIR_SWEEPS = 2  # violation best-response rounds per repaired tuple


def branch_groups(space) -> list[np.ndarray]:
    """Action columns of the op slots of each (layer kind, branch), and of each global op
    (embedding, lm_head) alone, in slot order."""
    groups: dict[tuple[str, str], list[int]] = {}
    for i, slot in enumerate(space.op_slots):
        kind, _, op = slot.rpartition(".")
        groups.setdefault((kind, OP_OF_BRANCH.get(op, op) if kind else slot), []).append(N_DEG + i)
    return [np.array(cols, dtype=np.int64) for cols in groups.values()]


class Archive:
    """Every action evaluated (value, or -inf when infeasible) and, per degree row, the best
    feasible action seen. Rows are keyed by degree *values* (tp, ep, pp, sp, batch), so two
    spellings of one row (sp "on" at tp = 1 is sp = 1) are one row."""

    def __init__(self, space):
        self.space = space
        self.seen: dict[bytes, float] = {}
        self.rows: dict[tuple[int, ...], tuple[float, np.ndarray]] = {}
        self.violation: dict[bytes, float] = {}  # infeasible actions: how far from feasible
        # degree tuples (tp, ep, pp, sp) with no feasible row yet: (smallest violation, its
        # action, the best raw value of a row within REPAIR_VIOLATION of feasible)
        self.near: dict[tuple[int, ...], tuple[float, np.ndarray, float]] = {}
        self.feasible_tuples: set[tuple[int, ...]] = set()
        self.memory: dict[bytes, float] = {}  # model bytes / usable HBM, when reported

    def row_keys(self, actions: np.ndarray) -> list[tuple[int, ...]]:
        d = self.space.degree_arrays(np.atleast_2d(actions))
        cols = np.stack([d[c] for c in ("tp", "ep", "pp", "sp", "batch")], axis=1)
        return [tuple(int(x) for x in row) for row in cols]

    def record(self, actions: np.ndarray, values: np.ndarray, feasible: np.ndarray,
               violation: np.ndarray | None = None, memory: np.ndarray | None = None) -> None:
        """Record evaluated ``actions``; ``violation`` (the objective's ``last_violation``,
        when it has one) feeds the repair step's ``near`` rows; ``memory`` (its
        ``last_memory``: model bytes / usable HBM) the lean screen
        (:mod:`shardc.search.lean_screen`)."""
        keys = self.row_keys(actions) if len(actions) else []
        if memory is not None and len(memory) == len(keys):
            for a, m in zip(actions, memory):
                self.memory[a.tobytes()] = float(m)
        if violation is None or len(violation) != len(keys):
            violation = np.full(len(keys), np.inf)
        for a, v, f, key, viol in zip(actions, values, feasible, keys, violation):
            val = float(v) if f else -np.inf
            self.seen[a.tobytes()] = val
            if f:
                old = self.rows.get(key)
                if old is None or val > old[0]:
                    self.rows[key] = (val, a.copy())
                self.feasible_tuples.add(key[:4])
                self.near.pop(key[:4], None)
                continue
            self.violation[a.tobytes()] = float(viol)
            if not np.isfinite(viol) or key[:4] in self.feasible_tuples:
                continue
            best_v, best_a, raw = self.near.get(key[:4], (np.inf, None, -np.inf))
            if viol <= REPAIR_VIOLATION and np.isfinite(v):
                raw = max(raw, float(v))
            if viol < best_v:
                best_v, best_a = float(viol), a.copy()
            self.near[key[:4]] = (best_v, best_a, raw)


class RowPolisher:
    """Steps 1-3 of the module docstring over ``budget``, starting from ``archive``."""

    def __init__(self, sampler: LegalSampler, budget: Budget, archive: Archive,
                 ops_free_at_tp1: bool = False, sweeps: int = 3):
        self.sampler = sampler
        self.space = sampler.space
        self.budget = budget
        self.archive = archive
        self.sweeps = sweeps
        self.groups = branch_groups(self.space)
        tp_values = self.space.values["tp"]
        self.free_tp = tp_values.index(1) if ops_free_at_tp1 and 1 in tp_values else -1
        self.megatron = [megatron_op_choices(self.space, t) for t in range(len(tp_values))]
        self.polished: set[tuple[int, ...]] = set()
        self.repaired: set[tuple[int, ...]] = set()

    # ------------------------------------------------------------------ evaluation
    def evaluate(self, actions: np.ndarray) -> np.ndarray:
        """Values of ``actions`` [B, A] (-inf when infeasible); only actions never evaluated
        before go to the budget (duplicates within the call are evaluated once)."""
        values = np.full(len(actions), -np.inf)
        new, where = [], {}
        for i, a in enumerate(actions):
            k = a.tobytes()
            if k in self.archive.seen:
                values[i] = self.archive.seen[k]
            elif k in where:
                where[k].append(i)
            else:
                where[k] = [i]
                new.append(a)
        if new:
            batch = np.array(new, dtype=np.int64)
            v, f = self.budget(batch)  # may evaluate fewer when the budget runs out
            obj = self.budget.objective
            self.archive.record(batch[:len(v)], v, f, getattr(obj, "last_violation", None),
                                getattr(obj, "last_memory", None))
            for a in batch[:len(v)]:
                for i in where[a.tobytes()]:
                    values[i] = self.archive.seen[a.tobytes()]
        return values

    # ------------------------------------------------------------------ step 1
    def _combos(self, tp_idx: int, cols: np.ndarray) -> np.ndarray:
        legal = [np.flatnonzero(self.sampler.op_mask[tp_idx, c - N_DEG]) for c in cols]
        return np.array(list(itertools.product(*legal)), dtype=np.int64)

    def group_neighbours(self, base: np.ndarray, tp_idx: int) -> tuple[list, list]:
        """``base`` with one branch group's columns changed to each other legal combination
        at tp index ``tp_idx``: (a block of actions per group, the group index of every
        action, in order); groups with one legal combination are skipped."""
        blocks, owner = [], []
        for g, cols in enumerate(self.groups):
            combos = self._combos(tp_idx, cols)
            if len(combos) < 2:
                continue
            acts = np.repeat(base[None], len(combos), axis=0)
            acts[:, cols] = combos
            keep = (combos != base[cols]).any(axis=1)
            blocks.append(acts[keep])
            owner += [g] * int(keep.sum())
        return blocks, owner

    def polish(self, action: np.ndarray, value: float) -> tuple[np.ndarray, float]:
        """Branch best responses at ``action``'s row (step 1); returns the best action and
        value reached (``action`` itself when nothing improves)."""
        cur, cur_v = action.copy(), value
        if action[TP] == self.free_tp:
            return cur, cur_v
        for _ in range(self.sweeps):
            cands, owner = self.group_neighbours(cur, int(cur[TP]))
            if not cands:
                break
            acts = np.concatenate(cands)
            vals = self.evaluate(acts)
            owner_a = np.array(owner)
            improving = []
            for g in np.unique(owner_a):
                sel = np.flatnonzero(owner_a == g)
                i = sel[int(np.argmax(vals[sel]))]
                if vals[i] > cur_v:
                    improving.append((vals[i], i, g))
            if not improving:
                break
            improving.sort(key=lambda t: -t[0])
            best_v, best_i, _ = improving[0]
            nxt, nxt_v = acts[best_i].copy(), best_v
            if len(improving) > 1:
                both = cur.copy()
                for _, i, g in improving:
                    both[self.groups[g]] = acts[i, self.groups[g]]
                both_v = self.evaluate(both[None])[0]
                if both_v > nxt_v:
                    nxt, nxt_v = both, both_v
            cur, cur_v = nxt, nxt_v
        return cur, cur_v

    # ------------------------------------------------------------------ step 2
    def _ops_at(self, ops: np.ndarray, tp_idx: int) -> np.ndarray:
        """``ops`` with every choice illegal at ``tp_idx`` replaced by Megatron's there."""
        legal = self.sampler.op_mask[tp_idx, np.arange(len(ops)), ops]
        return np.where(legal, ops, self.megatron[tp_idx])

    def neighbour_rows(self, action: np.ndarray) -> np.ndarray:
        """Seeds in the rows next to ``action``'s (step 2 of the module docstring)."""
        s, a = self.sampler, action
        n_batch = int(s.nvec[BATCH])
        log_batch = np.log2(np.asarray(self.space.values["batch"], dtype=np.float64))
        out = []
        for db in (-1, 1):
            if 0 <= a[BATCH] + db < n_batch:
                b = a.copy()
                b[BATCH] += db
                out.append(b)
        for sp in range(int(s.nvec[SP])):
            if sp != a[SP]:
                b = a.copy()
                b[SP] = sp
                out.append(b)
        dp = self.space.degree_arrays(a[None])["dp"][0]
        for triple in s.factor_neighbours(int(a[TP]), int(a[EP]), int(a[PP])):
            b = a.copy()
            b[[TP, EP, PP]] = triple
            shift = np.log2(dp / self.space.degree_arrays(b[None])["dp"][0])
            for j in (-1, 0, 1):  # dp * batch about the same, x 2**j (nearest in log2)
                bb = int(np.argmin(np.abs(log_batch - (log_batch[a[BATCH]] + shift + j))))
                for ops in (self._ops_at(a[N_DEG:], int(b[TP])), self.megatron[int(b[TP])]):
                    c = b.copy()
                    c[BATCH] = bb
                    c[N_DEG:] = ops
                    out.append(c)
        if not out:
            return np.zeros((0, len(a)), dtype=np.int64)
        out = np.array(out, dtype=np.int64)
        tp1 = np.asarray(self.space.values["tp"])[out[:, TP]] == 1
        if 0 in self.space.values["sp"]:  # sp = tp is sp off at tp = 1: one spelling
            out[tp1, SP] = self.space.values["sp"].index(0)
        if self.free_tp >= 0:  # tp = 1 rows under one name (Megatron's choices)
            free = out[:, TP] == self.free_tp
            out[free, N_DEG:] = self.megatron[self.free_tp]
        return out[s.legal(out)]

    def expand(self, action: np.ndarray) -> None:
        seeds = self.neighbour_rows(action)
        if len(seeds):
            self.evaluate(seeds)

    # ------------------------------------------------------------------ step 3
    def next_row(self) -> tuple[float, np.ndarray] | None:
        best = None
        for key in sorted(self.archive.rows):
            if key in self.polished:
                continue
            v, a = self.archive.rows[key]
            if best is None or v > best[0]:
                best = (v, a)
        return best

    def screen(self) -> None:
        """Step 0, only when nothing feasible is known: every row (legal degree tuple x
        batch) with Megatron's op choices, :data:`SCREEN_CHUNK` rows per call, until a chunk
        holds a feasible row (the polishing then starts from it). Rows whose
        batch splits evenly over the work units of the step (decode: pp micro-batches x ep
        attention groups; prefill: ep groups -- a row that does not split is infeasible) come
        first, ordered by their rank among their degree tuple's splittable batches and then
        by batch: first every tuple's smallest splittable batch, then each tuple's second,
        ... (in serving, a row can also be too small for its SLOs, so feasibility is not
        monotone in the batch)."""
        triples = np.argwhere(self.sampler.pp_mask)
        n_sp, n_b = int(self.sampler.nvec[SP]), int(self.sampler.nvec[BATCH])
        deg = np.array([(t, e, p, sp) for t, e, p in triples for sp in range(n_sp)
                        if self.space.values["tp"][t] > 1 or self.space.values["sp"][sp] == 0
                        or n_sp == 1], dtype=np.int64).reshape(-1, 4)  # sp at tp 1: one spelling
        acts = np.zeros((len(deg) * n_b, self.sampler.n_comp), dtype=np.int64)
        acts[:, [TP, EP, PP, SP]] = np.repeat(deg, n_b, axis=0)
        acts[:, BATCH] = np.tile(np.arange(n_b), len(deg))
        acts[:, N_DEG:] = np.array(self.megatron)[acts[:, TP]]
        acts = acts[self.sampler.legal(acts)]
        d = self.space.degree_arrays(acts)
        units = d["ep"] * (d["pp"] if self.space.workload.phase == "decode" else 1)
        splits = d["batch"] % units == 0
        # rank of each row among its degree tuple's splittable batches (rows are grouped by
        # tuple, batch ascending within a group)
        tuple_id = np.unique(acts[:, [TP, EP, PP, SP]], axis=0, return_inverse=True)[1].ravel()
        rank = np.zeros(len(acts), dtype=np.int64)
        for t in np.unique(tuple_id):
            rows = np.flatnonzero((tuple_id == t) & splits)
            rows = rows[np.argsort(d["batch"][rows], kind="stable")]
            rank[rows] = np.arange(len(rows))
        order = np.lexsort((d["batch"], rank, ~splits))
        for start in range(0, len(order), SCREEN_CHUNK):  # stop at the first feasible rows
            values = self.evaluate(acts[order[start:start + SCREEN_CHUNK]])
            if np.isfinite(values).any() or self.budget.remaining <= 0:
                return

    # ------------------------------------------------------------------ repair
    def next_repair(self) -> tuple[float, tuple[int, ...], np.ndarray] | None:
        """The degree tuple with no feasible row whose near rows promise the most: (best raw
        value of a row within :data:`REPAIR_VIOLATION` of feasible, tuple, its least-violating
        action), if that value beats the best feasible value known."""
        best = None
        for key in sorted(self.archive.near):
            viol, action, raw = self.archive.near[key]
            if key in self.repaired or key in self.archive.feasible_tuples or action is None:
                continue
            if raw > self.budget.best_value and (best is None or raw > best[0]):
                best = (raw, key, action)
        return best

    def repair(self, action: np.ndarray) -> None:
        """Branch best responses and batch steps (+-1, +-2) that *minimise the violation* at
        ``action``'s degree tuple (memory and latency are sums over the branches at a fixed
        row, so the branches' best responses combine, as in :meth:`polish`), until a feasible
        strategy appears (then its op choices are tried at every batch of the tuple) or no
        step lowers the violation (at most :data:`REPAIR_SWEEPS` rounds)."""
        cur = action.copy()
        cur_v = self.archive.violation.get(cur.tobytes(), np.inf)
        n_batch = int(self.sampler.nvec[BATCH])
        for _ in range(REPAIR_SWEEPS):
            cands, owner = [], []
            if cur[TP] != self.free_tp:
                for g, cols in enumerate(self.groups):
                    combos = self._combos(int(cur[TP]), cols)
                    acts = np.repeat(cur[None], len(combos), axis=0)
                    acts[:, cols] = combos
                    keep = (combos != cur[cols]).any(axis=1)
                    cands.append(acts[keep])
                    owner += [g] * int(keep.sum())
            for db in (-2, -1, 1, 2):
                if 0 <= cur[BATCH] + db < n_batch:
                    b = cur.copy()
                    b[BATCH] += db
                    cands.append(b[None])
                    owner.append(-1)
            if not cands:
                return
            acts = np.concatenate(cands)
            vals = self.evaluate(acts)
            if not np.isfinite(vals).any():
                viol = self._violations(acts)
                owner_a = np.array(owner)
                both, improving = cur.copy(), 0
                for g in np.unique(owner_a[owner_a >= 0]):
                    sel = np.flatnonzero(owner_a == g)
                    i = sel[int(np.argmin(viol[sel]))]
                    if viol[i] < cur_v:
                        both[self.groups[g]] = acts[i, self.groups[g]]
                        improving += 1
                if improving > 1:
                    vals = np.append(vals, self.evaluate(both[None]))
                    acts = np.concatenate([acts, both[None]])
                    viol = np.append(viol, self._violations(both[None]))
            if np.isfinite(vals).any():
                best = acts[int(np.argmax(vals))]
                rows = np.repeat(best[None], n_batch, axis=0)
                rows[:, BATCH] = np.arange(n_batch)
                self.evaluate(rows)
                return
            i = int(np.argmin(viol))
            if not viol[i] < cur_v:
                return
            cur, cur_v = acts[i].copy(), float(viol[i])

    def _violations(self, actions: np.ndarray) -> np.ndarray:
        return np.array([self.archive.violation.get(a.tobytes(), np.inf) for a in actions])

    def run(self) -> None:
        """Polish and expand rows, best first, until the budget is spent (BudgetExhausted
        propagates) or no unpolished row is left; a degree tuple with no feasible row whose
        near rows promise more than the next row is repaired first (:meth:`repair`)."""
        if not self.archive.rows:
            self.screen()
        screened = False
        while self.budget.remaining > 0:
            nxt = self.next_row()
            # the best row is polished first; then the most promising repair, if it promises
            # more than the next row
            rep = self.next_repair() if nxt is None or nxt[0] < self.budget.best_value else None
            if rep is not None and (nxt is None or rep[0] > nxt[0]):
                self.repaired.add(rep[1])
                self.repair(rep[2])
                continue
            if nxt is None:
                return
            value, action = nxt
            self.polished.update(self.archive.row_keys(action))
            best, best_v = self.polish(action, value)
            self.polished.update(self.archive.row_keys(best))
            self.expand(best)
            if best_v >= self.budget.best_value:
                self.repair_next_batch(best)
            if not screened:  # once, after the best row: the tuples the agent left unfit
                screened = True
                lean_screen(self)

    def repair_next_batch(self, action: np.ndarray) -> None:
        """The best strategy's next larger batch, when it came back infeasible but within
        :data:`REPAIR_VIOLATION` of its limits (an SLO or HBM cliff the polished choices just
        miss): repaired once (:meth:`repair`)."""
        for step in (1, 2):  # the next batch that splits evenly (a finite violation)
            if action[BATCH] + step >= self.sampler.nvec[BATCH]:
                return
            nxt = action.copy()
            nxt[BATCH] += step
            key = self.archive.row_keys(nxt)[0]
            if key in self.archive.rows or key in self.repaired:
                return
            if np.isfinite(self.evaluate(nxt[None])[0]):
                return
            viol = self.archive.violation.get(nxt.tobytes(), np.inf)
            if np.isfinite(viol):
                break
        if not viol <= REPAIR_VIOLATION:
            return
        self.repaired.add(key)
        self.repair(nxt)
