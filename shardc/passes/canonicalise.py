"""Canonicalise: raw IR -> canonical op kinds, FLOPs and bytes per node.

Op kinds come from the op's *base name* (``aten.linear.default`` -> ``linear``; custom ops
such as ``transformers.grouped_mm_fallback.default`` -> ``grouped_mm_fallback``) via
:data:`KIND_OF_BASE`. A node whose target is not in the table keeps the kind its frontend
gave it if that is a known kind (the ONNX frontend sets kinds itself), else becomes
``other`` and one warning per unknown target is added to ``Graph.warnings``. ``mm``/``bmm``
/``matmul`` with a parameter become ``linear``; ``linear`` without one becomes ``matmul``.

Views are *kept* as ``view`` nodes with 0 FLOPs and 0 bytes (so the dataflow stays intact
for the passes and the annotator); pure views of parameters were already folded by the
frontend (the parameter is attached to the consumer).

One FLOP formula per kind (``out`` = output elements, ``K`` = last dim of the first input,
``in`` = sum of input elements, a multiply-add = 2 FLOPs):

=================  ==========================================================
linear, matmul     ``2 * out * K`` (bias adds ignored)
grouped_matmul     ``2 * out * K`` (rows = tokens x top_k: only routed rows count)
attention          ``2 * B * H * Sq * Sk * (D + Dv)`` from q [B,H,Sq,D], k [..,Sk,D],
                   v [..,Sk,Dv] (QK^T and PV; no causal halving)
norm               ``5 * out``
activation         ``4 * out``
elementwise        ``1 * out``
reduction          ``1 * in``
router             ``1 * in`` (top-k comparisons)
causal_conv        ``2 * out * K`` (depthwise, kernel width ``K`` = last weight dim)
recurrent_scan     gated delta rule (q [B,S,Hk,Dk], v [B,S,Hv,Dv]), per token and v-head:
                   ``4 * C * (Dk + Dv) + 6 * Dk * Dv`` (chunked form, ``C`` =
                   :data:`DELTA_CHUNK`: intra-chunk scores and values, the UT transform,
                   the state read, the output from it and its update); selective scan
                   (u [B,D,S], A [D,N]), per token: ``9 * D * N`` (discretise, update,
                   read out); Mamba-2's chunked SSD scan (x [B,S,H,P], B [B,S,G,N], chunk
                   ``Q``), per token: ``2 * Q * N * G`` (C B^T per group) ``+ H * (2 * Q * P
                   + 4 * N * P)`` (scores x values, chunk states, state read-out)
embedding, gather_scatter, view, input, output, other   ``0``
=================  ==========================================================

Bytes (one execution, ``b`` = element size of the node's dtype, parameters at their own
dtype): ``(in + out) * b + param_bytes`` for every computing kind, except
``embedding``: ``(in + 2 * out) * b`` (ids + gathered rows + output, not the whole table);
``grouped_matmul``: parameter bytes scaled by ``min(E, rows) / E`` (only experts that
receive rows are read); ``gather_scatter``: ``(in + out) * b`` with no parameters;
``view``, ``input``, ``output``: 0.
"""

from __future__ import annotations

from shardc.ir.graph import OP_KINDS, Graph, Node

