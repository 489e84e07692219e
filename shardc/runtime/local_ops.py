"""Local-tensor pieces of the fast runtime (torch only): the plan's repairs as explicit
functional collectives, linears on local weight shards, RMSNorm, rotary embeddings and
attention over a :mod:`shardc.runtime.kv_cache` slice.

Placements on one mesh dim (plan.json's vocabulary) of an activation ``[rows, seq, F]``:
``R`` whole, ``S(0)`` this rank's ``rows / n`` rows, ``S(1)`` this rank's slice of every
packed part of the features (``parts``: q|k|v, gate|up; one part when None), ``P`` partial
sums. :func:`repair` is the collective the contract's walk names for a (src, dst) pair
(``torch.distributed._functional_collectives``: no DTensor dispatch); ``R -> S(d)`` is a
local slice.
"""

from __future__ import annotations

import torch
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F

# (src, dst) -> the collective the contract names for it (None: a local slice)
REPAIRS = {("S(0)", "R"): "all_gather", ("S(1)", "R"): "all_gather",
           ("S(0)", "S(1)"): "all_to_all", ("S(1)", "S(0)"): "all_to_all",
           ("P", "R"): "all_reduce", ("P", "S(0)"): "reduce_scatter",
           ("P", "S(1)"): "reduce_scatter", ("R", "S(0)"): None, ("R", "S(1)"): None}


class Group:
    """One mesh dim as the runtime uses it: its process group, size and this rank's index."""

    def __init__(self, mesh=None):
        if mesh is None:
            self.pg, self.size, self.rank = None, 1, 0
        else:
            self.pg, self.size, self.rank = mesh.get_group(), mesh.size(), mesh.get_local_rank()

    def __bool__(self):
        return self.size > 1


def held_rows(n: int, placement: str, tp: Group) -> slice:
    """The rows (of the ``n`` this rank serves) an activation at ``placement`` holds on this
    tp rank: all of them, or its 1/tp share under ``S(0)`` (ValueError when they do not
    split)."""
    if placement != "S(0)" or not tp:
        return slice(0, n)
    if n % tp.size:
        raise ValueError(f"{n} rows do not split over tp = {tp.size}")
    k = n // tp.size
    return slice(tp.rank * k, (tp.rank + 1) * k)


def _widths(total: int, parts) -> list[int]:
    return [total] if not parts else list(parts)


def to_rank_order(x: torch.Tensor, parts, n: int) -> torch.Tensor:
    """Packed features ``[p0 | p1 | ...]`` (full widths ``parts``) -> ``[p0_r0 p1_r0 ...
    p0_r1 ...]``: a contiguous n-way split of the last dim gives each rank its slices."""
    if not parts or len(parts) == 1:
        return x
    pieces = [p.chunk(n, -1) for p in x.split(list(parts), -1)]
    return torch.cat([c[r] for r in range(n) for c in pieces], -1)


def from_rank_order(x: torch.Tensor, parts, n: int) -> torch.Tensor:
    """Inverse of :func:`to_rank_order`."""
    if not parts or len(parts) == 1:
        return x
    local = [w // n for w in parts]
    per_rank = x.chunk(n, -1)
    split = [r.split(local, -1) for r in per_rank]
    return torch.cat([torch.cat([split[r][j] for r in range(n)], -1)
                      for j in range(len(parts))], -1)


def local_features(x: torch.Tensor, parts, g: Group) -> torch.Tensor:
    """This rank's ``S(1)`` slice of whole packed features ``x``."""
    widths = _widths(x.shape[-1], parts)
    return torch.cat([p.chunk(g.size, -1)[g.rank] for p in x.split(widths, -1)], -1)


def repair(x: torch.Tensor, src: str, dst: str, g: Group, parts=None) -> torch.Tensor:
    """``x`` (this rank's tensor at ``src``) -> this rank's tensor at ``dst`` over group
    ``g``, with the collective of :data:`REPAIRS`. ``parts``: full widths of the packed
    features (S(1) cuts each part)."""
    if src == dst or not g:
        return x
    if (src, dst) not in REPAIRS:
        raise ValueError(f"no repair from {src} to {dst}")
    n, pg = g.size, g.pg
    if src == "R":
        return x.chunk(n, 0)[g.rank] if dst == "S(0)" else local_features(x, parts, g)
    if (src, dst) == ("P", "R"):
        return funcol.all_reduce(x, "sum", pg)
    if (src, dst) == ("P", "S(0)"):
        return funcol.reduce_scatter_single(x.contiguous(), "sum", 0, pg)
    if (src, dst) == ("P", "S(1)"):
        x = to_rank_order(x, parts, n).movedim(-1, 0).contiguous()
        return funcol.reduce_scatter_single(x, "sum", 0, pg).movedim(0, -1)
    if (src, dst) == ("S(0)", "R"):
        return funcol.all_gather_single(x.contiguous(), 0, pg)
    if (src, dst) == ("S(1)", "R"):
        y = funcol.all_gather_single(x.movedim(-1, 0).contiguous(), 0, pg).movedim(0, -1)
        return from_rank_order(y, parts, n)
    if (src, dst) == ("S(0)", "S(1)"):  # whole features of my rows -> my features of all rows
        send = to_rank_order(x, parts, n).chunk(n, -1)
        buf = torch.stack(send, 0).contiguous()  # [n, rows/n, ..., F/n]: chunk r to rank r
        got = funcol.all_to_all_single(buf, None, None, pg)
        return got.flatten(0, 1)
    # S(1) -> S(0): my features of all rows -> whole features of my rows
    buf = torch.stack(x.chunk(n, 0), 0).contiguous()  # [n, rows/n, ..., F_local]
    got = funcol.all_to_all_single(buf, None, None, pg)  # [n (src rank), rows/n, ..., F_local]
    return from_rank_order(torch.cat(got.unbind(0), -1), parts, n)


def linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, choice: str,
           g: Group) -> torch.Tensor:
    """``x @ w.T (+ b)`` on local shards: ``col`` / ``rep`` add their (local / whole) bias;
    ``row`` produces partial sums, so tp rank 0 alone adds the whole bias."""
    if b is not None and choice == "row" and g.rank != 0:
        b = None
    return F.linear(x, w, b)


