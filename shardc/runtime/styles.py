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
# head counts an attention forward may read from its config instead (Phi-3 slices its
# packed q|k|v at config.num_attention_heads * head_dim)
CONFIG_HEAD_SIZES = ("num_attention_heads", "num_key_value_heads")


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


def _shallow_copy(obj):
    """A new object of ``obj``'s class sharing its attribute values (``copy.copy`` without
    the import: the inlined runtime's imports are torch's)."""
    new = object.__new__(type(obj))
    new.__dict__.update(obj.__dict__)
    return new


class HeadParallelAttention(PrepareHiddenStates):
    """A heads split of an attention module whose packed q|k|v projection is column
    parallel (:class:`WeightColwiseParallel` with ``parts``): the module's head-count
    attributes (:data:`HEAD_SIZES`, those it has) and those of its config
    (:data:`CONFIG_HEAD_SIZES`, on a copy the module alone holds) become this rank's share,
    so its own forward views the local [q_r | k_r | v_r] as its heads. Given layouts, it also moves
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
        config = getattr(module, "config", None)
        if config is not None and any(isinstance(getattr(config, k, None), int)
                                      for k in CONFIG_HEAD_SIZES):
            config = _shallow_copy(config)  # this module's own: the model's stays whole
            for name in CONFIG_HEAD_SIZES:
                value = getattr(config, name, None)
                if isinstance(value, int) and not isinstance(value, bool):
                    if value % n:
                        raise ValueError(f"config.{name}={value} does not split over tp={n}")
                    setattr(config, name, value // n)
            module.config = config
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
