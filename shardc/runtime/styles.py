"""shardc's own ParallelStyles: only what torch's ``ColwiseParallel`` / ``RowwiseParallel`` /
``PrepareModuleInput`` do not express. Imports torch only (``shardc compile --standalone``
inlines this file into ``parallelize.py``).

Activations of an HF decoder are ``[batch, seq, hidden]`` (the MoE experts see
``[tokens, hidden]``). plan.json's tp placements map onto them as: ``R`` = ``Replicate()``,
``S(1)`` (features / heads) = ``Shard(-1)``, ``S(0)`` (token rows: batch-split attention) =
``Shard(0)`` -- whole sequences, so the attention core of a row stays on one rank.

* :class:`ReplicateParallel`: a module whose weights stay whole on every rank but whose
  input arrives at one placement and whose output must leave at another (an op of choice
  ``rep`` inside a sharded branch: e.g. ``S(1) -> R`` all-gather before it).
* :class:`BatchSplitAttention`: the attention module runs on this rank's batch rows
  (``R -> S(0)``, a local slice; the 4-D mask and rotary tables follow the rows).
* :class:`ExpertParallel`: stacked HF experts (``gate_up_proj [E, 2f, h]``,
  ``down_proj [E, h, f]``) split over ep (experts) and optionally tp (``gate|up``
  interleaved per tp rank, then column / row parallel); tokens reach the experts' owners
  after the per-expert token counts are exchanged, with one uneven ``all_to_all_single``
  carrying exactly the routed rows (no capacity padding) and one more back.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import (
    DTensor,
    Replicate,
    Shard,
    distribute_module,
    distribute_tensor,
)
from torch.distributed.tensor.parallel import ParallelStyle


def move(x: torch.Tensor, mesh, src, dst) -> torch.Tensor:
    """Local tensor ``x`` held at placement ``src`` on 1-D ``mesh`` -> this rank's local
    tensor at ``dst`` (``DTensor.redistribute``: the collective the two placements imply)."""
    if src == dst:
        return x
    dt = DTensor.from_local(x, mesh, (src,), run_check=False)
    return dt.redistribute(mesh, (dst,)).to_local()


class ReplicateParallel(ParallelStyle):
    """Weights replicated (left as they are: every rank holds the whole tensor); the input
    arriving at ``input_layouts`` is moved to ``desired_input_layouts`` (``Replicate()`` or
    ``Shard(0)``: a replicated weight passes token rows through), the output, at the same
    placement as the input, is moved to ``output_layouts``."""

    def __init__(self, *, input_layouts=Replicate(), desired_input_layouts=None,
                 output_layouts=None):
        super().__init__()
        self.input_layouts = input_layouts
        self.desired_input_layouts = desired_input_layouts or input_layouts
        self.output_layouts = output_layouts or self.desired_input_layouts

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        src, need, out = self.input_layouts, self.desired_input_layouts, self.output_layouts

        def pre(mod, args):
            return (move(args[0], device_mesh, src, need), *args[1:])

        def post(mod, args, output):
            return move(output, device_mesh, need, out)

        module.register_forward_pre_hook(pre)
        module.register_forward_hook(post)
        return module


def _rows(x, n: int, i: int):
    """Rank ``i``'s batch rows of ``x`` (a tensor whose dim 0 is the batch, else as is)."""
    if isinstance(x, torch.Tensor) and x.dim() > 0 and x.shape[0] > 1:
        if x.shape[0] % n:
            raise ValueError(f"batch {x.shape[0]} does not split over tp={n} for "
                             "batch-split attention")
        return x.chunk(n, dim=0)[i]
    return x


class BatchSplitAttention(ParallelStyle):
    """The attention module (an HF ``self_attn``) computes whole sequences of this rank's
    batch rows: its ``hidden_states`` (replicated on the tp mesh) are sliced to ``Shard(0)``
    -- no collective -- and so are a 4-D attention mask and per-row rotary tables. Its
    projections keep replicated weights (choice ``rep``); the output projection's style
    moves the rows back (e.g. ``ReplicateParallel(input_layouts=Shard(0),
    output_layouts=Replicate())``: an all-gather)."""

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        n, i = device_mesh.size(), device_mesh.get_local_rank()

        def pre(mod, args, kwargs):
            kwargs = dict(kwargs)
            if args:
                args = (_rows(args[0], n, i), *args[1:])
            for key in ("hidden_states", "attention_mask"):
                if key in kwargs:
                    kwargs[key] = _rows(kwargs[key], n, i)
            pe = kwargs.get("position_embeddings")
            if isinstance(pe, tuple):
                kwargs["position_embeddings"] = tuple(_rows(t, n, i) for t in pe)
            return args, kwargs

        module.register_forward_pre_hook(pre, with_kwargs=True)
        return module


