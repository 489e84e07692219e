"""Per-head vectors of an attention module under a heads split (torch only; inlined by
``shardc compile --standalone`` after :mod:`shardc.runtime.styles`): :class:`HeadSlices`."""

from __future__ import annotations

from torch import nn
from torch.distributed.tensor.parallel import ParallelStyle


class HeadSlices(ParallelStyle):
    """A heads split of an attention module holding one value per query head (GPT-OSS's
    attention sinks ``[heads]``, a learned logit joining each head's softmax): each named
    parameter becomes this rank's contiguous ``heads / tp`` slice -- the heads its q / o
    projections hold -- as a plain tensor, which the module's own forward concatenates to
    its local heads' scores (the fast runtime reads it as is). ``style``: the module's other
    style (moving its input, its head counts), applied first (one style per module)."""

    def __init__(self, names, style=None):
        super().__init__()
        self.names, self.style = tuple(names), style

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        if self.style is not None:
            self.style.src_data_rank = self.src_data_rank
            module = self.style._apply(module, device_mesh)
        n, i = device_mesh.size(), device_mesh.get_local_rank()
        for name in self.names:
            whole = getattr(module, name).detach()
            if whole.shape[0] % n:
                raise ValueError(f"{name} of {whole.shape[0]} heads does not split over tp={n}")
            module.register_parameter(name, nn.Parameter(whole.chunk(n)[i].clone(),
                                                         requires_grad=False))
        return module
