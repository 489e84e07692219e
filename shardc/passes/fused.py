"""Fused-op grouping: assign ``Node.fused_op`` from canonical IR fields only.

Uses op kinds, parameters (shapes), layer indices and dataflow (``Node.inputs``) -- never
``Node.target`` -- so nodes from any frontend (torch.export, ONNX) are grouped the same way.
Per decoder layer (nodes with the same ``Node.layer``):

* attention core: the ``attention`` node(s); without one, a linear-attention / Mamba core
  (the ``causal_conv`` and ``recurrent_scan`` nodes, plus the linears between them and the
  per-head parameters reaching them: :func:`_recurrent_core_params`); else (unfused
  attention) the activation-by-activation ``matmul`` nodes and the ``softmax``-like
  activations between them;
* ``qkv``: parametric ``linear`` nodes before the core whose output reaches another linear
  before the core (MLA's low-rank "down" projections; ``Node.attrs['low_rank'] = True``),
  plus those whose output reaches the core without passing another linear ("up" projections);
* ``out_proj``: linears reached from the core output without passing another linear;
* ``router``: a linear whose output reaches a ``router`` (top-k) node without passing
  another linear, plus the parametric nodes on that path (e.g. a score-correction bias) and
  the top-k nodes;
* ``expert_ffn1`` / ``expert_ffn2``: ``grouped_matmul`` nodes whose output does / does not
  reach another grouped matmul. *Batched* experts (a ``matmul`` against an ``[E, a, b]``
  parameter gathered per routed token, e.g. transformers' ``batched_mm`` experts or an ONNX
  ``Gather``/``GatherND`` + ``MatMul``) are first rewritten into this grouped form by
  :func:`recognise_batched_experts`;
* remaining linears: ``ffn1`` / ``ffn2`` in a layer without experts, ``shared_ffn1`` /
  ``shared_ffn2`` in a layer with experts; ``*1`` if the output reaches another remaining
  linear, else ``*2``; in a layer with experts, a linear with one output feature is a
  per-token scalar gate (Qwen2-MoE's sigmoid gate on the shared expert), no fused op
  (``attrs["scalar_gate"]``: its weight stays whole on every rank, like a norm's);
* ``norm``: ``norm`` nodes and remaining nodes with only 1-D parameters (decomposed RMSNorm).

Outside the layers: ``embedding`` nodes -> ``embedding``; linears -> ``lm_head``.
"""

from __future__ import annotations

from collections import defaultdict

from shardc.errors import InputError
from shardc.ir.graph import Graph, Node
from shardc.passes.canonicalise import node_bytes
from shardc.passes.dataflow import Dataflow

_MATMULS = ("linear", "grouped_matmul")


def _expert_gather(node: Node, by_name: dict[str, Node]) -> Node | None:
    """The ``gather_scatter`` node behind ``node`` (through single-input views) that picks
    rows of one ``[E, a, b]`` parameter per routed token (output ``[S, a, b]``), else None."""
    cur = node
    while cur is not None and cur.op == "view" and len(cur.inputs) == 1:
        cur = by_name.get(cur.inputs[0])
    if cur is None or cur.op != "gather_scatter" or len(cur.params) != 1:
        return None
    shape = list(cur.params[0].shape)
    out = list(cur.output_shape)
    if len(shape) < 3 or len(out) != len(shape) or out[1:] != shape[1:]:
        return None
    return cur


def recognise_batched_experts(graph: Graph) -> int:
    """Rewrite batched expert matmuls into the canonical grouped form (in place).

    A parameter-free ``matmul`` with two operands ``A [S, m, k] @ B [S, k, n]`` one of which
    is a per-token gather of an ``[E, a, b]`` parameter ``W`` (:func:`_expert_gather`) is an
    expert matmul over the ``S = tokens x top_k`` routed rows: its kind becomes
    ``grouped_matmul`` and it carries ``W`` (the gather no longer does, as in the grouped
    form, where the weight is read by the expert matmul itself). Its FLOPs stay
    ``2 * S * out * k`` -- only the active experts' rows. ``attrs['expert_features'] =
    [in, out]`` records the features (``[k, m]`` if ``W`` is the left operand, ``[k, n]`` if
    the right) since the node's shapes are 3-D; ``attrs['expert_gather']`` names the gather.
    Bytes are recomputed by the grouped-matmul formula. Reads canonical fields only.
    Returns the number of rewritten nodes."""
    by_name = {n.name: n for n in graph.nodes}
    rewritten, moved = 0, []
    for n in graph.nodes:
        if n.op != "matmul" or n.params or len(n.inputs) != 2 or len(n.input_shapes) != 2:
            continue
        a, b = n.input_shapes
        if len(a) < 3 or len(b) < 3:
            continue
        for side, name in enumerate(n.inputs):
            gather = _expert_gather(by_name[name], by_name) if name in by_name else None
            if gather is None:
                continue
            n.op = "grouped_matmul"
            n.params = list(gather.params)
            n.attrs["expert_features"] = [int(a[-1]), int(a[-2])] if side == 0 else \
                [int(b[-2]), int(b[-1])]
            n.attrs["expert_gather"] = gather.name
            n.bytes = node_bytes(n)
            moved.append(gather)
            rewritten += 1
            break
    for gather in moved:
        gather.params = []
    return rewritten


