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
from torch import nn
from torch.distributed.tensor import (
    DTensor,
    Replicate,
    Shard,
    distribute_module,
    distribute_tensor,
)
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel


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


def interleave(t: torch.Tensor, dim: int, parts, n: int) -> torch.Tensor:
    """Reorder ``dim`` = [part0 | part1 | ...] (``parts``: their widths, or a count of equal
    parts) into [part0_r0, part1_r0, ..., part0_r1, ...]: a contiguous n-way split then gives
    every rank its matching slice of every part."""
    widths = [t.shape[dim] // parts] * parts if isinstance(parts, int) else list(parts)
    if sum(widths) != t.shape[dim] or any(w % n for w in widths):
        raise ValueError(f"packed parts {widths} of dim {dim} {tuple(t.shape)} do not split "
                         f"{n} ways")
    pieces = [p.chunk(n, dim) for p in t.split(widths, dim)]
    return torch.cat([c[r] for r in range(n) for c in pieces], dim)


def _distribute(style, module: nn.Module, device_mesh) -> nn.Module:
    """``distribute_module`` with ``style``'s partition and its torch input / output hooks."""
    inputs, desired = style.input_layouts, style.desired_input_layouts
    outputs, local = style.output_layouts, style.use_local_output
    return distribute_module(
        module, device_mesh, style._partition_linear_fn,
        lambda mod, args, mesh: style._prepare_input_fn(inputs, desired, mod, args, mesh),
        lambda mod, out, mesh: style._prepare_output_fn(outputs, local, mod, out, mesh))


class WeightColwiseParallel(ColwiseParallel):
    """torch's ``ColwiseParallel`` for a module whose weight torch's style cannot place: stored
    with the output features at dim ``out_dim`` (GPT-2's ``Conv1D`` keeps ``[in, out]``:
    ``out_dim=1``) and/or packing ``parts`` along them (widths of q|k|v, gate|up: each part
    is cut n ways, a rank's slices side by side, so its output is [q_r | k_r | v_r]). The
    bias follows the output features. Inputs and outputs as ``ColwiseParallel``."""

    def __init__(self, *, out_dim: int = 0, parts=(), **kwargs):
        super().__init__(**kwargs)
        self.out_dim, self.parts = out_dim, tuple(parts)

    def _partition_linear_fn(self, name, module, device_mesh):
        for pname, param in list(module.named_parameters(recurse=False)):
            dim = self.out_dim if param.ndim > 1 else 0
            full = param.detach()
            if self.parts:
                full = interleave(full, dim, self.parts, device_mesh.size())
            dt = distribute_tensor(full, device_mesh, [Shard(dim)],
                                   src_data_rank=self.src_data_rank)
            module.register_parameter(pname, nn.Parameter(dt, requires_grad=False))

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        return _distribute(self, module, device_mesh)


class WeightRowwiseParallel(RowwiseParallel):
    """torch's ``RowwiseParallel`` for a weight stored with the input features at dim
    ``in_dim`` (GPT-2's ``Conv1D``: ``in_dim=0``); the bias stays whole (added once to the
    partial sums). Inputs and outputs as ``RowwiseParallel``."""

    def __init__(self, *, in_dim: int = 1, **kwargs):
        super().__init__(**kwargs)
        self.in_dim = in_dim

    def _partition_linear_fn(self, name, module, device_mesh):
        for pname, param in list(module.named_parameters(recurse=False)):
            place = [Shard(self.in_dim)] if param.ndim > 1 else [Replicate()]
            dt = distribute_tensor(param.detach(), device_mesh, place,
                                   src_data_rank=self.src_data_rank)
            module.register_parameter(pname, nn.Parameter(dt, requires_grad=False))

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        self.desired_input_layouts = (Shard(-1),)
        return _distribute(self, module, device_mesh)


class PrepareHiddenStates(ParallelStyle):
    """``PrepareModuleInput`` for a module's first input, whether passed positionally (GPT-2,
    plain models) or as ``hidden_states=`` (HF decoder layers): the local tensor at
    ``input_layouts`` is moved to ``desired_input_layouts``."""

    def __init__(self, *, input_layouts, desired_input_layouts):
        super().__init__()
        self.src, self.dst = input_layouts, desired_input_layouts

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        def pre(mod, args, kwargs):
            if args:
                return (move(args[0], device_mesh, self.src, self.dst), *args[1:]), kwargs
            kwargs = dict(kwargs)
            kwargs["hidden_states"] = move(kwargs["hidden_states"], device_mesh, self.src,
                                           self.dst)
            return args, kwargs

        module.register_forward_pre_hook(pre, with_kwargs=True)
        return module


# integer attributes an attention module's own forward sizes its head views from when its
# q|k|v come packed in one projection (GPT-MoE's ``num_heads``, GPT-2's ``split_size``)
HEAD_SIZES = ("num_heads", "num_key_value_heads", "split_size")


class FullWidthNormParallel(ParallelStyle):
    """An RMSNorm over a whole projection (OLMoE's q/k norms over all heads) applied to
    this rank's heads of it (``Shard(-1)``): the sum of squares is all-reduced over tp (one
    ``[tokens, 1]`` all-reduce) and the rank's slice of the weight, kept whole on every
    rank, scales its features. Same maths as the model's RMSNorm (float32 statistics)."""

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        group, n = device_mesh.get_group(), device_mesh.size()
        i = device_mesh.get_local_rank()
        eps = float(getattr(module, "variance_epsilon", getattr(module, "eps", 1e-6)))

        def forward(x):
            width = x.shape[-1] * n
            h = x.to(torch.float32)
            sq = h.pow(2).sum(-1, keepdim=True)
            dist.all_reduce(sq, group=group)
            h = h * torch.rsqrt(sq / width + eps)
            return module.weight.chunk(n)[i] * h.to(x.dtype)

        module.forward = forward
        return module


class HeadParallelAttention(PrepareHiddenStates):
    """A heads split of an attention module whose packed q|k|v projection is column
    parallel (:class:`WeightColwiseParallel` with ``parts``): the module's head-count
    attributes (:data:`HEAD_SIZES`, those it has) become this rank's share, so its own
    forward views the local [q_r | k_r | v_r] as its heads. Given layouts, it also moves
    its input as :class:`PrepareHiddenStates` (one style per module)."""

    def __init__(self, *, input_layouts=None, desired_input_layouts=None):
        super().__init__(input_layouts=input_layouts, desired_input_layouts=desired_input_layouts)

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        if self.src is not None:
            super()._apply(module, device_mesh)
        n = device_mesh.size()
        for name in HEAD_SIZES:
            value = getattr(module, name, None)
            if isinstance(value, int) and not isinstance(value, bool):
                if value % n:
                    raise ValueError(f"{name}={value} does not split over tp={n}")
                setattr(module, name, value // n)
        return module


class RouterParallel(ParallelStyle):
    """A column / row parallel MoE router: ``style`` (torch's ``ColwiseParallel`` /
    ``RowwiseParallel``) as is on an ``nn.Linear`` router (GPT-MoE); an HF router module
    (which computes its scores, top-k and weights itself) gets its weight as that style
    shards it and its input as a DTensor, so its own code runs on DTensors: the softmax over
    the sharded expert scores all-gathers them (col) or reduces the partial sums (row), the
    collective the plan charges (under sequence parallelism: an all-gather / all-reduce of
    the scores where the plan charges an all-to-all / reduce-scatter); its outputs leave at
    the style's output layout (a token-row split is a local slice), as local tensors (the
    returned raw scores, unused by the block's forward, are gathered too: not charged)."""

    def __init__(self, style):
        super().__init__()
        self.style = style

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        self.style.src_data_rank = self.src_data_rank
        if isinstance(module, nn.Linear):
            return self.style._apply(module, device_mesh)
        row = isinstance(self.style, RowwiseParallel)
        dt = distribute_tensor(module.weight.detach(), device_mesh,
                               [Shard(1) if row else Shard(0)], src_data_rank=self.src_data_rank)
        module.register_parameter("weight", nn.Parameter(dt, requires_grad=False))
        src, out = self.style.input_layouts[0], self.style.output_layouts[0]
        need = Shard(-1) if row else Replicate()

        def pre(mod, args):
            x = DTensor.from_local(args[0], device_mesh, (src,), run_check=False)
            return (x.redistribute(device_mesh, (need,)), *args[1:])

        def local(t):
            if not isinstance(t, DTensor):
                return t
            return t.redistribute(device_mesh, (Replicate(),)).redistribute(
                device_mesh, (out,)).to_local()

        def post(mod, args, out):
            return tuple(local(t) for t in out) if isinstance(out, tuple) else local(out)

        module.register_forward_pre_hook(pre)
        module.register_forward_hook(post)
        return module


HF_EXPERTS = {"gate_up_proj": (1, (2,)), "down_proj": (2, ())}  # name -> (tp dim, parts)


class ExpertParallel(ParallelStyle):
    """Stacked experts (HF's ``gate_up_proj [E, 2f, h]`` / ``down_proj [E, h, f]``, or any
    ``[E, ...]`` weights) on a mesh of dims ``ep`` and/or ``tp``; the module's forward is
    ``experts(tokens [T, h], top_k_index [T, k], top_k_weights [T, k]) -> [T, h]``.

    Over ``ep`` the expert dim 0 is ``Shard(0)``. ``weights`` maps each weight's name to
    (its tp dim, the widths of the parts it packs along it, or a count); with ``tp_split``
    the experts are column then row parallel (the first weight's output features -- parts
    interleaved per rank -- and the second's input features cut over tp), else they stay
    replicated over tp. Dispatch: the routed (token, expert) pairs are sorted by expert, the
    per-expert counts exchanged (``all_to_all_single`` of ``E`` integers), the rows go to
    their experts' owners with one uneven ``all_to_all_single``, run through the module's
    own forward on the local weights (its activation, gating and layout), and come back with
    one more. The tp partial sums are all-reduced at the experts; with ``token_rows`` (under
    sequence parallelism the block holds its tp rank's token rows) a tp split first
    all-gathers the tokens over tp and reduce-scatters the partial outputs back to the rows
    (replicated experts compute the rank's own rows: no tp collective)."""

    def __init__(self, *, tp_split: bool = True, weights=None, token_rows: bool = False):
        super().__init__()
        self.tp_split, self.token_rows = tp_split, token_rows
        self.weights = dict(weights or HF_EXPERTS)

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        names = tuple(device_mesh.mesh_dim_names)
        tp = device_mesh.size(names.index("tp")) if "tp" in names else 1
        split = self.tp_split and tp > 1
        forward_local = module.forward  # the model's own expert maths

        def partition(_name, mod, mesh):
            if mod is not module:
                return
            for name, (tp_dim, parts) in self.weights.items():
                full = getattr(mod, name).detach()
                if parts and split:
                    full = interleave(full, tp_dim, parts if len(parts) > 1 else parts[0], tp)
                placements = [Shard(0) if d == "ep" else Shard(tp_dim) if split else Replicate()
                              for d in names]
                dt = distribute_tensor(full, mesh, placements, src_data_rank=self.src_data_rank)
                mod.register_parameter(name, nn.Parameter(dt, requires_grad=False))

        distribute_module(module, device_mesh, partition)
        ep_group = device_mesh.get_group("ep") if "ep" in names else None
        tp_group = device_mesh.get_group("tp") if "tp" in names and tp > 1 else None
        rows_group = tp_group if self.token_rows and split else None
        reduce_group = tp_group if split and rows_group is None else None

        def run(rows, sizes):
            return _run_local(module, forward_local, tuple(self.weights), rows, sizes,
                              reduce_group)

        def forward(hidden, top_k_index, top_k_weights):
            if rows_group is not None:
                hidden, top_k_index, top_k_weights = (
                    _gather_rows(t, rows_group) for t in (hidden, top_k_index, top_k_weights))
            out = _dispatch_compute_combine(run, hidden, top_k_index, top_k_weights,
                                            int(getattr(module, next(iter(self.weights))).shape[0]),
                                            ep_group)
            return out if rows_group is None else _reduce_scatter_rows(out, rows_group)

        module.forward = forward
        return module


def _gather_rows(t: torch.Tensor, group) -> torch.Tensor:
    """The tp group's rows of ``t`` (rank order), all-gathered along dim 0."""
    out = t.new_empty(t.shape[0] * dist.get_world_size(group), *t.shape[1:])
    dist.all_gather_into_tensor(out, t.contiguous(), group=group)
    return out


def _reduce_scatter_rows(t: torch.Tensor, group) -> torch.Tensor:
    """This rank's rows of the sum over ``group`` of ``t`` (reduce-scatter along dim 0)."""
    out = t.new_empty(t.shape[0] // dist.get_world_size(group), *t.shape[1:])
    dist.reduce_scatter_tensor(out, t.contiguous(), group=group)
    return out


def _dispatch_compute_combine(run, x, idx, weights, num_experts: int, ep_group) -> torch.Tensor:
    """Routed output [T, h] of tokens ``x`` [T, h] (see :class:`ExpertParallel`); ``run(rows,
    sizes)`` computes this rank's experts on rows grouped by local expert."""
    t, k = idx.shape
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
        out = run(recv[regroup], per_src.sum(0).tolist())
        back = torch.empty_like(out)
        back[regroup] = out
        out = rows.new_empty(rows.shape)
        dist.all_to_all_single(out, back, send_splits, recv_splits, group=ep_group)
    else:
        out = run(rows, counts.tolist())
    pairs = torch.empty_like(out)
    pairs[order] = out
    # as HF's experts: each weighted row cast to the activation dtype, then summed
    return (pairs.view(t, k, -1) * weights.unsqueeze(-1)).to(x.dtype).sum(dim=1)


def _run_local(module, forward_local, names, rows: torch.Tensor, sizes: list[int],
               tp_group) -> torch.Tensor:
    """This rank's experts over ``rows`` grouped by expert (``sizes[j]`` rows for local
    expert j), computed by the module's own forward (``forward_local``) on the local weight
    shards with weight 1 per row; tp partial sums all-reduced over ``tp_group``."""
    ids = torch.repeat_interleave(torch.arange(len(sizes)), torch.tensor(sizes, dtype=torch.long))
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
