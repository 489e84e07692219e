"""The step time as a sum over (layer kind x branch) terms, for exact search.

At fixed degrees and batch (the first five action components), every branch's time and
resident bytes depend only on that branch's own op choices (branches start and end at the
residual placement), so::

    layer_ms[k]   = norms_ms[k] + sum_b term[k, b].time_ms[combo_b]
    stage_ms[s]   = sum_k counts[s, k] * layer_ms[k]
                    + [s == 0] embedding.time_ms[c] + [s == pp-1] lm_head.time_ms[c]
    tick_ms       = max_s stage_ms[s] + send_ms
    decode:  TPOT = pp * tick_ms;  prefill: TTFT = (micro_batches + pp - 1) * tick_ms

and the per-stage model bytes are the same sums of ``weight_bytes + kv_bytes`` (+ the
choice-independent activation bytes). All coefficients are >= 0, so without the memory
constraint the per-branch argmin is the joint optimum; with it, choices couple only
through these sums. :meth:`BranchTables.compose` recomputes TPOT/TTFT from a selection and
equals :meth:`CostModel.evaluate` (tested).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import numpy as np

from shardc.cost.branch_tables import split_requirements
from shardc.cost.layer_costs import BranchCost
from shardc.ir.space import DEGREE_COMPONENTS, StrategySpace, megatron_op_choices


@dataclass
class BranchTerm:
    kind: str  # layer kind name, or "global"
    branch: str
    slots: list[str]  # op slots of the space this branch's choices go to
    combos: np.ndarray  # [n, m] choice per slot
    legal: np.ndarray  # [n] every choice unmasked at this tp
    time_ms: np.ndarray  # [n] per layer, one micro-batch
    weight_bytes: np.ndarray  # [n] per GPU per layer
    kv_bytes: np.ndarray  # [n] per GPU per layer


@dataclass
class BranchTables:
    degree_action: np.ndarray
    pp: int
    phase: str
    terms: list[BranchTerm] = field(default_factory=list)
    norms_ms: dict = field(default_factory=dict)  # kind -> ms per layer
    other_bytes: dict = field(default_factory=dict)  # kind -> replicated bytes per layer
    kind_names: list = field(default_factory=list)
    counts: np.ndarray | None = None  # [pp, n_kinds]
    send_ms: float = 0.0
    micro_batches: float = 1.0
    activation_bytes: float = 0.0

    def compose(self, selection: dict[tuple[str, str], int]) -> dict:
        """Step latency (ms) and bottleneck-stage model bytes for a choice of combination
        index per (kind, branch) term."""
        layer = {k: self.norms_ms[k] for k in self.kind_names}
        mem = {k: self.other_bytes[k] for k in self.kind_names}
        glob_t, glob_m = {}, {}
        for t in self.terms:
            i = selection[(t.kind, t.branch)]
            if t.kind == "global":
                glob_t[t.branch], glob_m[t.branch] = t.time_ms[i], t.weight_bytes[i]
            else:
                layer[t.kind] += t.time_ms[i]
                mem[t.kind] += t.weight_bytes[i] + t.kv_bytes[i]
        st, sm = [], []
        for s in range(self.pp):
            ts = ms = 0.0
            for ki, k in enumerate(self.kind_names):
                ts += self.counts[s, ki] * layer[k]
                ms += self.counts[s, ki] * mem[k]
            if s == 0:
                ts += glob_t.get("embedding", 0.0)
                ms += glob_m.get("embedding", 0.0)
            if s == self.pp - 1:
                ts += glob_t.get("lm_head", 0.0)
                ms += glob_m.get("lm_head", 0.0)
            st.append(ts)
            sm.append(ms)
        tick = max(st) + self.send_ms
        steps = self.pp if self.phase == "decode" else self.micro_batches + self.pp - 1
        return {"latency_ms": steps * tick, "tick_ms": tick, "stage_ms": st,
                "model_bytes": max(sm) + self.activation_bytes}


@dataclass
class BranchTermGrid:
    """One (kind, branch) term at many degree rows: arrays ``[N_rows, n_combos]``."""

    kind: str  # layer kind name, or "global"
    branch: str
    slots: list[str]
    fops: list
    combos: np.ndarray  # [n, m]
    legal: np.ndarray  # [N, n] every choice unmasked at the row's tp
    time_ms: np.ndarray  # [N, n] per layer, one micro-batch
    weight_bytes: np.ndarray  # [N, n] per GPU per layer
    kv_bytes: np.ndarray  # [N, n] per GPU per layer (0 for global terms)
    needs: np.ndarray  # [N, n] split requirements (branch_tables.split_requirements bits)
    term: tuple = (None, 0)  # (kind index or None for a global op, branch index)
    time_s: np.ndarray | None = None  # [N, n] as priced (time_ms is it x 1e3)


def _base_actions(space: StrategySpace, degree_rows: np.ndarray) -> np.ndarray:
    """Degree rows completed with Megatron's op choices at their tp."""
    tp_col = DEGREE_COMPONENTS.index("tp")
    ops = {t: megatron_op_choices(space, int(t)) for t in np.unique(degree_rows[:, tp_col])}
    return np.array([np.concatenate([d, ops[d[tp_col]]]) for d in degree_rows], dtype=np.int64)


