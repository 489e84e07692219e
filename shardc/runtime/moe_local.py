"""Sparse MoE blocks on local weights for the fast runtime (torch only): the HF router module
picks the experts (its own maths: softmax top-k, DeepSeek's sigmoid + group-limited top-k),
tokens reach the experts' owners over ``ep`` with explicit functional all-to-alls, the
experts' two matmuls run on this rank's shards (``col`` / ``row`` over tp, or whole), and
the partial sums are repaired as the walk says.

Dispatch over ep: the routed (token, expert) pairs are sorted by expert, the per-expert
counts exchanged (an eager ``all_to_all_single`` of ``E`` int64, read on the host at once:
latency only, not charged by the cost model), the rows sent with one uneven ``all_to_all_single`` (exactly the routed rows:
``T x top_k x hidden``, the charged bytes) and returned with one more. The uneven split
sizes are read on the host, so a decode step with ep > 1 is not captured as a CUDA graph.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F

from shardc.runtime.local_ops import Group, linear, linear_parts, repair


def _local(t):
    return t.to_local() if hasattr(t, "to_local") else t


class ExpertsLocal:
    """One MoE block's routed experts on this rank: ``gate_up [E_local, 2f_local, h]``
    (this rank's gate slice then up slice), ``down [E_local, h, f_local]``."""

    def __init__(self, mlp, walk: dict, tp: Group, ep: Group):
        steps = walk["experts"]["steps"]
        self.choices = tuple(s[1] for s in steps)
        if self.choices not in (("col", "row"), ("rep", "rep")):
            raise NotImplementedError(f"experts {'/'.join(self.choices)} (the fast runtime "
                                      "runs col/row and rep/rep experts)")
        if walk["router"]["steps"][0][1] != "rep":
            raise NotImplementedError("a sharded router (the fast runtime runs rep routers)")
        self.walk, self.tp, self.ep = walk, tp, ep
        self.router = mlp.gate
        experts = mlp.experts
        self.gate_up, self.down = _local(experts.gate_up_proj), _local(experts.down_proj)
        self.act = experts.act_fn
        self.num_experts = int(self.router.weight.shape[0])
        self.local_experts = self.gate_up.shape[0]

    def _run(self, rows: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """Rows grouped by local expert (``counts`` per expert) through their experts."""
        out, i = [], 0
        for e, n in enumerate(counts):
            if n:
                g, u = F.linear(rows[i:i + n], self.gate_up[e]).chunk(2, -1)
                out.append(F.linear(self.act(g) * u, self.down[e]))
            i += n
        return torch.cat(out, 0) if out else rows.new_zeros(0, self.down.shape[1])

    def __call__(self, x: torch.Tensor, residual: str) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        _, weights, idx = self.router(x2)
        t, k = idx.shape
        flat = idx.reshape(-1)
        order = torch.argsort(flat, stable=True)
        tok = order // k
        rows = x2[tok]
        counts = torch.bincount(flat, minlength=self.num_experts)
        n_ep, e_l = self.ep.size, self.local_experts
        if self.ep:
            got_counts = torch.empty_like(counts)  # read on the host next: an eager exchange
            dist.all_to_all_single(got_counts, counts, group=self.ep.pg)
            send = counts.view(n_ep, e_l).sum(1).tolist()
            recv_by_src = got_counts.view(n_ep, e_l)
            recv = recv_by_src.sum(1).tolist()
            got = funcol.all_to_all_single(rows.contiguous(), recv, send, self.ep.pg)
            eid = torch.arange(e_l, device=x.device).repeat(n_ep)
            eid = torch.repeat_interleave(eid, recv_by_src.reshape(-1))
            by_expert = torch.argsort(eid, stable=True)
            y = self._run(got[by_expert], recv_by_src.sum(0).tolist())
            y = torch.empty_like(y).index_copy_(0, by_expert, y)
            back = funcol.all_to_all_single(y.contiguous(), send, recv, self.ep.pg)
        else:
            back = self._run(rows, counts.tolist())
        scaled = back * weights.reshape(-1)[order, None].to(back.dtype)
        out = x2.new_zeros(t, shape[-1]).index_add_(0, tok, scaled.to(x2.dtype))
        produced = self.walk["experts"]["steps"][-1][3]
        return repair(out.view(shape), produced, residual, self.tp)


class DenseMLP:
    """A gated MLP branch (``mlp`` / ``shared_experts``: ffn1 = gate|up, ffn2 = down) on
    local shards, its activation placed as the walk says."""

    def __init__(self, module, walk: dict, tp: Group):
        self.steps, self.end, self.tp = walk["steps"], walk["end"], tp
        self.w1 = [_local(module.gate_proj.weight), _local(module.up_proj.weight)]  # no copy
        self.w2 = _local(module.down_proj.weight)
        self.inter = module.down_proj.in_features if hasattr(module.down_proj, "in_features") \
            else self.w2.shape[1]
        self.act = module.act_fn

    def __call__(self, x: torch.Tensor, residual: str) -> torch.Tensor:
        (_, c1, need1, prod1), (_, c2, need2, prod2) = self.steps
        parts = (self.inter, self.inter)
        y = linear_parts(repair(x, residual, need1, self.tp), self.w1, (None, None), c1,
                         self.tp)
        y = repair(y, prod1, need2, self.tp, parts)
        g, u = y.chunk(2, -1)
        y = linear(self.act(g) * u, self.w2, None, c2, self.tp)
        return repair(y, prod2, self.end, self.tp)
