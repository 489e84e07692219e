"""Layer grouping: structurally identical decoder layers -> :class:`LayerKind`, with the
per-layer :class:`FusedOp` records the cost model consumes, plus ``Graph.global_ops`` and
``Graph.config``. Reads canonical fields only (op, fused_op, params, shapes, layer).

A layer's *signature* is the sequence of (op kind, fused op, parameter shapes) of its nodes;
layers with equal signatures form one kind, named ``moe_block`` (has grouped expert matmuls)
or ``dense_block`` (``_2``, ``_3`` ... if several kinds share a base name), ordered by first
layer. FusedOp conventions (per layer, one token): see :class:`shardc.ir.graph.FusedOp`;
``nodes`` lists the node names of the kind's first layer.

Attention FLOPs per position (``attn_core`` attrs): ``flops_per_token_per_context`` is the
attention the traced model computes, ``2 * heads * (head_dim + v_head_dim)`` (for MLA the
non-absorbed form over up-projected K/V, as in prefill); ``decode_flops_per_token_per_context``
is what a decode step costs per cached position: the same for standard attention, the
absorbed-MLA form ``2 * heads * (2 * kv_lora + rope)`` over the latent cache for MLA
(:func:`mla_absorbed_flops_per_context`). The cost model uses the first for prefill and the
second for decode. ``window`` (tokens, only on sliding-window layers): the
``attention_window`` the frontend recorded on the layer's nodes (the traced model's
per-layer window; :mod:`shardc.ir.windows`); such a core reads ``min(context, window)``
positions. ``whole_projection_norms`` (only when > 0): q/k norms that normalise a whole
projection output rather than each head (OLMoE) -- a reduction over the full width of a
qkv up-projection's output on its way to the core; under a heads split each such norm
all-reduces a ``[tokens, 1]`` sum of squares over tp (:func:`whole_projection_norms`).

A linear-attention / Mamba layer's core (:func:`_recurrent_core`, kinds named
``linear_attn_*`` / ``mamba_*``) has no per-context FLOPs and no KV cache: a constant state
per sequence, ``flops_per_token`` (prefill) and ``decode_flops_per_token`` (one step), which
the decode sum below uses in place of the traced form.

Decode FLOPs per token (:func:`decode_flops_per_token`) at context ``C``::

    sum_kinds count * (sum_ops flops_per_token
                       + min(C, window) * attn_core.decode_flops_per_token_per_context)
    + sum_global_ops flops_per_token

with linear-like ops at ``2 * weight elements`` (experts: ``top_k * 2 * in * out``), the
embedding lookup at 0 -- i.e. ``2 x active parameters (embedding table excluded) + attention
term``.
"""

from __future__ import annotations

from collections import defaultdict

from shardc.ir.graph import FusedOp, Graph, LayerKind, Node
from shardc.ir.windows import attended_positions, op_window
from shardc.passes.canonicalise import (
    DELTA_CHUNK,
    dtype_bytes,
    numel,
    recurrent_scan_flops,
    ssd_chunk,
)
from shardc.passes.dataflow import Dataflow


def _param_total(nodes: list[Node]) -> int:
    seen: dict[str, int] = {}
    for n in nodes:
        for p in n.params:
            seen[p.fqn] = p.numel
    return sum(seen.values())


def _weight_total(nodes: list[Node]) -> int:
    seen: dict[str, int] = {}
    for n in nodes:
        for p in n.params:
            if len(p.shape) >= 2:
                seen[p.fqn] = p.numel
    return sum(seen.values())


def _in(n: Node) -> int:
    if "expert_features" in n.attrs:  # batched expert matmul (3-D shapes): see passes.fused
        return int(n.attrs["expert_features"][0])
    return int(n.input_shapes[0][-1]) if n.input_shapes and n.input_shapes[0] else 0


def _out(n: Node) -> int:
    if "expert_features" in n.attrs:
        return int(n.attrs["expert_features"][1])
    return int(n.output_shape[-1]) if n.output_shape else 0


def _linear_op(name: str, nodes: list[Node], **attrs) -> FusedOp:
    params = _param_total(nodes)
    return FusedOp(name=name, in_features=_in(nodes[0]), out_features=sum(_out(n) for n in nodes),
                   params=params, shardable_params=params, flops_per_token=2 * _weight_total(nodes),
                   nodes=[n.name for n in nodes], attrs=dict(attrs))


