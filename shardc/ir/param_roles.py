"""Which fused op each parameter belongs to, and which of its tensor dims a choice cuts --
read from the graph, not from parameter names.

A parameter's node says it all: ``Node.fused_op`` (set by the fused-op pass), ``Node.layer``,
the input / output widths of the node (``in`` / ``out`` features) and, when the frontend saw
a parameter through a transpose, ``Node.attrs["param_dims"]`` (per parameter of the node, its
dims in the order the op reads them). An op reads a weight as ``[out, in]`` when it is a canonical
``linear`` from ``aten.linear`` (``x @ W^T``), as ``[..., in, out]`` otherwise (``addmm`` /
``mm`` / grouped matmuls: ``x @ W``, e.g. GPT-2's Conv1D, stacked experts), and an embedding
table as ``[vocab, hidden]``; where the widths tell the two apart (``in != out``) they win.

:class:`ParamUse` per parameter FQN:

* ``op``: the fused op (``qkv``, ``ffn1``, ``expert_ffn2``, ``embedding``, the parameters of a
  linear-attention / Mamba ``attn_core``, ...) or None (norms,
  learned position tables, MLA's low-rank down projections: replicated over tp);
* ``layer``: the decoder-layer index (None outside the repeated blocks);
* ``split_dims``: the tensor dim cut by choice 0 and by choice 1 (``OpChoice.weight_split``:
  ``out`` / ``in`` features, ``vocab`` / ``hidden`` of the embedding); a bias follows its
  output features (choice 0 cuts dim 0, choice 1 none);
* ``expert_dim``: the stacked-expert dim (split over ep) or None; an expert bias ``[E,
  out]`` (GPT-OSS's ``gate_up_proj_bias`` / ``down_proj_bias``, gathered per routed row
  beside the router) belongs to the expert op whose output it adds to, ``split_dims (1,
  None)``;
* ``parts``: widths (elements) of the equal-role parts packed along the output features of
  one parameter -- ``[q, k, v]`` of a packed qkv, ``[gate, up]`` of a packed gated FFN -- that a
  column split must cut part by part; ``[]`` when not packed, and for a gated FFN whose gate
  and up features alternate (GPT-OSS: read back as ``[..., ::2]`` / ``[..., 1::2]``): a
  contiguous cut keeps each (gate, up) pair on one rank;
* a per-head vector of the attention (GPT-OSS's ``sinks [heads]``, read beside the scores):
  ``op`` ``attn_core``, ``split_dims (0, None)`` (a heads split cuts it);
* ``tied``: ``[(op, module path)]`` of the other fused ops reading the same (tied) weight
  through another module (GPT-2's and Gemma-2's ``lm_head`` reading the embedding table).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from shardc.ir.graph import Graph, LayerKind, Node

_GATED_FIRST = ("ffn1", "shared_ffn1", "expert_ffn1")


@dataclass(frozen=True)
class ParamUse:
    op: str | None
    layer: int | None
    split_dims: tuple[int | None, int | None] = (None, None)
    expert_dim: int | None = None
    parts: list[int] = field(default_factory=list)
    tied: list[tuple[str, str]] = field(default_factory=list)

    def as_row(self) -> dict:
        """plan.json ``params[]`` fields of this use (see :mod:`shardc.plan`)."""
        row = {"op": self.op, "layer": self.layer, "split_dims": list(self.split_dims)}
        if self.expert_dim is not None:
            row["expert_dim"] = self.expert_dim
        if self.parts:
            row["parts"] = list(self.parts)
        if self.tied:
            row["tied"] = [{"op": op, "module": mod} for op, mod in self.tied]
        return row


def _in_out(n: Node) -> tuple[int, int]:
    if "expert_features" in n.attrs:
        a, b = n.attrs["expert_features"]
        return int(a), int(b)
    k = int(n.input_shapes[0][-1]) if n.input_shapes and n.input_shapes[0] else -1
    return k, int(n.output_shape[-1]) if n.output_shape else -1


def _seen_dims(n: Node, i: int) -> list[int] | None:
    """Dims of ``n.params[i]`` in the order the op reads them (``Node.attrs["param_dims"]``,
    one entry per parameter; None: seen through a reshape)."""
    dims = n.attrs.get("param_dims")
    if dims is None or i >= len(dims):
        return list(range(len(n.params[i].shape)))
    return dims[i]


def _weight_dims(n: Node, i: int, shape: list[int]) -> tuple[int | None, int | None]:
    """(out dim, in dim) of weight ``n.params[i]`` (``shape``) as node ``n`` reads it."""
    nd = len(shape)
    order = _seen_dims(n, i)
    if order is None or nd < 2:  # seen through a reshape: the widths alone decide
        order = list(range(nd))
    k, m = _in_out(n)
    seen = [shape[d] for d in order]
    if seen[-1] == k and seen[-2] == m and k != m:
        out_pos, in_pos = nd - 2, nd - 1
    elif seen[-2] == k and seen[-1] == m and k != m:
        out_pos, in_pos = nd - 1, nd - 2
    elif n.target.split(".")[:2] == ["aten", "linear"]:
        out_pos, in_pos = nd - 2, nd - 1
    else:
        out_pos, in_pos = nd - 1, nd - 2
    return order[out_pos], order[in_pos]


def _alternating(graph: Graph, layer: int | None, width: int) -> bool:
    """Whether layer ``layer`` reads a ``width``-wide activation back as its even and odd
    features (stride-2 slices of the last dim: gate / up interleaved, GPT-OSS's)."""
    for n in graph.nodes:
        s = n.attrs.get("scalars") or []
        if n.layer == layer and n.target == "aten.slice.Tensor" and len(s) == 4 and \
                s[3] == 2 and n.input_shapes and n.input_shapes[0] and \
                int(n.input_shapes[0][-1]) == width and s[0] in (-1, len(n.input_shapes[0]) - 1):
            return True
    return False


def _packed_parts(graph: Graph, kind: LayerKind | None, op: str, width: int,
                  weights_in_op: int, layer: int | None = None) -> list[int]:
    """Widths of the parts one parameter of ``op`` packs (see the module docstring)."""
    if weights_in_op != 1 or kind is None:
        return []
    fused = kind.op(op)
    if op == "qkv":
        core = kind.op("attn_core")
        if core is None:
            return []
        a = core.attrs
        if a.get("recurrent") == "mamba2":  # in_proj: z | x | B | C | dt
            hp = int(a.get("heads", 0)) * int(a.get("v_head_dim", 0))
            gn = int(a.get("kv_heads", 0)) * int(a.get("head_dim", 0))
            parts = [hp, hp, gn, gn, int(a.get("heads", 0))]
            return parts if sum(parts) == width and all(parts) else []
        q = int(a.get("heads", 0)) * int(a.get("head_dim", 0))
        kv = int(a.get("kv_heads", 0))
        parts = [q, kv * int(a.get("head_dim", 0)), kv * int(a.get("v_head_dim", a.get("head_dim", 0)))]
        return parts if sum(parts) == width and all(parts) else []
    if op in _GATED_FIRST and fused is not None and fused.attrs.get("gated") and width % 2 == 0:
        return [] if _alternating(graph, layer, width) else [width // 2, width // 2]
    return []


def _recurrent_use(a: dict, layer: int | None, shape: list[int]) -> ParamUse:
    """A parameter of a linear-attention / Mamba core (:mod:`shardc.ir.recurrent`): a heads
    split cuts the dim that runs over its heads (Mamba: channels) -- ``A_log``, ``dt_bias``,
    ``D``, ``dt_proj`` (out) and ``x_proj`` (in) -- or, for Gated DeltaNet's conv weight over
    the concatenated q, k, v channels, each of the three parts; a batch split none."""
    heads = int(a.get("heads", 0))
    q = k = int(a.get("kv_heads", 0)) * int(a.get("head_dim", 0))
    v = heads * int(a.get("v_head_dim", 0))
    for d, size in enumerate(shape):
        if size == heads:
            return ParamUse("attn_core", layer, (d, None))
    if shape and a.get("recurrent") == "gated_deltanet" and shape[0] == q + k + v:
        return ParamUse("attn_core", layer, (0, None), None, [q, k, v])
    if shape and a.get("recurrent") == "mamba2" and shape[0] == q + k + v:
        return ParamUse("attn_core", layer, (0, None), None, [v, q, k])  # conv over x, B, C
    return ParamUse(None, layer)


def param_uses(graph: Graph) -> dict[str, ParamUse]:
    """FQN -> :class:`ParamUse` for every parameter a fused op reads (the first op reading a
    tied weight owns it: the embedding); parameters no fused op reads are absent."""
    kind_of = {i: k for k in graph.layer_kinds for i in k.layers}
    # the embedding op's table is the first embedding node's (as the layer pass counts it);
    # later ones (GPT-2's learned positions) stay replicated
    table = next((n.params[0].fqn for n in graph.nodes
                  if n.fused_op == "embedding" and n.layer is None and n.params), None)
    # weights (>= 2-D, not low-rank) per (layer, op): one packed parameter or several
    weights: dict[tuple, set[str]] = {}
    for n in graph.nodes:
        if n.fused_op and not n.attrs.get("low_rank"):
            weights.setdefault((n.layer, n.fused_op), set()).update(
                p.fqn for p in n.params if len(p.shape) >= 2)
    uses: dict[str, ParamUse] = {}
    for n in graph.nodes:
        for i, p in enumerate(n.params):
            if p.fqn in uses:
                u = uses[p.fqn]
                if n.fused_op not in (None, "norm", u.op) and len(p.shape) >= 2 \
                        and (n.fused_op, n.module_path) not in u.tied:
                    u.tied.append((n.fused_op, n.module_path))
                continue
            op = n.fused_op
            core = kind_of[n.layer].op("attn_core") if op == "attn_core" \
                and n.layer in kind_of else None
            if core is not None and core.attrs.get("recurrent"):
                uses[p.fqn] = _recurrent_use(core.attrs, n.layer, [int(s) for s in p.shape])
                continue
            if op in (None, "norm", "attn_core") or n.attrs.get("low_rank"):
                uses[p.fqn] = ParamUse(None, n.layer)
                continue
            if op == "embedding" and p.fqn != table:
                uses[p.fqn] = ParamUse(None, n.layer)  # a learned position table
                continue
            shape = [int(s) for s in p.shape]
            if len(shape) == 1:  # a bias: follows the output features
                uses[p.fqn] = ParamUse(op, n.layer, (0, None))
                continue
            if op == "embedding":
                order = _seen_dims(n, i) or [0, 1]
                uses[p.fqn] = ParamUse(op, n.layer, (order[0], order[1]))
                continue
            out_d, in_d = _weight_dims(n, i, shape)
            expert = next((d for d in range(len(shape)) if d not in (out_d, in_d)), None) \
                if len(shape) == 3 else None
            parts = _packed_parts(graph, kind_of.get(n.layer), op, shape[out_d],
                                  len(weights.get((n.layer, op), ())), n.layer)
            uses[p.fqn] = ParamUse(op, n.layer, (out_d, in_d), expert, parts)
    shapes = {p.fqn: [int(d) for d in p.shape] for n in graph.nodes for p in n.params}
    gathered = {p.fqn for n in graph.nodes if n.op == "gather_scatter" for p in n.params}
    _expert_biases(uses, {f: sh for f, sh in shapes.items() if f in gathered}, shapes)
    _head_vectors(graph, uses, kind_of, shapes)
    # a bias whose op is packed is packed the same way
    packed = {(u.layer, u.op): u.parts for u in uses.values() if u.parts
              and u.op != "attn_core"}  # a recurrent core's per-head vectors are not packed
    for fqn, u in uses.items():
        if u.split_dims == (0, None) and (u.layer, u.op) in packed:
            uses[fqn] = ParamUse(u.op, u.layer, u.split_dims, None, packed[(u.layer, u.op)],
                                 u.tied)
    return uses


def _expert_biases(uses: dict[str, ParamUse], gathered: dict[str, list[int]],
                   shapes: dict[str, list[int]]) -> None:
    """Expert biases ``[E, out]`` (``gathered``: FQN -> shape of the parameters read by a
    gather, per routed row, on the router's path) moved to the expert op whose stacked
    weight (``E`` experts, ``out`` output features) they add to (in place)."""
    weights = {(u.layer, u.op): (shapes[fqn][u.expert_dim], shapes[fqn][u.split_dims[0]])
               for fqn, u in uses.items() if u.op in ("expert_ffn1", "expert_ffn2")
               and u.expert_dim is not None and len(shapes.get(fqn, ())) == 3}
    for fqn, u in list(uses.items()):
        shape = gathered.get(fqn, [])
        if u.op != "router" or len(shape) != 2:
            continue
        for op in ("expert_ffn1", "expert_ffn2"):
            if weights.get((u.layer, op)) == (shape[0], shape[1]):
                uses[fqn] = ParamUse(op, u.layer, (1, None), 0)
                break


def _head_vectors(graph: Graph, uses: dict[str, ParamUse], kind_of: dict,
                  shapes: dict[str, list[int]]) -> None:
    """A 1-D parameter of ``heads`` values concatenated to the attention scores in a layer
    whose (softmax) attention core has that many heads (GPT-OSS's sinks: a learned logit per
    head): op ``attn_core``, cut by a heads split (in place)."""
    for n in graph.nodes:
        kind = kind_of.get(n.layer)
        core = kind.op("attn_core") if kind is not None else None
        if core is None or core.attrs.get("recurrent") or n.fused_op not in (None, "norm", "attn_core") \
                or str(n.target).split(".")[:2] != ["aten", "cat"]:
            continue
        for p in n.params:
            u = uses.get(p.fqn)
            if u is not None and u.op is None and shapes.get(p.fqn) == [int(core.attrs.get(
                    "heads", 0))]:
                uses[p.fqn] = ParamUse("attn_core", u.layer, (0, None))


def read_before_layers(graph: Graph) -> set[str]:
    """FQNs of the parameters outside the decoder layers first read before any layer runs
    (token and position embeddings: a pipeline's first stage holds them)."""
    out: set[str] = set()
    for n in graph.nodes:
        if n.layer is not None:
            break
        out.update(p.fqn for p in n.params)
    return out
