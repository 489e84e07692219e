"""Sharded multi-head latent attention (DeepSeek-V2/V3 MLA) as one fused ``qkv`` op.

MLA computes q and k/v through low-rank bottlenecks::

    q      = q_b_proj(q_a_layernorm(q_a_proj(x)))                 [heads x (nope + rope)]
    c, k_r = split(kv_a_proj_with_mqa(x), [kv_lora_rank, rope])   (k_r: one rope key, all heads)
    k_n, v = split(kv_b_proj(kv_a_layernorm(c)), per head [nope, v])

The IR groups all of it into ``qkv`` (its shardable weights are the up projections). The
runtime keeps the down projections and their norms replicated and applies the strategy's
choice to the up projections:

* ``col`` (heads): up projections column-parallel, each rank computes its heads;
* ``row``: up projections split over the low-rank dim (a free slice of the replicated
  latent), partial sums repaired at the op's output like any row-parallel op;
* ``rep``: everything replicated (rows follow the incoming placement).

The down projections read the block input at the op's ``need`` placement, or ``R`` when the
op needs ``S(1)`` (row: a replicated weight wants the whole hidden vector; with a replicated
residual that is free, under sequence parallelism it is an all-gather instead of the
cost model's all-to-all). The shared rope key ``k_r`` travels with the attention core's
rows: sliced to ``S(0)`` for a batch split, otherwise replicated across the heads.
"""

from __future__ import annotations

import sys

import torch

from shardc.backends.attention import attend
from shardc.backends.models import AttentionSite
from shardc.backends.runtime import ShardingRuntime


def shard_mla(rt: ShardingRuntime, site: AttentionSite, layer: int) -> None:
    """Place the MLA parameters, hook the projections and install a layout-aware forward."""
    for mod, pre in site.down + site.down_norms + site.qkv + [site.out]:
        rt.place_module_params(mod, pre)
    (need_qkv, _, after_qkv), (need_core, produced_core, _), (need_out, _, after_out) = \
        rt.walk("attention", layer)
    down_place = need_qkv if need_qkv in ("R", "S(0)") else "R"
    memo: list = [None, None]  # q_a_proj and kv_a_proj read the same tensor: one repair
    for mod, _ in site.down:
        rt.hook_op(mod, rt.residual, down_place, down_place, memo=memo)
    for mod, _ in site.down_norms:
        rt.hook_local(mod, down_place)
    for mod, _ in site.qkv:
        rt.hook_op(mod, down_place, need_qkv, after_qkv)
    rt.hook_op(site.out[0], produced_core, need_out, after_out)
    rot_place = "S(0)" if need_core == "S(0)" else "R"

    mod = site.module
    fns = sys.modules[type(mod).__module__]
    rotary = fns.apply_rotary_pos_emb
    rotary_interleave = getattr(fns, "apply_rotary_pos_emb_interleave", None)
    interleave = bool(getattr(mod.config, "rope_interleave", False))
    if interleave and rotary_interleave is None:
        raise ValueError(f"{type(mod).__module__} has no apply_rotary_pos_emb_interleave()")
    nope, rope, vdim = int(mod.qk_nope_head_dim), int(mod.qk_rope_head_dim), int(mod.v_head_dim)
    kv_rank = int(mod.kv_lora_rank)
    (q_a, _), (kv_a, _) = site.down
    (q_norm, _), (kv_norm, _) = site.down_norms
    (q_b, _), (kv_b, _) = site.qkv
    o_proj = site.out[0]

    def forward(hidden_states, position_embeddings=None, attention_mask=None,
                past_key_values=None, **kwargs):
        q = q_b(q_norm(q_a(hidden_states)))  # [b, s, local heads * (nope + rope)]
        b, s = q.shape[0], q.shape[1]
        q = q.reshape(b, s, -1, nope + rope).transpose(1, 2)
        q_pass, q_rot = torch.split(q, [nope, rope], dim=-1)
        latent, k_rot = torch.split(kv_a(hidden_states), [kv_rank, rope], dim=-1)
        kv = kv_b(kv_norm(latent))  # [b, s, local heads * (nope + v)]
        kv = kv.reshape(b, s, -1, nope + vdim).transpose(1, 2)
        k_pass, v = torch.split(kv, [nope, vdim], dim=-1)
        if rot_place != down_place:
            k_rot = rt.local(rt.redist(rt.wrap(k_rot.contiguous(), down_place), rot_place))
        k_rot = k_rot.reshape(b, 1, s, rope)
        cos, sin = position_embeddings
        if interleave:
            q_rot, k_rot = rotary_interleave(q_rot, k_rot, cos, sin)
        else:
            q_rot, k_rot = rotary(q_rot, k_rot, cos, sin)
        q = torch.cat((q_pass, q_rot), dim=-1)
        k = torch.cat((k_pass, k_rot.expand(-1, k_pass.shape[1], -1, -1)), dim=-1)
        y = attend(q, k, v, mod.scaling, past_key_values, mod.layer_idx, rt)
        return o_proj(y.transpose(1, 2).reshape(b, s, -1)), None

    mod.forward = forward
