"""A column / row parallel MoE router (torch only; inlined by ``shardc compile
--standalone`` after :mod:`shardc.runtime.styles`): :class:`RouterParallel`."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ParallelStyle, RowwiseParallel

from shardc.runtime.styles import move


class _RouterLinear(torch.overrides.TorchFunctionMode):
    """Active during an HF router's forward: ``F.linear`` with a DTensor weight (the
    router's, as :class:`RouterParallel` cut it) runs on the local shard and returns the
    whole scores as a plain tensor -- ``Shard(0)`` (col): this rank's experts' scores (and
    their slice of a bias: GPT-OSS's), the features all-gathered; ``Shard(1)`` (row): partial
    sums of the rank's feature slice, all-reduced, the whole bias added after. The rest of the router (softmax / sigmoid, group-limited top-k, scatters,
    its buffers) runs on plain tensors."""

    def __init__(self, mesh):
        super().__init__()
        self.mesh = mesh

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.linear and len(args) >= 2 and isinstance(args[1], DTensor):
            bias = args[2] if len(args) > 2 else kwargs.get("bias")
            placed = isinstance(bias, DTensor)  # a col router's: this rank's experts' slice
            bias = bias.to_local() if placed else bias
            x, w = args[0], args[1]
            x = x.to_local() if isinstance(x, DTensor) else x
            n, i = self.mesh.size(), self.mesh.get_local_rank()
            if w.placements[0] == Shard(0):  # this rank's experts' scores (+ their bias)
                if bias is not None and not placed:
                    bias = bias.chunk(n)[i]
                y = F.linear(x, w.to_local(), bias)
                return move(y, self.mesh, Shard(y.dim() - 1), Replicate())
            x = x.chunk(n, dim=-1)[i]  # a local slice
            y = move(F.linear(x, w.to_local()), self.mesh, Partial(), Replicate())
            return y if bias is None else y + bias  # the whole bias once, after the sum
        return func(*args, **kwargs)


class RouterParallel(ParallelStyle):
    """A column / row parallel MoE router: ``style`` (torch's ``ColwiseParallel`` /
    ``RowwiseParallel``) as is on an ``nn.Linear`` router (GPT-MoE); an HF router module
    (which computes its scores, top-k and weights itself) gets its weight as that style
    shards it (a DTensor) and its input whole (the router's own code sizes its views from
    the hidden width); its scores matmul runs on the local shard (row: on this rank's slice
    of the features) and the scores are made whole -- all-gathered (col) or all-reduced
    (row), the collective the plan charges (under sequence parallelism after the input rows
    are all-gathered, where the plan charges an all-to-all / reduce-scatter of the scores) --
    and the rest of its own
    code runs on plain tensors (:class:`_RouterLinear`); its outputs leave at the style's
    output layout (a token-row split is a local slice of every output)."""

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
        bias = getattr(module, "bias", None)
        if isinstance(bias, nn.Parameter) and not row:  # GPT-OSS's: cut with the experts
            module.register_parameter("bias", nn.Parameter(distribute_tensor(
                bias.detach(), device_mesh, [Shard(0)], src_data_rank=self.src_data_rank),
                requires_grad=False))
        src, out = self.style.input_layouts[0], self.style.output_layouts[0]
        n, i = device_mesh.size(), device_mesh.get_local_rank()
        forward = module.forward

        def scores(x, *args, **kwargs):
            with _RouterLinear(device_mesh):
                return forward(move(x, device_mesh, src, Replicate()), *args, **kwargs)

        def rows(t):
            return t.chunk(n, dim=0)[i] if isinstance(t, torch.Tensor) and t.dim() else t

        def post(mod, args, output):
            if not (isinstance(out, Shard) and out.dim == 0):
                return output
            return tuple(rows(t) for t in output) if isinstance(output, tuple) else rows(output)

        module.forward = scores
        module.register_forward_hook(post)
        return module
