"""Where each parameter's sharded dims are, and the placements a strategy gives it.

The strategy speaks in op terms (``shardc.ir.strategy``): choice 0 shards the op's weight
"dim 0" (output features for a linear, vocab for the embedding), choice 1 its "dim 1"
(input features / hidden), choice 2 replicates. How those map onto a real parameter tensor
depends on how the model stores it (``nn.Linear`` keeps ``[out, in]``, GPT-2's Conv1D
``[in, out]``, GPT-MoE's experts ``[E, in, out]``, HF Mixtral's ``[E, out, in]``; DeepSeek's
MLA ``qkv`` shards only its up projections). plan.json's ``params`` rows (:func:`param_plan`)
take it from the graph (:mod:`shardc.ir.param_roles`: the fused op reading the parameter and
the dims as it reads them), and the runtime's styles are chosen from those rows
(:mod:`shardc.backends.torch_styles`). :data:`PARAM_ROLES`, keyed by parameter-name
patterns, is the older
table, used in one place only: rows of a plan written before the IR fields existed get them
from it (:func:`rows_with_ops`).

Placements here are per *SPMD* mesh dim: the logical mesh without ``pp`` (pipeline stages
hold whole parameters; the stage split is :func:`shardc.ir.strategy.pipeline_stages`).
Over ``dp`` every parameter is replicated; over ``ep`` expert weights are ``S(<expert dim>)``
and everything else replicated; over ``tp`` the op choice decides. The one exception: the
expert weights of a mixed experts split (``moe_tp`` and ``moe_ep`` both > 1 and not (tp,
ep)) live on the experts mesh ``(moe_ep, moe_tp)`` -- the ep x tp ranks re-factored,
:func:`shardc.runtime.gathered_experts.experts_mesh` -- and their rows say so: ``mesh_dims
["moe_ep", "moe_tp"]``, placements one per those dims (:func:`row_mesh_dims`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from shardc.ir.strategy import Degrees, Strategy


@dataclass(frozen=True)
class ParamRole:
    """How one kind of parameter relates to its fused op.

    ``dims[i]`` is the tensor dim sharded by choice ``i`` (0 or 1); ``expert_dim`` the
    stacked-expert dim (split over ep) or None; ``fused`` > 1 when the output dim packs that
    many equal parts (q|k|v, gate|up) that must be interleaved before a column split.
    """

    op: str
    dims: tuple[int, int]
    expert_dim: int | None = None
    fused: int = 1


# (pattern on the parameter FQN, role). First match wins; unmatched parameters (norms,
# rotary buffers) are replicated everywhere.
PARAM_ROLES: list[tuple[re.Pattern, ParamRole]] = [
    (re.compile(p), r) for p, r in [
        (r"(^|\.)(embed_tokens|embed|wte)\.weight$", ParamRole("embedding", (0, 1))),
        (r"self_attn\.[qkv]_proj\.(weight|bias)$", ParamRole("qkv", (0, 1))),
        # MLA: the up projections carry the heads; the low-rank down projections
        # (q_a_proj, kv_a_proj_with_mqa) and their norms stay replicated (no role)
        (r"self_attn\.(q_b_proj|kv_b_proj)\.weight$", ParamRole("qkv", (0, 1))),
        (r"attn\.qkv\.weight$", ParamRole("qkv", (0, 1), fused=3)),
        # GPT-2 Conv1D: weights [in, out] (a column split cuts dim 1); c_attn packs q|k|v in
        # its output (and bias), interleaved per tp rank before a column split
        (r"attn\.c_attn\.weight$", ParamRole("qkv", (1, 0), fused=3)),
        (r"attn\.c_attn\.bias$", ParamRole("qkv", (0, 1), fused=3)),
        (r"attn\.c_proj\.weight$", ParamRole("out_proj", (1, 0))),
        (r"mlp\.c_fc\.weight$", ParamRole("ffn1", (1, 0))),
        (r"mlp\.c_proj\.weight$", ParamRole("ffn2", (1, 0))),
        (r"self_attn\.o_proj\.weight$", ParamRole("out_proj", (0, 1))),
        (r"attn\.out\.weight$", ParamRole("out_proj", (0, 1))),
        (r"shared_experts?\.(gate_proj|up_proj)\.weight$", ParamRole("shared_ffn1", (0, 1))),
        (r"shared_experts?\.down_proj\.weight$", ParamRole("shared_ffn2", (0, 1))),
        (r"mlp\.(gate_proj|up_proj)\.weight$", ParamRole("ffn1", (0, 1))),
        (r"mlp\.down_proj\.weight$", ParamRole("ffn2", (0, 1))),
        (r"(mlp\.gate|moe\.router)\.weight$", ParamRole("router", (0, 1))),
        (r"experts\.gate_up_proj$", ParamRole("expert_ffn1", (1, 2), expert_dim=0, fused=2)),
        (r"experts\.down_proj$", ParamRole("expert_ffn2", (1, 2), expert_dim=0)),
        (r"experts\.w_in$", ParamRole("expert_ffn1", (2, 1), expert_dim=0)),
        (r"experts\.w_out$", ParamRole("expert_ffn2", (2, 1), expert_dim=0)),
        (r"(^|\.)lm_head\.weight$", ParamRole("lm_head", (0, 1))),
    ]
]
_LAYER_RE = re.compile(r"(?:^|\.)(?:layers|h)\.(\d+)\.")  # GPT-2: transformer.h.<i>


def layer_of(fqn: str) -> int | None:
    """Decoder-layer index in a parameter name (:func:`rows_with_ops`' fallback only)."""
    m = _LAYER_RE.search(fqn)
    return int(m.group(1)) if m else None


def spmd_dims(degrees: Degrees) -> list[str]:
    """Names of the logical mesh dims that shard tensors (:meth:`Degrees.spmd_dims`)."""
    return degrees.spmd_dims()


def choice_key(op: str, layer_kind: str | None) -> str:
    return op if layer_kind is None else f"{layer_kind}.{op}"


def op_choice(strategy: Strategy, op: str, layer_kind: str | None) -> int:
    """Choice index of ``op`` in ``layer_kind`` (2 = replicate when the strategy has none)."""
    return int(strategy.choices.get(choice_key(op, layer_kind), 2))


def kv_repeat(is_kv: bool, layer: int | None, strategy: Strategy,
              kind_of_layer: dict[int, str], kv_heads: int) -> int:
    """How many times each KV head of a k / v projection (``is_kv``) of decoder layer
    ``layer`` is repeated before its tp split: ``tp / kv_heads`` for GQA with tp > kv_heads
    when the layer's qkv is column split (``col``) into attention split by heads -- each rank
    then holds the one KV head its query heads read
    (:func:`shardc.ir.contract.kv_head_replicas`, as vLLM places it; the runtime places the
    repeated ``[kv_heads x repeat x head_dim, ...]`` tensor, so the local shape is one KV
    head) --, else 1."""
    tp = strategy.degrees.tp
    if not is_kv or not kv_heads or tp <= kv_heads or tp % kv_heads:
        return 1
    kind = kind_of_layer.get(layer)
    heads_split = op_choice(strategy, "attn_core", kind) == 0
    return tp // kv_heads if heads_split and op_choice(strategy, "qkv", kind) == 0 else 1


def kv_projections(graph, uses: dict) -> dict[str, int]:
    """FQN -> the layer's KV heads, for the separate k / v projection parameters (weights and
    biases) of GQA attention, from the IR: a ``qkv`` parameter not packed (no ``parts``) whose
    output features are its layer's ``kv_heads x head_dim`` (its layer kind's ``attn_core``
    attributes), fewer than the query heads'."""
    cores = {i: k.op("attn_core").attrs for k in graph.layer_kinds
             if k.op("attn_core") is not None for i in k.layers}
    out: dict[str, int] = {}
    for p in graph.params:
        u = uses.get(p.fqn)
        a = cores.get(u.layer) if u is not None else None
        if a is None or u.op != "qkv" or u.parts or u.split_dims[0] is None:
            continue
        heads, kv, head_dim = (int(a.get(k, 0) or 0) for k in ("heads", "kv_heads", "head_dim"))
        if 0 < kv < heads and int(p.shape[u.split_dims[0]]) == kv * head_dim:
            out[p.fqn] = kv
    return out


EXPERTS_MESH_DIMS = ["moe_ep", "moe_tp"]  # a mixed split's experts mesh (ep x tp re-factored)


def mixed_split(degrees: Degrees) -> bool:
    """The experts split ``moe_tp x moe_ep`` with both > 1, other than (tp, ep): no
    placement per SPMD mesh dim says it (it factors a mesh dim in two), so its expert
    weights live on the experts mesh :data:`EXPERTS_MESH_DIMS`."""
    return degrees.experts_resplit and degrees.moe_tp > 1 and degrees.moe_ep > 1


def row_mesh_dims(row: dict, degrees: Degrees) -> list[str]:
    """The mesh dims a params row's ``placements`` refer to: its ``mesh_dims`` (the experts
    mesh of a mixed split), else the SPMD dims."""
    return list(row.get("mesh_dims") or spmd_dims(degrees))


def local_shape(shape: list[int], placements: list[str], degrees: Degrees,
                dims: list[str] | None = None) -> list[int]:
    """Per-rank shape of a tensor of global ``shape`` under ``placements`` over ``dims``
    (the SPMD dims unless given; a dim's size is the degree of that name)."""
    out = list(shape)
    for dim, p in zip(dims or spmd_dims(degrees), placements):
        if p.startswith("S("):
            d = int(p[2:-1])
            n = getattr(degrees, dim)
            out[d] = -(-out[d] // n)
    return out


def rows_with_ops(rows: list[dict]) -> list[dict]:
    """plan.json params rows, each with the IR fields ``op`` / ``layer`` / ``split_dims`` /
    ``expert_dim`` / ``parts``; a row of a plan written before they existed (schema 1
    without ``op``) gets them from the parameter-name table :data:`PARAM_ROLES`."""
    out = []
    for r in rows:
        if "op" in r:
            out.append(r)
            continue
        role = next((role for pat, role in PARAM_ROLES if pat.search(str(r["fqn"]))), None)
        shape = list(r["shape"])
        extra: dict = {"op": None, "layer": layer_of(str(r["fqn"])),
                       "split_dims": [None, None]}
        if role is not None:
            extra["op"] = role.op
            bias = len(shape) == 1
            extra["split_dims"] = [0, None] if bias else list(role.dims)
            if role.expert_dim is not None:
                extra["expert_dim"] = role.expert_dim
            if role.fused > 1:
                width = shape[0 if bias else role.dims[0]]
                extra["parts"] = [width // role.fused] * role.fused
        out.append({**r, **extra})
    return out


def use_placements(use: dict, ndim: int, strategy: Strategy,
                   kind_of_layer: dict[int, str]) -> list[str]:
    """Placements (``"S(d)"`` / ``"R"``) per SPMD mesh dim of a parameter whose plan.json
    row (or :meth:`shardc.ir.param_roles.ParamUse.as_row`) is ``use``: over ``ep`` its
    ``expert_dim``, over ``tp`` the dim its op's choice cuts (``split_dims``)."""
    op, layer = use.get("op"), use.get("layer")
    kind = kind_of_layer.get(layer) if layer is not None else None
    dims = list(use.get("split_dims") or (None, None))
    if strategy.degrees.experts_resplit and use.get("expert_dim") is not None:
        return resplit_expert_placements(use, dims, ndim, strategy, kind)
    out = []
    for dim in spmd_dims(strategy.degrees):
        p = "R"
        if dim == "ep" and use.get("expert_dim") is not None:
            p = f"S({use['expert_dim']})"
        elif dim == "tp" and op is not None:
            c = op_choice(strategy, op, kind)
            if c in (0, 1) and dims[c] is not None and dims[c] < ndim:
                p = f"S({dims[c]})"
        out.append(p)
    return out


def resplit_expert_placements(use: dict, dims: list, ndim: int, strategy: Strategy,
                              kind: str | None) -> list[str]:
    """Placements of a stacked expert weight whose experts are split moe_tp x moe_ep other
    than (tp, ep) (:class:`~shardc.ir.strategy.Degrees`): all tensor-parallel (moe_ep = 1:
    its op's column / row dim cut over ep and tp, ep outer), all expert-parallel (moe_tp
    = 1: the expert dim cut over both), or mixed (both > 1: over the experts mesh
    :data:`EXPERTS_MESH_DIMS`, the expert dim over moe_ep and the column / row dim over
    moe_tp). A split cutting the width of experts that do not run column / row: InputError."""
    from shardc.errors import InputError

    d = strategy.degrees
    c = op_choice(strategy, use["op"], kind)
    width = dims[c] if c in (0, 1) and dims[c] is not None and dims[c] < ndim else None
    if d.moe_tp == 1:
        return [f"S({use['expert_dim']})" if dim in ("ep", "tp") else "R"
                for dim in spmd_dims(d)]
    if width is None:
        raise InputError(f"the experts split moe_tp={d.moe_tp} x moe_ep={d.moe_ep} over "
                         f"tp={d.tp} x dp_attn={d.ep} cuts each expert's width, which "
                         f"{use.get('op')} {choice_key(use['op'], kind)!r} does not split "
                         "(the split runs column / row experts)")
    if d.moe_ep == 1:
        return [f"S({width})" if dim in ("ep", "tp") else "R" for dim in spmd_dims(d)]
    return [f"S({use['expert_dim']})", f"S({width})"]  # over EXPERTS_MESH_DIMS


def param_plan(graph, strategy: Strategy, kind_of_layer: dict[int, str]) -> list[dict]:
    """plan.json ``params``: per parameter of ``graph`` {fqn, shape, placements, local_shape,
    stage} and the fused op it belongs to, from the graph
    (:func:`shardc.ir.param_roles.param_uses`: ``op``, ``layer``, ``split_dims``, and
    ``expert_dim`` / ``parts`` where they apply). The local shape of a k / v projection whose
    KV heads are replicated (GQA, tp > kv_heads: :func:`kv_repeat`) is one KV head's."""
    from shardc.ir.param_roles import param_uses, read_before_layers
    from shardc.ir.strategy import pipeline_stages

    uses = param_uses(graph)
    kv_projs = kv_projections(graph, uses)
    first = read_before_layers(graph)
    num_layers = len(kind_of_layer)
    stages = pipeline_stages(num_layers, strategy.degrees.pp) if num_layers else []
    rows = []
    for p in graph.params:
        shape = [int(s) for s in p.shape]
        use = uses[p.fqn].as_row() if p.fqn in uses else {"op": None, "layer": None,
                                                           "split_dims": [None, None]}
        pl = use_placements(use, len(shape), strategy, kind_of_layer)
        layer = use["layer"]
        if layer is not None and layer < len(stages):
            stage = stages[layer]
        elif p.fqn in first:  # embeddings
            stage = 0
        else:  # final norm, lm_head
            stage = strategy.degrees.pp - 1
        repeat = kv_repeat(p.fqn in kv_projs, layer, strategy, kind_of_layer,
                           kv_projs.get(p.fqn, 0))
        placed = list(shape)
        if repeat > 1:  # the runtime places the repeated KV heads (out features)
            placed[use["split_dims"][0]] *= repeat
        mesh = {}
        if use.get("expert_dim") is not None and mixed_split(strategy.degrees):
            mesh = {"mesh_dims": list(EXPERTS_MESH_DIMS)}
        rows.append({"fqn": p.fqn, "shape": shape, "placements": pl,
                     "local_shape": local_shape(placed, pl, strategy.degrees,
                                                mesh.get("mesh_dims")),
                     "stage": stage, **mesh, **use})
    return rows
