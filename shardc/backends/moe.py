"""Sharded MoE block: router, expert-parallel dispatch / combine, tensor-parallel experts.

Replaces the block's forward (same maths as the model's own block: HF Mixtral / Qwen-MoE /
shardc GPT-MoE softmax top-k, DeepSeek-V3 sigmoid group-limited top-k, see :func:`route`;
DeepSeek's shared experts run as a dense gated MLP, ops ``shared_ffn1`` / ``shared_ffn2``,
on the same input and are added to the routed output). The router and the two expert matmuls follow the
strategy's choices on the tp dim through :meth:`ShardingRuntime.redist`, exactly like dense
ops; over the ep dim the stacked expert weights are ``Shard(0)`` and tokens travel with one
``all_to_all`` to the experts' owners (dispatch) and one back (combine).

Dispatch sends only the routed (token, expert) pairs, packed into per-expert slots of a
common capacity ``C``: the send buffer is ``[E, C, hidden]`` and slot ``(e, i)`` holds the
i-th local token that chose expert e (zeros past the expert's count). ``C`` is the largest
per-expert count over the ranks that exchange or share the buffer (one scalar ``all_reduce``
MAX per SPMD mesh dim, latency only, not charged by the cost model), so nothing is dropped and
the result is exact. On the ``meta`` device (full-size models on the fake process group)
routing has no values and ``C = ceil(tokens * top_k / E)``, the balanced load: the buffers
then carry exactly the ``tokens * top_k * hidden`` elements per rank the cost model charges
for each of the two ep all-to-alls. With real routing the bytes are ``E * C * hidden``
(>= the charged volume; the excess is the load imbalance of the batch).
"""

from __future__ import annotations

import torch
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F

from shardc.backends.models import MoESite
from shardc.backends.runtime import ShardingRuntime, deinterleave


def _all_to_all(x: torch.Tensor, group) -> torch.Tensor:
    out = funcol.all_to_all_single(x.contiguous(), None, None, group)
    return funcol.wait_tensor(out) if isinstance(out, funcol.AsyncCollectiveTensor) else out