_TABLE: dict[str, tuple[str, ...]] = {
    "linear": ("linear", "addmm"),
    "matmul": ("mm", "bmm", "matmul", "einsum", "baddbmm", "outer"),
    "grouped_matmul": ("grouped_mm", "_grouped_mm", "grouped_mm_fallback", "_scaled_grouped_mm"),
    "embedding": ("embedding",),
    "attention": ("scaled_dot_product_attention", "_scaled_dot_product_flash_attention",
                  "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention",
                  "_scaled_dot_product_flash_attention_for_cpu", "flex_attention"),
    "norm": ("layer_norm", "native_layer_norm", "rms_norm", "_fused_rms_norm", "group_norm",
             "native_group_norm", "batch_norm"),
    "activation": ("silu", "gelu", "relu", "softmax", "_softmax", "log_softmax", "_log_softmax",
                   "sigmoid", "tanh", "elu", "mish", "hardswish", "leaky_relu", "glu", "softplus",
                   "silu_", "gelu_", "relu_", "hardtanh", "erf"),
    "elementwise": (
        "add", "add_", "sub", "sub_", "mul", "mul_", "div", "div_", "neg", "rsqrt", "sqrt", "pow",
        "exp", "log", "cos", "sin", "cat", "concat", "concatenate", "polar", "stack", "where",
        "masked_fill", "masked_fill_", "clamp",
        "clamp_", "clamp_min", "clamp_max", "floor_divide", "remainder", "fmod", "eq", "ne", "lt",
        "le", "gt", "ge", "bitwise_not", "bitwise_and", "bitwise_or", "bitwise_xor", "__and__",
        "__or__", "__xor__", "__invert__", "logical_not", "logical_and", "logical_or", "abs",
        "reciprocal", "to", "_to_copy", "copy_", "copy", "type_as", "fill", "fill_", "zeros_like",
        "ones_like", "empty_like", "full_like", "new_zeros", "new_ones", "new_empty", "new_full",
        "zeros", "ones", "empty", "full", "arange", "tril", "triu", "clone", "diff", "scalar_tensor",
        "lift_fresh_copy", "round", "trunc", "floor", "ceil", "maximum", "minimum", "sign",
        "isnan", "isinf", "rand", "randn", "lerp", "addcmul", "addcdiv", "square", "sigmoid_",
        "exp_", "float", "repeat", "tile", "pad", "constant_pad_nd", "roll", "flip", "dropout",
        "native_dropout", "alias_copy", "masked_fill_scalar", "triu_", "tril_", "mul_scalar",
    ),
    "reduction": ("sum", "mean", "max", "min", "amax", "amin", "argmax", "argmin", "prod",
                  "cumsum", "cumprod", "var", "std", "var_mean", "norm", "linalg_vector_norm",
                  "all", "any", "histc", "logsumexp", "bincount", "count_nonzero"),
    "view": ("view", "reshape", "_unsafe_view", "transpose", "t", "permute", "expand", "expand_as",
             "unsqueeze", "squeeze", "slice", "select", "split", "split_with_sizes", "chunk",
             "unbind", "getitem", "alias", "flatten", "unflatten", "narrow", "as_strided",
             "detach", "contiguous", "view_as", "movedim", "tensor_split", "split_tensor",
             "_assert_tensor_metadata", "lift_fresh", "view_as_real", "view_as_complex",
             "swapaxes", "mT", "numpy_T"),
    "router": ("topk",),
    "causal_conv": ("causal_conv1d",),
    "recurrent_scan": ("gated_delta_rule", "selective_scan", "ssd_scan"),
    "gather_scatter": ("index", "index_select", "gather", "scatter", "scatter_", "scatter_add",
                       "scatter_add_", "index_put", "index_put_", "index_copy", "index_copy_",
                       "index_add", "index_add_", "masked_scatter", "take", "sort", "argsort",
                       "repeat_interleave", "masked_select", "nonzero", "one_hot",
                       "scatter_reduce", "index_fill", "embedding_bag"),
}
KIND_OF_BASE: dict[str, str] = {base: kind for kind, bases in _TABLE.items() for base in bases}

_FLOPS_PER_OUT = {"norm": 5, "activation": 4, "elementwise": 1}
# recurrent_scan variants by base name (Node.attrs["recurrent"]; frontends other than
# torch.export set the attr themselves)
RECURRENT_VARIANTS = {"gated_delta_rule": "gated_deltanet", "selective_scan": "mamba",
                      "ssd_scan": "mamba2"}
SSD_CHUNK = 256  # Mamba-2 chunk length when the trace does not say (mamba_ssm's default)
DELTA_CHUNK = 64  # chunk length of the chunked gated delta rule (FLA's and transformers')
_ZERO_BYTES = {"view", "input", "output"}


def base_name(target: str) -> str:
    """``aten.linear.default`` -> ``linear``; ``ns.op.overload`` -> ``op``; ``getitem`` as is."""
    parts = target.split(".")
    return parts[1] if len(parts) >= 3 else parts[0] if len(parts) == 1 else parts[-1]


def numel(shape: list[int]) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n


def dtype_bytes(dtype: str) -> int:
    """Element size in bytes of a dtype name (``bfloat16`` -> 2); unknown -> 2. torch is
    imported here, not with the module: the compile driver imports ``shardc.passes`` (for
    the annotate pass) and a warm compile that needs no torch must not load it."""
    import torch

    try:
        return torch.empty((), dtype=getattr(torch, dtype)).element_size()
    except (AttributeError, TypeError):
        return 2


def kind_of(node: Node) -> str | None:
    """Canonical kind of a raw node from its target, or None if the target is unknown."""
    kind = KIND_OF_BASE.get(base_name(node.target))
    if kind is None:
        return None
    if kind == "matmul" and node.params:
        return "linear"
    if kind == "linear" and not node.params:
        return "matmul"
    return kind


def node_flops(node: Node) -> int:
    """FLOPs of one execution of ``node`` (formula table in the module docstring)."""
    op, out = node.op, numel(node.output_shape) if node.output_shape else 0
    ins = node.input_shapes
    if op in ("linear", "matmul", "grouped_matmul"):
        k = ins[0][-1] if ins and ins[0] else 0
        if op == "linear" and not ins and node.params:  # weight-only input (rare)
            k = node.params[0].shape[-1]
        return 2 * out * int(k)
    if op == "attention":
        if len(ins) < 3 or len(ins[0]) < 2:
            return 0
        q, k, v = ins[0], ins[1], ins[2]
        batch_heads_sq = numel(q[:-1])
        return 2 * batch_heads_sq * int(k[-2]) * (int(q[-1]) + int(v[-1]))
    if op in _FLOPS_PER_OUT:
        return _FLOPS_PER_OUT[op] * out
    if op == "causal_conv":
        k = node.params[0].shape[-1] if node.params else 1
        return 2 * out * int(k)
    if op == "recurrent_scan":
        return recurrent_scan_flops(node)[0]
    if op in ("reduction", "router"):
        return sum(numel(s) for s in ins)
    return 0


