"""DBRX's layout for the fast runtime (torch only): the decoder block ``transformer.blocks[i]``
holds ``norm_attn_norm`` (``norm_1``, the attention ``attn`` with a packed ``Wqkv`` whose
output is clamped to ``[-clip_qkv, clip_qkv]``, ``norm_2``) and ``ffn`` (a ``DbrxRouter``
whose ``layer`` is the scores linear, the routing in ``DbrxFFN.route_tokens_to_experts``,
and ``DbrxExperts`` whose weights are stored fused: ``mlp.w1`` gate, ``mlp.v1`` up,
``mlp.w2`` down, each ``[E * f, h]``, placed as ``[E, f, h]`` views:
:mod:`shardc.frontends.fused_experts`)."""

from __future__ import annotations

from shardc.runtime.local_ops import local_tensor


def is_dbrx_block(layer) -> bool:
    """Whether ``layer`` is a DBRX decoder block (``norm_attn_norm`` + ``ffn``)."""
    return hasattr(layer, "norm_attn_norm") and hasattr(layer, "ffn")


def dbrx_block_parts(layer):
    """``(attention, norm before it, norm after it, ffn)`` of a DBRX block."""
    nan = layer.norm_attn_norm
    return nan.attn, nan.norm_1, nan.norm_2, layer.ffn


def is_fused_experts(experts) -> bool:
    """DBRX's ``DbrxExperts`` (its GLU's ``w1`` / ``v1`` / ``w2``)."""
    glu = getattr(experts, "mlp", None)
    return glu is not None and all(hasattr(glu, n) for n in ("w1", "v1", "w2"))


def fused_expert_weights(experts):
    """``((gate, up) [E_local, f_local, h] each, down [E_local, h, f_local], act, f)`` of
    DBRX's experts on this rank: the local shards of ``w1`` / ``v1`` / ``w2`` seen as
    ``[E_local, f_local, h]`` (placed as such, or a whole ``[E * f, h]`` parameter viewed;
    no copy), the down shard read transposed in place; the runtime runs gate and up as two
    matmuls whose outputs sit side by side (``[g_r | u_r]``, the packed layout the repairs
    keep); ``f`` is the whole per-expert width (the packed parts' widths)."""
    glu = experts.mlp
    f, h = int(experts.ffn_hidden_size), int(experts.hidden_size)

    def view(t):
        t = local_tensor(t)
        return t if t.dim() == 3 else t.view(-1, f, h)

    return (view(glu.w1), view(glu.v1)), view(glu.w2).transpose(1, 2), glu.activation_fn, f


def dbrx_routing(ffn):
    """The DBRX block's routing of whole scores ``logits [T, E]`` as its own
    ``route_tokens_to_experts`` computes it; returns ``(logits, weights [T, k], index)``."""
    def route(logits):
        weights, idx = ffn.route_tokens_to_experts(logits)
        return logits, weights, idx
    return route


def clip_of(attn) -> float | None:
    """DBRX's ``clip_qkv`` (None: no clamp; every other attention has none)."""
    clip = getattr(attn, "clip_qkv", None)
    return None if clip is None else float(clip)


def fused_topk_forward(glu, names):
    """Experts stored fused as ``forward(hidden [..., h], top_k_index [T, k], top_k_weights
    [T, k]) -> [..., h]`` on the local ``[E_local, f, h]`` shards of ``glu``'s ``names``
    (gate, up, down): each token's weighted sum of its local experts' GLU outputs (an index
    outside ``[0, E_local)``, another rank's expert, adds nothing)."""
    def forward(hidden, top_k_index, top_k_weights):
        shape = hidden.shape
        x = hidden.reshape(-1, shape[-1])
        w1, v1, w2 = (getattr(glu, n) for n in names)
        out = x.new_zeros(x.shape)
        for e in range(w1.shape[0]):
            tok, slot = (top_k_index == e).nonzero(as_tuple=True)
            if tok.numel():
                y = glu(x[tok], w1[e], v1[e], w2[e]) * top_k_weights[tok, slot, None]
                out.index_add_(0, tok, y.to(x.dtype))
        return out.view(shape)
    return forward
