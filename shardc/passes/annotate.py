"""Annotation pass: a strategy -> DTensor placements on every IR node.

``annotate(graph, strategy)`` returns a new graph (:func:`annotation_copy`: new
:class:`~shardc.ir.graph.Node` objects, the nodes' unchanged fields shared with ``graph``,
which is left as it was) where every node carries

* ``placements``: the placement of its output on each SPMD mesh dim, i.e. the logical mesh
  (:meth:`Degrees.logical_mesh`) *without* ``pp``, in the same order (dp, ep, tp; only dims
  of size > 1), spelt ``"S(d)"`` / ``"R"`` / ``"P(sum)"``. Activations are ``S(0)`` (batch
  split) over dp and ep; over tp the fused ops of each branch follow the walk of
  :func:`shardc.ir.contract.walk`; views, elementwise ops and norms follow their
  producer. A single-GPU plan annotates ``["R"]`` on a size-1 ``tp`` dim.
* ``stage``: the pipeline stage holding the node (``pp`` is represented only here:
  :func:`shardc.ir.strategy.pipeline_stages`; embedding on stage 0, lm_head on the last).
* ``redistribute`` on the node that consumes a repaired tensor (the first consumer of the
  producing op's output -- where the DTensor runtime issues the collective, before any
  non-linear op -- or the entry node of a branch's first op):
  ``{collective, mesh_dim, bytes, src, dst, branch, before_op, layer}``; ``before_op`` is the op
  of :func:`shardc.ir.contract.walk` (``"<end>"`` for the branch end,
  ``"dispatch"`` / ``"combine"`` for the expert all-to-alls over ep). A node that carries
  two repairs lists the second under ``"also"``.

Collectives come from :func:`shardc.ir.contract.walk`, the walk the cost
model's tables are built from. ``bytes`` follows the cost model's accounting: full tensor
bytes = ``tokens x width x act_bytes`` with ``width`` the producing op's output features
(the branch input width for the first op); for the ep all-to-alls, per-rank bytes
``tokens x top_k x hidden x act_bytes``. ``tokens`` defaults to the traced tokens.
"""

from __future__ import annotations

import copy
import dataclasses

from shardc.ir.contract import (
    BRANCHES,
    GLOBAL_OPS,
    dtensor_spelling,
    repeated_kv_growth,
    walk,
)
from shardc.ir.graph import FusedOp, Graph, LayerKind
from shardc.ir.strategy import Strategy, pipeline_stages, residual_placement


def spmd_dims(strategy: Strategy) -> list[str]:
    """Mesh dims the placements list refers to (:meth:`Degrees.spmd_dims`)."""
    return strategy.degrees.spmd_dims()


def _out_width(fop: FusedOp) -> int:
    if fop.name == "attn_core":
        a = fop.attrs
        return int(fop.out_features or a.get("heads", 0) * a.get("v_head_dim", a.get("head_dim", 0)))
    return int(fop.out_features)


class _BranchPlan:
    """One branch of one layer kind (or a global op): placements and repairs of its walk."""

    def __init__(self, name: str, fops: list[FusedOp], choices: list[int], start: str, end: str,
                 hidden: int):
        self.name, self.fops = name, fops
        self.ops = tuple(f.name for f in fops)
        walked = walk(self.ops, choices, start, end)
        self.produced: dict[str, str] = {s.op: s.produced for s in walked.steps}
        self.walk = walked.collectives()
        first_width = hidden if name == "experts" else (1 if name == "embedding"
                                                        else fops[0].in_features)
        self.width_before = {self.ops[0]: first_width}
        for i in range(1, len(self.ops)):
            self.width_before[self.ops[i]] = _out_width(fops[i - 1])
        self.width_before["<end>"] = _out_width(fops[-1])

    def repair_before(self, op: str):
        for before, src, dst, coll in self.walk:
            if before == op:
                return src, dst, coll
        return None

    def repair_after(self, op: str):
        """The repair of this op's output (before the next op, or at the branch end)."""
        i = self.ops.index(op)
        nxt = self.ops[i + 1] if i + 1 < len(self.ops) else "<end>"
        r = self.repair_before(nxt)
        return (nxt, *r) if r else None


