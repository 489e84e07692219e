"""Routed experts split their own way over the attention ranks (torch only; inlined by
``shardc compile --standalone`` after :mod:`shardc.runtime.moe_local`): the all-gather
dispatch of attention data parallelism (``dp_attn`` = the ep mesh dim) with the experts
split ``moe_tp x moe_ep`` over the tp x ep ranks other than (tp, ep)
(:class:`shardc.ir.strategy.Degrees`; docs/deploy.md, "Attention data parallel").

Every split runs, each rank holding a ``1 / (tp x ep)`` share of every expert layer:

* ``"tp"`` (``moe_tp = tp x ep``): every rank holds all ``E`` experts at ``1 / (tp x ep)``
  of their ffn width (the first matmul's output features, the second's input features, cut
  over ep then tp: placements ``Shard(d)`` on both mesh dims; packed gate|up interleaved per
  rank);
* ``"ep"`` (``moe_ep = tp x ep``): every rank holds ``E / (tp x ep)`` whole experts (the
  expert dim cut over ep then tp);
* an int ``moe_tp`` (both > 1, e.g. DeepSeek-V3's ``tp8`` with expert TP2 x EP4): the tp x ep
  ranks, numbered ep-major, re-factored into an experts mesh ``(moe_ep, moe_tp)`` (the same
  ranks, :meth:`DeviceMesh._unflatten`): rank ``r`` holds expert group ``r // moe_tp`` (``E /
  moe_ep`` whole experts, ``Shard(0)`` over ``moe_ep``) at slice ``r % moe_tp`` of their ffn
  width (``Shard(d)`` over ``moe_tp``; gate|up interleaved per moe_tp rank).

The MoE block (router + experts) then runs as the engines run it and the cost model charges
it (:func:`shardc.cost.moe_dispatch.gather_exchange`): the block's input ``[rows, seq, h]``
(replicated over tp) is all-gathered over ep (``rows x ep`` rows on every rank), the router
picks the experts of every gathered token, this rank's expert slices compute partial sums
(the ``"tp"`` split: a slice of every expert's width; ``"ep"``: the rank's own experts,
the other experts' rows contribute nothing), the block's output is reduce-scattered over ep
(each ep rank gets its ``rows`` back, summed over the ep ranks) and all-reduced over tp.
Three collectives per MoE layer, nothing else: no count exchange, no uneven split sizes.

:class:`GatheredExperts` is the ParallelStyle (``parallelize.py``: DTensor parameters, the
model's own router and experts forward); :class:`GatheredExpertsLocal` the fast runtime's
block on the local shards (:mod:`shardc.runtime.fast`).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import Shard, distribute_tensor
from torch.distributed.tensor.parallel import ParallelStyle

from shardc.runtime.dbrx_local import fused_expert_weights, fused_topk_forward, is_fused_experts
from shardc.runtime.local_ops import Group
from shardc.runtime.styles import interleave

SPLITS = ("tp", "ep")  # or an int moe_tp: both moe_tp and moe_ep > 1
EXPERTS_MESH_DIMS = ("moe_ep", "moe_tp")  # a mixed split's experts mesh (plan.json mesh_dims)


def _groups(device_mesh):
    """(ep group or None, tp group or None, this rank's index among the ep x tp ranks, their
    count) of the experts' mesh (dims among ``ep`` / ``tp``, ep outer)."""
    names = tuple(device_mesh.mesh_dim_names)
    groups = {d: device_mesh.get_group(d) if device_mesh.size(names.index(d)) > 1 else None
              for d in ("ep", "tp") if d in names}
    index, count = 0, 1
    for i, d in enumerate(names):  # row-major over the mesh dims: ep outer, tp inner
        index = index * device_mesh.size(i) + device_mesh.get_local_rank(d)
        count *= device_mesh.size(i)
    return groups.get("ep"), groups.get("tp"), index, count


def split_sizes(split, count: int) -> tuple[int, int]:
    """(moe_tp, moe_ep) of ``split`` (``"tp"``, ``"ep"`` or an int moe_tp) over ``count``
    = tp x ep ranks (ValueError when it does not tile them)."""
    moe_tp = count if split == "tp" else 1 if split == "ep" else split
    if isinstance(moe_tp, bool) or not isinstance(moe_tp, int) or moe_tp < 1 \
            or count % moe_tp:
        raise ValueError(f"split {split!r} is not one of {SPLITS} or an int moe_tp "
                         f"dividing the {count} experts ranks")
    return moe_tp, count // moe_tp


