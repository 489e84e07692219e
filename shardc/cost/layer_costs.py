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
from shardc.cost import silicon
from shardc.cost.branch_tables import BranchTable
from shardc.cost.imbalance import batch_split_imbalance
from shardc.cost.moe_dispatch import experts_exchange, gather_exchange
from shardc.cost.quantisation import quant_time
from shardc.cost.roofline import compute_time, gemm_flop_efficiency, kernel_time, memory_time
from shardc.cost.topology import CommGroup
from shardc.ir.contract import (
    MODE_EXPONENTS,
    SHARD_BOTH,
    SHARD_IN,
    SHARD_OUT,
    TOKEN_SPLIT,
    repeated_kv_growth,
)
from shardc.ir.contract import REPLICATED as REPLICATED_MODE
from shardc.ir.graph import FusedOp
from shardc.ir.recurrent import is_recurrent, state_bytes_per_sequence
from shardc.ir.windows import attended_positions, causal_pairs, op_window

EXPERT_OPS = ("expert_ffn1", "expert_ffn2")
QK_NORMS = "attn_core q/k norms"  # detail: the whole-projection q/k norms' all-reduce
INNER_REDUCE = "attn_core x_proj"  # detail: a Mamba core's x_proj all-reduce under a heads split


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
    ssm_bytes: float  # a recurrent core's SSM state, per element (ir.recurrent.ssm_state_bytes)
    gemm_peak: float
    detail: bool = False
    expert_imbalance: np.ndarray | float = 1.0  # busiest ep rank's routed rows / mean
    fp8_dispatch: bool = False  # MoE dispatch in FP8 (combine stays at act_bytes)
    moe_layouts: str = "backend"  # moe_dispatch.LAYOUT_RULES
    kernels: object = None  # silicon.SiliconKernels (measured kernel times) or None: roofline
    fallbacks: list = field(default_factory=list)  # detail: ops the tables did not price
    # decode only: prompt tokens of a chunked prefill riding on the step (aggregated serving;
    # included in ``tokens``), which attend on average to half the prompt
    chunk_tokens: np.ndarray | float = 0.0
    redundant_experts: int = 0  # EPLB's extra expert slots per EP group (ep > 1)
    fp8_scaling: str = "per-tensor"  # FP8 linears' activation scaling (cost.quantisation)
    # experts re-split (moe_tp x moe_ep != tp x ep): the attention side of the all-gather
    # dispatch (moe_dispatch.GatherView); None: the all-to-all dispatch over ep
    gather: object = None


@dataclass
class OpCost:
    """Cost of one fused op (arrays [B]): seconds, and bytes resident per GPU."""

    compute_s: np.ndarray
    memory_s: np.ndarray
    time_s: np.ndarray
    weight_bytes: np.ndarray
    kv_bytes: np.ndarray
    source: str = "roofline"  # detail: what priced time_s (silicon.STATUS_TEXT)
    quant_s: np.ndarray | float = 0.0  # FP8: the activation quantisation's part of time_s


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
        return OpCost(comp, mem, kernel_time(comp, mem, 1, b.hw), wbytes, np.zeros_like(wbytes))
    flops = tokens * _flops_per_token(fop) * (sh / d_flop + (1.0 - sh) / d_tok)
    eff = gemm_flop_efficiency(tokens / d_tok, fop.in_features * fop.out_features * w_frac, b.hw)
    comp = compute_time(flops, eff, b.gemm_peak)
    k = fop.in_features / d_in
    quant = 0.0
    if b.gemm_peak > b.hw.peak_flops(False):  # FP8: quantise the input, GEMM on FP8 operands
        act = act - tokens * k * (b.act_bytes - 1.0)
        quant = quant_time(tokens / d_tok, k, b.fp8_scaling, b.act_bytes, b.hw)
    mem = memory_time(wbytes + act, b.hw)
    oc = OpCost(comp, mem, kernel_time(comp, mem, 1, b.hw) + quant, wbytes, np.zeros_like(wbytes),
                quant_s=quant)
    if b.kernels is not None:
        oc = silicon.price_linear(oc, fop.name, tokens / d_tok, wbytes / b.weight_bytes / k, k,
                                  flops, wbytes + act, b)
    return oc