class _Flow:
    """Node lookup, positions and the dataflow (:class:`~shardc.passes.dataflow.Dataflow`)
    for the fused-op questions of one graph."""

    def __init__(self, graph: Graph):
        self.by_name = {n.name: n for n in graph.nodes}
        self.pos = {n.name: i for i, n in enumerate(graph.nodes)}
        self.dataflow = Dataflow(graph.nodes)

    def reach(self, start: Node) -> set[str]:
        """Names of nodes reachable from ``start`` (exclusive) within its layer; the walk
        reports matmuls (linear, grouped) but does not continue through them."""
        flow = self.dataflow
        return flow.downstream(start.name, stop=lambda n: flow.op(n) in _MATMULS,
                               same_layer=True)


def _out_features(n: Node) -> int:
    return int(n.output_shape[-1]) if n.output_shape else -1


RECURRENT_OPS = ("causal_conv", "recurrent_scan")


def recurrent_heads(scan: Node) -> int:
    """Heads a ``recurrent_scan`` splits into under tensor parallelism: Gated DeltaNet's value
    heads (v ``[B, S, Hv, Dv]``), Mamba's channels (u ``[B, D, S]``, each its own state)."""
    ins = scan.input_shapes
    if scan.attrs.get("recurrent") == "gated_deltanet" and len(ins) >= 3:
        return int(ins[2][-2])
    if scan.attrs.get("recurrent") == "mamba2" and ins and len(ins[0]) >= 2:
        return int(ins[0][-2])  # x [B, S, H, P]
    return int(ins[0][1]) if ins and len(ins[0]) >= 2 else 1


def _attention_core(nodes: list[Node], flow: _Flow) -> list[Node]:
    core = [n for n in nodes if n.op == "attention"]
    if core:
        return core
    core = [n for n in nodes if n.op in RECURRENT_OPS]
    if any(n.op == "recurrent_scan" for n in core):
        return core
    mms = [n for n in nodes if n.op == "matmul" and not n.params and len(n.input_shapes) >= 2
           and len(n.input_shapes[0]) >= 3]
    if len(mms) < 2:
        return []
    first, last = flow.pos[mms[0].name], flow.pos[mms[-1].name]
    between = [n for n in nodes if first < flow.pos[n.name] < last and n.op == "activation"]
    return mms[:2] + between


def _assign_layer(nodes: list[Node], flow: _Flow) -> None:
    linears = [n for n in nodes if n.op == "linear" and n.params]
    grouped = [n for n in nodes if n.op == "grouped_matmul"]
    core = _attention_core(nodes, flow)
    done: set[str] = set()

    def mark(node: Node, name: str) -> None:
        node.fused_op = name
        done.add(node.name)

    if core:
        core_names = {n.name for n in core}
        start, end = min(flow.pos[c] for c in core_names), max(flow.pos[c] for c in core_names)
        for c in core:
            mark(c, "attn_core")
        before = [n for n in linears if flow.pos[n.name] < start]
        before_names = {n.name for n in before}
        low_rank = [n for n in before if flow.reach(n) & before_names]
        low_names = {n.name for n in low_rank}
        for n in before:
            if n.name not in low_names and flow.reach(n) & core_names:
                mark(n, "qkv")
        for n in low_rank:
            mark(n, "qkv")
            n.attrs["low_rank"] = True
        reached = set()
        for c in core:
            reached |= flow.reach(c)
        for n in linears:
            if n.name in reached and flow.pos[n.name] > end and n.name not in done:
                mark(n, "out_proj")
        if any(c.op == "recurrent_scan" for c in core):
            _recurrent_core_params(nodes, core, flow, mark, done)
    routers = [n for n in nodes if n.op == "router"]
    router_names = {n.name for n in routers}
    num_experts = {int(n.params[0].shape[0]) for n in grouped if n.params}
    for n in linears:
        if n.name in done:
            continue
        path = flow.reach(n)
        # no top-k node (e.g. Phi-3.5-MoE's sparsemixer picks experts with max): the linear
        # scoring every expert (out features = the experts' count) is the router
        scores_experts = not routers and _out_features(n) in num_experts
        if path & router_names or scores_experts:
            mark(n, "router")
            for name in path:
                node = flow.by_name[name]
                if node.params and node.name not in done and node.op not in _MATMULS:
                    mark(node, "router")
    for n in routers:
        mark(n, "router")
    grouped_names = {n.name for n in grouped}
    for n in grouped:
        mark(n, "expert_ffn1" if flow.reach(n) & grouped_names else "expert_ffn2")
    rest = [n for n in linears if n.name not in done]
    for n in rest:  # a per-token scalar gate (Qwen2-MoE's shared_expert_gate): not an FFN half
        if grouped and _out_features(n) == 1:
            n.attrs["scalar_gate"] = True
    rest = [n for n in rest if not n.attrs.get("scalar_gate")]
    rest_names = {n.name for n in rest}
    prefix = "shared_ffn" if grouped else "ffn"
    for n in rest:
        mark(n, f"{prefix}1" if flow.reach(n) & rest_names else f"{prefix}2")
    for n in nodes:
        if n.name in done:
            continue
        if n.op == "norm" or (n.params and all(len(p.shape) == 1 for p in n.params)):
            n.fused_op = "norm"


