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


def repeat_heads(t: torch.Tensor, dim: int, kv_repeat) -> torch.Tensor:
    """``t`` with each head (``head_dim`` consecutive features at ``dim``) repeated
    ``copies`` times in place, ``kv_repeat = (head_dim, copies)``: [h0, h1] -> [h0, h0, h1,
    h1]. GQA with tp > kv_heads: a contiguous tp-way split of the result gives each rank
    the one KV head its query heads read (each KV head on ``copies`` ranks, as vLLM)."""
    if not kv_repeat or int(kv_repeat[1]) == 1:
        return t
    head_dim, copies = int(kv_repeat[0]), int(kv_repeat[1])
    dim = dim % t.dim()
    return t.unflatten(dim, (-1, head_dim)).repeat_interleave(copies, dim).flatten(dim, dim + 1)


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
    placement as the input, is moved to ``output_layouts`` (packing ``parts``, q|k|v: split
    by features, each rank gets its slice of every part). ``kv_repeat=(head_dim, copies)``
    (a k / v projection of GQA with tp > kv_heads): the whole output's KV heads are repeated
    (:func:`repeat_heads`) before it moves, so a heads split gives each rank its one KV
    head."""

    def __init__(self, *, input_layouts=Replicate(), desired_input_layouts=None,
                 output_layouts=None, kv_repeat=None, parts=()):
        super().__init__()
        self.input_layouts = input_layouts
        self.desired_input_layouts = desired_input_layouts or input_layouts
        self.output_layouts = output_layouts or self.desired_input_layouts
        self.kv_repeat, self.parts = kv_repeat, tuple(parts)

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        src, need, out = self.input_layouts, self.desired_input_layouts, self.output_layouts

        def pre(mod, args):
            return (move(args[0], device_mesh, src, need), *args[1:])

        def post(mod, args, output):
            output = repeat_heads(output, -1, self.kv_repeat)
            if self.parts and _feature_split(out):  # packed q|k|v: each rank its heads of each
                output = interleave(output, output.dim() - 1, self.parts, device_mesh.size())
            return move(output, device_mesh, need, out)

        module.register_forward_pre_hook(pre)
        module.register_forward_hook(post)
        return module


_WHOLE_ROWS = []  # [(mask, mesh, gathered)]: the last mask gathered (one per forward)


def whole_rows(x, device_mesh):
    """All tp ranks' batch rows of ``x`` (a 4-D attention mask or a per-row rotary table the
    model built for this rank's rows under sequence parallelism), all-gathered over
    ``device_mesh`` along dim 0 for an attention core that runs on whole rows; the same
    tensor (every layer gets the model's one mask) is gathered once. Not a tensor, or one
    row broadcast over the batch: as is."""
    if not isinstance(x, torch.Tensor) or x.dim() == 0 or x.shape[0] == 1:
        return x
    for mask, mesh, gathered in _WHOLE_ROWS:
        if mask is x and mesh is device_mesh:
            return gathered
    t = x.to(torch.uint8) if x.dtype == torch.bool else x  # gloo gathers no bool
    gathered = move(t.contiguous(), device_mesh, Shard(0), Replicate())
    gathered = gathered.to(torch.bool) if x.dtype == torch.bool else gathered
    _WHOLE_ROWS[:] = [(x, device_mesh, gathered)]
    return gathered


def _gather_row_inputs(kwargs: dict, device_mesh) -> dict:
    """``kwargs`` of an attention module with its 4-D mask and per-row rotary tables of this
    rank's rows made whole (:func:`whole_rows`)."""
    kwargs = dict(kwargs)
    if kwargs.get("attention_mask") is not None:
        kwargs["attention_mask"] = whole_rows(kwargs["attention_mask"], device_mesh)
    pe = kwargs.get("position_embeddings")
    if isinstance(pe, tuple):
        kwargs["position_embeddings"] = tuple(whole_rows(t, device_mesh) for t in pe)
    return kwargs


def _rows_split(layout) -> bool:
    return isinstance(layout, Shard) and layout.dim == 0


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


def deinterleave(t: torch.Tensor, dim: int, parts, n: int) -> torch.Tensor:
    """The inverse of :func:`interleave`: [part0_r0, part1_r0, ..., part0_r1, ...] (the
    features of n ranks' packed slices gathered side by side) -> [part0 | part1 | ...]."""
    dim = dim % t.dim()
    total = t.shape[dim]
    widths = [total // parts] * parts if isinstance(parts, int) else list(parts)
    per_rank = [w // n for w in widths]
    blocks = [b.split(per_rank, dim) for b in t.chunk(n, dim)]
    return torch.cat([blocks[r][k] for k in range(len(widths)) for r in range(n)], dim)


def _feature_split(layout) -> bool:
    """Whether ``layout`` (a placement, or a 1-tuple of one) splits the features of an
    ``[batch, seq, features]`` activation."""
    if isinstance(layout, tuple):
        layout = layout[0] if len(layout) == 1 else None
    return isinstance(layout, Shard) and layout.dim in (-1, 2)


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
    is cut n ways, a rank's slices side by side, so its output is [q_r | k_r | v_r]), and/or
    a k / v projection of GQA with tp > kv_heads (``kv_repeat=(head_dim, copies)``: its KV
    heads repeated before the split, :func:`repeat_heads`, so each rank holds one KV head).
    The bias follows the output features. Inputs and outputs as ``ColwiseParallel``."""

    def __init__(self, *, out_dim: int = 0, parts=(), kv_repeat=None, **kwargs):
        super().__init__(**kwargs)
        self.out_dim, self.parts, self.kv_repeat = out_dim, tuple(parts), kv_repeat

    def _partition_linear_fn(self, name, module, device_mesh):
        for pname, param in list(module.named_parameters(recurse=False)):
            dim = self.out_dim if param.ndim > 1 else 0
            full = repeat_heads(param.detach(), dim, self.kv_repeat)
            if self.parts:
                full = interleave(full, dim, self.parts, device_mesh.size())
            dt = distribute_tensor(full, device_mesh, [Shard(dim)],
                                   src_data_rank=self.src_data_rank)
            module.register_parameter(pname, nn.Parameter(dt, requires_grad=False))

    def _prepare_output_fn(self, output_layouts, use_local_output, mod, outputs, device_mesh):
        out = ColwiseParallel._prepare_output_fn(output_layouts, use_local_output, mod, outputs,
                                                 device_mesh)
        if self.parts and not _feature_split(output_layouts) and not isinstance(out, DTensor):
            # gathered features are rank-major [q_r0|k_r0|v_r0|q_r1|...]: back to q|k|v
            out = deinterleave(out, -1, self.parts, device_mesh.size())
        return out

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        return _distribute(self, module, device_mesh)


class WeightRowwiseParallel(RowwiseParallel):
    """torch's ``RowwiseParallel`` for a weight stored with the input features at dim
    ``in_dim`` (GPT-2's ``Conv1D``: ``in_dim=0``); the bias stays whole (added once to the
    partial sums). Inputs and outputs as ``RowwiseParallel``; packed ``parts`` (q|k|v) split
    by features on the way out are interleaved first, so each rank gets its slice of every
    part. ``kv_repeat=(head_dim,
    copies)`` (a k / v projection of GQA with tp > kv_heads before a heads split): the
    partial sums' KV heads are repeated (:func:`repeat_heads`, linear: still partial sums)
    before they are reduce-scattered, so each rank receives its one KV head."""

    def __init__(self, *, in_dim: int = 1, kv_repeat=None, parts=(), **kwargs):
        super().__init__(**kwargs)
        self.in_dim, self.kv_repeat, self.parts = in_dim, kv_repeat, tuple(parts)

    def _prepare_output_fn(self, output_layouts, use_local_output, mod, outputs, device_mesh):
        if (self.kv_repeat or self.parts and _feature_split(output_layouts)) \
                and isinstance(outputs, DTensor):
            local = repeat_heads(outputs.to_local(), -1, self.kv_repeat)
            if self.parts and _feature_split(output_layouts):  # packed q|k|v split by features
                local = interleave(local, local.dim() - 1, self.parts, device_mesh.size())
            outputs = DTensor.from_local(local, device_mesh, outputs.placements,
                                         run_check=False)
        return RowwiseParallel._prepare_output_fn(output_layouts, use_local_output, mod,
                                                  outputs, device_mesh)

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
    ``input_layouts`` is moved to ``desired_input_layouts``. When that makes this rank's
    rows (``Shard(0)``, sequence parallelism) whole, a 4-D attention mask and per-row rotary
    tables the model built for those rows are all-gathered too (:func:`whole_rows`)."""

    def __init__(self, *, input_layouts, desired_input_layouts):
        super().__init__()
        self.src, self.dst = input_layouts, desired_input_layouts

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        gather = _rows_split(self.src) and not _rows_split(self.dst)

        def pre(mod, args, kwargs):
            if gather:  # the rows become whole: so do the mask and rotary tables
                kwargs = _gather_row_inputs(kwargs, device_mesh)
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
        # DBRX slices its packed q|k|v at hidden_size (its query width)
        names = HEAD_SIZES + (("hidden_size",) if hasattr(module, "Wqkv") else ())
        for name in names:
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


class GroupedKVAttention(PrepareHiddenStates):
    """A heads split of GQA attention at tp > kv_heads: each rank holds ``H / tp`` query
    heads and the one KV head they read (its k / v styles repeat the KV heads before the
    split, ``kv_repeat``), so the module's ``num_key_value_groups`` (query heads per KV
    head, which HF's attention repeats the keys by) becomes ``H / tp``: divided by
    ``kv_replicas`` (tp / kv_heads). Given layouts, it also moves its input as
    :class:`PrepareHiddenStates` (one style per module)."""

    def __init__(self, *, kv_replicas: int, input_layouts=None, desired_input_layouts=None):
        super().__init__(input_layouts=input_layouts, desired_input_layouts=desired_input_layouts)
        self.kv_replicas = int(kv_replicas)

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        if self.src is not None:
            super()._apply(module, device_mesh)
        groups = int(module.num_key_value_groups)
        if groups % self.kv_replicas:
            raise ValueError(f"num_key_value_groups={groups} does not split over "
                             f"{self.kv_replicas} replicas of each KV head")
        module.num_key_value_groups = groups // self.kv_replicas
        return module


class CoreRowsAttention(ParallelStyle):
    """An attention module whose core computes on other batch rows than its q/k/v
    projections read: the walk's repair between the projections and the core moves rows.

    * ``core_layouts=Shard(0)`` (batch-split attention after a ``col`` / ``row`` qkv): the
      module's own forward runs on this rank's batch rows (its ``hidden_states`` sliced, as
      are a 4-D mask and per-row rotary tables: :class:`BatchSplitAttention`), while each
      projection in ``projections`` reads the whole rows it was given and its style moves
      its output to ``Shard(0)`` (col: ``S(1) -> S(0)`` all-to-all; row: ``P -> S(0)``
      reduce-scatter). A projection reading a tensor the module computed on its rows (MLA's
      up projections read the latents of the replicated down projections) gets those rows
      all-gathered first (``S(0) -> R``, not charged by the walk).
    * ``core_layouts=Replicate()`` (under sequence parallelism a ``rep`` qkv before a heads
      split): the projections compute on this rank's rows (``Shard(0)``) and their styles
      all-to-all the outputs to ``Shard(-1)`` (whole rows, this rank's heads); the module's
      own forward sees a zero-copy stand-in of the whole batch's shape (``expand``: it only
      sizes its views from it), and the 4-D mask / per-row rotary tables the model built for
      this rank's rows all-gathered (:func:`whole_rows`).

    ``input_layouts`` / ``desired_input_layouts``: the module's input is moved first, as
    :class:`PrepareHiddenStates`. ``heads_split``: a packed q|k|v's head-count attributes
    become this rank's share (:class:`HeadParallelAttention`); ``kv_replicas``: KV heads
    replicated (:class:`GroupedKVAttention`)."""

    def __init__(self, *, core_layouts, projections, input_layouts=None,
                 desired_input_layouts=None, heads_split=False, kv_replicas=1):
        super().__init__()
        self.core = core_layouts
        self.projections = tuple(projections)
        self.src = input_layouts
        self.dst = desired_input_layouts or input_layouts
        self.heads_split, self.kv_replicas = bool(heads_split), int(kv_replicas)

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        n, i = device_mesh.size(), device_mesh.get_local_rank()
        rows_split = isinstance(self.core, Shard)
        state: dict = {}

        def pre(mod, args, kwargs):
            kwargs = dict(kwargs)
            x = args[0] if args else kwargs["hidden_states"]
            if self.src is not None:
                x = move(x, device_mesh, self.src, self.dst)
            if rows_split and self.src == Shard(0):  # masks / rotary already of these rows
                view, pick = _rows(x, n, i), lambda t: t
            elif rows_split:
                view, pick = _rows(x, n, i), lambda t: _rows(t, n, i)
            else:
                view, pick = x[:1].expand(x.shape[0] * n, *x.shape[1:]), \
                    lambda t: whole_rows(t, device_mesh)
            state["view"], state["x"] = view, x
            if "attention_mask" in kwargs:
                kwargs["attention_mask"] = pick(kwargs["attention_mask"])
            pe = kwargs.get("position_embeddings")
            if isinstance(pe, tuple):
                kwargs["position_embeddings"] = tuple(pick(t) for t in pe)
            if args:
                return (view, *args[1:]), kwargs
            kwargs["hidden_states"] = view
            return args, kwargs

        def post(mod, args, kwargs, out):
            state.clear()
            return out

        def projection_input(mod, args):
            x = args[0]
            if x is state.get("view"):
                return (state["x"], *args[1:])
            if rows_split:  # computed on this rank's rows: the projection needs them all
                return (move(x, device_mesh, Shard(0), Replicate()), *args[1:])
            raise ValueError("CoreRowsAttention: a projection reads a tensor computed on the "
                             "stand-in batch")

        module.register_forward_pre_hook(pre, with_kwargs=True)
        module.register_forward_hook(post, with_kwargs=True)
        for name in self.projections:
            module.get_submodule(name).register_forward_pre_hook(projection_input)
        if self.heads_split:
            HeadParallelAttention()._apply(module, device_mesh)
        if self.kv_replicas > 1:
            GroupedKVAttention(kv_replicas=self.kv_replicas)._apply(module, device_mesh)
        return module
