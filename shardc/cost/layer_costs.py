"""Per-op and per-branch time and memory, vectorised over a batch of strategies.

Everything here is for ONE micro-batch through ONE layer on ONE GPU of the bottleneck
tp group; :mod:`shardc.cost.model` multiplies by layers per stage and assembles the pipeline.

Token counts (per tp group = one attention group, one micro-batch):

* ``T`` -- tokens entering the dense ops: sequences per attention group ``s`` x 1 (decode)
  or x prompt (prefill);
* ``T_e`` -- tokens an ep rank's experts receive: ``T * top_k * imbalance`` (every ep rank
  serves the tokens of ep attention groups, ``T * ep * top_k`` routed tokens over ``ep``
  ranks, times the load-imbalance factor of the busiest rank; 1 when ep = 1);
* lm_head sees ``T`` tokens in decode and only the last token of each sequence in prefill.

Units: seconds, bytes, FLOPs.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from shardc.cost import collectives as coll
from shardc.cost.branch_tables import BranchTable
from shardc.cost.roofline import compute_time, gemm_flop_efficiency, kernel_time, memory_time
from shardc.cost.topology import CommGroup
from shardc.ir.contract import MODE_EXPONENTS, SHARD_BOTH, TOKEN_SPLIT
from shardc.ir.graph import FusedOp

EXPERT_OPS = ("expert_ffn1", "expert_ffn2")


@dataclass
class Batch:
    """Per-strategy quantities shared by every op (arrays [B] unless noted)."""

    hw: object
    phase: str
    tp: np.ndarray
    ep: np.ndarray
    sp: np.ndarray  # 1 or tp
    seqs: np.ndarray  # sequences per attention group per micro-batch
    seqs_resident: np.ndarray  # sequences per attention group whose KV cache is resident
    tokens: np.ndarray  # T
    expert_tokens: np.ndarray  # T_e
    lm_tokens: np.ndarray
    context: float  # tokens attended per decode step (decode) / prompt (prefill)
    kv_context: float  # KV-cache length held per sequence
    prompt: float
    residual: np.ndarray  # 0 = R, 1 = S(0)
    groups: dict[str, CommGroup]
    hidden: int
    top_k: int
    num_experts: int
    weight_bytes: float
    act_bytes: float
    kv_bytes: float
    gemm_peak: float
    detail: bool = False
    # decode only: prompt tokens of a chunked prefill riding on the step (aggregated serving;
    # included in ``tokens``), which attend on average to half the prompt
    chunk_tokens: np.ndarray | float = 0.0


@dataclass
class OpCost:
    """Cost of one fused op (arrays [B]): seconds, and bytes resident per GPU."""

    compute_s: np.ndarray
    memory_s: np.ndarray
    time_s: np.ndarray
    weight_bytes: np.ndarray
    kv_bytes: np.ndarray


@dataclass
class BranchCost:
    time_s: np.ndarray
    weight_bytes: np.ndarray
    kv_bytes: np.ndarray
    ops: list = field(default_factory=list)  # detail: [(op, mode, OpCost, comm_s before)]
    collectives: list = field(default_factory=list)  # detail: [(before_op, kind, dim, S, s)]


def _sharded_fraction(fop: FusedOp) -> float:
    return fop.shardable_params / fop.params if fop.params else 1.0


def _flops_per_token(fop: FusedOp) -> float:
    return float(fop.flops_per_token or 2 * fop.in_features * fop.out_features)


def op_out_width(fop: FusedOp) -> int:
    """Features of the op's output activation (attention core: heads x v_head_dim)."""
    if fop.name == "attn_core":
        a = fop.attrs
        return int(fop.out_features or a.get("heads", 0) * a.get("v_head_dim", a.get("head_dim", 0)))
    return int(fop.out_features)


def linear_cost(fop: FusedOp, div: np.ndarray, tokens, b: Batch) -> OpCost:
    """A GEMM-like op (dense linear, router, lm_head, embedding lookup)."""
    d_tok, d_flop, d_w, d_in, d_out = (div[:, i] for i in range(5))
    sh = _sharded_fraction(fop)
    w_frac = sh / d_w + (1.0 - sh)
    wbytes = fop.params * b.weight_bytes * w_frac
    act = tokens * (fop.in_features / d_in + fop.out_features / d_out) * b.act_bytes
    if fop.name == "embedding":  # a row gather: no FLOPs, reads T rows of the local shard
        comp = np.zeros_like(act)
        mem = memory_time(tokens / d_tok * fop.out_features / d_out * (b.weight_bytes + b.act_bytes), b.hw)
    else:
        flops = tokens * _flops_per_token(fop) * (sh / d_flop + (1.0 - sh) / d_tok)
        eff = gemm_flop_efficiency(tokens / d_tok, fop.in_features * fop.out_features * w_frac, b.hw)
        comp = compute_time(flops, eff, b.gemm_peak)
        mem = memory_time(wbytes + act, b.hw)
    return OpCost(comp, mem, kernel_time(comp, mem, 1, b.hw), wbytes, np.zeros_like(wbytes))


