"""The DTensor runtime behind ``parallelize.py`` and ``Plan.apply``.

:class:`ShardingRuntime` places a model's parameters as DTensors on the SPMD mesh (the
logical mesh minus ``pp``) and wraps each fused op's modules with hooks that move the
activation between the placements the strategy prescribes. The walk through a branch
(residual -> qkv -> attention core -> out-proj -> residual, ...) is
:func:`shardc.ir.contract.walk`, the same walk the cost model charges from; every
repair is ``DTensor.redistribute`` (all-gather, all-reduce, reduce-scatter, all-to-all).

Activation conventions (plan.json speaks of [tokens, features]):

* over ``dp`` and ``ep`` an activation is split over the batch: ``Shard(0)``;
* over ``tp``: ``R`` = ``Replicate()``, ``S(0)`` = ``Shard(0)`` (batch rows: sequence
  parallel, batch-split attention), ``S(1)`` = ``Shard(-1)`` (features, heads),
  ``P`` = ``Partial()``;
* between fused ops (attention core, activations, norms, residual adds) the model's own code
  runs on the *local* tensors, which is exact for every placement the walk leaves there:
  partial sums are always reduced at the producer, before any non-linearity.

Parameters are cut from the full tensor each rank already holds (built from the same seed
or loaded from the same checkpoint): no broadcast is issued, so meta-device models on the
``fake`` process group can be placed too. Which fused op reads a parameter, which tensor dim
each choice cuts, its expert dim, its packed parts and its pipeline stage come from plan.json's
``params`` rows (the IR's: :mod:`shardc.ir.param_roles`), never from the parameter's name.
Packed outputs (GPT-MoE's ``q|k|v``, Mixtral's ``gate|up``) are interleaved per tp rank
first, so a column split keeps matching parts.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

from shardc.backends.layout import kv_repeat, rows_by_fqn, spmd_dims, use_placements
from shardc.ir.contract import BRANCHES, walk
from shardc.ir.strategy import Strategy, residual_placement

_TP_PLACEMENT = {"R": Replicate(), "P": Partial()}


def interleave(t: torch.Tensor, dim: int, parts: int, n: int) -> torch.Tensor:
    """Reorder ``dim`` = [part0 | part1 | ...] into [part0_r0, part1_r0, ..., part0_r1, ...]:
    a contiguous n-way split then gives every rank its matching slice of every part."""
    c = t.shape[dim] // (parts * n)
    return t.unflatten(dim, (parts, n, c)).transpose(dim, dim + 1).flatten(dim, dim + 2)


def repeat_heads(t: torch.Tensor, dim: int, heads: int, repeat: int) -> torch.Tensor:
    """``dim`` = [head0 | head1 | ...] (``heads`` equal parts) -> each head ``repeat`` times
    in a row: a tp split of the result gives every rank the KV head its query heads read."""
    d = dim % t.dim()
    return t.unflatten(d, (heads, -1)).repeat_interleave(repeat, dim=d).flatten(d, d + 1)


def deinterleave(t: torch.Tensor, parts: int, n: int) -> torch.Tensor:
    """Inverse of :func:`interleave` on the last dim (a full, gathered activation)."""
    c = t.shape[-1] // (parts * n)
    return t.unflatten(-1, (n, parts, c)).transpose(-3, -2).flatten(-3)


class ShardingRuntime:
    """Applies one strategy to one model (or one pipeline stage of it) on ``world_mesh``.

    ``kind_of_layer`` maps decoder-layer index -> layer-kind name (the keys of
    ``strategy.choices`` are ``"<kind>.<op>"``); ``params`` is plan.json's ``params`` rows
    (a plan of schema 1 without the IR fields too: :func:`shardc.backends.layout.rows_by_fqn`).
    """

    def __init__(self, model: nn.Module, strategy: Strategy, world_mesh: DeviceMesh | None,
                 kind_of_layer: dict[int, str], params: list[dict]):
        self.model, self.strategy, self.kind_of_layer = model, strategy, kind_of_layer
        self.rows = rows_by_fqn(params, strategy.degrees.pp - 1)
        self.degrees = strategy.degrees
        self.dims = spmd_dims(self.degrees)
        self.tp = self.degrees.tp
        self.residual = residual_placement(self.degrees)
        self.world_mesh = world_mesh
        self.mesh = None
        if self.dims:
            self.mesh = world_mesh if tuple(world_mesh.mesh_dim_names) == tuple(self.dims) \
                else world_mesh[tuple(self.dims) if len(self.dims) > 1 else self.dims[0]]
        self.placed: dict[str, list[str]] = {}
        # id(k / v module) -> (kv_heads, repeat): its output is made whole, each KV head
        # repeated, then split over tp (a heads split with tp > kv_heads after a qkv that is
        # not column split; with a column split the weights are repeated instead)
        self.kv_expand: dict[int, tuple[int, int]] = {}
        self.padding_mask: torch.Tensor | None = None  # this forward's [rows, seq] 0/1 mask

    # ------------------------------------------------------------------ placements
    def placements(self, tp: str, ndim: int, kind: str = "act") -> list:
        """DTensor placements of a local activation. ``kind`` "act": [batch, ..., features];
        "expert": an expert buffer [experts, tokens, features] (ep splits experts)."""
        token, expert = (1, 0) if kind == "expert" else (0, None)
        out = []
        for d in self.dims:
            if d == "ep" and expert is not None:
                out.append(Shard(expert))
            elif d in ("dp", "ep"):
                out.append(Shard(token))
            elif tp == "S(0)":
                out.append(Shard(token))
            elif tp == "S(1)":
                out.append(Shard(ndim - 1))
            else:
                out.append(_TP_PLACEMENT[tp])
        return out

    def wrap(self, x: torch.Tensor, tp: str, kind: str = "act"):
        if self.mesh is None:
            return x
        return DTensor.from_local(x, self.mesh, self.placements(tp, x.ndim, kind), run_check=False)

    def redist(self, x, tp: str, kind: str = "act"):
        if self.mesh is None:
            return x
        want = self.placements(tp, x.ndim, kind)
        if tuple(x.placements) == tuple(want):
            return x
        return x.redistribute(self.mesh, want)

    def local(self, x):
        return x.to_local() if isinstance(x, DTensor) else x

    # ------------------------------------------------------------------ parameters
    def place_param(self, module: nn.Module, name: str, fqn: str, kv_heads: int = 0) -> None:
        """Replace ``module.<name>`` by a DTensor parameter with the placements of its plan
        row (``kv_heads``: the attention's KV heads when ``module`` is its k or v projection,
        whose heads may be repeated before the tp split, :func:`shardc.backends.layout.kv_repeat`)."""
        row = self.rows.get(fqn)
        if row is None:
            raise ValueError(f"parameter {fqn} has no row in the plan's params (a plan for "
                             "another model?)")
        p = getattr(module, name)
        full = p.detach()
        parts = row.get("parts") or []
        if len(parts) > 1 and self.tp > 1:
            if len(set(parts)) > 1:
                raise ValueError(f"{fqn}: packed parts {parts} of unequal widths")
            full = interleave(full, row["split_dims"][0], len(parts), self.tp)
        repeat = kv_repeat(kv_heads > 0, row.get("layer"), self.strategy, self.kind_of_layer,
                           kv_heads)
        if repeat > 1:
            full = repeat_heads(full, 0, kv_heads, repeat)
        spelled = use_placements(row, full.ndim, self.strategy, self.kind_of_layer)
        self.placed[fqn] = spelled
        if self.mesh is None:
            return
        placements, local = [], full
        for d, sp in zip(self.dims, spelled):
            if sp == "R":
                placements.append(Replicate())
                continue
            k = int(sp[2:-1])
            placements.append(Shard(k))
            local = local.chunk(getattr(self.degrees, d), dim=k)[self.mesh.get_local_rank(d)]
        dt = DTensor.from_local(local.contiguous(), self.mesh, placements, run_check=False,
                                shape=full.shape, stride=full.contiguous().stride())
        module.register_parameter(name, nn.Parameter(dt, requires_grad=False))

    def place_module_params(self, module: nn.Module, prefix: str, kv_heads: int = 0) -> None:
        for name, _ in list(module.named_parameters(recurse=False)):
            self.place_param(module, name, f"{prefix}.{name}" if prefix else name, kv_heads)

    # ------------------------------------------------------------------ hooks
    def choice(self, op: str, layer: int | None) -> int:
        kind = self.kind_of_layer.get(layer) if layer is not None else None
        key = op if kind is None else f"{kind}.{op}"
        return int(self.strategy.choices.get(key, 2))

    def walk(self, branch_or_ops, layer: int | None, start=None, end=None):
        ops = BRANCHES.get(branch_or_ops, branch_or_ops) if isinstance(branch_or_ops, str) \
            else branch_or_ops
        if isinstance(ops, str):
            ops = (ops,)
        w = walk(tuple(ops), [self.choice(o, layer) for o in ops],
                 self.residual if start is None else start,
                 self.residual if end is None else end)
        return [(s.need, s.produced, s.after) for s in w.steps]

    def hook_op(self, module: nn.Module, src: str, need: str, after: str,
                unfuse: int = 1, memo: list | None = None) -> None:
        """Input: local ``src`` -> DTensor ``need``; output: DTensor -> ``after`` -> local
        (de-interleaved when a packed output ends up whole). Modules of one op that read the
        same tensor (q/k/v, gate/up) share ``memo``, so its repair is issued once."""
        memo = memo if memo is not None else [None, None]

        def pre(mod, args, kwargs):
            x = args[0]
            if memo[0] is not x:
                memo[0], memo[1] = x, self.redist(self.wrap(x, src), need)
            return (memo[1], *args[1:]), kwargs

        def post(mod, args, kwargs, out):
            kv = self.kv_expand.get(id(mod))
            if kv is not None and after == "S(1)":  # whole -> this rank's (repeated) KV head
                full = repeat_heads(self.local(self.redist(out, "R")), -1, *kv)
                return full.chunk(self.tp, dim=-1)[self.mesh.get_local_rank("tp")]
            out = self.local(self.redist(out, after))
            if unfuse > 1 and self.tp > 1 and after != "S(1)":
                out = deinterleave(out, unfuse, self.tp)
            return out

        module.register_forward_pre_hook(pre, with_kwargs=True)
        module.register_forward_hook(post, with_kwargs=True)

    def hook_local(self, module: nn.Module, placement: str) -> None:
        """Run ``module`` (a norm) in DTensor on activations at ``placement``."""
        def pre(mod, args, kwargs):
            return (self.wrap(args[0], placement), *args[1:]), kwargs

        def post(mod, args, kwargs, out):
            return self.local(out)

        if self.mesh is not None:
            module.register_forward_pre_hook(pre, with_kwargs=True)
            module.register_forward_hook(post, with_kwargs=True)

    def hook_chain(self, modules_per_op: list[list[nn.Module]], steps, start: str,
                   unfuse: list[int] | None = None) -> None:
        """Hook a branch: ``modules_per_op[i]`` run op i (empty = op without a module, e.g.
        the attention core, whose output is repaired at the next op's input)."""
        src = start
        for i, (mods, (need, produced, after)) in enumerate(zip(modules_per_op, steps)):
            if not mods:
                src = produced
                continue
            memo: list = [None, None]
            for m in mods:
                self.hook_op(m, src, need, after, unfuse[i] if unfuse else 1, memo)
            src = after