def _recurrent_core_params(nodes: list[Node], core: list[Node], flow: _Flow, mark, done) -> None:
    """The rest of a linear-attention / Mamba core: linears between its conv and its scan
    (Mamba's ``x_proj`` / ``dt_proj``: per-channel inputs, split with the channels) and
    parametric nodes with one entry per head that reach the core without passing a matmul
    (``A_log``, ``dt_bias``); both shard with the heads. Per-token norms of other widths
    (Mamba's dt / B / C norms, the gated output norm) stay ``norm`` (replicated)."""
    scan = next(c for c in core if c.op == "recurrent_scan")
    heads = recurrent_heads(scan)
    names = {c.name for c in core}
    start, end = min(flow.pos[c] for c in names), max(flow.pos[c] for c in names)
    for n in nodes:
        if n.name in done or not n.params:
            continue
        if n.op == "linear" and start < flow.pos[n.name] < end:
            mark(n, "attn_core")
        elif n.op != "linear" and all(p.shape and int(p.shape[0]) == heads for p in n.params) \
                and flow.reach(n) & names:
            mark(n, "attn_core")


def refuse_dense_experts(graph: Graph) -> None:
    """Raise :class:`InputError` when stacked expert weights (a parameter of 3 or more dims)
    are multiplied by every token instead of the routed ones -- after
    :func:`recognise_batched_experts`, a ``linear`` / ``matmul`` (e.g. a ``bmm``) still reading such a parameter. Such a
    trace (e.g. transformers' Llama-4 MoE, which runs all experts densely and weights them by
    the router scores) would be planned as a dense FFN: a different model."""
    for n in graph.nodes:
        if n.op not in ("linear", "matmul"):
            continue
        stacked = [p for p in n.params if len(p.shape) >= 3]
        if stacked:
            p = stacked[0]
            raise InputError(
                f"{graph.name or 'model'}: layer {n.layer}: expert weights {p.fqn} "
                f"{list(p.shape)} are applied to every token (experts computed densely, not "
                "routed); shardc would plan it as a dense FFN, a different model -- not supported")


def group_fused_ops(graph: Graph) -> Graph:
    """Set ``Node.fused_op`` on every node that belongs to a fused op (in place), after
    rewriting batched expert matmuls into the grouped form (:func:`recognise_batched_experts`);
    refuses experts computed densely (:func:`refuse_dense_experts`)."""
    recognise_batched_experts(graph)
    refuse_dense_experts(graph)
    flow = _Flow(graph)
    by_layer: dict[int, list[Node]] = defaultdict(list)
    for n in graph.nodes:
        n.fused_op = None
        if n.layer is not None:
            by_layer[n.layer].append(n)
    for layer in sorted(by_layer):
        _assign_layer(by_layer[layer], flow)
    for n in graph.nodes:
        if n.layer is not None:
            continue
        if n.op == "embedding":
            n.fused_op = "embedding"
        elif n.op == "linear" and n.params:
            n.fused_op = "lm_head"
        elif n.op == "norm" or (n.params and all(len(p.shape) == 1 for p in n.params)):
            n.fused_op = "norm"
    return graph