def _top_k(nodes: list[Node], num_experts: int, tokens: int = 0) -> int:
    """Experts per token: the last dim of the top-k over the experts' scores; without a
    top-k node (experts picked another way, e.g. by successive max), the routed rows of the
    first expert matmul (``tokens * top_k``) over the traced ``tokens``."""
    routers = [n for n in nodes if n.op == "router" and n.output_shape]
    exact = [n for n in routers if n.input_shapes and len(n.input_shapes[0]) == 2
             and n.input_shapes[0][-1] == num_experts]
    pick = (exact or routers)
    if pick:
        return int(pick[-1].output_shape[-1])
    grouped = [n for n in nodes if n.op == "grouped_matmul" and n.input_shapes]
    if grouped and tokens:
        rows = 1
        for d in grouped[0].input_shapes[0][:-1]:
            rows *= int(d)
        if "expert_features" in grouped[0].attrs:  # batched form [S, 1, in]: S routed rows
            rows = int(grouped[0].input_shapes[0][0])
        return max(rows // tokens, 1)
    return 0


def attention_flops_per_context(heads: int, head_dim: int, v_head_dim: int) -> int:
    """FLOPs per query token per attended position of the attention the model computes
    (QK^T and PV): ``2 * heads * (head_dim + v_head_dim)``."""
    return 2 * heads * (head_dim + v_head_dim)


def mla_absorbed_flops_per_context(heads: int, kv_lora: int, rope: int) -> int:
    """FLOPs per decoded token per cached position of *absorbed* MLA (the form decode kernels
    such as FlashMLA run: the key up-projection is folded into the query, the value one into
    the output, and attention reads the ``kv_lora + rope`` latent cache directly): scores over
    ``kv_lora + rope`` dims and the weighted sum of ``kv_lora``-dim latents, per head:
    ``2 * heads * ((kv_lora + rope) + kv_lora)``. The folded projections cost, per token, what
    the traced ``kv_b`` up-projection costs (``qkv.flops_per_token``), so they are not added."""
    return 2 * heads * ((kv_lora + rope) + kv_lora)


def _recurrent_core(core: list[Node], qkv: list[Node]) -> FusedOp:
    """The core of a linear-attention (Gated DeltaNet) or Mamba layer: conv + scan, and
    for Mamba the ``x_proj`` / ``dt_proj`` linears between them. No KV cache: a constant
    per-sequence state (``state_elems_per_sequence`` = recurrent + conv state, per layer,
    all heads), split by heads like attention. ``flops_per_token`` is the traced (prefill,
    chunked) form; ``decode_flops_per_token`` one recurrent step. ``inner_all_reduce_features``:
    the outputs of linears inside the core (Mamba's ``x_proj``: dt rank + 2 x state), whose
    input is split by channels under a heads split, so they are all-reduced over tp."""
    scan = next(n for n in core if n.op == "recurrent_scan")
    conv = [n for n in core if n.op == "causal_conv"]
    inner = [n for n in core if n.op == "linear"]
    _, decode_scan, state = recurrent_scan_flops(scan)
    ins = scan.input_shapes
    variant = scan.attrs.get("recurrent", "")
    if variant == "gated_deltanet":
        heads, kv_heads, head_dim, v_head_dim = (int(ins[2][-2]), int(ins[0][-2]),
                                                 int(ins[0][-1]), int(ins[2][-1]))
        tokens = numel(ins[2][:-2])
    elif variant == "mamba2":  # x [B, S, H, P], B [B, S, G, N]: G groups share B and C
        heads, kv_heads, head_dim, v_head_dim = (int(ins[0][-2]), int(ins[3][-2]),
                                                 int(ins[3][-1]), int(ins[0][-1]))
        tokens = numel(ins[0][:-2])
    else:  # mamba: every channel its own d_state-wide state
        heads = kv_heads = int(ins[0][1])
        head_dim, v_head_dim = int(ins[2][-1]), 1
        tokens = numel(ins[0]) // max(heads, 1)
    conv_state = sum(int(n.params[0].shape[0]) * (int(n.params[0].shape[-1]) - 1)
                     for n in conv if n.params)
    conv_flops = sum(2 * int(n.params[0].shape[0]) * int(n.params[0].shape[-1])
                     for n in conv if n.params)
    linear_flops = 2 * _weight_total(inner)
    prefill = scan.flops // max(tokens, 1) + conv_flops + linear_flops
    params = _param_total(core)
    attrs = {"recurrent": variant, "heads": heads, "kv_heads": kv_heads, "head_dim": head_dim,
             "v_head_dim": v_head_dim, "kv_cache_elems_per_token": 0,
             "kv_cache_split_by_heads": True, "flops_per_token_per_context": 0,
             "decode_flops_per_token_per_context": 0,
             "decode_flops_per_token": decode_scan + conv_flops + linear_flops,
             "recurrent_state_elems": state, "conv_state_elems": conv_state,
             "state_elems_per_sequence": state + conv_state,
             "kernels": len(conv) + 1 + len(inner)}
    if variant == "gated_deltanet":
        attrs["scan_chunk"] = DELTA_CHUNK
    elif variant == "mamba2":
        attrs["scan_chunk"] = ssd_chunk(scan)
    reduced = [int(p.shape[0]) for n in inner for p in n.params
               if len(p.shape) == 2 and int(p.shape[1]) == heads]  # weight [out, channels]
    if reduced:
        attrs["inner_all_reduce_features"] = sum(reduced)
    up = [n for n in qkv if not n.attrs.get("low_rank")]
    return FusedOp(name="attn_core", in_features=sum(_out(n) for n in up),
                   out_features=heads * v_head_dim,
                   params=params, shardable_params=params, flops_per_token=prefill,
                   nodes=[n.name for n in core], attrs=attrs)


def _attn_core(core: list[Node], qkv: list[Node], nodes: list[Node]) -> FusedOp:
    if any(n.op == "recurrent_scan" for n in core):
        return _recurrent_core(core, qkv)
    att = next((n for n in core if n.op == "attention"), None)
    if att is not None and len(att.input_shapes) >= 3:
        q, v = att.input_shapes[0], att.input_shapes[2]
        heads, head_dim, v_head_dim = int(q[-3]), int(q[-1]), int(v[-1])
    else:  # unfused: q [.., H, S, D] @ k^T; probs @ v [.., H, S, Dv]
        mms = [n for n in core if n.op == "matmul"]
        q = mms[0].input_shapes[0]
        heads, head_dim = int(q[-3]) if len(q) >= 3 else 1, int(q[-1])
        v_head_dim = _out(mms[1]) if len(mms) > 1 else head_dim
    up = [n for n in qkv if not n.attrs.get("low_rank")]
    low = [n for n in qkv if n.attrs.get("low_rank")]
    names = {n.name for n in nodes}
    v_input = att.inputs[2] if att is not None and len(att.inputs) >= 3 else None
    feeds_v = _feeders(v_input, nodes, names) if v_input else set()
    kv_up = {n.name for n in up if n.name in feeds_v}
    kv_down = [n for n in low if _reaches_any(n, kv_up, nodes)]
    traced = attention_flops_per_context(heads, head_dim, v_head_dim)
    if kv_down:  # MLA: the cache holds the shared latent (+ rope key), not per-head K/V
        cache, kv_heads, split = sum(_out(n) for n in kv_down), heads, False
        kv_lora = max((_in(n) for n in up if n.name in kv_up), default=0)
        decode = mla_absorbed_flops_per_context(heads, kv_lora, cache - kv_lora)
    else:
        total = sum(_out(n) for n in up)
        kv_heads = max((total - heads * head_dim) // max(head_dim + v_head_dim, 1), 1)
        # projections feeding v but not q (a q projection may carry more than the queries,
        # e.g. Qwen3-Next's output gate): the KV heads from their width
        feeds_q = _feeders(att.inputs[0], nodes, names) if att is not None and att.inputs \
            else set()
        v_only = [n for n in up if n.name in feeds_v and n.name not in feeds_q]
        if v_only and att is not None and len(att.inputs) >= 2:
            feeds_k = _feeders(att.inputs[1], nodes, names)
            width = sum(_out(n) for n in v_only)
            both = all(n.name in feeds_k for n in v_only)
            kv_heads = max(width // max(head_dim + v_head_dim if both else v_head_dim, 1), 1)
        cache, split, decode = kv_heads * (head_dim + v_head_dim), True, traced
    attrs = {"heads": heads, "kv_heads": kv_heads, "head_dim": head_dim, "v_head_dim": v_head_dim,
             "kv_cache_elems_per_token": cache, "kv_cache_split_by_heads": split,
             "flops_per_token_per_context": traced,
             "decode_flops_per_token_per_context": decode}
    window = _layer_window(core)
    if window:
        attrs["window"] = window
    norms = whole_projection_norms(up, nodes, head_dim)
    if norms:
        attrs["whole_projection_norms"] = norms
    return FusedOp(name="attn_core", in_features=sum(_out(n) for n in up),
                   out_features=heads * v_head_dim, nodes=[n.name for n in core], attrs=attrs)


def _layer_window(nodes: list[Node]) -> int | None:
    """The sliding window (tokens) the frontend recorded on these nodes
    (``Node.attrs["attention_window"]``), None for full attention."""
    return next((int(n.attrs["attention_window"]) for n in nodes
                 if n.attrs.get("attention_window")), None)


def whole_projection_norms(up: list[Node], nodes: list[Node], head_dim: int) -> int:
    """How many of the qkv up-projections ``up`` are normalised over their whole output
    (more than one head's ``head_dim`` features) before the attention core: a reduction
    reached from the projection without passing a matmul or the core, whose input's last
    dim is the projection's output width and whose output's is 1 (RMSNorm's mean of
    squares). Per-head norms (Qwen3) reduce over ``head_dim`` after the view into heads."""
    flow = Dataflow(nodes)
    by_name = {n.name: n for n in nodes}
    stop = ("linear", "grouped_matmul", "matmul", "attention")
    count = 0
    for lin in up:
        width = _out(lin)
        if width <= head_dim:
            continue
        after = flow.downstream(lin.name, stop=lambda n: flow.op(n) in stop)
        if any(by_name[m].op == "reduction" and by_name[m].input_shapes
               and by_name[m].input_shapes[0] and by_name[m].input_shapes[0][-1] == width
               and by_name[m].output_shape and by_name[m].output_shape[-1] == 1
               for m in after):
            count += 1
    return count


def _feeders(start: str, nodes: list[Node], names: set[str]) -> set[str]:
    """Nodes whose output reaches ``start`` backwards, stopping at (and including) linears."""
    flow = Dataflow(nodes)
    return flow.upstream(start, stop=lambda n: flow.op(n) in _MATMULS)


def _reaches_any(node: Node, targets: set[str], nodes: list[Node]) -> bool:
    """Whether ``node``'s output reaches one of ``targets`` within ``nodes`` without passing
    through another matmul."""
    flow = Dataflow(nodes)
    return bool(flow.downstream(node.name, stop=lambda n: flow.op(n) in _MATMULS) & targets)


_MATMULS = ("linear", "grouped_matmul")


def _layer_ops(nodes: list[Node], tokens: int = 0) -> tuple[list[FusedOp], int]:
    """FusedOps of one layer and the parameter elements outside them."""
    by_op: dict[str, list[Node]] = defaultdict(list)
    for n in nodes:
        if n.fused_op:
            by_op[n.fused_op].append(n)
    lin = {k: [n for n in v if n.op in ("linear", "grouped_matmul") and n.params]
           for k, v in by_op.items()}
    ops: list[FusedOp] = []
    grouped = lin.get("expert_ffn1", []) + lin.get("expert_ffn2", [])
    num_experts = int(grouped[0].params[0].shape[0]) if grouped and grouped[0].params else 0
    top_k = _top_k(nodes, num_experts, tokens) if num_experts else 0
    if lin.get("qkv"):
        qkv = lin["qkv"]
        up = [n for n in qkv if not n.attrs.get("low_rank")]
        op = _linear_op("qkv", qkv)
        op.in_features = max(_in(n) for n in qkv)
        op.out_features = sum(_out(n) for n in up)
        op.shardable_params = _param_total(up)
        ops.append(op)
    if by_op.get("attn_core"):
        ops.append(_attn_core(by_op["attn_core"], lin.get("qkv", []), nodes))
    if lin.get("out_proj"):
        op = _linear_op("out_proj", lin["out_proj"])
        op.in_features = sum(_in(n) for n in lin["out_proj"])
        op.out_features = _out(lin["out_proj"][0])
        ops.append(op)
    for pre in ("ffn", "shared_ffn"):
        f1, f2 = lin.get(f"{pre}1", []), lin.get(f"{pre}2", [])
        if not (f1 and f2):
            continue
        gated = sum(_out(n) for n in f1) == 2 * _in(f2[0])
        extra = {}
        if pre == "shared_ffn" and grouped:
            extra["num_shared"] = max(_in(f2[0]) // max(_in(lin["expert_ffn2"][0]), 1), 1)
        ops.append(_linear_op(f"{pre}1", f1, gated=gated, **extra))
        op2 = _linear_op(f"{pre}2", f2, **extra)
        op2.out_features = _out(f2[0])
        ops.append(op2)
    if lin.get("router"):
        op = _linear_op("router", lin["router"], num_experts=num_experts, top_k=top_k)
        op.params = op.shardable_params = _param_total(by_op["router"])
        ops.append(op)
    if lin.get("expert_ffn1") and lin.get("expert_ffn2"):
        # expert_ffn1: one packed gate_up grouped matmul, or (DBRX) a gate and an up one
        e1s, e2 = lin["expert_ffn1"], lin["expert_ffn2"][0]
        out1 = sum(_out(n) for n in e1s)
        gated = out1 == 2 * _in(e2)
        for name, group, out in (("expert_ffn1", e1s, out1), ("expert_ffn2", [e2], _out(e2))):
            params = _param_total(group)
            fin = _in(group[0])
            ops.append(FusedOp(name=name, in_features=fin, out_features=out, params=params,
                               shardable_params=params, flops_per_token=top_k * 2 * fin * out,
                               nodes=[n.name for n in group],
                               attrs={"num_experts": num_experts, "top_k": top_k,
                                      "gated": gated}))
    in_ops = {name for o in ops for name in o.nodes}
    if lin.get("router"):  # the router op counts every parameter on its path (e.g. a bias)
        in_ops |= {n.name for n in by_op["router"]}
    other = _param_total([n for n in nodes]) - _param_total(
        [n for n in nodes if n.name in in_ops])
    return ops, other


RECURRENT_KIND_PREFIX = {"gated_deltanet": "linear_attn", "mamba": "mamba", "mamba2": "mamba2"}


def _signature(nodes: list[Node]) -> tuple:
    """Per node: op, fused op, parameter shapes and the attention window (a sliding-window
    layer is a kind of its own even where its traced graph matches a full layer's)."""
    return tuple((n.op, n.fused_op, tuple(tuple(p.shape) for p in n.params),
                  n.attrs.get("attention_window")) for n in nodes)


def group_layers(graph: Graph) -> Graph:
    """Fill ``layer_kinds``, ``global_ops``, ``config`` and ``Node.layer_kind`` (in place)."""
    by_layer: dict[int, list[Node]] = defaultdict(list)
    for n in graph.nodes:
        n.layer_kind = None
        if n.layer is not None:
            by_layer[n.layer].append(n)
    kinds: dict[tuple, LayerKind] = {}
    base_count: dict[str, int] = defaultdict(int)
    for layer in sorted(by_layer):
        nodes = by_layer[layer]
        sig = _signature(nodes)
        kind = kinds.get(sig)
        if kind is None:
            base = "moe_block" if any(n.op == "grouped_matmul" for n in nodes) else "dense_block"
            scan = next((n for n in nodes if n.op == "recurrent_scan"), None)
            if scan is not None:  # a linear-attention / Mamba layer: a kind of its own name
                base = f"{RECURRENT_KIND_PREFIX.get(scan.attrs.get('recurrent'), 'recurrent')}_{base}"
            base_count[base] += 1
            name = base if base_count[base] == 1 else f"{base}_{base_count[base]}"
            ops, other = _layer_ops(nodes, graph.tokens)
            kind = LayerKind(name=name, count=0, ops=ops, attrs={"other_params": other})
            kinds[sig] = kind
        kind.count += 1
        kind.layers.append(layer)
        for n in nodes:
            n.layer_kind = kind.name
    graph.layer_kinds = list(kinds.values())
    graph.global_ops = _global_ops(graph)
    graph.config = _config(graph)
    return graph


def _global_ops(graph: Graph) -> list[FusedOp]:
    outside = [n for n in graph.nodes if n.layer is None]
    ops: list[FusedOp] = []
    emb = [n for n in outside if n.fused_op == "embedding" and n.params]
    if emb:
        p = emb[0].params[0]
        ops.append(FusedOp(name="embedding", in_features=int(p.shape[0]), out_features=int(p.shape[-1]),
                           params=p.numel, shardable_params=p.numel, flops_per_token=0,
                           nodes=[n.name for n in emb]))
    head = [n for n in outside if n.fused_op == "lm_head"]
    if head:
        op = _linear_op("lm_head", head)
        tied = emb and {p.fqn for p in head[0].params} & {p.fqn for p in emb[0].params}
        if tied:  # stored once, counted with the embedding
            op.params = op.shardable_params = 0
            op.attrs["tied_to"] = "embedding"
        ops.append(op)
    return ops


def _config(graph: Graph) -> dict:
    cfg: dict = {}
    if graph.config.get("max_position_embeddings"):  # set by the frontend from the model config
        cfg["max_position_embeddings"] = int(graph.config["max_position_embeddings"])
    for key in ("model_type", "mamba_ssm_cache_dtype"):  # the recurrent state's dtype rule
        if isinstance(graph.config.get(key), str):
            cfg[key] = graph.config[key]
    emb, head = graph.global_op("embedding"), graph.global_op("lm_head")
    cfg["vocab"] = emb.in_features if emb else head.out_features if head else 0
    cfg["hidden"] = emb.out_features if emb else head.in_features if head else 0
    cfg["layers"] = graph.num_layers
    cores = [k.op("attn_core") for k in graph.layer_kinds if k.op("attn_core")]
    # the model's attention heads: a softmax-attention core's, else a recurrent one's
    attn = next((c for c in cores if not c.attrs.get("recurrent")), cores[0] if cores else None)
    a = attn.attrs if attn else {}
    for key in ("heads", "kv_heads", "head_dim", "v_head_dim"):
        cfg[key] = int(a.get(key, 0))
    ffn2 = next((k.op("ffn2") for k in graph.layer_kinds if k.op("ffn2")), None)
    exp2 = next((k.op("expert_ffn2") for k in graph.layer_kinds if k.op("expert_ffn2")), None)
    shared = next((k.op("shared_ffn2") for k in graph.layer_kinds if k.op("shared_ffn2")), None)
    cfg["ffn"] = ffn2.in_features if ffn2 else 0
    cfg["expert_ffn"] = exp2.in_features if exp2 else 0
    cfg["num_experts"] = int(exp2.attrs["num_experts"]) if exp2 else 0
    cfg["top_k"] = int(exp2.attrs["top_k"]) if exp2 else 0
    cfg["num_shared_experts"] = int(shared.attrs.get("num_shared", 0)) if shared else 0
    dtypes: dict[str, int] = defaultdict(int)
    for p in graph.params:
        dtypes[p.dtype] += p.numel
    cfg["dtype_bytes"] = dtype_bytes(max(dtypes, key=dtypes.get)) if dtypes else 2
    counted = sum(k.count * (sum(o.params for o in k.ops) + k.attrs.get("other_params", 0))
                  for k in graph.layer_kinds) + sum(o.params for o in graph.global_ops)
    cfg["other_global_params"] = graph.num_params - counted
    return cfg


def decode_flops_per_token(graph: Graph, context: int) -> int:
    """Forward FLOPs to decode one token at ``context`` cached positions (module docstring)."""
    total = sum(o.flops_per_token for o in graph.global_ops)
    for k in graph.layer_kinds:
        per_layer = sum(o.flops_per_token for o in k.ops)
        attn = k.op("attn_core")
        if attn and attn.attrs.get("recurrent"):  # one recurrent step, whatever the context
            per_layer += int(attn.attrs["decode_flops_per_token"]) - attn.flops_per_token
        elif attn:
            a = attn.attrs
            read = int(attended_positions(context, op_window(a)))
            per_layer += read * int(a.get("decode_flops_per_token_per_context",
                                          a.get("flops_per_token_per_context", 0)))
        total += k.count * per_layer
    return total


def active_params(graph: Graph) -> int:
    """Parameters touched per token: all but the embedding table, experts scaled by top_k / E."""
    total = graph.num_params
    emb = graph.global_op("embedding")
    total -= emb.params if emb else 0
    for k in graph.layer_kinds:
        for o in k.ops:
            if o.name.startswith("expert_ffn") and o.attrs.get("num_experts"):
                e, kk = o.attrs["num_experts"], o.attrs["top_k"]
                total -= k.count * (o.params - o.params * kk // e)
    return total

