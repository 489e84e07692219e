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

from dataclasses import dataclass, field

import numpy as np

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


def branch_tables(cm, degree_action, space: StrategySpace) -> BranchTables:
    """Enumerate every (kind, branch) term at the degrees/batch of ``degree_action``
    (5 ints: tp, ep, pp, sp, batch indices); other slots held at Megatron's choices."""
    d = np.asarray(degree_action, dtype=np.int64)[: len(DEGREE_COMPONENTS)]
    base = np.concatenate([d, megatron_op_choices(space, int(d[0]))])
    col = {s: len(DEGREE_COMPONENTS) + i for i, s in enumerate(space.op_slots)}
    pp = int(space.values["pp"][d[2]])
    out = BranchTables(degree_action=d, pp=pp, phase=cm.workload.phase,
                       kind_names=[k.name for k in cm.kinds], counts=cm.stage_counts(pp))
    groups = [(ki, k.name, k.branches) for ki, k in enumerate(cm.kinds)]
    groups.append((None, "global", cm.globals))
    first = None
    for ki, kname, branches in groups:
        for bi, (bname, _fops, table, slots) in enumerate(branches):
            combos = table.combos()
            acts = np.repeat(base[None, :], len(combos), axis=0)
            for j, s in enumerate(slots):
                acts[:, col[s]] = combos[:, j]
            r = cm._simulate(acts, space)
            first = first or r
            bc = r["kinds"][ki][1][bi][4] if ki is not None else r["glob"][bname][4]
            masks = space.op_masks(acts[:, 0])
            legal = np.ones(len(combos), dtype=bool)
            for j, s in enumerate(slots):
                legal &= masks[np.arange(len(combos)), space.op_slots.index(s), combos[:, j]]
            out.terms.append(BranchTerm(kname, bname, list(slots), combos, legal,
                                        bc.time_s * 1e3, bc.weight_bytes.copy(),
                                        bc.kv_bytes.copy()))
    for ki, k in enumerate(cm.kinds):
        out.norms_ms[k.name] = float(first["kinds"][ki][2][0]) * 1e3
        out.other_bytes[k.name] = float(k.other_params * cm.weight_bytes)
    out.send_ms = float(first["send"][0]) * 1e3
    out.micro_batches = float(first["micro"][0]) if cm.workload.phase == "prefill" else pp
    out.activation_bytes = float(first["act"][0])
    return out