def recurrent_scan_flops(node: Node) -> tuple[int, int, int]:
    """(FLOPs of the traced execution, FLOPs per token of one decode step, state elements per
    sequence) of a ``recurrent_scan`` node (formulas in the module docstring). Gated DeltaNet
    decode per token and v-head: ``7 * Dk * Dv`` (decay, read ``S^T k``, rank-1 update,
    output ``S^T q``); Mamba: the same ``9 * D * N`` as the scan; Mamba-2 per token and
    head ``5 * P * N`` (dt B x, decay, add, read-out multiply-add), state ``H x P x N``."""
    ins = node.input_shapes
    if node.attrs.get("recurrent") == "gated_deltanet" and len(ins) >= 3:
        q, v = ins[0], ins[2]
        tokens, heads, dk, dv = numel(v[:-2]), int(v[-2]), int(q[-1]), int(v[-1])
        per_token = heads * (4 * DELTA_CHUNK * (dk + dv) + 6 * dk * dv)
        return tokens * per_token, heads * 7 * dk * dv, heads * dk * dv
    if node.attrs.get("recurrent") == "mamba2" and len(ins) >= 4:
        x, b = ins[0], ins[3]
        tokens, heads, p = numel(x[:-2]), int(x[-2]), int(x[-1])
        groups, n = int(b[-2]), int(b[-1])
        chunk = ssd_chunk(node)
        per_token = 2 * chunk * n * groups + heads * (2 * chunk * p + 4 * n * p)
        return tokens * per_token, heads * 5 * p * n, heads * p * n
    if node.attrs.get("recurrent") == "mamba" and len(ins) >= 3:
        u, a = ins[0], ins[2]
        tokens = numel(u) // max(int(u[1]), 1)
        return tokens * 9 * int(a[0]) * int(a[-1]), 9 * int(a[0]) * int(a[-1]), \
            int(a[0]) * int(a[-1])
    return 0, 0, 0


def ssd_chunk(node: Node) -> int:
    """Chunk length (tokens) of a Mamba-2 ``recurrent_scan`` node: its first integer argument
    (``shardc::ssd_scan``'s ``chunk_size``), else :data:`SSD_CHUNK`."""
    scalars = [s for s in node.attrs.get("scalars", []) if not isinstance(s, bool)]
    return int(scalars[0]) if scalars else SSD_CHUNK


def node_bytes(node: Node) -> int:
    """Bytes moved by one execution of ``node`` (formula in the module docstring)."""
    op = node.op
    if op in _ZERO_BYTES:
        return 0
    b = dtype_bytes(node.dtype) if node.dtype else 2
    ins = sum(numel(s) for s in node.input_shapes)
    out = numel(node.output_shape) if node.output_shape else 0
    param_bytes = sum(p.numel * dtype_bytes(p.dtype) for p in node.params)
    if op == "embedding":
        return (ins + 2 * out) * b
    if op == "gather_scatter":
        return (ins + out) * b
    if op == "grouped_matmul" and node.params:
        experts = max(int(node.params[0].shape[0]), 1)
        rows = node.input_shapes[0][0] if node.input_shapes and node.input_shapes[0] else experts
        param_bytes = param_bytes * min(experts, int(rows)) // experts
    return (ins + out) * b + param_bytes


def canonicalise(graph: Graph) -> Graph:
    """Assign canonical kinds, FLOPs and bytes to every node (in place; returns ``graph``)."""
    unknown: dict[str, int] = {}
    for node in graph.nodes:
        if node.op not in ("input", "output"):
            kind = kind_of(node)
            if kind is None:
                kind = node.op if node.op in OP_KINDS and node.op != "other" else "other"
                if kind == "other":
                    unknown[node.target] = unknown.get(node.target, 0) + 1
            node.op = kind
            if kind == "recurrent_scan" and base_name(node.target) in RECURRENT_VARIANTS:
                node.attrs["recurrent"] = RECURRENT_VARIANTS[base_name(node.target)]
        node.flops = node_flops(node)
        node.bytes = node_bytes(node)
    for target, count in sorted(unknown.items()):
        msg = (f"unknown op {target} ({count} node{'s' if count > 1 else ''}) -> kind 'other' "
               "with 0 FLOPs")
        if msg not in graph.warnings:
            graph.warnings.append(msg)
    return graph
