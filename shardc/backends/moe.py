"""Sharded MoE block: router, expert-parallel dispatch / combine, tensor-parallel experts.

Replaces the block's forward (same maths as the model's own block: HF Mixtral / Qwen-MoE /
shardc GPT-MoE softmax top-k, DeepSeek-V3 sigmoid group-limited top-k, see :func:`route`;
DeepSeek's shared experts run as a dense gated MLP, ops ``shared_ffn1`` / ``shared_ffn2``,
on the same input and are added to the routed output). The router and the two expert matmuls follow the
strategy's choices on the tp dim through :meth:`ShardingRuntime.redist`, exactly like dense
ops; over the ep dim the stacked expert weights are ``Shard(0)`` and tokens travel with one
``all_to_all`` to the experts' owners (dispatch) and one back (combine).

Dispatch uses a fixed capacity of every local token per expert (a token's row is zero for an
expert that did not select it), so no shape depends on the routing: nothing is dropped, the
result is exact, meta-device models trace, and each MoE layer issues exactly two ep
all-to-alls. A production kernel would send only the routed rows; the collective count and
placements are the same.
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
        gates = route(site, logits)  # [T, E] combine weight of each expert per token
        # dispatch: row t of expert e's slot holds token t if it chose e, else zeros
        send = flat.unsqueeze(0) * (gates.t() > 0).unsqueeze(-1).to(flat.dtype)  # [E, T, h]
        if ep > 1:
            recv = _all_to_all(send, ep_group)  # [ep_src * E_local, T, h]
            e_loc = site.num_experts // ep
            buf = recv.view(ep, e_loc, -1, h).transpose(0, 1).reshape(e_loc, -1, h)
        else:
            buf = send
        out = _experts(rt, site, buf, expert_steps)  # [E_local, N, h]
        if ep > 1:
            e_loc = out.shape[0]
            back = out.view(e_loc, ep, -1, h).transpose(0, 1).reshape(ep * e_loc, -1, h)
            out = _all_to_all(back, ep_group)  # [E, T, h] in expert order
        y = (out * gates.t().unsqueeze(-1).to(out.dtype)).sum(dim=0)
        y = y.to(x.dtype).view(b, s, h)
        if site.shared is not None:
            y = y + site.shared[2](x)
        return y

    site.block.forward = forward


def route(site: MoESite, logits: torch.Tensor) -> torch.Tensor:
    """Dense combine weights [T, E] from router logits [T, E] (zero where not routed), the
    maths of the model's own router: softmax top-k (renormalised unless the router says
    ``norm_topk_prob=False``: Mixtral, Qwen-MoE, GPT-MoE) or DeepSeek-V3's sigmoid scores
    with the score-correction bias, group-limited top-k and the routed scaling factor."""
    r = site.router[0]
    logits = logits.float()
    if hasattr(r, "e_score_correction_bias"):
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
    else:
        probs = F.softmax(logits, dim=-1)
        top_w, top_i = torch.topk(probs, site.top_k, dim=-1)
        if getattr(r, "norm_topk_prob", True):
            top_w = top_w / top_w.sum(dim=-1, keepdim=True)
    return torch.zeros_like(logits).scatter(1, top_i, top_w)


def _experts(rt: ShardingRuntime, site: MoESite, buf: torch.Tensor, steps) -> torch.Tensor:
    """expert_ffn1 -> activation -> expert_ffn2 over an expert buffer [E_local, N, hidden]."""
    (need1, _, after1), (need2, _, after2) = steps
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
    return rt.local(rt.redist(torch.bmm(y, w2), after2, "expert"))