def interleave(t: torch.Tensor, dim: int, parts: int, n: int) -> torch.Tensor:
    """Reorder ``dim`` = [part0 | part1 | ...] into [part0_r0, part1_r0, ..., part0_r1, ...]:
    a contiguous n-way split then gives every rank its matching slice of every part."""
    c = t.shape[dim] // (parts * n)
    return t.unflatten(dim, (parts, n, c)).transpose(dim, dim + 1).flatten(dim, dim + 2)


class ExpertParallel(ParallelStyle):
    """HF stacked experts on a mesh of dims ``ep`` and/or ``tp`` (the module's forward is
    ``experts(tokens [T, h], top_k_index [T, k], top_k_weights [T, k]) -> [T, h]``).

    Over ``ep`` the expert dim is ``Shard(0)``. Over ``tp`` with ``tp_split`` the experts are
    column parallel then row parallel (``gate_up_proj`` ``Shard(1)`` with gate|up
    interleaved per rank, ``down_proj`` ``Shard(2)``; the partial sums travel back as they
    are and are all-reduced over tp after the weighted top-k sum, on ``T`` rows rather than
    ``T x top_k``); without it they stay replicated over tp. Dispatch: the routed
    (token, expert) pairs are sorted by expert, the per-expert counts exchanged
    (``all_to_all_single`` of ``E`` integers), then the rows go to their experts' owners with
    one uneven ``all_to_all_single`` and come back with one more."""

    def __init__(self, *, tp_split: bool = True):
        super().__init__()
        self.tp_split = tp_split

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        names = tuple(device_mesh.mesh_dim_names)
        tp = device_mesh.size(names.index("tp")) if "tp" in names else 1
        split = self.tp_split and tp > 1

        def partition(_name, mod, mesh):
            if mod is not module:
                return
            for name, tp_dim in (("gate_up_proj", 1), ("down_proj", 2)):
                full = getattr(mod, name).detach()
                if name == "gate_up_proj" and split:
                    full = interleave(full, 1, 2, tp)
                placements = [Shard(0) if d == "ep" else Shard(tp_dim) if split else Replicate()
                              for d in names]
                dt = distribute_tensor(full, mesh, placements, src_data_rank=self.src_data_rank)
                mod.register_parameter(name, nn.Parameter(dt, requires_grad=False))

        distribute_module(module, device_mesh, partition)
        ep_group = device_mesh.get_group("ep") if "ep" in names else None
        tp_group = device_mesh.get_group("tp") if split else None

        def forward(hidden, top_k_index, top_k_weights):
            return _dispatch_compute_combine(module, hidden, top_k_index, top_k_weights,
                                             ep_group, tp_group)

        module.forward = forward
        return module


def _dispatch_compute_combine(module, x, idx, weights, ep_group, tp_group) -> torch.Tensor:
    """Routed output [T, h] of tokens ``x`` [T, h] (see :class:`ExpertParallel`)."""
    t, k = idx.shape
    num_experts = int(module.num_experts)
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
        regroup = torch.argsort(row_expert, stable=True)  # source-major -> expert-major
        out = _local_experts(module, recv[regroup], per_src.sum(0).tolist())
        back = torch.empty_like(out)
        back[regroup] = out
        out = rows.new_empty(rows.shape)
        dist.all_to_all_single(out, back, send_splits, recv_splits, group=ep_group)
    else:
        out = _local_experts(module, rows, counts.tolist())
    pairs = torch.empty_like(out)
    pairs[order] = out
    # as HF's experts: each weighted row cast to the activation dtype, then summed
    out = (pairs.view(t, k, -1) * weights.unsqueeze(-1)).to(x.dtype).sum(dim=1)
    if tp_group is not None:  # tp partial sums reduced once per token, after the top-k sum
        dist.all_reduce(out, group=tp_group)
    return out


def _local_experts(module, rows: torch.Tensor, sizes: list[int]) -> torch.Tensor:
    """This rank's experts over ``rows`` grouped by expert (``sizes[j]`` rows for local
    expert j): gated MLP with the local weight shards (tp-split: partial sums)."""
    gate_up = module.gate_up_proj.to_local()
    down = module.down_proj.to_local()
    outs = []
    for j, chunk in enumerate(rows.split(sizes)):
        gate, up = F.linear(chunk, gate_up[j]).chunk(2, dim=-1)
        outs.append(F.linear(module.act_fn(gate) * up, down[j]))
    return torch.cat(outs) if outs else rows.new_empty(0, rows.shape[1])