def expert_cost(fop: FusedOp, div: np.ndarray, b: Batch) -> OpCost:
    """Grouped expert GEMM on one ep rank: its num_experts/ep experts, tokens T_e."""
    d_tok, d_flop, d_w, d_in, d_out = (div[:, i] for i in range(5))
    E = max(int(fop.attrs.get("num_experts", b.num_experts) or 1), 1)
    k = max(int(fop.attrs.get("top_k", b.top_k) or 1), 1)
    local = E / b.ep
    te = b.expert_tokens
    # expected fraction of experts hit by >= 1 of the micro-batch's routed tokens
    total = b.tokens * b.ep
    active = 1.0 - np.power(1.0 - min(k / E, 1.0), total)
    w_res = fop.params / b.ep * b.weight_bytes / d_w
    w_read = w_res * active
    flops = te * _flops_per_token(fop) / k / d_flop
    per_expert_m = te / d_tok / np.maximum(local * active, 1e-9)
    eff = gemm_flop_efficiency(per_expert_m, fop.in_features * fop.out_features / d_w, b.hw)
    comp = compute_time(flops, eff, b.gemm_peak)
    act = te * (fop.in_features / d_in + fop.out_features / d_out) * b.act_bytes
    mem = memory_time(w_read + act, b.hw)
    return OpCost(comp, mem, kernel_time(comp, mem, 1, b.hw), w_res, np.zeros_like(w_res))


def attention_cost(fop: FusedOp, div: np.ndarray, mode: np.ndarray, b: Batch,
                   in_width: int) -> OpCost:
    """Attention core: decode reads the KV cache at ``decode_flops_per_token_per_context``
    FLOPs per cached position (absorbed MLA for DeepSeek); prefill is causal flash attention
    at ``flops_per_token_per_context`` (the traced, non-absorbed form)."""
    d_tok, d_flop, d_w, d_in, d_out = (div[:, i] for i in range(5))
    a = fop.attrs
    heads = int(a.get("heads", 1) or 1)
    kv_heads = int(a.get("kv_heads", heads) or heads)
    hd, vhd = int(a.get("head_dim", 0)), int(a.get("v_head_dim", a.get("head_dim", 0)))
    per_ctx = float(a.get("flops_per_token_per_context") or 2 * heads * (hd + vhd))
    # decode runs the form decode kernels use (absorbed MLA over the latent cache)
    decode_per_ctx = float(a.get("decode_flops_per_token_per_context") or per_ctx)
    kv_elems = float(a.get("kv_cache_elems_per_token", 2 * kv_heads * hd))
    split_heads = bool(a.get("kv_cache_split_by_heads", True))
    # fraction of each sequence's KV cache held (and read) per GPU, by mode
    head_frac = 1.0 / np.minimum(b.tp, kv_heads) if split_heads else np.ones_like(b.tp, dtype=float)
    kv_frac = np.where(mode == SHARD_BOTH, head_frac, np.where(mode == TOKEN_SPLIT, 1.0 / b.tp, 1.0))
    out_width = op_out_width(fop)
    act = b.tokens * (in_width / d_in + out_width / d_out) * b.act_bytes
    if b.phase == "decode":
        flops = b.seqs * b.context * decode_per_ctx / d_flop
        traffic = b.seqs * b.context * kv_elems * b.kv_bytes * kv_frac + act
        if np.any(b.chunk_tokens):  # chunk: context attention over its prompt prefix
            flops = flops + b.chunk_tokens * (b.prompt + 1) / 2 * per_ctx / d_flop
            prompts = np.maximum(b.chunk_tokens / b.prompt, np.minimum(b.chunk_tokens, 1.0))
            traffic = traffic + (b.chunk_tokens + prompts * b.prompt / 2) * kv_elems \
                * b.kv_bytes * kv_frac
    else:
        flops = b.seqs * b.prompt * (b.prompt + 1) / 2 * per_ctx / d_flop
        traffic = b.tokens * kv_elems * b.kv_bytes * kv_frac + act
    comp = compute_time(flops, b.hw.attention_eff, b.hw.peak_flops(False))
    mem = memory_time(traffic, b.hw)
    kv_res = b.seqs_resident * b.kv_context * kv_elems * b.kv_bytes * kv_frac
    zero = np.zeros_like(kv_res)
    return OpCost(comp, mem, kernel_time(comp, mem, 2, b.hw), zero, kv_res)


