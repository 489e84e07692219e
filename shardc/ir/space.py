"""The search space as a MultiDiscrete action vector, with masks for illegal values.

An action is an int array of length ``len(space.components)``::

    [tp_idx, ep_idx, pp_idx, sp_idx, batch_idx, op_choice_0, ..., op_choice_{L-1}]

Degree components index into candidate lists (``space.values[name]``); op components are
the choice index 0/1/2 of :mod:`shardc.ir.strategy`. dp is derived:
``dp = mesh.gpus / (tp * ep * pp)``, and an action whose product does not divide the mesh is
invalid (``space.degrees_valid``). Per-op masks depend on the tp degree only
(``space.op_masks``): e.g. splitting attention by heads needs tp | heads. Everything else
(memory, SLOs, batch divisibility) is the cost model's verdict.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from shardc.errors import InputError
from shardc.ir.contract import GLOBAL_OPS, NUM_CHOICES, legal, op_choice
from shardc.ir.graph import FUSED_OP_NAMES, Graph
from shardc.ir.strategy import SP_ON, Degrees, Mesh, Strategy, Workload
from shardc.validate import divisors

DEGREE_COMPONENTS = ("tp", "ep", "pp", "sp", "batch")
MAX_TP = 64
MAX_PP = 64
BATCH_STEPS_PER_OCTAVE = (4, 5, 6, 7)  # 2^k x {1, 1.25, 1.5, 1.75}: neighbours <= 25% apart


def batch_grid(limit: int) -> tuple[int, ...]:
    """Batch candidates 1 .. ``limit``: 1, 2, 3, then ``m x 2^k`` for m in
    :data:`BATCH_STEPS_PER_OCTAVE` -- a geometric grid whose neighbours differ by at most 25%
    from 4 up (powers of two alone put a 2x step next to a latency SLO, so a plan just over
    it lost half its batch), and whose values keep their large power-of-two factors (the
    divisibility over pp x ep micro-batches and tp token splits that a plain geometric grid
    would break). Each odd part's values form a doubling chain (3, 6, 12, ...; 5, 10, 20, ...),
    along which divisibility only improves (see ``search.exact``'s batch pruning)."""
    out = {1, 2, 3}
    k = 0
    while 4 * 2**k <= limit:
        out.update(m * 2**k for m in BATCH_STEPS_PER_OCTAVE if m * 2**k <= limit)
        k += 1
    return tuple(sorted(v for v in out if v <= limit))


DECODE_BATCHES = batch_grid(4096)  # 1 .. 4096 sequences per replica (44 values)
PREFILL_BATCHES = batch_grid(256)  # 1 .. 256 prompts per replica (28 values)


def check_positions(graph: Graph, workload: Workload) -> None:
    """InputError when the workload's sequence (decode: ``--context``, the KV length of a
    step; prefill: ``--prompt``) is longer than the model's ``max_position_embeddings``
    (``Graph.config``, recorded by the frontend from the model's config)."""
    limit = int(graph.config.get("max_position_embeddings", 0) or 0)
    flag, tokens = (("--context", workload.context) if workload.phase == "decode"
                    else ("--prompt", workload.prompt))
    if limit and int(tokens) > limit:
        model = graph.name or "the model"
        raise InputError(f"{flag} {int(tokens)} tokens is longer than {model}'s "
                         f"max_position_embeddings {limit}")


def nvlink_tp_domain(mesh: Mesh, nvlink_domain: int, allow_cross_node_tp: bool = False
                     ) -> int | None:
    """GPUs a tp group may span: one node's NVLink domain, ``min(G, nvlink_domain)`` (the
    hardware's NVLink domain size in GPUs), so tensor parallelism -- collectives on every
    layer -- never runs over the scale-out network; None (no limit) with
    ``allow_cross_node_tp`` (``--allow-cross-node-tp``). tp must divide the domain (tp is the
    innermost mesh dim, so its groups then never straddle a node)."""
    if allow_cross_node_tp:
        return None
    return max(1, min(int(mesh.gpus_per_node), int(nvlink_domain)))


def cross_node_tp_note(tp_domain: int) -> str:
    """Why a tp degree is not searched (the infeasibility and --degrees messages say it)."""
    return (f"tp is kept inside one NVLink domain ({tp_domain} GPUs; tp must divide it); "
            "--allow-cross-node-tp lets tp span nodes")


@dataclass
class StrategySpace:
    graph: Graph
    mesh: Mesh
    workload: Workload
    values: dict[str, list[int]] = field(default_factory=dict)
    op_slots: list[str] = field(default_factory=list)  # "kind.op" or global "op"
    op_mask_by_tp: np.ndarray | None = None  # [n_tp, n_slots, 3]
    # degrees the user fixed (``--degrees``; sp: 1, or SP_ON / the tp value for "on"): the
    # search explores the rest
    fixed: dict[str, int] = field(default_factory=dict)
    replica_gpus: int | None = None  # tp * ep * pp when dp is fixed
    # GPUs one tp group may span (:func:`nvlink_tp_domain`: tp must divide it); None = any
    # (``--allow-cross-node-tp``, or a caller pricing a given strategy)
    tp_domain: int | None = None
    # (tp, ep) pairs a runtime expresses (:func:`shardc.ir.engines.mode_space`); None = all
    allowed_tp_ep: tuple[tuple[int, int], ...] | None = None

    def __post_init__(self):
        check_positions(self.graph, self.workload)
        g, world, cfg = self.graph, self.mesh.gpus, self.graph.config
        hidden = int(cfg.get("hidden", 0)) or 1
        experts = int(cfg.get("num_experts", 0) or 0)
        tp = [d for d in divisors(world) if d <= MAX_TP and hidden % d == 0
              and (self.tp_domain is None or self.tp_domain % d == 0)]
        ep = [d for d in divisors(world) if experts and experts % d == 0] or [1]
        if experts and ("moe_tp" in self.fixed or "moe_ep" in self.fixed):
            # a fixed experts split: its moe_ep must divide the experts (:meth:`experts_split`:
            # a row where it does not is invalid), not dp_attn (vLLM / SGLang attention data
            # parallel with expert TP: --data-parallel-size 16 on Mixtral's 8 experts)
            ep = list(divisors(world))
        pp = [d for d in divisors(world) if d <= min(MAX_PP, max(g.num_layers, 1))]
        # sequence parallel (residual token-split between tp regions) in both phases; in
        # decode the tokens are the batch's sequences (one new token each)
        sp = [0, 1]
        if self.fixed:
            tp, ep, pp, sp = self._apply_fixed(tp, ep, pp, sp, hidden, experts)
        if self.workload.batch is not None:
            batch = [int(self.workload.batch)]
        else:
            batch = list(DECODE_BATCHES if self.workload.phase == "decode" else PREFILL_BATCHES)
        self.values = {"tp": tp, "ep": ep, "pp": pp, "sp": sp, "batch": batch}
        slots = []
        for kind in g.layer_kinds:
            for name in FUSED_OP_NAMES:
                if kind.op(name) is not None:
                    slots.append(f"{kind.name}.{name}")
        for name in GLOBAL_OPS:
            if g.global_op(name) is not None:
                slots.append(name)
        self.op_slots = slots
        self.op_mask_by_tp = np.stack([self._op_mask_for_tp(t) for t in tp])
        if "moe_tp" in self.fixed or "moe_ep" in self.fixed:
            self._experts_megatron_only()

    def _apply_fixed(self, tp, ep, pp, sp, hidden: int, experts: int):
        """Restrict the degree values to ``self.fixed``; an InputError names a fixed degree
        the model or the mesh rules out."""
        f, world, layers = self.fixed, self.mesh.gpus, max(self.graph.num_layers, 1)
        why = {"tp": f"tp must divide the GPU count {world} and hidden {hidden} (at most {MAX_TP})",
               "ep": (f"ep must divide the GPU count {world} and the {experts} experts"
                      + (" (with the experts split fixed: the GPU count)"
                         if "moe_tp" in f or "moe_ep" in f else "")
                      if experts else "the model has no experts, so ep = dp_attn must be 1; "
                      "for data parallelism of a dense model use dp=N"),
               "pp": f"pp must divide the GPU count {world} and be at most {min(MAX_PP, layers)}"}
        out = {"tp": tp, "ep": ep, "pp": pp}
        t = f.get("tp", 1)
        if (self.tp_domain is not None and self.tp_domain % t and not world % t
                and not hidden % t and t <= MAX_TP):  # possible, but spans nodes
            raise InputError(f"--degrees tp={f['tp']}: {cross_node_tp_note(self.tp_domain)}")
        for name, values in out.items():
            if name in f:
                if f[name] not in values:
                    raise InputError(f"--degrees {name}={f[name]}: not possible here ({why[name]})")
                out[name] = [f[name]]
        if "dp" in f:
            if world % f["dp"]:
                raise InputError(f"--degrees dp={f['dp']}: does not divide the GPU count {world}")
            self.replica_gpus = world // f["dp"]
            if not any(t * e * p == self.replica_gpus
                       for t in out["tp"] for e in out["ep"] for p in out["pp"]):
                raise InputError(f"--degrees dp={f['dp']}: no tp x ep x pp here makes "
                                 f"{self.replica_gpus} GPUs per replica")
        if "moe_tp" in f or "moe_ep" in f:
            self._check_fixed_experts_split(experts)
            sp = [0]  # sequence parallelism needs the experts at the attention tp
        if "sp" in f and f["sp"] != 1:
            if f["sp"] != SP_ON and ("tp" not in f or f["sp"] != f["tp"]):
                raise InputError(f"--degrees sp={f['sp']}: sp is 1 (off) or equal to tp (on)")
            sp = [1]
        elif "sp" in f:
            sp = [0]
        return out["tp"], out["ep"], out["pp"], sp

    def _check_fixed_experts_split(self, experts: int) -> None:
        """InputError when a fixed ``moe_tp`` / ``moe_ep`` means nothing for this model: no
        routed experts, an expert split that does not divide the experts or their ffn width,
        or sequence parallelism fixed on (it needs the experts at the attention tp)."""
        f = self.fixed
        given = ",".join(f"{k}={f[k]}" for k in ("moe_tp", "moe_ep") if k in f)
        if not experts:
            raise InputError(f"--degrees {given}: the model has no routed experts (for "
                             "attention data parallelism of a dense model use dp=N)")
        if "moe_ep" in f and experts % f["moe_ep"]:
            raise InputError(f"--degrees moe_ep={f['moe_ep']}: does not divide the "
                             f"{experts} experts")
        widths = {int(k.op("expert_ffn2").in_features or 0) for k in self.graph.layer_kinds
                  if k.op("expert_ffn2") is not None}
        bad = sorted(w for w in widths if w and "moe_tp" in f and w % f["moe_tp"])
        if bad:
            raise InputError(f"--degrees moe_tp={f['moe_tp']}: does not divide the experts' "
                             f"ffn width {bad[0]}")
        if f.get("sp", 1) != 1:
            raise InputError(f"--degrees {given} with sp=on: sequence parallelism needs the "
                             "experts at the attention tp (drop sp=on)")

    def _experts_megatron_only(self) -> None:
        """A fixed experts split runs the experts column / row over moe_tp (their legality
        at moe_tp is :meth:`_check_fixed_experts_split`'s) after a replicated router (every
        rank routes the gathered tokens, as the engines and
        :mod:`shardc.runtime.gathered_experts` do): one choice per expert / router slot."""
        for i, slot in enumerate(self.op_slots):
            op = slot.split(".")[-1]
            if op in ("expert_ffn1", "expert_ffn2", "router"):
                self.op_mask_by_tp[:, i, :] = False
                self.op_mask_by_tp[:, i, MEGATRON_CHOICE[op]] = True

    def experts_split(self, tp, ep) -> tuple[np.ndarray, np.ndarray]:
        """(moe_tp, moe_ep) arrays of the experts' split at degree arrays ``tp``, ``ep``: the
        fixed ``moe_tp`` / ``moe_ep`` (``--degrees``) where they tile ``tp x ep``, (tp, ep)
        where none is fixed, and 0 where a fixed one does not tile (an invalid row)."""
        tp, ep = np.asarray(tp, dtype=np.int64), np.asarray(ep, dtype=np.int64)
        f = self.fixed
        if "moe_tp" not in f and "moe_ep" not in f:
            return tp, ep
        group = tp * ep
        mt = np.full_like(group, int(f.get("moe_tp", 0)))
        me = np.full_like(group, int(f.get("moe_ep", 0)))
        mt = np.where(mt > 0, mt, group // np.maximum(me, 1))
        me = np.where(me > 0, me, group // np.maximum(mt, 1))
        ok = (mt * me == group) & (mt > 0) & (me > 0)
        # the derived half must also divide the experts (moe_ep) and their width (moe_tp)
        experts = int(self.graph.config.get("num_experts", 0) or 0)
        if experts:
            ok &= experts % np.maximum(me, 1) == 0
        for width in self._expert_widths():
            ok &= width % np.maximum(mt, 1) == 0
        return np.where(ok, mt, 0), np.where(ok, me, 0)

    def _expert_widths(self) -> list[int]:
        """The routed experts' ffn widths (the dims moe_tp splits)."""
        return sorted({int(k.op("expert_ffn2").in_features or 0)
                       for k in self.graph.layer_kinds if k.op("expert_ffn2") is not None} - {0})

    def fixed_degrees_fit(self, tp, ep, pp) -> np.ndarray:
        """Whether degree values (arrays) agree with a fixed dp: tp * ep * pp = GPUs / dp."""
        prod = np.asarray(tp) * np.asarray(ep) * np.asarray(pp)
        ok = (np.ones(np.shape(prod), dtype=bool) if self.replica_gpus is None
              else prod == self.replica_gpus)
        if self.allowed_tp_ep is not None:  # an engine's (tp, ep) pairs
            tp_b, ep_b, _ = np.broadcast_arrays(np.asarray(tp), np.asarray(ep), prod)
            pairs = np.array(self.allowed_tp_ep, dtype=np.int64).reshape(-1, 2)
            key = tp_b.astype(np.int64) * (1 << 20) + ep_b
            ok = ok & np.isin(key, pairs[:, 0] * (1 << 20) + pairs[:, 1])
        return ok

    # ----------------------------------------------------------------- structure
    @property
    def components(self) -> list[str]:
        return list(DEGREE_COMPONENTS) + self.op_slots

    @property
    def nvec(self) -> np.ndarray:
        deg = [len(self.values[c]) for c in DEGREE_COMPONENTS]
        return np.array(deg + [NUM_CHOICES] * len(self.op_slots), dtype=np.int64)

    @property
    def size(self) -> int:
        """Number of joint configurations (before masking), as a Python int."""
        return math.prod(int(v) for v in self.nvec)

    def _fused(self, slot: str):
        if "." in slot:
            kind, op = slot.split(".", 1)
            return self.graph.layer_kind(kind).op(op), op
        return self.graph.global_op(slot), slot

    def _op_mask_for_tp(self, tp: int, replicate_kv_heads: bool = True) -> np.ndarray:
        """[n_slots, 3] legal choices at tensor-parallel degree ``tp``
        (:func:`shardc.ir.contract.legal`; ``replicate_kv_heads`` False: a heads split only
        where tp divides the KV heads, Megatron's rule)."""
        cfg = self.graph.config
        heads = int(cfg.get("heads", 1) or 1)
        kv_heads = int(cfg.get("kv_heads", heads) or heads)
        mask = np.ones((len(self.op_slots), NUM_CHOICES), dtype=bool)
        for i, slot in enumerate(self.op_slots):
            fop, op = self._fused(slot)
            h, kv, rep = heads, kv_heads, replicate_kv_heads
            core = self.graph.layer_kind(slot.split(".", 1)[0]).op("attn_core") \
                if "." in slot else None
            if core is not None and core.attrs.get("recurrent"):
                # a linear-attention / Mamba layer splits its own heads (its state with
                # them): tp must divide both its value and key heads, none replicated
                h = int(core.attrs.get("heads", 1) or 1)
                kv, rep = int(core.attrs.get("kv_heads", h) or h), False
            for c in range(NUM_CHOICES):
                mask[i, c] = legal(op_choice(op, c), tp, int(fop.in_features or 0),
                                   int(fop.out_features or 0), h, kv, rep)
        return mask

    # ---------------------------------------------------------------- vectorised
    def degree_arrays(self, actions: np.ndarray) -> dict[str, np.ndarray]:
        """Degree values for a batch of actions [B, A] -> {tp, ep, pp, sp, dp, batch, moe_tp,
        moe_ep}: [B] (moe_tp, moe_ep: :meth:`experts_split`; dp 0 where they cannot tile)."""
        a = np.atleast_2d(actions)
        out = {}
        for j, c in enumerate(DEGREE_COMPONENTS):
            out[c] = np.asarray(self.values[c], dtype=np.int64)[a[:, j]]
        out["sp"] = np.where(out["sp"] > 0, out["tp"], 1)
        replica = out["tp"] * out["ep"] * out["pp"]
        out["dp"] = np.where(self.mesh.gpus % replica == 0, self.mesh.gpus // replica, 0)
        out["moe_tp"], out["moe_ep"] = self.experts_split(out["tp"], out["ep"])
        out["dp"] = np.where(out["moe_tp"] > 0, out["dp"], 0)  # a fixed split that cannot tile
        return out

    def degrees_valid(self, actions: np.ndarray) -> np.ndarray:
        """[B] bool: the degrees tile the mesh exactly (dp integral)."""
        return self.degree_arrays(actions)["dp"] > 0

    def op_masks(self, tp_idx: np.ndarray) -> np.ndarray:
        """[B, n_slots, 3] legal op choices given each action's tp index."""
        return self.op_mask_by_tp[np.asarray(tp_idx, dtype=np.int64)]

    def actions_legal(self, actions: np.ndarray) -> np.ndarray:
        """[B] bool: degrees tile the mesh and every op choice is unmasked."""
        a = np.atleast_2d(actions)
        m = self.op_masks(a[:, 0])
        ops = a[:, len(DEGREE_COMPONENTS):]
        ok_ops = np.take_along_axis(m, ops[:, :, None], axis=2)[:, :, 0].all(axis=1)
        ok = ok_ops & self.degrees_valid(a)
        if self.allowed_tp_ep is not None:  # an engine's (tp, ep) pairs
            deg = self.degree_arrays(a)
            ok &= self.fixed_degrees_fit(deg["tp"], deg["ep"], deg["pp"])
        return ok

    # ------------------------------------------------------------ encode / decode
    def decode(self, action) -> Strategy:
        a = np.asarray(action, dtype=np.int64).reshape(-1)
        d = {k: int(v[0]) for k, v in self.degree_arrays(a[None, :]).items()}
        if d["dp"] == 0:
            raise ValueError(f"degrees tp={d['tp']} ep={d['ep']} pp={d['pp']} do not tile {self.mesh}")
        degrees = Degrees(tp=d["tp"], pp=d["pp"], ep=d["ep"], dp=d["dp"], sp=d["sp"],
                          moe_tp=d["moe_tp"], moe_ep=d["moe_ep"])
        choices = {s: int(c) for s, c in zip(self.op_slots, a[len(DEGREE_COMPONENTS):])}
        return Strategy(degrees=degrees, batch=d["batch"], choices=choices)

    def encode(self, strategy: Strategy) -> np.ndarray:
        deg = strategy.degrees
        want = {"tp": deg.tp, "ep": deg.ep, "pp": deg.pp, "sp": 1 if deg.sp > 1 else 0,
                "batch": strategy.batch}
        out = []
        for c in DEGREE_COMPONENTS:
            if want[c] not in self.values[c]:
                raise ValueError(f"{c}={want[c]} is not a candidate ({self.values[c]})")
            out.append(self.values[c].index(want[c]))
        split = self.experts_split(deg.tp, deg.ep)
        if (int(split[0]), int(split[1])) != (deg.expert_tp, deg.expert_ep):
            raise ValueError(f"experts split moe_tp={deg.expert_tp} x moe_ep={deg.expert_ep} "
                             "is not this space's (fix it with fixed moe_tp / moe_ep)")
        out += [int(strategy.choices[s]) for s in self.op_slots]
        return np.array(out, dtype=np.int64)


def with_experts_split(space: StrategySpace, moe_tp: int) -> StrategySpace:
    """A copy of ``space`` with the experts split fixed at ``moe_tp`` (``moe_ep = tp x ep /
    moe_tp`` at each (tp, ep); as ``--degrees moe_tp=N`` builds it: sp off, the experts
    column / row): same components and candidate values (sp's value 0 keeps its index), so
    an action of ``space`` means the same degrees and ops in both, and decodes with the
    split only here; the ep (dp_attn) values a fixed split adds -- moe_ep, not dp_attn, must
    divide the experts there, e.g. dp_attn=16 on Mixtral's 8 experts with moe_tp=2 x
    moe_ep=8 -- come after ``space``'s, so its indices keep their meaning (an action using
    one decodes in the copy only). The searches sweep these copies as an outer loop
    (:func:`shardc.ir.engines.split_spaces`)."""
    import dataclasses

    out = dataclasses.replace(space, fixed={**space.fixed, "moe_tp": int(moe_tp)})
    extra = [e for e in out.values["ep"] if e not in space.values["ep"]]
    out.values = {**space.values, "sp": [0], "ep": list(space.values["ep"]) + extra}
    assert 0 in space.values["sp"] and space.values["sp"].index(0) == 0
    return out


# Megatron-LM's fixed per-op dims (SPEC section 7): column-parallel qkv / ffn1, row-parallel
# out_proj / ffn2, attention split by heads, vocab-parallel embedding, column-parallel
# (vocab-split) lm_head, router replicated, experts split by EP with Megatron dims inside.
MEGATRON_CHOICE = {
    "embedding": 0, "qkv": 0, "attn_core": 0, "out_proj": 1, "ffn1": 0, "ffn2": 1,
    "router": 2, "expert_ffn1": 0, "expert_ffn2": 1, "shared_ffn1": 0, "shared_ffn2": 1,
    "lm_head": 0,
}


def megatron_op_choices(space: StrategySpace, tp_idx: int) -> np.ndarray:
    """[n_slots] Megatron's choice per op slot at candidate ``tp_idx``; where Megatron's dim
    is illegal at that tp (e.g. tp does not divide the heads, or the KV heads: Megatron does
    not replicate KV heads) the op is replicated."""
    mask = space._op_mask_for_tp(space.values["tp"][int(tp_idx)], replicate_kv_heads=False)
    out = np.empty(len(space.op_slots), dtype=np.int64)
    for i, slot in enumerate(space.op_slots):
        c = MEGATRON_CHOICE[slot.split(".")[-1]]
        out[i] = c if mask[i, c] else 2
    return out


def megatron_ops_at_tp1(space: StrategySpace, actions: np.ndarray) -> np.ndarray:
    """``actions`` [B, A] with the op choices of every tp = 1 row set to Megatron's. At tp = 1
    no op is split, so the cost model charges every choice the same (the same strategy under
    one name); the other rows are returned unchanged (a copy only when something changes)."""
    if 1 not in space.values["tp"]:
        return actions
    t1 = space.values["tp"].index(1)
    rows = np.atleast_2d(actions)[:, 0] == t1
    if not rows.any():
        return actions
    out = np.array(np.atleast_2d(actions), copy=True)
    out[rows, len(DEGREE_COMPONENTS):] = megatron_op_choices(space, t1)
    return out
