"""The operator graph: the one data structure every shardc stage reads and writes.

A :class:`Graph` is a list of :class:`Node` in topological order, plus what the passes
learn about the model as a whole:

* ``layer_kinds`` -- repeated blocks found structurally (e.g. ``dense_block`` x 3,
  ``moe_block`` x 58), each with the :class:`FusedOp` records the search decides about;
* ``global_ops`` -- fused ops outside the repeated blocks (``embedding``, ``lm_head``);
* ``config`` -- model hyper-parameters recovered from the graph (hidden size, heads, ...).

Units: shapes in elements, ``flops`` in floating-point operations (a multiply-add is 2),
``bytes`` in bytes moved to/from memory by one execution of the node (inputs read +
outputs written + parameters read), parameter sizes in elements.

Serialisation (:meth:`Graph.to_json` / :meth:`Graph.from_json`) is stable (sorted keys,
no floats that do not round-trip) and exact: ``Graph.from_json(g.to_json()) == g``.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field, fields, is_dataclass
from typing import Any

# Canonical operator kinds (the vocabulary of Node.op).
OP_KINDS = (
    "input",  # graph input (token ids)
    "output",  # graph output
    "linear",  # x @ W^T (+ b) with a parameter W
    "matmul",  # matmul / bmm between activations
    "grouped_matmul",  # expert matmul over a stacked [E, ...] weight
    "embedding",
    "attention",  # scaled-dot-product attention core
    "norm",  # layer / rms norm
    "activation",  # silu, gelu, relu, softmax over features
    "elementwise",  # add, mul, neg, rsqrt, cat, rotary pieces ...
    "reduction",  # sum, mean, max over a dim
    "view",  # reshape, transpose, slice, expand ... (no data movement counted)
    "router",  # top-k routing
    "gather_scatter",  # index_select, scatter_add, index ops
    "causal_conv",  # depthwise causal conv1d of a linear-attention / Mamba layer (state K-1)
    "recurrent_scan",  # gated delta rule / selective scan: a state that does not grow
    "other",  # anything the frontend does not know (a warning is issued)
)

# Fused operators the search decides about (the paper's d_1 .. d_L).
FUSED_OP_NAMES = (
    "embedding",
    "qkv",
    "attn_core",
    "out_proj",
    "ffn1",
    "ffn2",
    "router",
    "expert_ffn1",
    "expert_ffn2",
    "shared_ffn1",
    "shared_ffn2",
    "lm_head",
)


@dataclass
class Param:
    """A parameter tensor: fully-qualified name in the module, shape (elements), dtype."""

    fqn: str
    shape: list[int]
    dtype: str = "bfloat16"

    @property
    def numel(self) -> int:
        return math.prod(int(s) for s in self.shape)


@dataclass
class Node:
    """One operator of the traced model.

    ``op`` is the canonical kind (one of :data:`OP_KINDS`), ``target`` the original op
    (``aten.mm.default`` or the ONNX op type). ``flops`` and ``bytes`` are for one
    execution at the traced input shape. ``layer`` is the decoder-layer index (None outside
    the repeated blocks); ``fused_op`` the fused operator it belongs to (a name from
    :data:`FUSED_OP_NAMES` or None); ``layer_kind`` the name of its layer kind.
    ``placements`` / ``redistribute`` / ``stage`` are filled by the annotation pass.
    """

    name: str
    op: str
    target: str = ""
    inputs: list[str] = field(default_factory=list)
    input_shapes: list[list[int]] = field(default_factory=list)
    output_shape: list[int] = field(default_factory=list)
    dtype: str = "bfloat16"
    params: list[Param] = field(default_factory=list)
    flops: int = 0
    bytes: int = 0
    module_path: str = ""
    layer: int | None = None
    fused_op: str | None = None
    layer_kind: str | None = None
    placements: list[str] | None = None
    redistribute: dict[str, Any] | None = None
    stage: int | None = None
    attrs: dict[str, Any] = field(default_factory=dict)


@dataclass
class FusedOp:
    """A fused operator of one layer kind (per layer), in the terms the cost model uses.

    Linear-like ops (qkv, out_proj, ffn*, router, lm_head, embedding, expert ffns) are
    described as a GEMM per token: ``in_features`` -> ``out_features``.
    ``params`` = parameter elements of this op in one layer (for experts: all experts);
    ``shardable_params`` = those split when the op is tensor-parallel (the rest, e.g. MLA's
    low-rank down projections, stay replicated); ``flops_per_token`` = forward FLOPs for one
    token (experts: counted for the top-k active experts).
    ``attrs`` holds kind-specific facts: for ``attn_core`` ``heads``, ``kv_heads``,
    ``head_dim``, ``v_head_dim``, ``kv_cache_elems_per_token`` (per layer, K+V),
    ``kv_cache_split_by_heads`` (False for MLA's shared latent cache) and
    ``flops_per_token_per_context`` = ``2 * heads * (head_dim + v_head_dim)`` (QK^T and PV per
    cached position, the attention the traced model computes; prefill),
    ``decode_flops_per_token_per_context`` (FLOPs per cached position of one decode step: the
    absorbed-MLA form ``2 * heads * (2 * kv_lora + rope)`` over the latent cache for MLA, else
    equal to the former), ``window`` (tokens; only on sliding-window layers:
    :mod:`shardc.ir.windows`), ``whole_projection_norms`` (only when > 0: q/k norms over a
    whole projection, all-reduced under a heads split); a linear-attention / Mamba core adds
    ``recurrent``, ``state_elems_per_sequence`` and the rest of :mod:`shardc.ir.recurrent`
    (its ``flops_per_token`` and ``params`` are its own); ``attn_core.flops_per_token`` is 0, ``in_features`` = q+k+v features,
    ``out_features`` = heads * v_head_dim); for expert ops ``num_experts``, ``top_k``,
    ``gated``; for ffn1-like ops ``gated`` (SwiGLU); for shared-expert ops ``num_shared``.
    ``qkv`` of MLA: ``out_features`` = q and kv up-projection outputs; the low-rank down
    projections are in ``params`` but not ``shardable_params``. ``lm_head`` tied to the
    embedding has ``params`` 0 and ``attrs["tied_to"] = "embedding"``.
    """

    name: str
    in_features: int = 0
    out_features: int = 0
    params: int = 0
    shardable_params: int = 0
    flops_per_token: int = 0
    nodes: list[str] = field(default_factory=list)
    attrs: dict[str, Any] = field(default_factory=dict)


@dataclass
class LayerKind:
    """A class of structurally identical decoder blocks (e.g. ``moe_block``).

    ``attrs["other_params"]`` = parameter elements of one layer outside its fused ops
    (norm weights, ...), so that ``sum(count * (sum(op.params) + other_params))`` over kinds
    + global ops + ``Graph.config["other_global_params"]`` == ``Graph.num_params``.
    """

    name: str
    count: int
    layers: list[int] = field(default_factory=list)
    ops: list[FusedOp] = field(default_factory=list)
    attrs: dict[str, Any] = field(default_factory=dict)

    def op(self, name: str) -> FusedOp | None:
        for o in self.ops:
            if o.name == name:
                return o
        return None


@dataclass
class Graph:
    """The whole model: nodes in topological order plus model-level facts."""

    name: str
    source: str = ""
    nodes: list[Node] = field(default_factory=list)
    params: list[Param] = field(default_factory=list)
    layer_kinds: list[LayerKind] = field(default_factory=list)
    global_ops: list[FusedOp] = field(default_factory=list)
    config: dict[str, Any] = field(default_factory=dict)
    tokens: int = 0  # tokens in the traced example (batch x sequence)
    warnings: list[str] = field(default_factory=list)

    # ---- queries -------------------------------------------------------------------
    @property
    def num_params(self) -> int:
        """Total parameter elements (each parameter counted once, tied weights once)."""
        return sum(p.numel for p in self.params)

    @property
    def num_layers(self) -> int:
        return sum(k.count for k in self.layer_kinds)

    def node(self, name: str) -> Node:
        for n in self.nodes:
            if n.name == name:
                return n
        raise KeyError(name)

    def layer_kind(self, name: str) -> LayerKind:
        for k in self.layer_kinds:
            if k.name == name:
                return k
        raise KeyError(name)

    def global_op(self, name: str) -> FusedOp | None:
        for o in self.global_ops:
            if o.name == name:
                return o
        return None

    def flops_by_kind(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for n in self.nodes:
            out[n.op] = out.get(n.op, 0) + n.flops
        return out

    # ---- serialisation -------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def to_json(self) -> str:
        """``json.dumps(self.to_dict())`` (sorted keys, compact), without building the deep
        copy: the encoder meets each dataclass and asks :func:`_fields_of` for its fields."""
        return json.dumps(self, sort_keys=True, separators=(",", ":"), default=_fields_of)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Graph:
        def mk_params(ps):
            return [Param(**p) for p in ps]

        def mk_op(o):
            return FusedOp(**o)

        nodes = []
        for nd in d.get("nodes", []):
            nd = dict(nd)
            nd["params"] = mk_params(nd.get("params", []))
            nodes.append(Node(**nd))
        kinds = []
        for k in d.get("layer_kinds", []):
            k = dict(k)
            k["ops"] = [mk_op(o) for o in k.get("ops", [])]
            kinds.append(LayerKind(**k))
        kw = {f.name: d[f.name] for f in fields(cls) if f.name in d}
        kw.update(
            nodes=nodes,
            params=mk_params(d.get("params", [])),
            layer_kinds=kinds,
            global_ops=[mk_op(o) for o in d.get("global_ops", [])],
        )
        return cls(**kw)

    @classmethod
    def from_json(cls, text: str) -> Graph:
        return cls.from_dict(json.loads(text))


def _fields_of(value) -> dict[str, Any]:
    """A dataclass instance's fields by name (what :func:`dataclasses.asdict` makes of it,
    one level: nested values are encoded as they come); TypeError for anything else, as
    :func:`json.dumps` raises without a ``default``."""
    if is_dataclass(value) and not isinstance(value, type):
        return {f.name: getattr(value, f.name) for f in fields(value)}
    raise TypeError(f"Object of type {type(value).__name__} is not JSON serializable")

