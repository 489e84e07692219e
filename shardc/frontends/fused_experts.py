"""Trace-time form of MoE experts stored as one 2-D parameter per projection (DBRX).

transformers' ``DbrxExperts`` keeps its experts' weights as three parameters of shape
``[E * f, h]`` (``mlp.w1`` gate, ``mlp.v1`` up, ``mlp.w2`` down, each expert ``f`` rows of
them) and loops over the experts the router hit, indexing by the router's values -- a loop
``torch.export`` cannot trace (a guard on data). It has no ``experts_implementation`` switch
like the other MoEs (Mixtral, Qwen2-MoE, OLMoE ...), whose ``grouped_mm`` form
:func:`shardc.frontends.hf_build.build_causal_lm` selects.

While a model is traced (:func:`fused_experts`), every such module computes the same function
in that grouped form: tokens sorted by expert, one grouped matmul per projection (transformers'
own ``_grouped_linear``), the routing weights applied and the top-k outputs summed per token.
Its three parameters are seen as ``[E, f, h]`` -- the same storage, elements and names -- so the
graph holds the expert ops every MoE has: ``expert_ffn1`` (the gate and up grouped matmuls,
``h -> f`` each) and ``expert_ffn2`` (``f -> h``) with ``E`` experts. The model's parameters
and forward are restored on exit; outside a trace (the tiny model's numerics, ``shardc
verify``) the model runs transformers' own loop.
"""

from __future__ import annotations

import contextlib
import types

import torch
from torch import nn

# class name (in a transformers module) -> (its GLU submodule, (gate, up, down) parameters)
FUSED_EXPERT_CLASSES = {"DbrxExperts": ("mlp", ("w1", "v1", "w2"))}


def _grouped_forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                     top_k_weights: torch.Tensor) -> torch.Tensor:
    """``DbrxExperts.forward`` with grouped matmuls: the same outputs as its expert loop."""
    from transformers.integrations.moe import _grouped_linear

    glu = self.mlp
    hidden = self.hidden_size
    batch = hidden_states.shape[0]
    x = hidden_states.reshape(-1, hidden)
    num_tokens, top_k = x.shape[0], top_k_index.shape[-1]
    expert_ids, perm = torch.sort(top_k_index.reshape(-1))
    routed = x[perm // top_k]
    weights = top_k_weights.reshape(-1)[perm]
    # histc counts floats on CPU, ints elsewhere (as transformers' grouped_mm experts do)
    counts = torch.histc(expert_ids.float() if x.device.type in ("cpu", "mps") else expert_ids.int(),
                         bins=self.num_experts, min=0, max=self.num_experts - 1)
    offsets = torch.cumsum(counts, dim=0, dtype=torch.int32)
    gate = _grouped_linear(routed, glu.w1, offsets)  # [E, f, h] read as x @ W^T: h -> f
    up = _grouped_linear(routed, glu.v1, offsets)
    inner = glu.activation_fn(gate) * up
    down = _grouped_linear(inner, glu.w2, offsets, is_transposed=True)  # [E, f, h]: f -> h
    down = down * weights.unsqueeze(-1)
    inverse = torch.empty_like(perm)
    inverse[perm] = torch.arange(perm.numel(), device=perm.device)
    out = down[inverse].view(num_tokens, top_k, hidden).sum(dim=1)
    return out.view(batch, -1, hidden).to(hidden_states.dtype)


def fused_expert_modules(model: nn.Module) -> list[nn.Module]:
    """The modules of ``model`` whose experts are stored fused (:data:`FUSED_EXPERT_CLASSES`)."""
    return [m for m in model.modules() if type(m).__name__ in FUSED_EXPERT_CLASSES
            and type(m).__module__.startswith("transformers.")]


@contextlib.contextmanager
def fused_experts(model: nn.Module):
    """While tracing ``model``: its fused-expert modules in the grouped form of the module
    docstring (parameters seen as ``[E, f, h]``); restored on exit."""
    saved = []
    for mod in fused_expert_modules(model):
        sub_name, names = FUSED_EXPERT_CLASSES[type(mod).__name__]
        glu = getattr(mod, sub_name)
        shape = (int(mod.num_experts), int(mod.ffn_hidden_size), int(mod.hidden_size))
        originals = {n: getattr(glu, n) for n in names}
        saved.append((mod, glu, originals))
        for n, p in originals.items():
            setattr(glu, n, nn.Parameter(p.detach().view(shape), requires_grad=False))
        mod.forward = types.MethodType(_grouped_forward, mod)
    try:
        yield
    finally:
        for mod, glu, originals in saved:
            for n, p in originals.items():
                setattr(glu, n, p)
            del mod.forward


def fused_experts_note(model: nn.Module) -> str | None:
    """The frontend's note on a model with fused experts (printed by every command, as the
    other substitutions are), None without any."""
    mods = fused_expert_modules(model)
    if not mods:
        return None
    mod = mods[0]
    sub_name, names = FUSED_EXPERT_CLASSES[type(mod).__name__]
    e, f, h = int(mod.num_experts), int(mod.ffn_hidden_size), int(mod.hidden_size)
    return (f"{type(mod).__name__} stores each expert projection as one [{e * f}, {h}] "
            f"parameter ({', '.join(f'{sub_name}.{n}' for n in names)}); traced as grouped "
            f"matmuls over [{e}, {f}, {h}] views of them (the same weights), which plan.json "
            "lists")