def shard_moe(rt: ShardingRuntime, site: MoESite, layer: int) -> None:
    """Place the block's parameters and install the sharded forward on ``site.block``."""
    rt.place_param(site.router[0], "weight", f"{site.router[1]}.weight")
    for name in (site.w1, site.w2):
        rt.place_param(site.experts, name, f"{site.prefix}.experts.{name}")
    if site.shared is not None:
        ffn1, ffn2, _ = site.shared
        for mod, pre in ffn1 + [ffn2]:
            rt.place_module_params(mod, pre)
        rt.hook_chain([[m for m, _ in ffn1], [ffn2[0]]], rt.walk("shared_experts", layer),
                      rt.residual)
    router_steps = rt.walk("router", layer)
    expert_steps = rt.walk("experts", layer)
    ep = rt.degrees.ep
    ep_group = rt.mesh.get_group("ep") if ep > 1 else None

    def forward(x: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        flat = x.reshape(b * s, h)  # local tokens [T, hidden]
        need, _, after = router_steps[0]
        logits = F.linear(rt.redist(rt.wrap(flat, rt.residual), need), site.router[0].weight)
        logits = rt.local(rt.redist(logits, after))
        top_w, top_i = route(site, logits)  # [T, top_k] weights and experts per token
        send, slot = _pack(rt, flat, top_i, site.num_experts)  # [E, C, h], [T * top_k]
        if ep > 1:
            recv = _all_to_all(send, ep_group)  # [ep_src * E_local, C, h]
            e_loc = site.num_experts // ep
            buf = recv.view(ep, e_loc, -1, h).transpose(0, 1).reshape(e_loc, -1, h)
        else:
            buf = send
        out, partial = _experts(rt, site, buf, expert_steps)  # [E_local, ep_src * C, h]
        if ep > 1:
            e_loc = out.shape[0]
            back = out.view(e_loc, ep, -1, h).transpose(0, 1).reshape(ep * e_loc, -1, h)
            out = _all_to_all(back, ep_group)  # [E, C, h] in expert order
        pairs = out.reshape(-1, h)[slot].view(b * s, site.top_k, h)
        y = (pairs * top_w.unsqueeze(-1).to(pairs.dtype)).sum(dim=1)
        if partial:  # tp partial sums all-reduced once per token, after the top-k sum
            y = rt.local(rt.redist(rt.wrap(y, "P"), rt.residual))
        y = y.to(x.dtype).view(b, s, h)
        if site.shared is not None:
            y = y + site.shared[2](x)
        return y

    site.block.forward = forward


def _pack(rt: ShardingRuntime, flat: torch.Tensor, top_i: torch.Tensor, num_experts: int
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """Routed rows of ``flat`` [T, h] into a send buffer [E, C, h]; returns it and each
    (token, k) pair's flat slot ``e * C + i`` [T * top_k] (to gather the combined rows)."""
    t, k = top_i.shape
    onehot = F.one_hot(top_i.reshape(-1), num_experts)  # [T * k, E]
    pos = ((onehot.cumsum(dim=0) - 1) * onehot).sum(dim=-1)  # rank of the pair in its expert
    if flat.device.type == "meta":
        cap = max(1, -(-t * k // num_experts))
    else:
        cap = onehot.sum(dim=0).max().reshape(1)
        if rt.mesh is not None:
            for d in rt.dims:  # every rank exchanging or sharing the buffer agrees on C
                torch.distributed.all_reduce(cap, torch.distributed.ReduceOp.MAX,
                                             group=rt.mesh.get_group(d))
        cap = max(1, int(cap.item()))
    slot = top_i.reshape(-1) * cap + pos
    send = flat.new_zeros(num_experts * cap, flat.shape[1])
    send = send.index_copy(0, slot, flat.repeat_interleave(k, dim=0))
    return send.view(num_experts, cap, -1), slot


def route(site: MoESite, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(top-k weights, top-k experts), each [T, top_k], from router logits [T, E]: the
    maths of the model's own router: softmax top-k (renormalised unless the router says
    ``norm_topk_prob=False``: Mixtral, Qwen-MoE, OLMoE, GPT-MoE), DeepSeek-V3's sigmoid
    scores with the score-correction bias, group-limited top-k and the routed scaling
    factor, or DeepSeek-V2's softmax with greedy / group-limited top-k times the routed
    scaling factor, not renormalised (its router has ``topk_method``), or Phi-3.5-MoE's
    :func:`sparsemixer` (``site.routing``, :func:`shardc.backends.models.routing_kind`).
    Other routers are
    refused before sharding (:func:`shardc.backends.support.backend_problem`)."""
    r = site.router[0]
    logits = logits.float()
    if site.routing == "sparsemixer":
        return sparsemixer(logits, float(r.router_jitter_noise))
    if site.routing == "sigmoid_group":
        scores = logits.sigmoid()
        choice = scores + r.e_score_correction_bias.float()
        t, e, ng = choice.shape[0], choice.shape[1], int(r.num_group)
        group_scores = choice.view(t, ng, e // ng).topk(2, dim=-1)[0].sum(dim=-1)
        group_idx = torch.topk(group_scores, k=int(r.topk_group), dim=-1)[1]
        group_mask = torch.zeros_like(group_scores).scatter(1, group_idx, 1.0)
        keep = group_mask.unsqueeze(-1).expand(t, ng, e // ng).reshape(t, e).bool()
        top_i = torch.topk(choice.masked_fill(~keep, float("-inf")), site.top_k, dim=-1)[1]
        top_w = scores.gather(1, top_i)
        if r.norm_topk_prob:
            top_w = top_w / (top_w.sum(dim=-1, keepdim=True) + 1e-20)
        top_w = top_w * r.routed_scaling_factor
    elif site.routing == "softmax_greedy":  # DeepSeek-V2: softmax, (group-limited) greedy top-k
        scores = F.softmax(logits, dim=-1)
        if r.topk_method == "group_limited_greedy":
            t, e, ng = scores.shape[0], scores.shape[1], int(r.num_group)
            group_idx = torch.topk(scores.view(t, ng, e // ng).max(dim=-1).values,
                                   k=int(r.topk_group), dim=-1)[1]
            keep = torch.zeros(t, ng, dtype=torch.bool).scatter(1, group_idx, True)
            scores = scores.masked_fill(~keep.unsqueeze(-1).expand(t, ng, e // ng).reshape(t, e),
                                        0.0)
        top_w, top_i = torch.topk(scores, site.top_k, dim=-1)
        top_w = top_w * r.routed_scaling_factor  # not renormalised
    else:
        probs = F.softmax(logits, dim=-1)
        top_w, top_i = torch.topk(probs, site.top_k, dim=-1)
        if site.routing != "softmax_topk_plain" and getattr(r, "norm_topk_prob", True):
            top_w = top_w / top_w.sum(dim=-1, keepdim=True)
    return top_w, top_i


def sparsemixer(scores: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Phi-3.5-MoE's top-2 routing at inference (transformers' ``sparsemixer``, eval mode):
    pick the best expert, weight it by a softmax over the scores within ``2 * eps``
    (relative) of it; then the same over the scores with the first expert masked out.
    Returns weights and experts, each [T, 2]; the weights are not renormalised."""
    def pick(candidates):
        best, idx = candidates.max(dim=-1, keepdim=True)
        factor = scores.abs().clamp(min=best)
        far = ((best - scores) / factor) > (2 * eps)
        gates = F.softmax(candidates.masked_fill(far, float("-inf")), dim=-1)
        return gates.gather(-1, idx), idx

    w1, i1 = pick(scores)
    w2, i2 = pick(scores.scatter(-1, i1, float("-inf")))
    return torch.cat((w1, w2), dim=-1), torch.cat((i1, i2), dim=-1)


def _experts(rt: ShardingRuntime, site: MoESite, buf: torch.Tensor, steps
             ) -> tuple[torch.Tensor, bool]:
    """expert_ffn1 -> activation -> expert_ffn2 over an expert buffer [E_local, N, hidden];
    returns it and whether it holds tp partial sums still to be all-reduced (a row-parallel
    expert_ffn2 under a replicated residual: reduced after the weighted top-k sum, on T
    rows instead of T x top_k)."""
    (need1, _, after1), (need2, produced2, after2) = steps
    w1 = getattr(site.experts, site.w1)
    w2 = getattr(site.experts, site.w2)
    if site.transposed:
        w1, w2 = w1.transpose(1, 2), w2.transpose(1, 2)
    x = rt.redist(rt.wrap(buf, rt.residual, "expert"), need1, "expert")
    hid = rt.local(rt.redist(torch.bmm(x, w1), after1, "expert"))
    if site.gated:
        if rt.tp > 1 and after1 != "S(1)":
            hid = deinterleave(hid, 2, rt.tp)
        gate, up = hid.chunk(2, dim=-1)
        hid = site.act(gate) * up
    else:
        hid = site.act(hid)
    y = rt.redist(rt.wrap(hid, after1, "expert"), need2, "expert")
    if rt.tp > 1 and produced2 == "P" and after2 == "R":
        return rt.local(torch.bmm(y, w2)), True
    return rt.local(rt.redist(torch.bmm(y, w2), after2, "expert")), False