def _pick_collective(kind: np.ndarray, S, group: CommGroup, hw) -> np.ndarray:
    """Seconds of the collective code ``kind`` (per strategy) on ``S`` full-tensor bytes."""
    ag = coll.all_gather(S, group, hw)
    base = hw.collective_base_us * 1e-6
    ar = np.where(group.size > 1, 2 * ag - base, 0.0)  # all_reduce = 2 x (AG - a0) + a0
    a2a = coll.all_to_all(S / group.size, group, hw)
    return np.select([kind == coll.ALL_GATHER, kind == coll.REDUCE_SCATTER,
                      kind == coll.ALL_REDUCE, kind == coll.ALL_TO_ALL], [ag, ag, ar, a2a], 0.0)


def branch_cost(branch: str, ops: list[FusedOp], table: BranchTable, combo: np.ndarray,
                b: Batch, in_width: int) -> BranchCost:
    """Time (s) and resident bytes of one branch for each strategy's choice combination."""
    tp = b.tp
    res = b.residual
    B = tp.shape[0]
    total = np.zeros(B)
    wsum = np.zeros(B)
    kvsum = np.zeros(B)
    out = BranchCost(total, wsum, kvsum)
    experts = branch == "experts"
    tokens = b.expert_tokens if experts else (b.lm_tokens if branch == "lm_head" else b.tokens)
    width = in_width
    coll_codes = table.collectives[combo, res]  # [B, m + 1]
    modes = table.modes[combo, res]  # [B, m]
    hw = b.hw
    for j, fop in enumerate(ops):
        S = tokens * width * b.act_bytes
        c_s = _pick_collective(coll_codes[:, j], S, b.groups["tp"], hw)
        mode = modes[:, j]
        div = np.where(MODE_EXPONENTS[mode] > 0, tp[:, None], 1).astype(np.float64)
        if fop.name == "attn_core":
            oc = attention_cost(fop, div, mode, b, width)
        elif fop.name in EXPERT_OPS:
            oc = expert_cost(fop, div, b)
        else:
            oc = linear_cost(fop, div, tokens, b)
        total += c_s + oc.time_s
        wsum += oc.weight_bytes
        kvsum += oc.kv_bytes
        if b.detail:
            out.ops.append((fop.name, mode, oc, c_s))
            out.collectives.append((fop.name, coll_codes[:, j], "tp", S, c_s))
        width = op_out_width(fop)
    S = tokens * width * b.act_bytes
    c_s = _pick_collective(coll_codes[:, len(ops)], S, b.groups["tp"], hw)
    total += c_s
    if b.detail:
        out.collectives.append(("<end>", coll_codes[:, len(ops)], "tp", S, c_s))
    if experts:  # dispatch + combine all-to-all over ep, per rank: T_local x top_k x hidden
        local = b.tokens / np.where(res == 1, tp, 1)
        S_a2a = local * b.top_k * b.hidden * b.act_bytes
        a2a = coll.all_to_all(S_a2a, b.groups["ep"], hw)
        total += 2 * a2a
        if b.detail:
            code = np.full(B, 4)
            out.collectives.insert(0, ("dispatch", code, "ep", S_a2a, a2a))
            out.collectives.append(("combine", code, "ep", S_a2a, a2a))
    return out


def norms_cost(b: Batch, other_params: int) -> tuple[np.ndarray, np.ndarray]:
    """Norms and residual adds of one layer (4 memory-bound kernels on the residual
    stream: 2 norms read + write, 2 adds read 2 write 1): (seconds, resident weight bytes)."""
    local = b.tokens / np.where(b.residual == 1, b.tp, 1)
    traffic = local * b.hidden * b.act_bytes * 10 + other_params * b.weight_bytes
    t = kernel_time(0.0, memory_time(traffic, b.hw), 4, b.hw)
    return t, np.full(b.tp.shape, float(other_params) * b.weight_bytes)