def expert_cost(fop: FusedOp, div: np.ndarray, b: Batch, branch_ops=()) -> OpCost:
    """Grouped expert GEMM on one ep rank: its num_experts/ep experts, tokens T_e
    (``branch_ops``: the experts branch's ops, for the measured MoE kernel's split)."""
    d_tok, d_flop, d_w, d_in, d_out = (div[:, i] for i in range(5))
    E = max(int(fop.attrs.get("num_experts", b.num_experts) or 1), 1)
    k = max(int(fop.attrs.get("top_k", b.top_k) or 1), 1)
    local = E / b.ep
    te = b.expert_tokens
    # expected fraction of experts hit by >= 1 of the micro-batch's routed tokens
    total = b.tokens * b.ep
    active = 1.0 - np.power(1.0 - min(k / E, 1.0), total)
    # EPLB: each ep rank also holds its share of the redundant slots (a multiple of ep)
    slots = 1.0 + np.where(b.ep > 1, (b.redundant_experts // b.ep) * b.ep, 0) / E
    w_res = fop.params / b.ep * slots * b.weight_bytes / d_w
    w_read = w_res * active
    flops = te * _flops_per_token(fop) / k / d_flop
    per_expert_m = te / d_tok / np.maximum(local * active, 1e-9)
    eff = gemm_flop_efficiency(per_expert_m, fop.in_features * fop.out_features / d_w, b.hw)
    comp = compute_time(flops, eff, b.gemm_peak)
    act = te * (fop.in_features / d_in + fop.out_features / d_out) * b.act_bytes
    mem = memory_time(w_read + act, b.hw)
    oc = OpCost(comp, mem, kernel_time(comp, mem, 1, b.hw), w_res, np.zeros_like(w_res))
    ffn2 = [o for o in branch_ops if o.name == "expert_ffn2"]
    if b.kernels is not None and ffn2:
        share = _flops_per_token(fop) / sum(_flops_per_token(o) for o in branch_ops)
        oc = silicon.price_expert(oc, fop.name, share, te / k * b.ep / d_tok, b.hidden,
                                  ffn2[0].in_features, k, E, d_w, flops, w_read + act, b)
    return oc


def attention_cost(fop: FusedOp, div: np.ndarray, mode: np.ndarray, b: Batch,
                   in_width: int) -> OpCost:
    """Attention core: decode reads the KV cache at ``decode_flops_per_token_per_context``
    FLOPs per cached position (absorbed MLA for DeepSeek); prefill is causal flash attention
    at ``flops_per_token_per_context`` (the traced, non-absorbed form). A sliding-window
    core (``attrs["window"]``, :mod:`shardc.ir.windows`) reads and holds ``min(context,
    window)`` positions per sequence and its prefill is banded causal attention. Split by
    batch, the busiest rank's uneven sequences set the time (:mod:`shardc.cost.imbalance`)."""
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
    window = op_window(a)
    chunk_flops = chunk_traffic = None  # aggregated serving: the step's prefill chunk
    if b.phase == "decode":
        read = attended_positions(b.context, window)
        flops = b.seqs * read * decode_per_ctx / d_flop
        traffic = b.seqs * read * kv_elems * b.kv_bytes * kv_frac + act
        length, banded = read, 1.0
        if np.any(b.chunk_tokens):  # chunk: context attention over its prompt prefix
            chunk_flops = b.chunk_tokens * (b.prompt + 1) / 2 * per_ctx / d_flop
            prompts = np.maximum(b.chunk_tokens / b.prompt, np.minimum(b.chunk_tokens, 1.0))
            chunk_traffic = (b.chunk_tokens + prompts * b.prompt / 2) * kv_elems \
                * b.kv_bytes * kv_frac
    else:
        pairs = causal_pairs(b.prompt, window)
        flops = b.seqs * pairs * per_ctx / d_flop
        traffic = b.tokens * kv_elems * b.kv_bytes * kv_frac + act
        # a measured causal kernel over the prompt, scaled to the band's query-key pairs
        length, banded = b.prompt, pairs / causal_pairs(b.prompt, None)
    comp = compute_time(flops, b.hw.attention_eff, b.hw.peak_flops(False))
    mem = memory_time(traffic, b.hw)
    held = attended_positions(b.kv_context, window)
    kv_res = b.seqs_resident * held * kv_elems * b.kv_bytes * kv_frac
    zero = np.zeros_like(kv_res)
    oc = OpCost(comp, mem, kernel_time(comp, mem, 2, b.hw), zero, kv_res)
    if b.kernels is not None:
        by_heads = mode == SHARD_BOTH
        oc = silicon.price_attention(
            oc, fop.name, b.seqs / np.where(mode == TOKEN_SPLIT, b.tp, 1.0), length,
            np.where(by_heads, heads / b.tp, heads),
            np.where(by_heads, kv_heads / np.minimum(b.tp, kv_heads), kv_heads), hd,
            not split_heads or hd != vhd, flops, traffic, b,
            mla_v3=not split_heads and kv_elems == 576, scale=banded)
    if chunk_flops is not None:  # its own context-attention kernel, priced by the roofline
        c_comp = compute_time(chunk_flops, b.hw.attention_eff, b.hw.peak_flops(False))
        c_mem = memory_time(chunk_traffic, b.hw)
        oc = OpCost(oc.compute_s + c_comp, oc.memory_s + c_mem,
                    oc.time_s + np.where(np.asarray(b.chunk_tokens) > 0,
                                         kernel_time(c_comp, c_mem, 1, b.hw), 0.0),
                    oc.weight_bytes, oc.kv_bytes)
    if (mode == TOKEN_SPLIT).any():  # whole sequences per rank: the longest ones set the pace
        imb = np.where(mode == TOKEN_SPLIT, batch_split_imbalance(b.tp, b.seqs / b.tp), 1.0)
        oc = OpCost(oc.compute_s * imb, oc.memory_s * imb, oc.time_s * imb, oc.weight_bytes,
                    oc.kv_bytes)
    return oc


def recurrent_cost(fop: FusedOp, div: np.ndarray, mode: np.ndarray, b: Batch,
                   in_width: int) -> OpCost:
    """A linear-attention / Mamba core (:mod:`shardc.ir.recurrent`): no KV cache, a constant
    state per sequence (the conv state at the activation dtype, the recurrent state at
    ``b.ssm_bytes``: :func:`shardc.ir.recurrent.state_bytes_per_sequence`).
    Decode: ``decode_flops_per_token`` per sequence, and the state read and written once
    per step. Prefill: ``flops_per_token`` (the chunked form) per prompt token; the state is
    written once per sequence and, for a chunked scan (``scan_chunk`` C), materialised once
    per chunk (``tokens / C`` states). Aggregated serving's prompt chunk in a decode step
    runs the prefill form. Weights (conv, ``x_proj`` / ``dt_proj``, ``A``, ``D``) and the
    state split with the heads (mode ``shard_both``) or whole per rank (batch split:
    1/tp of the sequences). Roofline only: the kernel tables have no such kernels."""
    d_tok, d_flop, d_w, d_in, d_out = (div[:, i] for i in range(5))
    a = fop.attrs
    state = state_bytes_per_sequence(a, b.act_bytes, b.ssm_bytes)
    frac = np.where(mode == REPLICATED_MODE, 1.0, 1.0 / b.tp)  # heads or sequences split
    act = b.tokens * (in_width / d_in + op_out_width(fop) / d_out) * b.act_bytes
    wbytes = fop.params * b.weight_bytes / d_w
    prefill_flops = float(fop.flops_per_token)
    if b.phase == "decode":
        flops = b.seqs * float(a.get("decode_flops_per_token", prefill_flops)) / d_flop
        traffic = 2.0 * b.seqs * state * frac + act + wbytes
        if np.any(b.chunk_tokens):
            flops = flops + b.chunk_tokens * prefill_flops / d_flop
    else:
        chunk = float(a.get("scan_chunk", 0) or 0)
        states = b.seqs + (b.tokens / chunk if chunk else 0.0)
        flops = b.tokens * prefill_flops / d_flop
        traffic = states * state * frac + act + wbytes
    comp = compute_time(flops, b.hw.attention_eff, b.hw.peak_flops(False))
    mem = memory_time(traffic, b.hw)
    held = b.seqs_resident * state * frac
    oc = OpCost(comp, mem, kernel_time(comp, mem, int(a.get("kernels", 2) or 2), b.hw),
                np.asarray(wbytes, dtype=float) * np.ones_like(held), held)
    if (mode == TOKEN_SPLIT).any():  # whole sequences per rank: the busiest rank sets the pace
        imb = np.where(mode == TOKEN_SPLIT, batch_split_imbalance(b.tp, b.seqs / b.tp), 1.0)
        oc = OpCost(oc.compute_s * imb, oc.memory_s * imb, oc.time_s * imb, oc.weight_bytes,
                    oc.kv_bytes)
    return oc


def inner_all_reduce(fop: FusedOp, mode: np.ndarray, b: Batch) -> tuple[np.ndarray, np.ndarray]:
    """(bytes, seconds) of the all-reduce inside a Mamba core under a heads split: its
    ``x_proj`` reads the channel-split activations, so its ``T x inner_all_reduce_features``
    partial sums are all-reduced over tp (as vLLM's row-parallel ``x_proj``); 0 otherwise."""
    width = int(fop.attrs.get("inner_all_reduce_features", 0) or 0)
    S = b.tokens * width * b.act_bytes
    codes = np.full(b.tp.shape, coll.ALL_REDUCE)
    t = _pick_collective(codes, S, b.groups["tp"], b.hw, b, INNER_REDUCE)
    return S, np.where((mode == SHARD_BOTH) & (width > 0), t, 0.0)


def replicated_kv_divisor(ops: list[FusedOp], modes: np.ndarray, tp: np.ndarray
                          ) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
    """GQA with tp > kv_heads (:func:`shardc.ir.contract.kv_head_replicas`): under a heads
    split each rank holds its 1/tp of the query heads and one whole KV head (each KV head
    repeated tp / kv_heads times before the split, as vLLM places it), so the attention
    core's input per rank is qkv's output grown by ``grow = 1 + kv_share x (replicas - 1)``
    (``kv_share`` = the K/V fraction of qkv's output features) over tp. Fed by a
    column-split qkv, qkv's own weights, FLOPs and output divide by ``tp / grow`` too; fed by
    a row-split one, its partial sums are repeated before the reduce-scatter into the heads
    split, so that collective moves ``grow`` x qkv's output. Returns ([B] the divisor of a
    column qkv: ``tp / grow`` on its rows, ``tp`` elsewhere; [B] the core input's divisor
    under either; [B] the repair's growth, 1 elsewhere), or None when no strategy of the
    batch replicates KV heads. ``modes`` [B, m]: the attention branch's."""
    names = [o.name for o in ops]
    if "qkv" not in names or "attn_core" not in names:
        return None
    qkv, core = ops[names.index("qkv")], ops[names.index("attn_core")]
    grow = repeated_kv_growth(core.attrs, qkv.out_features, tp)
    split = (grow > 1) & (modes[:, names.index("attn_core")] == SHARD_BOTH)
    col = split & (modes[:, names.index("qkv")] == SHARD_OUT)
    row = split & (modes[:, names.index("qkv")] == SHARD_IN)
    if not (col | row).any():
        return None
    return (np.where(col, tp / grow, tp), np.where(col | row, tp / grow, tp),
            np.where(row, grow, 1.0))


QK_NORM_SUM_BYTES = 4.0  # a norm's sum of squares is all-reduced in fp32 (FullWidthNormParallel)


def qk_norm_all_reduce(fop: FusedOp, mode: np.ndarray, b: Batch) -> tuple[np.ndarray, np.ndarray]:
    """(bytes, seconds) of all the all-reduces of whole-projection q/k norms (OLMoE,
    ``attrs["whole_projection_norms"]`` = n) before the attention core: under a heads split
    each rank holds a tp slice of the normalised features, so each norm all-reduces its
    ``T x 1`` fp32 sum of squares over tp (n all-reduces of ``T * 4`` bytes; the bytes
    returned are their sum); other modes normalise whole rows locally."""
    norms = int(fop.attrs.get("whole_projection_norms", 0) or 0)
    S = b.tokens * QK_NORM_SUM_BYTES
    codes = np.full(b.tp.shape, coll.ALL_REDUCE)
    t = _pick_collective(codes, S, b.groups["tp"], b.hw, b, QK_NORMS)
    return norms * S, np.where(mode == SHARD_BOTH, norms * t, 0.0)


def _pick_collective(kind: np.ndarray, S, group: CommGroup, hw, b: Batch | None = None,
                     before: str = "") -> np.ndarray:
    """Seconds of the collective code ``kind`` (per strategy) on ``S`` full-tensor bytes
    (measured where ``b.kernels`` covers it)."""
    ag = coll.all_gather(S, group, hw)
    base = hw.collective_base_us * 1e-6
    ar = np.where(group.size > 1, 2 * ag - base, 0.0)  # all_reduce = 2 x (AG - a0) + a0
    a2a = coll.all_to_all(S / group.size, group, hw)
    t = np.select([kind == coll.ALL_GATHER, kind == coll.REDUCE_SCATTER,
                   kind == coll.ALL_REDUCE, kind == coll.ALL_TO_ALL], [ag, ag, ar, a2a], 0.0)
    if b is not None and b.kernels is not None:
        msg = np.where(kind == coll.ALL_TO_ALL, S / group.size, S)
        t = silicon.price_collective(t, np.where(group.size > 1, kind, 0), msg, group, b, before)
    return t


def _tp_repairs(codes: np.ndarray, tokens, widths, b: Batch, start: int,
                end: bool) -> np.ndarray:
    """[B, m + 1] seconds of the tp collectives ``codes`` [B, m + 1] before each op (column
    j: on ``tokens x widths[j]`` activations; ``widths`` [m + 1] or per strategy [B, m + 1])
    and at the end, columns ``start`` .. m - 1 (and m where ``end``) priced by
    :func:`_pick_collective` in one call, 0 elsewhere."""
    B, n = codes.shape
    cols = np.arange(start, n if end else n - 1)
    out = np.zeros((B, n))
    if not len(cols) or not B:
        return out
    S = np.asarray(tokens, dtype=np.float64)[:, None] * np.broadcast_to(
        np.asarray(widths, dtype=np.float64), (B, n))[:, cols] * b.act_bytes
    g = b.groups["tp"]
    rep = CommGroup(*(np.repeat(np.broadcast_to(x, (B,)), len(cols))
                      for x in (g.size, g.per_node, g.nodes)))
    t = _pick_collective(codes[:, cols].reshape(-1), S.reshape(-1), rep, b.hw, b)
    out[:, cols] = t.reshape(B, len(cols))
    return out


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
    kv_rep = replicated_kv_divisor(ops, modes, tp) if branch == "attention" else None
    hw = b.hw
    compute = np.zeros(B)  # the ops' own time, for the overlap with the collectives
    widths = [in_width] + [op_out_width(f) for f in ops]  # the activation before op j
    if kv_rep is not None:  # a row qkv's partial sums, KV heads repeated, reduce-scattered
        widths = np.tile(np.asarray(widths, dtype=np.float64), (B, 1))
        core = [f.name for f in ops].index("attn_core")
        widths[:, core] *= kv_rep[2]
    # the tp repairs before each op (and at the end), priced in one pass (detail: one by one)
    repairs = None if b.detail else _tp_repairs(coll_codes, tokens, widths, b,
                                                 1 if experts else 0, not experts)
    for j, fop in enumerate(ops):
        S = tokens * (widths[:, j] if kv_rep is not None else width) * b.act_bytes
        # the experts' first repair is priced with the dispatch (moe_dispatch)
        c_s = (np.zeros(B) if experts and j == 0 else repairs[:, j] if repairs is not None
               else _pick_collective(coll_codes[:, j], S, b.groups["tp"], hw, b, fop.name))
        mode = modes[:, j]
        div = np.where(MODE_EXPONENTS[mode] > 0, tp[:, None], 1).astype(np.float64)
        if kv_rep is not None and fop.name in ("qkv", "attn_core"):  # replicated KV heads
            kv_div = kv_rep[0] if fop.name == "qkv" else kv_rep[1]
            for c in ([1, 2, 4] if fop.name == "qkv" else [3]):  # flops, weight, out / input
                div[:, c] = np.where(div[:, c] > 1, kv_div, div[:, c])
        if fop.name == "attn_core" and is_recurrent(fop.attrs):
            oc = recurrent_cost(fop, div, mode, b, width)
            if fop.attrs.get("inner_all_reduce_features"):
                inner_S, inner_s = inner_all_reduce(fop, mode, b)
                total += inner_s
                if b.detail:
                    out.collectives.append((INNER_REDUCE, np.where(inner_s > 0, coll.ALL_REDUCE,
                                                                   0), "tp", inner_S, inner_s))
        elif fop.name == "attn_core":
            oc = attention_cost(fop, div, mode, b, width)
            if fop.attrs.get("whole_projection_norms"):
                norm_S, norm_s = qk_norm_all_reduce(fop, mode, b)
                total += norm_s
                if b.detail:
                    out.collectives.append((QK_NORMS, np.where(norm_s > 0, coll.ALL_REDUCE, 0),
                                            "tp", norm_S, norm_s))
        elif fop.name in EXPERT_OPS:
            oc = expert_cost(fop, div, b, ops)
        else:
            oc = linear_cost(fop, div, tokens, b)
        total += c_s + oc.time_s
        compute += oc.time_s
        wsum += oc.weight_bytes
        kvsum += oc.kv_bytes
        if b.detail:
            out.ops.append((fop.name, mode, oc, c_s))
            if not (experts and j == 0):
                out.collectives.append((fop.name, coll_codes[:, j], "tp", S, c_s))
        width = op_out_width(fop)
    if experts:  # dispatch + combine over ep and the tp repairs around them (moe_dispatch)
        t_x, rows = (experts_exchange(table.ops, combo, b, b.detail) if b.gather is None
                     else gather_exchange(table.ops, b, b.detail))
        tp_comm = total - compute
        total += t_x
        if getattr(hw, "tp_comm_overlap", 0.0) or getattr(hw, "ep_comm_overlap", 0.0):
            total[:] = overlapped(compute, tp_comm, t_x, hw)
        if b.detail:
            first = next(i for i, r in enumerate(rows) if r[0] == ops[0].name)
            out.ops[0] = out.ops[0][:3] + (rows[first][4],)
            out.collectives[:0] = rows[:first + 1]
            out.collectives += rows[first + 1:]
        return out
    S = tokens * width * b.act_bytes
    c_s = (repairs[:, len(ops)] if repairs is not None else
           _pick_collective(coll_codes[:, len(ops)], S, b.groups["tp"], hw, b, f"end of {branch}"))
    total += c_s
    if b.detail:
        out.collectives.append(("<end>", coll_codes[:, len(ops)], "tp", S, c_s))
    if getattr(hw, "tp_comm_overlap", 0.0) or getattr(hw, "ep_comm_overlap", 0.0):
        total[:] = overlapped(compute, total - compute, 0.0, hw)
    return out


def overlapped(compute, tp_comm, ep_comm, hw) -> np.ndarray:
    """A branch's time (s) when the preset's ``tp_comm_overlap`` / ``ep_comm_overlap``
    fractions of its tp collectives / ep all-to-alls run under its compute:
    ``compute + (1 - o_tp) tp_comm + (1 - o_ep) ep_comm``, never below
    ``max(compute, tp_comm + ep_comm)`` (what is hidden is at most the compute it hides
    behind). Per branch, from that branch's own terms: the step stays a sum of branch terms,
    so the decomposed exact search stays exact."""
    o_tp = float(getattr(hw, "tp_comm_overlap", 0.0))
    o_ep = float(getattr(hw, "ep_comm_overlap", 0.0))
    return compute + tp_comm + ep_comm - np.minimum(o_tp * tp_comm + o_ep * ep_comm, compute)


def norms_cost(b: Batch, other_params: int) -> tuple[np.ndarray, np.ndarray]:
    """Norms and residual adds of one layer (4 memory-bound kernels on the residual
    stream: 2 norms read + write, 2 adds read 2 write 1): (seconds, resident weight bytes)."""
    local = b.tokens / np.where(b.residual == 1, b.tp, 1)
    traffic = local * b.hidden * b.act_bytes * 10 + other_params * b.weight_bytes
    t = kernel_time(0.0, memory_time(traffic, b.hw), 4, b.hw)
    return t, np.full(b.tp.shape, float(other_params) * b.weight_bytes)