def _branches_of(kind: LayerKind | None, graph: Graph, strategy: Strategy, residual: str
                 ) -> list[_BranchPlan]:
    hidden = int(graph.config.get("hidden", 0) or 0)
    out = []
    if kind is None:
        for op in GLOBAL_OPS:
            fop = graph.global_op(op)
            if fop is None:
                continue
            start, end = ("R", residual) if op == "embedding" else (residual, "R")
            out.append(_BranchPlan(op, [fop], [int(strategy.choices.get(op, 2))], start, end,
                                   hidden))
        return out
    for bname, ops in BRANCHES.items():
        fops = [kind.op(o) for o in ops]
        if any(f is None for f in fops):
            continue
        choices = [int(strategy.choices.get(f"{kind.name}.{o}", 2)) for o in ops]
        bp = _BranchPlan(bname, fops, choices, residual, residual, hidden)
        if bname == "attention" and bp.produced.get("qkv") == "P" and \
                bp.produced.get("attn_core") == "S(1)":
            # a row qkv's partial sums are repeated per KV head before the reduce-scatter
            # into the heads split when tp > kv_heads (as the cost model charges)
            bp.width_before["attn_core"] *= float(repeated_kv_growth(
                kind.op("attn_core").attrs, kind.op("qkv").out_features, strategy.degrees.tp))
        out.append(bp)
    return out


def annotation_copy(graph: Graph) -> Graph:
    """The graph :func:`annotate` writes into: a new :class:`Graph` with a shallow copy of
    every node (and of the top-level lists) whose ``placements``, ``stage`` and
    ``redistribute`` are cleared, so that annotating leaves ``graph`` untouched and an
    annotation of an annotated graph keeps nothing of the old one. Fields the annotation
    never writes (inputs, shapes, params, attrs, layer kinds, config) are shared with
    ``graph``, not copied: a deep copy of a 10k-node graph costs ~1 s."""
    nodes = []
    for n in graph.nodes:
        m = copy.copy(n)
        m.placements = m.redistribute = m.stage = None
        nodes.append(m)
    return dataclasses.replace(graph, nodes=nodes, params=list(graph.params),
                               layer_kinds=list(graph.layer_kinds),
                               global_ops=list(graph.global_ops), config=dict(graph.config),
                               warnings=list(graph.warnings))