def linear_parts(x: torch.Tensor, ws, bs, choice: str, g: Group) -> torch.Tensor:
    """Packed output ``[x @ w0.T | x @ w1.T | ...]`` of a fused op held as separate weights
    (q / k / v, gate / up): one matmul per part on the module's own shard -- no fused copy
    of the weights -- then the outputs side by side (activation-sized)."""
    return torch.cat([linear(x, w, b, choice, g) for w, b in zip(ws, bs)], -1)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             fp32_weight: bool = False) -> torch.Tensor:
    """RMSNorm as HF's Llama-family modules compute it (fp32 statistics; the weight applied
    after the cast back, or before it with ``fp32_weight``: OLMo-2's)."""
    dtype = x.dtype
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return (weight * x32).to(dtype) if fp32_weight else weight * x32.to(dtype)


# RMSNorms applying their weight in fp32, before the cast back (OLMo-2's, Nemotron-H's), by
# class name
FP32_WEIGHT_RMS_NORMS = ("Olmo2RMSNorm", "NemotronHRMSNorm")


# RMSNorms scaling by ``1 + weight`` in fp32 (Gemma's), by class name
OFFSET_RMS_NORMS = ("GemmaRMSNorm", "Gemma2RMSNorm", "Gemma3RMSNorm")


def norm_of(module, x: torch.Tensor) -> torch.Tensor:
    """``module``'s normalisation of ``x`` (replicated weights) as HF computes it: Llama's
    RMSNorm (``variance_epsilon``), Gemma's ``(1 + weight)`` RMSNorm, ``nn.LayerNorm``."""
    w = local_tensor(module.weight)
    if isinstance(module, torch.nn.LayerNorm):
        return F.layer_norm(x, module.normalized_shape, w, local_tensor(module.bias), module.eps)
    if type(module).__name__ in OFFSET_RMS_NORMS:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + module.eps)
        return (x32 * (1.0 + w.float())).type_as(x)
    return rms_norm(x, w, module.variance_epsilon,
                    type(module).__name__ in FP32_WEIGHT_RMS_NORMS)


def local_tensor(t):
    """A DTensor's local shard (a plain tensor or None as is)."""
    return t.to_local() if hasattr(t, "to_local") else t