def _price_term(cm, space, base, col, ki, bi, combos, slots, chunk):
    """(time s, weight bytes, KV bytes) [rows x combos, flat] of term (``ki``, ``bi``) at
    every degree row of ``base`` x every combination (other slots as in ``base``)."""
    nd, n = len(base), len(combos)
    acts = np.repeat(base, n, axis=0)
    for j, s in enumerate(slots):
        acts[:, col[s]] = np.tile(combos[:, j], nd)
    time_s, wbytes, kvbytes = (np.empty(nd * n) for _ in range(3))
    for i in range(0, len(acts), chunk):
        bc = cm.branch_term_cost(acts[i:i + chunk], space, ki, bi)
        time_s[i:i + chunk] = bc.time_s
        wbytes[i:i + chunk] = bc.weight_bytes
        kvbytes[i:i + chunk] = bc.kv_bytes if ki is not None else 0.0
    return time_s, wbytes, kvbytes


def branch_term_grid(cm, space: StrategySpace, degree_rows, chunk: int = 65536
                     ) -> list[BranchTermGrid]:
    """Every (kind, branch) term of the cost model at every row of ``degree_rows``
    (``[N, 5]`` degree/batch indices), other slots held at Megatron's choices; one
    vectorised call per term (and chunk) pricing that term alone
    (:meth:`CostModel.branch_term_cost`, the numbers the full step adds up)."""
    rows = np.atleast_2d(np.asarray(degree_rows, dtype=np.int64))[:, : len(DEGREE_COMPONENTS)]
    base = _base_actions(space, rows)
    col = {s: len(DEGREE_COMPONENTS) + i for i, s in enumerate(space.op_slots)}
    residual = (space.degree_arrays(base)["sp"] > 1).astype(np.int64)
    masks = space.op_masks(rows[:, DEGREE_COMPONENTS.index("tp")])  # [N, slots, 3]
    nd = len(rows)
    groups = [(ki, k.name, k.branches) for ki, k in enumerate(cm.kinds)]
    groups.append((None, "global", cm.globals))
    out = []
    priced = []  # (branch, its ops but their node lists, costs): the same attention in dense
    for ki, kname, branches in groups:  # and MoE layers is priced once
        for bi, (bname, fops, table, slots) in enumerate(branches):
            combos = table.combos()
            n = len(combos)
            key = (bname, ki is None, [replace(f, nodes=[]) for f in fops])
            hit = next((costs for k, costs in priced if k == key), None)
            if hit is not None:
                time_s, wbytes, kvbytes = hit
            else:
                time_s, wbytes, kvbytes = _price_term(cm, space, base, col, ki, bi, combos,
                                                      slots, chunk)
                priced.append((key, (time_s, wbytes, kvbytes)))
            legal = np.ones((nd, n), dtype=bool)
            for j, s in enumerate(slots):
                legal &= masks[:, space.op_slots.index(s), :][:, combos[:, j]]
            modes = table.modes[np.arange(n)[None, :], residual[:, None]]  # [N, n, m]
            out.append(BranchTermGrid(kname, bname, list(slots), list(fops), combos, legal,
                                      time_s.reshape(nd, n) * 1e3, wbytes.reshape(nd, n),
                                      kvbytes.reshape(nd, n),
                                      split_requirements(bname, fops, modes), (ki, bi),
                                      time_s.reshape(nd, n)))
    return out


class GridTermCosts:
    """``term_costs`` for :meth:`CostModel.evaluate` of actions whose degree rows are
    ``rows`` (indices into the grid's degree rows): each term's BranchCost read off the grid
    (the numbers :meth:`CostModel.branch_term_cost` priced, bit for bit)."""

    def __init__(self, terms: list[BranchTermGrid], rows: np.ndarray):
        self.by_term = {t.term: t for t in terms}
        self.rows = np.asarray(rows, dtype=np.int64)

    def __call__(self, kind, branch, combo) -> BranchCost:
        t = self.by_term[(kind, branch)]
        if len(combo) != len(self.rows):
            raise ValueError(f"{len(combo)} actions, {len(self.rows)} degree rows")
        return BranchCost(t.time_s[self.rows, combo], t.weight_bytes[self.rows, combo],
                          t.kv_bytes[self.rows, combo])


def branch_tables(cm, degree_action, space: StrategySpace) -> BranchTables:
    """Enumerate every (kind, branch) term at the degrees/batch of ``degree_action``
    (5 ints: tp, ep, pp, sp, batch indices); other slots held at Megatron's choices."""
    d = np.asarray(degree_action, dtype=np.int64)[: len(DEGREE_COMPONENTS)]
    pp = int(space.values["pp"][d[2]])
    out = BranchTables(degree_action=d, pp=pp, phase=cm.workload.phase,
                       kind_names=[k.name for k in cm.kinds], counts=cm.stage_counts(pp))
    for t in branch_term_grid(cm, space, d[None, :]):
        out.terms.append(BranchTerm(t.kind, t.branch, t.slots, t.combos, t.legal[0],
                                    t.time_ms[0], t.weight_bytes[0], t.kv_bytes[0]))
    first = cm._simulate(_base_actions(space, d[None, :]), space)
    for ki, k in enumerate(cm.kinds):
        out.norms_ms[k.name] = float(first["kinds"][ki][2][0]) * 1e3
        out.other_bytes[k.name] = float(k.other_params * cm.weight_bytes)
    out.send_ms = float(first["send"][0]) * 1e3
    out.micro_batches = float(first["micro"][0]) if cm.workload.phase == "prefill" else pp
    out.activation_bytes = float(first["act"][0])
    return out