def annotate(graph: Graph, strategy: Strategy, tokens: int | None = None,
             act_bytes: int | None = None) -> Graph:
    """Return a copy of ``graph`` (:func:`annotation_copy`; ``graph`` itself is not
    modified) with placements, stages and redistributions on every node. ``tokens`` = the
    tokens of one step of one replica the collective bytes are for; ``act_bytes`` = bytes
    per activation element."""
    g = annotation_copy(graph)
    deg = strategy.degrees
    dims = spmd_dims(strategy)
    residual = residual_placement(deg)
    tokens = int(tokens or g.tokens or 1)
    act_bytes = int(act_bytes or g.config.get("dtype_bytes", 2) or 2)
    top_k = int(g.config.get("top_k", 0) or 0)
    hidden = int(g.config.get("hidden", 0) or 0)
    num_layers = max(g.num_layers, 1)
    stages = pipeline_stages(g.num_layers, min(deg.pp, num_layers)) if g.num_layers else []

    plans: dict[str | None, list[_BranchPlan]] = {None: _branches_of(None, g, strategy, residual)}
    for k in g.layer_kinds:
        plans[k.name] = _branches_of(k, g, strategy, residual)
    op_plan: dict[tuple[str | None, str], _BranchPlan] = {
        (kname, op): bp for kname, bps in plans.items() for bp in bps for op in bp.ops}

    # the entry (first) and exit (last) node of each fused op instance, per layer
    first_node: dict[tuple, str] = {}
    last_node: dict[tuple, str] = {}
    for n in g.nodes:
        if n.fused_op is None:
            continue
        key = (n.layer, n.layer_kind, n.fused_op)
        first_node.setdefault(key, n.name)
        last_node[key] = n.name

    def mark(bp: _BranchPlan, layer: int | None, before: str, src: str, dst: str, coll: str,
             mesh_dim: str = "tp", nbytes: int | None = None) -> dict:
        if mesh_dim == "tp" and deg.tp == 1:
            return None  # a size-1 dim: every placement is the same tensor, nothing to move
        if nbytes is None:
            nbytes = tokens * bp.width_before[before] * act_bytes
        return {"collective": coll, "mesh_dim": mesh_dim, "bytes": int(nbytes),
                "src": dtensor_spelling(src), "dst": dtensor_spelling(dst),
                "branch": bp.name, "before_op": before, "layer": layer}

    def attach(node, red: dict | None) -> None:
        if red is None:
            return
        if node.redistribute is None:
            node.redistribute = red
        else:
            node.redistribute.setdefault("also", []).append(red)

    seen_layer = False
    eff: dict[str, str] = {}  # placement consumers of a node see (after a repair)
    pending: dict[str, dict] = {}  # producer -> repair to attach to its first consumer
    for n in g.nodes:
        for i in n.inputs:
            if i in pending:
                attach(n, pending.pop(i))
        kname = n.layer_kind if n.layer is not None else None
        bp = op_plan.get((kname, n.fused_op)) if n.fused_op else None
        key = (n.layer, n.layer_kind, n.fused_op)
        if n.op == "input":
            tp = "R"
        elif bp is not None:
            tp = bp.produced[n.fused_op]
            if first_node.get(key) == n.name:
                if n.fused_op == bp.ops[0]:
                    r = bp.repair_before(n.fused_op)
                    if r:
                        attach(n, mark(bp, n.layer, n.fused_op, *r))
                if bp.name == "experts" and n.fused_op == "expert_ffn1" and deg.ep > 1:
                    attach(n, mark(bp, n.layer, "dispatch", "S(0)", "S(0)", "all_to_all", "ep",
                                   tokens * top_k * hidden * act_bytes))
        else:
            ins = [eff[i] for i in n.inputs if i in eff]
            tp = next((p for p in ins if p != "R"), "R")
        eff[n.name] = tp
        if bp is not None and last_node.get(key) == n.name:
            after = bp.repair_after(n.fused_op)
            if after:
                before, src, dst, coll = after
                red = mark(bp, n.layer, before, src, dst, coll)
                if red is not None:
                    pending[n.name] = red
                eff[n.name] = dst
            if bp.name == "experts" and n.fused_op == "expert_ffn2" and deg.ep > 1:
                red = mark(bp, n.layer, "combine", "S(0)", "S(0)", "all_to_all", "ep",
                           tokens * top_k * hidden * act_bytes)
                if n.name in pending:
                    pending[n.name].setdefault("also", []).append(red)
                else:
                    pending[n.name] = red
        if deg.tp == 1:
            tp = "R"
        n.placements = [("S(0)" if d in ("dp", "ep") else dtensor_spelling(tp)) for d in dims]
        if n.layer is not None and n.layer < len(stages):
            n.stage = stages[n.layer]
        else:  # outside the layers: before the first layer stage 0, after it the last
            n.stage = deg.pp - 1 if seen_layer else 0
        seen_layer = seen_layer or n.layer is not None
    for producer, red in pending.items():  # repairs of graph outputs: on the producer
        attach(g.node(producer), red)
    return g


def redistributions(graph: Graph) -> list[dict]:
    """Every repair in an annotated graph (flattened), with the node it sits on and the layer
    and layer kind of the op whose output or input it repairs (None: embedding / lm_head)."""
    kinds = {i: k.name for k in graph.layer_kinds for i in k.layers}
    out = []
    for n in graph.nodes:
        r = n.redistribute
        while r:
            for red in [r, *r.get("also", [])]:
                row = {k: v for k, v in red.items() if k != "also"}
                row.setdefault("layer", n.layer)
                row.update(node=n.name, layer_kind=kinds.get(row["layer"]))
                out.append(row)
            r = None
    return out
