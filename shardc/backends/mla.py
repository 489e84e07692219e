"""Sharded multi-head latent attention (DeepSeek-V2/V3 MLA) as one fused ``qkv`` op.

MLA computes q and k/v through low-rank bottlenecks::

    q      = q_b_proj(q_a_layernorm(q_a_proj(x)))                 [heads x (nope + rope)]
             (or q_proj(x) without a q low-rank projection, DeepSeek-V2-Lite)
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

from shardc.backends.attention import attend, kv_cache_arg
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
    (q_up, _), (kv_b, _) = site.qkv
    # q_b_proj reads the replicated q latent; without q_lora, q_proj reads the block input
    rt.hook_op(q_up, down_place if site.q_low_rank else rt.residual, need_qkv, after_qkv)
    rt.hook_op(kv_b, down_place, need_qkv, after_qkv)
    rt.hook_op(site.out[0], produced_core, need_out, after_out)
    rot_place = "S(0)" if need_core == "S(0)" else "R"

    mod = site.module
    fns = sys.modules[type(mod).__module__]
    # (cos, sin) rotary (DeepSeek-V3), optionally on interleaved pairs, or the complex
    # ``freqs_cis`` form of DeepSeek-V2 (``apply_rotary_emb``)
    rotary = getattr(fns, "apply_rotary_pos_emb", None)
    rotary_complex = getattr(fns, "apply_rotary_emb", None) if rotary is None else None
    rotary_interleave = getattr(fns, "apply_rotary_pos_emb_interleave", None)
    interleave = bool(getattr(mod.config, "rope_interleave", False))
    if interleave and rotary_interleave is None or rotary is None and rotary_complex is None:
        raise ValueError(f"{type(mod).__module__}: no rotary function the MLA forward knows")
    nope, rope, vdim = int(mod.qk_nope_head_dim), int(mod.qk_rope_head_dim), int(mod.v_head_dim)
    kv_rank = int(mod.kv_lora_rank)
    (kv_a, _), (kv_norm, _) = site.down[-1], site.down_norms[-1]
    if site.q_low_rank:
        (q_a, _), (q_norm, _) = site.down[0], site.down_norms[0]

        def project_q(x):
            return q_up(q_norm(q_a(x)))
    else:
        project_q = q_up
    o_proj = site.out[0]

    def forward(hidden_states, position_embeddings=None, attention_mask=None,
                past_key_values=None, cache=None, **kwargs):
        q = project_q(hidden_states)  # [b, s, local heads * (nope + rope)]
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
        if rotary_complex is not None:
            q_rot, k_rot = rotary_complex(q_rot, k_rot, position_embeddings)
        elif interleave:
            q_rot, k_rot = rotary_interleave(q_rot, k_rot, *position_embeddings)
        else:
            q_rot, k_rot = rotary(q_rot, k_rot, *position_embeddings)
        q = torch.cat((q_pass, q_rot), dim=-1)
        k = torch.cat((k_pass, k_rot.expand(-1, k_pass.shape[1], -1, -1)), dim=-1)
        kv = kv_cache_arg(cache, past_key_values)
        y = attend(q, k, v, mod.scaling, kv, mod.layer_idx, rt)
        return o_proj(y.transpose(1, 2).reshape(b, s, -1)), None

    mod.forward = forward