def experts_mesh(device_mesh, moe_tp: int, moe_ep: int):
    """The ep x tp ranks of ``device_mesh`` (ep outer) re-factored as a 2-D mesh
    ``(moe_ep, moe_tp)`` over the same ranks: rank ``ep_rank x tp + tp_rank`` sits at
    ``(r // moe_tp, r % moe_tp)``. Made once per mesh and split (its process groups), kept
    on ``device_mesh`` for the other layers."""
    made = device_mesh.__dict__.setdefault("_shardc_experts_meshes", {})
    if moe_tp not in made:
        from torch.distributed.device_mesh import DeviceMesh
        made[moe_tp] = DeviceMesh(device_mesh.device_type,
                                  device_mesh.mesh.reshape(moe_ep, moe_tp),
                                  mesh_dim_names=EXPERTS_MESH_DIMS, _init_backend=False)
    return made[moe_tp]


class GatheredExperts(ParallelStyle):
    """The all-gather dispatch on an HF sparse-MoE block (its ``forward(hidden [b, s, h])``
    runs the router then ``experts(tokens, top_k_index, top_k_weights)``), applied to the
    block on the ep x tp mesh (module docstring). ``experts``: the experts child's name;
    ``weights``: each stacked weight's name -> (the dim the ``"tp"`` split cuts, the widths
    of the parts it packs along it, or a count); ``split``: ``"tp"``, ``"ep"`` or an int
    moe_tp (module docstring); the expert dim is 0. ``shared``: the block's shared-expert
    children (DeepSeek's ``shared_experts``, Qwen2-MoE's ``shared_expert``), run on this
    rank's own rows beside the gathered routed experts (:meth:`_with_shared`); ``router``:
    the block's router child."""

    def __init__(self, *, experts: str = "experts", weights=None, split="tp",
                 shared=(), router: str = "gate", fused=None):
        super().__init__()
        # experts stored fused (DBRX): (the GLU child holding the weights, f, h): each
        # [E * f, h] weight placed as its [E, f, h] view (tp dim 1: each expert's f rows)
        self.fused = tuple(fused) if fused else None
        self.shared, self.router = tuple(shared), router
        if split not in SPLITS and (isinstance(split, bool) or not isinstance(split, int)
                                    or split < 1):
            raise ValueError(f"split {split!r} is not one of {SPLITS} or an int moe_tp")
        self.experts, self.split = experts, split
        self.weights = dict(weights or {"gate_up_proj": (1, (2,)), "down_proj": (2, ())})

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        experts = module.get_submodule(self.experts)
        ep_group, tp_group, index, count = _groups(device_mesh)
        moe_tp, moe_ep = split_sizes(self.split, count)
        mesh = device_mesh
        if moe_tp > 1 and moe_ep > 1:  # a mesh dim per factor: experts, then their width
            mesh = experts_mesh(device_mesh, moe_tp, moe_ep)
        owner = experts.get_submodule(self.fused[0]) if self.fused else experts
        for name, (dim, parts) in self.weights.items():
            full = getattr(owner, name).detach()
            if self.fused:
                full = full.view(-1, *self.fused[1:])
            if parts and moe_tp > 1:  # each moe_tp rank: [gate_r | up_r]
                full = interleave(full, dim, parts if len(parts) > 1 else parts[0], moe_tp)
            if mesh is device_mesh:  # one split over every mesh dim (ep then tp)
                placements = [Shard(dim if moe_tp > 1 else 0)] * mesh.ndim
            else:
                placements = [Shard(0), Shard(dim)]
            dt = distribute_tensor(full, mesh, placements, src_data_rank=self.src_data_rank)
            owner.register_parameter(name, nn.Parameter(dt, requires_grad=False))
        names = tuple(self.weights)
        forward_local = experts.forward  # the model's own expert maths
        if self.fused:  # its GLU per local expert (rows routed elsewhere add nothing)
            forward_local = fused_topk_forward(owner, names)
        total = int(getattr(owner, names[0]).shape[0])
        local = total // moe_ep
        first = index // moe_tp * local
        if moe_ep > 1 and hasattr(experts, "_is_expert_parallel"):
            # HF's experts kernels (grouped_mm) zero the sentinel rows only when told the
            # experts are split: else those rows stay uninitialised memory (NaN at random)
            experts._is_expert_parallel = True

        def experts_forward(hidden, top_k_index, top_k_weights):
            if moe_ep > 1:  # other ranks' experts -> the sentinel HF skips
                mine = (top_k_index >= first) & (top_k_index < first + local)
                top_k_index = torch.where(mine, top_k_index - first, local)
                top_k_weights = top_k_weights * mine.to(top_k_weights.dtype)
            saved = {n: owner._parameters[n] for n in names}
            num = getattr(experts, "num_experts", None)
            try:
                for n in names:
                    owner._parameters[n] = nn.Parameter(saved[n].to_local(),
                                                        requires_grad=False)
                if num is not None:
                    experts.num_experts = local
                return forward_local(hidden, top_k_index, top_k_weights)
            finally:
                owner._parameters.update(saved)
                if num is not None:
                    experts.num_experts = num

        experts.forward = experts_forward
        block_forward = module.forward

        def forward(hidden_states, *args, **kwargs):
            x = hidden_states
            if ep_group is not None:  # every ep rank's rows (its attention group's tokens)
                n = dist.get_world_size(ep_group)
                gathered = x.new_empty((n * x.shape[0], *x.shape[1:]))
                dist.all_gather_single(gathered, x.contiguous(), group=ep_group)
                x = gathered
            out = block_forward(x, *args, **kwargs)  # partial sums over the ep x tp ranks
            y = out[0] if isinstance(out, tuple) else out
            if ep_group is not None:
                mine = y.new_empty((y.shape[0] // dist.get_world_size(ep_group), *y.shape[1:]))
                dist.reduce_scatter_single(mine, y.contiguous(), group=ep_group)
                y = mine
            if tp_group is not None:
                dist.all_reduce(y, group=tp_group)
            return (y, *out[1:]) if isinstance(out, tuple) else y

        module.forward = forward if not self.shared else self._with_shared(
            module, forward, ep_group)
        return module

    def _with_shared(self, module: nn.Module, routed, ep_group):
        """The block's forward with shared experts beside the re-split ones: the routed pass
        (``routed``: gathered tokens, collectives) runs with the shared children swapped for
        zeros and records the router's outputs; then the model's own block forward runs on
        this rank's rows with the routed experts swapped for zeros and the router for this
        rank's slice of what it picked -- the shared experts (their own tp styles, gates
        such as Qwen2-MoE's sigmoid) on the attention rows, nothing run twice."""
        names, router = tuple(self.shared), self.router
        children = module._modules

        def forward(hidden_states, *args, **kwargs):
            real = {n: children[n] for n in (*names, router, self.experts)}
            picked = []
            try:
                for n in names:
                    children[n] = _Zeros(real[n])
                children[router] = _Recorded(real[router], picked)
                out = routed(hidden_states, *args, **kwargs)
                ways = dist.get_world_size(ep_group) if ep_group is not None else 1
                rank = dist.get_rank(ep_group) if ep_group is not None else 0
                for n in names:
                    children[n] = real[n]
                children[router] = _Replayed(picked[0], rank, hidden_states[..., 0].numel(),
                                             ways)
                children[self.experts] = _Zeros(None)
                shared = module.__class__.forward(module, hidden_states, *args, **kwargs)
            finally:
                children.update(real)
            y = out[0] if isinstance(out, tuple) else out
            s = shared[0] if isinstance(shared, tuple) else shared
            return (y + s, *out[1:]) if isinstance(out, tuple) else y + s

        return forward


class _Zeros(nn.Module):
    """Stands in for a block child whose output must add nothing: zeros shaped like its
    first input, ``out_features`` wide when the child is a linear (a shared expert's gate)."""

    def __init__(self, child):
        super().__init__()
        self.width = getattr(child, "out_features", None)

    def forward(self, x, *args, **kwargs):
        if self.width is None:
            return torch.zeros_like(x)
        return x.new_zeros((*x.shape[:-1], self.width))


class _Recorded(nn.Module):
    """The router as is, its outputs kept (``into``) for :class:`_Replayed`."""

    def __init__(self, router, into: list):
        super().__init__()
        self.router, self.into = router, into

    def forward(self, *args, **kwargs):
        out = self.router(*args, **kwargs)
        self.into.append(out)
        return out


class _Replayed(nn.Module):
    """The router's outputs over the gathered tokens (``ways`` ep ranks' ``tokens`` each,
    ep-rank-major), cut to this rank's (every output whose first dim holds them all)."""

    def __init__(self, outputs, rank: int, tokens: int, ways: int):
        super().__init__()
        self.outputs, self.rank, self.tokens, self.ways = outputs, rank, tokens, ways

    def forward(self, *args, **kwargs):
        def cut(t):
            if not torch.is_tensor(t) or t.dim() == 0 or t.shape[0] != self.tokens * self.ways:
                return t
            return t[self.rank * self.tokens:(self.rank + 1) * self.tokens]
        if isinstance(self.outputs, tuple):
            return tuple(cut(t) for t in self.outputs)
        return cut(self.outputs)


class GatheredExpertsLocal:
    """The fast runtime's MoE block under the all-gather dispatch (module docstring), on the
    local shards :class:`GatheredExperts` placed (``walk["experts"]["gather"]``: its split):
    the HF router module picks the experts of
    the gathered tokens, the experts run as HF gated experts (``gate_up [E_local, 2f_local,
    h]``, this rank's gate slice then up slice; ``down [E_local, h, f_local]``), and the
    collectives are functional (``all_gather`` / ``reduce_scatter`` over ep, ``all_reduce``
    over tp)."""

    def __init__(self, mlp, walk: dict, tp: Group, ep: Group):
        steps = walk["experts"]["steps"]
        if tuple(s[1] for s in steps) != ("col", "row"):
            raise NotImplementedError("the all-gather dispatch runs col/row experts")
        if walk["router"]["steps"][0][1] != "rep":
            raise NotImplementedError("a sharded router (the fast runtime runs rep routers)")
        self.split = walk["experts"]["gather"]
        self.tp, self.ep = tp, ep
        experts = mlp.experts
        self.fused = is_fused_experts(experts)  # DBRX: gate / up apart, its own routing
        if self.fused:
            self.router, self.route = mlp.router.layer, mlp.route_tokens_to_experts
            (self.gate, self.up), self.down, self.act, _ = fused_expert_weights(experts)
            self.gate_up = self.gate
        else:
            self.router = mlp.gate
            self.gate_up = experts.gate_up_proj
            self.down = experts.down_proj
            self.gate_up, self.down = (t.to_local() if hasattr(t, "to_local") else t
                                       for t in (self.gate_up, self.down))
            self.act = experts.act_fn
        self.num_experts = int(self.router.weight.shape[0])
        self.local_experts = int(self.gate_up.shape[0])
        moe_tp, _ = split_sizes(self.split, tp.size * ep.size)
        self.first = (ep.rank * tp.size + tp.rank) // moe_tp * self.local_experts

    def __call__(self, x: torch.Tensor, residual: str) -> torch.Tensor:
        if residual != "R":
            raise NotImplementedError("the all-gather dispatch needs a replicated residual")
        if self.ep:
            x = funcol.all_gather_single(x.contiguous(), 0, self.ep.pg)
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        if self.fused:
            w = self.router.weight
            weights, idx = self.route(F.linear(x2, w.to_local() if hasattr(w, "to_local") else w))
        else:
            _, weights, idx = self.router(x2)
        t, k = idx.shape
        local = idx.reshape(-1) - self.first
        keep = (local >= 0) & (local < self.local_experts)
        pair = torch.nonzero(keep).squeeze(1)
        expert = local[pair]
        order = torch.argsort(expert, stable=True)
        pair = pair[order]
        counts = torch.bincount(expert, minlength=self.local_experts).tolist()
        rows = x2[pair // k]
        out, i = [], 0
        for e, n in enumerate(counts):
            if n:
                if self.fused:
                    g, u = F.linear(rows[i:i + n], self.gate[e]), F.linear(rows[i:i + n], self.up[e])
                else:
                    g, u = F.linear(rows[i:i + n], self.gate_up[e]).chunk(2, -1)
                out.append(F.linear(self.act(g) * u, self.down[e]))
            i += n
        y = torch.cat(out, 0) if out else rows.new_zeros(0, shape[-1])
        scaled = y * weights.reshape(-1)[pair, None].to(y.dtype)
        y = x2.new_zeros(t, shape[-1]).index_add_(0, pair // k, scaled.to(x2.dtype))
        y = y.view(shape)  # partial sums over the ep x tp ranks
        if self.ep:
            y = funcol.reduce_scatter_single(y.contiguous(), "sum", 0, self.ep.pg)
        if self.tp:
            y = funcol.all_reduce(y, "sum", self.tp.pg)
        return y
