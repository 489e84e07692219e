"""Expert parallelism for stacked MoE experts (torch only; inlined by ``shardc compile
--standalone`` after :mod:`shardc.runtime.styles`): :class:`ExpertParallel`.

Tokens reach the experts' owners over ``ep`` after the per-expert counts are exchanged, with
one uneven ``all_to_all_single`` carrying exactly the routed rows (no capacity padding) and
one more back. Over ``tp`` the experts are column then row parallel (the module's own
forward on the local shards, the partial sums all-reduced once per token after the
weighted top-k sum), replicated, or -- HF gated experts
-- any other pair of choices, the activation moved between the two matmuls as the
contract's walk says (:func:`_chain`).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import (
    DTensor,
    Partial,
    Replicate,
    Shard,
    distribute_module,
    distribute_tensor,
)
from torch.distributed.tensor.parallel import ParallelStyle

from shardc.runtime.styles import interleave

# name -> (the dim tp cuts, or None: replicated; the parts it packs along it, or a count)
HF_EXPERTS = {"gate_up_proj": (1, (2,)), "down_proj": (2, ())}


class ExpertParallel(ParallelStyle):
    """Stacked experts (HF's ``gate_up_proj [E, 2f, h]`` / ``down_proj [E, h, f]``, or any
    ``[E, ...]`` weights) on a mesh of dims ``ep`` and/or ``tp``; the module's forward is
    ``experts(tokens [T, h], top_k_index [T, k], top_k_weights [T, k]) -> [T, h]``.

    Over ``ep`` the expert dim 0 is ``Shard(0)``. ``weights`` maps each weight's name to
    (its tp dim, the widths of the parts it packs along it, or a count); with ``tp_split``
    the experts are column then row parallel (the first weight's output features -- parts
    interleaved per rank -- and the second's input features cut over tp), else they stay
    replicated over tp (GPT-OSS: its biases are weights too, ``[E, 2f]`` cut with the first
    weight's output features, ``[E, h]`` named in ``partial`` under a split: held by tp rank
    0, zeros elsewhere, so the partial sums add it once). Dispatch: the routed (token,
    expert) pairs are sorted by expert, the per-expert counts exchanged (``all_to_all_single`` of ``E`` integers), the rows go to
    their experts' owners with one uneven ``all_to_all_single``, run through the module's
    own forward on the local weights (its activation, gating and layout), and come back with
    one more. The tp partial sums travel back as they are and are all-reduced over tp after
    the weighted top-k sum, on ``T`` rows rather than ``T x top_k``; with ``token_rows`` (under
    sequence parallelism the block holds its tp rank's token rows) a tp split all-gathers
    over tp the rows each rank received for its experts and reduce-scatters the partial
    outputs back (:func:`_run_tp_rows`), as the cost model charges; replicated experts
    compute the rank's own rows (no tp collective).

    ``chain=(c1, c2)`` (any other pair of ``"col"`` / ``"row"`` / ``"rep"``): the two matmuls
    are computed here, each weight cut as its choice says (``weights``: the dim its choice
    cuts, None for ``rep``; ``in_out``: weights stored ``[E, in, out]``, GPT-MoE's, else
    ``[E, out, in]``, HF's), the activation moved between them as the walk does
    (:func:`_chain`): HF gated experts (packed gate|up) apply ``act_fn(gate) * up``, others
    their own activation (the module's forward run elementwise, :func:`_own_activation`).
    Under sequence parallelism (``token_rows``) the tp ranks' rows are all-gathered first
    and each rank keeps its own rows of the whole output (:func:`_chain_tp_rows`)."""

    def __init__(self, *, tp_split: bool = True, weights=None, token_rows: bool = False,
                 chain=None, in_out: bool = False, fused=None, partial=()):
        super().__init__()
        # biases added once to partial sums (GPT-OSS's down_proj_bias after a row split):
        # Partial over tp -- tp rank 0 holds the values, the other ranks zeros
        self.partial = tuple(partial)
        # experts stored fused (DBRX): (the GLU submodule holding the weights, f, h); each
        # [E * f, h] weight placed as its [E, f, h] view, computed by the GLU per expert
        self.fused = tuple(fused) if fused else None
        self.tp_split, self.token_rows = tp_split, token_rows
        self.weights = dict(weights or HF_EXPERTS)
        self.chain = tuple(chain) if chain else None
        self.in_out = bool(in_out)

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        names = tuple(device_mesh.mesh_dim_names)
        tp = device_mesh.size(names.index("tp")) if "tp" in names else 1
        split = self.tp_split and tp > 1
        forward_local = module.forward  # the model's own expert maths
        owner = module
        if self.fused:
            owner = getattr(module, self.fused[0])
            forward_local = _fused_forward(owner, tuple(self.weights))

        def partition(_name, mod, mesh):
            if mod is not owner:
                return
            for i, (name, (tp_dim, parts)) in enumerate(self.weights.items()):
                full = getattr(mod, name).detach()
                if self.fused:  # [E * f, h] -> [E, f, h]: whole experts, each one's f rows
                    full = full.view(-1, *self.fused[1:])
                cut = split and tp_dim is not None
                # packed gate|up interleaved per rank where a rank's slice of the output
                # features is activated on its own (col; row whose output is reduce-scattered)
                packed = parts and split and (self.chain is None or i == 0 and self.chain in (
                    ("col", "col"), ("col", "rep"), ("col", "row"), ("row", "row")))
                if packed:
                    full = interleave(full, 1 if self.chain else tp_dim,
                                      parts if len(parts) > 1 else parts[0], tp)
                placements = [Shard(0) if d == "ep" else Shard(tp_dim) if cut else Replicate()
                              for d in names]
                dt = distribute_tensor(full, mesh, placements, src_data_rank=self.src_data_rank)
                if split and name in self.partial:  # the sum over tp is the bias
                    local = dt.to_local()
                    if mesh.get_local_rank("tp") != 0:
                        local = torch.zeros_like(local)
                    dt = DTensor.from_local(local, mesh, [Partial() if d == "tp" else p
                                                          for d, p in zip(names, placements)],
                                            run_check=False)
                mod.register_parameter(name, nn.Parameter(dt, requires_grad=False))

        distribute_module(module, device_mesh, partition)
        ep_group = device_mesh.get_group("ep") if "ep" in names else None
        tp_group = device_mesh.get_group("tp") if "tp" in names and tp > 1 else None
        rows_group = tp_group if self.token_rows and split else None
        # col/row through the module's own forward: partial sums, reduced after the top-k sum
        reduce_group = tp_group if split and rows_group is None and self.chain is None else None

        gated = bool(next(iter(self.weights.values()))[1])  # packed gate|up

        def chain(rows, sizes):
            return _chain(module, forward_local, tuple(self.weights), self.chain, rows, sizes,
                          tp_group, gated, self.in_out)

        def run(rows, sizes):
            if self.chain is not None and split and self.token_rows:
                return _chain_tp_rows(chain, rows, sizes, tp_group)
            if self.chain is not None and split:
                return chain(rows, sizes)
            if rows_group is not None:
                return _run_tp_rows(owner, forward_local, tuple(self.weights), rows, sizes,
                                    rows_group)
            return _run_local(owner, forward_local, tuple(self.weights), rows, sizes, None)

        def forward(hidden, top_k_index, top_k_weights):
            shape = hidden.shape  # DBRX's experts read [batch, seq, h]
            out = _dispatch_compute_combine(run, hidden.reshape(-1, shape[-1]), top_k_index,
                                            top_k_weights,
                                            int(getattr(owner, next(iter(self.weights))).shape[0]),
                                            ep_group, reduce_group)
            return out.view(shape)

        module.forward = forward
        return module


def _dispatch_compute_combine(run, x, idx, weights, num_experts: int, ep_group,
                              reduce_group=None) -> torch.Tensor:
    """Routed output [T, h] of tokens ``x`` [T, h] (see :class:`ExpertParallel`); ``run(rows,
    sizes)`` computes this rank's experts on rows grouped by local expert (tp partial sums
    when ``reduce_group``: all-reduced over it after the weighted top-k sum)."""
    t, k = idx.shape
    if x.is_meta:  # shapes only (a fake process group): a balanced routing's counts, each
        # expert's rows rounded up (exact when E divides tokens x top_k)
        counts = torch.full((num_experts,), -(-t * k // num_experts), dtype=torch.long)
        order, rows = None, x.new_empty(int(counts.sum()), x.shape[1])
    else:
        pair_expert = idx.reshape(-1)
        order = torch.argsort(pair_expert, stable=True)  # (token, k) pairs grouped by expert
        rows = x[order // k]
        counts = torch.bincount(pair_expert, minlength=num_experts)  # rows per expert, [E]
    if ep_group is not None:
        ep = dist.get_world_size(ep_group)
        recv_counts = torch.empty_like(counts)  # [ep source, local expert], flattened
        dist.all_to_all_single(recv_counts, counts, group=ep_group)
        send_splits = counts.view(ep, -1).sum(1).tolist()
        recv_splits = recv_counts.view(ep, -1).sum(1).tolist()
        recv = rows.new_empty(sum(recv_splits), x.shape[1])
        dist.all_to_all_single(recv, rows, recv_splits, send_splits, group=ep_group)
        per_src = recv_counts.view(ep, -1)
        local = per_src.shape[1]
        row_expert = torch.arange(local).repeat(ep).repeat_interleave(per_src.reshape(-1))
        regroup = torch.argsort(row_expert, stable=True).to(x.device)  # source -> expert-major
        out = run(recv[regroup], per_src.sum(0).tolist())
        back = torch.empty_like(out)
        back[regroup] = out
        out = rows.new_empty(rows.shape)
        dist.all_to_all_single(out, back, send_splits, recv_splits, group=ep_group)
    else:
        out = run(rows, counts.tolist())
    if order is None:
        pairs = out[:t * k]
    else:
        pairs = torch.empty_like(out)
        pairs[order] = out
    # as HF's experts: each weighted row cast to the activation dtype, then summed
    out = (pairs.view(t, k, -1) * weights.unsqueeze(-1)).to(x.dtype).sum(dim=1)
    if reduce_group is not None:  # tp partial sums reduced once per token, after the top-k sum
        dist.all_reduce(out, group=reduce_group)
    return out


def _fused_forward(glu: nn.Module, names: tuple[str, ...]):
    """Experts stored fused (DBRX's GLU: gate, up, down ``[E_local, f, h]`` local shards)
    as ``forward(rows [N, h], local expert [N, 1], weights [N, 1]) -> [N, h]``: each local
    expert's rows through the GLU's own forward on its weights."""
    def forward(rows, idx, weights):
        if rows.is_meta:  # shapes only (a fake process group)
            return rows.new_empty(rows.shape)
        w1, v1, w2 = (getattr(glu, n) for n in names)
        out = rows.new_zeros(rows.shape)
        ids = idx[:, 0]
        for e in range(w1.shape[0]):
            hit = (ids == e).nonzero().flatten()
            if hit.numel():
                out[hit] = glu(rows[hit], w1[e], v1[e], w2[e]) * weights[hit]
        return out
    return forward


def _run_tp_rows(module, forward_local, names, rows: torch.Tensor, sizes: list[int],
                 group) -> torch.Tensor:
    """Column / row parallel experts under sequence parallelism: every tp rank received its
    own token rows' pairs (``rows``, ``sizes[j]`` for local expert j). The per-expert counts
    are all-gathered over tp (``L`` int64, latency only), the rows all-gathered (padded to
    the largest rank's count: exactly the rows when balanced), every rank's rows run through
    the local shards, and the partial outputs reduce-scattered back to their rank."""
    n = dist.get_world_size(group)
    per_rank, m, every_rows, ids = _gather_tp_rows(rows, sizes, group)
    out = _run_local(module, forward_local, names, every_rows, sizes, None, ids)
    back = out.new_zeros(n * m, out.shape[1]) if not out.is_meta else out.new_empty(n * m, out.shape[1])
    start = 0
    for i, c in enumerate(per_rank):
        back[i * m:i * m + sum(c)] = out[start:start + sum(c)]
        start += sum(c)
    result = out.new_empty(m, out.shape[1])
    dist.reduce_scatter_single(result, back, group=group)
    return result[:rows.shape[0]]


def _gather_tp_rows(rows: torch.Tensor, sizes: list[int], group):
    """Every tp rank's routed rows (``rows``: this rank's, ``sizes[j]`` for local expert j),
    all-gathered over ``group``: the per-expert counts first (``L`` int64), then the rows
    padded to the largest rank's count. Returns ``(per_rank counts, padded rows per rank m,
    the ranks' rows concatenated [sum of counts, features], their local expert ids)``."""
    n = dist.get_world_size(group)
    mine = torch.tensor(sizes, dtype=torch.long)
    every = torch.empty(n * len(sizes), dtype=torch.long)
    dist.all_gather_single(every, mine, group=group)
    per_rank = [list(sizes)] * n if rows.is_meta else every.view(n, -1).tolist()
    m = max(sum(c) for c in per_rank)
    padded = rows.new_zeros(m, rows.shape[1]) if not rows.is_meta else rows.new_empty(m, rows.shape[1])
    padded[:rows.shape[0]] = rows
    gathered = rows.new_empty(n * m, rows.shape[1])
    dist.all_gather_single(gathered, padded, group=group)
    every_rows = torch.cat([gathered[i * m:i * m + sum(c)] for i, c in enumerate(per_rank)])
    ids = torch.cat([_expert_ids(c) for c in per_rank]).to(rows.device)
    return per_rank, m, every_rows, ids


def _expert_ids(sizes: list[int]) -> torch.Tensor:
    """Local expert index of each row of rows grouped by expert (``sizes[j]`` rows of j)."""
    return torch.repeat_interleave(torch.arange(len(sizes)), torch.tensor(sizes, dtype=torch.long))


def _run_local(module, forward_local, names, rows: torch.Tensor, sizes: list[int],
               tp_group, ids: torch.Tensor | None = None) -> torch.Tensor:
    """This rank's experts over ``rows`` grouped by expert (``sizes[j]`` rows for local
    expert j; or ``ids``: each row's local expert), computed by the module's own forward
    (``forward_local``) on the local weight shards with weight 1 per row; tp partial sums
    all-reduced over ``tp_group``."""
    ids = (_expert_ids(sizes) if ids is None else ids).to(rows.device)
    ones = rows.new_ones(rows.shape[0], 1)
    saved = {n: module._parameters[n] for n in names}
    num = getattr(module, "num_experts", None)
    try:
        for n in names:
            module._parameters[n] = nn.Parameter(saved[n].to_local(), requires_grad=False)
        if num is not None:
            module.num_experts = len(sizes)
        out = forward_local(rows, ids.unsqueeze(1), ones)
    finally:
        module._parameters.update(saved)
        if num is not None:
            module.num_experts = num
    if tp_group is not None:
        dist.all_reduce(out, group=tp_group)
    return out


def _own_activation(module, forward_local, names, h: torch.Tensor) -> torch.Tensor:
    """The expert module's own activation of ``h`` (a plain, non-gated expert
    ``act(x @ W1) @ W2``): its forward run with identity ``k x k`` weights on ``h`` cut into
    rows of ``k`` features (``k`` = 16 where it divides, else 1; an identity matmul is exact),
    every row routed to expert 0 with weight 1."""
    k = 16 if h.shape[-1] % 16 == 0 else 1
    x = h.reshape(-1, k)
    eye = torch.eye(k, dtype=h.dtype, device=h.device).unsqueeze(0)
    saved = {n: module._parameters[n] for n in names}
    num = getattr(module, "num_experts", None)
    try:
        for n in names:
            module._parameters[n] = nn.Parameter(eye, requires_grad=False)
        if num is not None:
            module.num_experts = 1
        ids = torch.zeros(x.shape[0], 1, dtype=torch.long, device=h.device)
        out = forward_local(x, ids, x.new_ones(x.shape[0], 1))
    finally:
        module._parameters.update(saved)
        if num is not None:
            module.num_experts = num
    return out.reshape(h.shape)


def _chain(module, forward_local, names, chain, rows: torch.Tensor, sizes: list[int], group,
           gated: bool = True, in_out: bool = False) -> torch.Tensor:
    """Experts over ``rows`` grouped by local expert, the first matmul cut as ``chain[0]``
    and the second as ``chain[1]`` on the tp ``group`` (every rank of it holds the same
    rows): the placements and repairs of the contract's walk -- ``col`` / ``rep`` need the
    whole activation (``R``), ``row`` its feature slice; partial sums are reduced before the
    activation; the output leaves whole (``R``). ``gated``: HF's ``act_fn(gate) * up`` on a
    packed gate|up (``[g_r | u_r]`` per rank), else the module's own activation;
    ``in_out``: weights ``[E, in, out]`` (``x @ w``), else ``[E, out, in]``."""
    c1, c2 = chain
    n, r = dist.get_world_size(group), dist.get_rank(group)
    w1, w2 = (getattr(module, nm).to_local() for nm in names)
    parts = rows.split(sizes)

    def per_expert(xs, w):
        return torch.cat([x @ w[j] if in_out else F.linear(x, w[j]) for j, x in enumerate(xs)])

    x_in = [x.chunk(n, dim=-1)[r] for x in parts] if c1 == "row" else list(parts)
    h = per_expert(x_in, w1)  # col: [g_r | u_r]; row: partial; rep: whole [g | u]
    need = "S(1)" if c2 == "row" else "R"
    if c1 == "row":
        if need == "R":
            dist.all_reduce(h, group=group)
        else:  # gate|up interleaved per rank: the scattered slice is [g_r | u_r]
            out = h.new_empty(h.shape[1] // n, h.shape[0])  # features are dim 0 here
            dist.reduce_scatter_single(out, h.t().contiguous(), group=group)
            h = out.t()
    have = "S(1)" if c1 == "col" or (c1 == "row" and need == "S(1)") else "R"
    if have == "S(1)" and need == "R":  # the walk's repair of expert_ffn1's output
        h = _gather_features(h, n, group)  # [g_0 | u_0 | g_1 | u_1 ...] when gated
        if gated:
            h = torch.cat([torch.cat(p, dim=-1) for p in zip(*(
                c.chunk(2, dim=-1) for c in h.chunk(n, dim=-1)))], dim=-1)
        have = "R"
    if gated:
        gate, up = h.chunk(2, dim=-1)
        a = module.act_fn(gate) * up
    else:
        a = _own_activation(module, forward_local, names, h)
    if have == "R" and need == "S(1)":
        a = a.chunk(n, dim=-1)[r]
    out = per_expert(list(a.split(sizes)), w2)  # col: [.., h/tp]; row: partial; rep: whole
    if c2 == "row":
        dist.all_reduce(out, group=group)
    elif c2 == "col":
        out = _gather_features(out, n, group)
    return out


def _gather_features(x: torch.Tensor, n: int, group) -> torch.Tensor:
    """``x`` [rows, f / n] of every rank of ``group`` side by side: [rows, f] (one
    ``all_gather_single``)."""
    out = x.new_empty(n * x.shape[0], x.shape[1])
    dist.all_gather_single(out, x.contiguous(), group=group)
    return torch.cat(out.chunk(n, dim=0), dim=-1)


def _chain_tp_rows(chain, rows: torch.Tensor, sizes: list[int], group) -> torch.Tensor:
    """:func:`_chain` under sequence parallelism: each tp rank received its own token rows'
    pairs (``rows``, ``sizes[j]`` for local expert j). The per-expert counts and the rows are
    all-gathered over tp (padded to the largest rank's count), the chain runs on every rank's
    rows grouped by expert, and each rank keeps its own rows of the whole output."""
    me = dist.get_rank(group)
    per_rank, _m, every_rows, ids = _gather_tp_rows(rows, sizes, group)
    order = torch.argsort(ids, stable=True)  # every rank's rows, grouped by local expert
    totals = [sum(c[j] for c in per_rank) for j in range(len(sizes))]
    out = chain(every_rows[order], totals)
    back = torch.empty_like(out)
    back[order] = out
    start = sum(sum(c) for c in per_rank[:me])
    return back[start:start + rows.shape[0]]