def projection_norms(q: torch.Tensor, k: torch.Tensor, q_norm, k_norm, g: Group | None,
                     kv_replicas: int):
    """RMSNorms over the whole q and k projections (OLMoE) of ``q`` / ``k [rows, seq,
    F_local]``. Split by heads over ``g`` (None: whole rows, plain norms), the two ``[rows,
    seq, 1]`` fp32 sums of squares are all-reduced over ``g`` together (one collective of
    both norms' bytes: the row the cost model charges) and each rank scales by its heads'
    slice of the weights. ``kv_replicas``: ranks holding each k head (KV heads replicated
    over ``tp / kv_heads`` ranks count each head, and so the width, that many times)."""
    def eps(m):
        return getattr(m, "variance_epsilon", None) or m.eps

    wq, wk = local_tensor(q_norm.weight), local_tensor(k_norm.weight)
    fp32_weight = type(q_norm).__name__ in FP32_WEIGHT_RMS_NORMS
    if g is None or not g:
        return (rms_norm(q, wq, eps(q_norm), fp32_weight),
                rms_norm(k, wk, eps(k_norm), fp32_weight))
    q32, k32 = q.float(), k.float()
    ss = torch.cat([q32.pow(2).sum(-1, keepdim=True), k32.pow(2).sum(-1, keepdim=True)], -1)
    ss = funcol.all_reduce(ss, "sum", g.pg)
    q32 = q32 * torch.rsqrt(ss[..., :1] / (q.shape[-1] * g.size) + eps(q_norm))
    k32 = k32 * torch.rsqrt(ss[..., 1:] / (k.shape[-1] * g.size) + eps(k_norm))
    n = g.size // kv_replicas
    wq, wk = wq.chunk(g.size)[g.rank], wk.chunk(n)[g.rank // kv_replicas]
    if fp32_weight:
        return (wq * q32).to(q.dtype), (wk * k32).to(k.dtype)
    return wq * q32.to(q.dtype), wk * k32.to(k.dtype)


def repeat_kv_heads(y: torch.Tensor, parts, head_dim: int, copies: int):
    """Whole packed ``q|k|v`` features ``y`` with each k / v head repeated ``copies`` times
    ([h0, h1] -> [h0, h0, h1, h1]: a contiguous tp split then gives each rank the KV head its
    query heads read); returns ``(y, parts)`` with the widened parts."""
    q, k, v = y.split(list(parts), -1)
    k, v = (t.unflatten(-1, (-1, head_dim)).repeat_interleave(copies, -2).flatten(-2)
            for t in (k, v))
    return torch.cat([q, k, v], -1), (parts[0], parts[1] * copies, parts[2] * copies)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    a, b = x.chunk(2, -1)
    return torch.cat((-b, a), -1)


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
         interleaved: bool = False) -> torch.Tensor:
    """Rotary embedding of ``x [rows, heads, seq, d]`` with ``cos`` / ``sin [rows, seq, d]``;
    ``interleaved`` (DeepSeek's ``rope_interleave``): pairs are adjacent in ``x``."""
    if interleaved:
        r, h, s, d = x.shape
        x = x.view(r, h, s, d // 2, 2).transpose(-1, -2).reshape(r, h, s, d)
    cos, sin = cos[:, None], sin[:, None]
    return x * cos + rotate_half(x) * sin


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
           scale: float, softcap: float | None = None, upcast: bool = False,
           sinks: torch.Tensor | None = None) -> torch.Tensor:
    """SDPA of ``q [rows, hq, s, d]`` over ``k`` / ``v [rows, hkv, n, d]`` (grouped heads)
    under boolean ``mask [rows, 1, s, n]``; returns ``[rows, s, hq * dv]``. Grouped heads
    are read in place (``enable_gqa``: no copy of the cache per query head). ``softcap``
    (Gemma-2's logit softcapping, ``cap * tanh(scores / cap)``): SDPA has none, so the
    scores are computed explicitly (fp32 softmax, as HF's eager attention). ``upcast``
    (GPT-2's ``reorder_and_upcast_attn``): the scores computed from fp32 ``q`` and ``k``,
    the fp32 probabilities cast to the values' dtype. ``sinks`` (GPT-OSS's attention sinks,
    ``[hq]``: this rank's heads' learned logits): one more logit per row and head joins the
    softmax and is dropped after it (the probabilities of the keys sum to less than 1),
    computed in the queries' dtype as HF's eager attention does."""
    k, v = k.to(q.dtype), v.to(q.dtype)
    if sinks is not None:
        rep = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
        scores = (q @ k.transpose(-1, -2)) * scale
        scores = scores.masked_fill(~mask, float("-inf"))
        sink = sinks.to(q.dtype).view(1, -1, 1, 1).expand(*scores.shape[:-1], 1)
        logits = torch.cat([scores, sink], -1)
        logits = logits - logits.max(-1, keepdim=True).values
        probs = F.softmax(logits, -1, dtype=logits.dtype)[..., :-1]
        return (probs.to(v.dtype) @ v).transpose(1, 2).flatten(2)
    if softcap or upcast:
        rep = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
        scores = ((q.float() @ k.float().transpose(-1, -2)) if upcast
                  else (q @ k.transpose(-1, -2))) * scale
        if softcap:
            scores = torch.tanh(scores / softcap) * softcap
        probs = scores.masked_fill(~mask, float("-inf")).softmax(-1, dtype=torch.float32)
        o = probs.to(q.dtype) @ v
    else:
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale,
                                           enable_gqa=k.shape[1] != q.shape[1])
    return o.transpose(1, 2).flatten(2)
