"""DeepSeek MLA on local shards (torch only): :class:`LatentAttention` (absorbed, the
latent cache: a ``col`` qkv before a heads split, a ``rep`` one) and
:class:`PerHeadLatentAttention` (after a ``row`` qkv, or a ``col`` qkv before a batch-split or
replicated core).

Per head: ``row`` splits the up projections' low-rank input (``q_b_proj`` over ``q_lora_rank``, or
``q_proj`` over the hidden size without a q low-rank projection; ``kv_b_proj`` over
``kv_lora_rank``): each tp rank multiplies its slice of the replicated latents by its
weight slice, giving partial sums of every head's ``q`` and ``k_nope | v``; ``col`` splits
them by heads: each rank computes its heads' ``q`` and ``k_nope | v`` from the whole
latents. That output is the qkv output the walk repairs to the core (``P -> S(1)``
reduce-scatter for a heads split, ``P`` / ``S(1) -> S(0)`` for a batch split, ``-> R`` for a
replicated core), packed as ``[q | kv]`` in one collective of the bytes the cost model
charges. The attention then runs per head, not absorbed (the latent cache would need every
head's whole ``kv_b_proj`` rows, which these choices split): keys ``k_nope | k_rope`` (the
shared rope key broadcast over heads) and values are cached per head, like Llama-style
attention's (``value_dim = v_head_dim``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from shardc.runtime.kv_cache import KVCache, positions, visible
from shardc.runtime.local_ops import (
    Group,
    attend,
    held_rows,
    linear,
    local_features,
    local_tensor,
    repair,
    rope,
)


class PerHeadLatentAttention:
    """MLA of one layer after a ``row`` qkv, or a ``col`` qkv before a core other than a
    heads split (module docstring); ``window``: its sliding window (tokens) or None."""

    def __init__(self, attn, walk: dict, tp: Group, cfg, i: int, window):
        (_, self.c_qkv, _, self.qkv_out), (_, core, self.core_need, _), _ = walk["steps"]
        if self.c_qkv not in ("row", "col"):
            raise NotImplementedError(f"per-head MLA after a {self.c_qkv} qkv")
        self.walk, self.tp, self.i, self.attn, self.window = walk, tp, i, attn, window
        self.nope, self.rope_d = int(cfg.qk_nope_head_dim), int(cfg.qk_rope_head_dim)
        self.vd, self.lora = int(cfg.v_head_dim), int(cfg.kv_lora_rank)
        self.heads = int(cfg.num_attention_heads)
        self.q_lora = getattr(attn, "q_lora_rank", None)
        self.wq = local_tensor((attn.q_b_proj if self.q_lora else attn.q_proj).weight)
        self.wkv = local_tensor(attn.kv_b_proj.weight)
        self.wo, self.bo = local_tensor(attn.o_proj.weight), local_tensor(attn.o_proj.bias)
        self.scale = float(attn.scaling)
        self.interleave = bool(getattr(cfg, "rope_interleave", False))
        self.parts = (self.heads * (self.nope + self.rope_d), self.heads * (self.nope + self.vd))
        # row: this rank's slice of the latents; col: the whole latents, its heads' weights
        self.slice_in = (lambda t: local_features(t, None, tp)) if self.c_qkv == "row" \
            else (lambda t: t)
        self.local_heads = self.heads // tp.size if core == "heads" and tp else self.heads

    def alloc(self, cache: KVCache, rows: int) -> None:
        cache.add_heads(self.i, held_rows(rows, self.core_need, self.tp), self.local_heads,
                        self.nope + self.rope_d, value_dim=self.vd, window=self.window)

    def __call__(self, x, residual, cache: KVCache, steps, upto, rope_tables, prefill):
        a, tp = self.attn, self.tp
        # the down projections are replicated and read whole hidden vectors: from R the
        # walk's R -> S(1) of a row qkv is the free slice of the latents below; under
        # sequence parallelism the rows are all-gathered (charged for col; for row the walk
        # charges an all-to-all)
        x = repair(x, residual, "R", tp)
        qin = a.q_a_layernorm(a.q_a_proj(x)) if self.q_lora else x
        ckv = a.kv_a_proj_with_mqa(x)
        lat, k_rot = ckv.split([self.lora, self.rope_d], -1)
        lat = a.kv_a_layernorm(lat)
        part = torch.cat([linear(self.slice_in(qin), self.wq, None, self.c_qkv, tp),
                          linear(self.slice_in(lat), self.wkv, None, self.c_qkv, tp)], -1)
        y = repair(part, self.qkv_out, self.core_need, tp, self.parts)
        rows = held_rows(x.shape[0], self.core_need, tp)
        k_rot = k_rot[rows]
        r, s, h = y.shape[0], y.shape[1], self.local_heads
        q, kv = y.split([h * (self.nope + self.rope_d), h * (self.nope + self.vd)], -1)
        q = q.view(r, s, h, self.nope + self.rope_d).transpose(1, 2)
        kv = kv.view(r, s, h, self.nope + self.vd).transpose(1, 2)
        q_nope, q_rot = q.split([self.nope, self.rope_d], -1)
        k_nope, v = kv.split([self.nope, self.vd], -1)
        layer = cache.layers[self.i]
        start = cache.start[layer.rows]
        cos, sin = rope_tables(positions(steps, start))
        q_rot = rope(q_rot, cos, sin, self.interleave)
        k_rot = rope(k_rot[:, None], cos, sin, self.interleave).expand(r, h, s, self.rope_d)
        q = torch.cat([q_nope, q_rot], -1)
        k = torch.cat([k_nope, k_rot], -1)
        layer.write(steps, k, v)
        if prefill:
            keys, vals, kst = k, v, steps
        else:
            keys, vals, kst = layer.view(upto)
        o = attend(q, keys, vals, visible(kst, steps, start, self.window), self.scale)
        (_, c_out, need, prod) = self.walk["steps"][2]
        o = linear(repair(o, self.core_need, need, tp), self.wo, self.bo, c_out, tp)
        return repair(o, prod, self.walk["end"], tp)


class LatentAttention:
    """DeepSeek MLA of one layer on local shards, absorbed: ``q_nope`` is mapped into the
    latent space through ``kv_b_proj``'s key half, attention reads the cached latent and
    shared rope key, and the latent output goes through the value half. ``qkv`` ``col``
    splits ``q_b_proj`` / ``kv_b_proj`` by heads (the latent stays whole), ``rep`` keeps
    them whole (a ``batch`` core then runs this tp rank's rows). Under sequence parallelism
    a ``rep`` qkv runs on this tp rank's rows; before a heads split its ``q`` goes to the
    rank's heads of every row with the walk's all-to-all and the latents (``kv_lora_rank +
    qk_rope_head_dim`` per token, shared by the heads) are all-gathered -- one collective
    more than the walk's (docs/backend.md, "Known differences")."""

    def __init__(self, attn, walk: dict, tp: Group, cfg, i: int, window):
        (_, self.c_qkv, _, _), (_, core, self.core_need, _), (_, self.c_out, _, _) = \
            walk["steps"]
        pairs = {("col", "heads"), ("rep", "heads"), ("rep", "batch"), ("rep", "rep")}
        if (self.c_qkv, core) not in pairs:
            raise NotImplementedError(f"MLA qkv {self.c_qkv} with attention core {core}")
        self.x_need = walk["steps"][0][2]  # where the down projections read their input
        self.walk, self.tp, self.i, self.attn = walk, tp, i, attn
        self.nope, self.rope_d = int(cfg.qk_nope_head_dim), int(cfg.qk_rope_head_dim)
        self.vd, self.lora = int(cfg.v_head_dim), int(cfg.kv_lora_rank)
        wkv = local_tensor(attn.kv_b_proj.weight)
        self.heads = wkv.shape[0] // (self.nope + self.vd)
        wkv = wkv.view(self.heads, self.nope + self.vd, self.lora)
        if self.c_qkv == "rep" and core == "heads" and tp:  # whole weights: this rank's heads
            self.heads //= tp.size
            wkv = wkv[tp.rank * self.heads:(tp.rank + 1) * self.heads]
        self.w_uk, self.w_uv = wkv[:, :self.nope], wkv[:, self.nope:]
        self.q_lora = getattr(attn, "q_lora_rank", None)
        self.wq = local_tensor((attn.q_b_proj if self.q_lora else attn.q_proj).weight)
        self.wo, self.bo = local_tensor(attn.o_proj.weight), attn.o_proj.bias
        self.bo = None if self.bo is None else local_tensor(self.bo)
        self.scale = float(attn.scaling)
        # adjacent pairs rotate (DeepSeek-V3's rope_interleave; V2's complex tables: new_cache)
        self.interleave = bool(getattr(cfg, "rope_interleave", False))
        self.window = window

    def alloc(self, cache: KVCache, rows: int) -> None:
        cache.add_latent(self.i, held_rows(rows, self.core_need, self.tp), self.lora, self.rope_d,
                         window=self.window)

    def __call__(self, x, residual, cache: KVCache, steps, upto, rope_tables, prefill):
        a, tp = self.attn, self.tp
        x = repair(x, residual, self.walk["steps"][0][2], tp)
        qin = a.q_a_layernorm(a.q_a_proj(x)) if self.q_lora else x
        q = F.linear(qin, self.wq)
        ckv = a.kv_a_proj_with_mqa(x)
        lat, k_rot = ckv.split([self.lora, self.rope_d], -1)
        lat = a.kv_a_layernorm(lat)
        # q to the core's placement (R -> S(0) rows or S(1) heads: a local slice); the
        # replicated latents to the core's rows
        q = repair(q, self.walk["steps"][0][3], self.core_need, tp)
        if self.core_need == "S(0)" and self.x_need == "R":
            rows = held_rows(x.shape[0], "S(0)", tp)
            lat, k_rot = lat[rows], k_rot[rows]
        elif self.core_need == "S(1)" and self.x_need == "S(0)":  # rows -> heads: every row
            lat, k_rot = repair(torch.cat([lat, k_rot], -1), "S(0)", "R", tp).split(
                [self.lora, self.rope_d], -1)
        r, s = q.shape[0], q.shape[1]
        q = q.view(r, s, self.heads, self.nope + self.rope_d).transpose(1, 2)
        q_nope, q_rot = q.split([self.nope, self.rope_d], -1)
        layer = cache.layers[self.i]
        start = cache.start[layer.rows]
        cos, sin = rope_tables(positions(steps, start))
        q_rot = rope(q_rot, cos, sin, self.interleave)
        k_rot = rope(k_rot[:, None], cos, sin, self.interleave)[:, 0]
        layer.write(steps, lat, k_rot)
        if prefill:
            keys, krs, kst = lat, k_rot, steps
        else:
            keys, krs, kst = layer.view(upto)
        q_lat = torch.einsum("rhsd,hdl->rhsl", q_nope, self.w_uk)
        scores = (q_lat @ keys[:, None].transpose(-1, -2).to(q.dtype)
                  + q_rot @ krs[:, None].transpose(-1, -2).to(q.dtype)) * self.scale
        mask = visible(kst, steps, start, self.window)
        probs = scores.masked_fill(~mask, float("-inf")).softmax(-1, dtype=torch.float32)
        o_lat = probs.to(q.dtype) @ keys[:, None].to(q.dtype)
        o = torch.einsum("rhsl,hvl->rshv", o_lat, self.w_uv).flatten(2)
        (_, _, need, prod) = self.walk["steps"][2]
        o = linear(repair(o, self.core_need, need, tp), self.wo, self.bo, self.c_out, tp)
        return repair(o, prod, self.walk["end"], tp)
