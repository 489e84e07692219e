"""shardc's GPT-MoE (``examples/gpt_moe.py``, a plain PyTorch model, not an HF class) on the
fast runtime (torch only): what differs from an HF causal LM, as data and small functions
:mod:`shardc.runtime.fast` and :mod:`shardc.runtime.moe_local` read.

The layout: ``embed`` / ``layers`` / ``ln_f`` / ``lm_head`` on the model itself; blocks of
``ln_attn``, ``attn`` (one packed ``qkv`` linear ``[q | k | v]`` of full multi-head
attention, ``out``), ``ln_moe`` and ``moe`` (``router``: an ``nn.Linear`` scoring the
experts, ``top_k``; ``experts``: ``w_in [E, hidden, ffn]``, ``w_out [E, ffn, hidden]``).
Its maths, which the runtime repeats on local shards: rotate-half rotary positions from
``rope_theta`` (tables computed in fp32, cast to the weights' dtype), causal attention with
the ``1 / sqrt(head_dim)`` scale, softmax (fp32) top-k routing renormalised over the k
picked, ``gelu(x @ w_in[e]) @ w_out[e]`` per expert (the activation is checked against the
module's own forward once: :func:`check_activation`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def is_gpt_moe(model) -> bool:
    """Whether ``model`` (or its pipeline stage's cut model) has GPT-MoE's layout."""
    return not hasattr(model, "model") and not hasattr(model, "transformer") and all(
        hasattr(model, a) for a in ("embed", "layers", "ln_f", "lm_head"))


def rotary_tables(theta: float, head_dim: int, context: int, device, dtype):
    """cos / sin ``[context, head_dim]`` of positions ``0 .. context - 1`` as GPT-MoE's
    ``_rotary`` computes them (fp32 angles, both halves alike, cast to ``dtype``)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=device,
                                             dtype=torch.float32) / head_dim))
    angles = torch.outer(torch.arange(context, device=device, dtype=torch.float32), inv_freq)
    emb = torch.cat([angles, angles], -1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def top_k_routing(logits: torch.Tensor, k: int):
    """GPT-MoE's ``MoE.forward`` routing of whole scores ``logits [T, E]``: softmax (fp32),
    the ``k`` largest, renormalised to sum 1. Returns ``(logits, weights [T, k], index)``
    (an HF router's outputs)."""
    probs = F.softmax(logits, dim=-1, dtype=torch.float32)
    weights, idx = torch.topk(probs, k, dim=-1)
    return logits, weights / weights.sum(-1, keepdim=True), idx


def is_plain_router(router) -> bool:
    """A plain ``nn.Linear`` router (GPT-MoE's): the block, not the router, picks the
    experts. A subclass (Phi-3.5-MoE's ``PhimoeTopKRouter``) has a forward of its own."""
    return type(router) is nn.Linear


def expert_weights(experts):
    """``(first [E_local, out, in], second [E_local, out, in], act, gated)`` of GPT-MoE's
    experts on this rank: ``w_in`` / ``w_out`` (stored ``[E, in, out]``) read transposed in
    place (no copy), the GeLU between them, not gated."""
    def local(t):
        return t.to_local() if hasattr(t, "to_local") else t

    return local(experts.w_in).transpose(1, 2), local(experts.w_out).transpose(1, 2), F.gelu, \
        False


def check_activation(experts) -> None:
    """NotImplementedError unless the experts module's own forward computes
    ``gelu(x @ w_in) @ w_out`` (its class's forward run once on a probe with identity
    weights on a copy: ``[1, k, k]`` eye, every row to expert 0 with weight 1)."""
    k = 8
    probe = torch.linspace(-3.0, 3.0, 4 * k).view(4, k)
    eye = torch.eye(k).unsqueeze(0)
    module = type(experts).__new__(type(experts))
    nn.Module.__init__(module)
    module.__dict__.update({n: v for n, v in experts.__dict__.items()
                            if not n.startswith("_") and n != "forward"})
    module.w_in, module.w_out = nn.Parameter(eye.clone()), nn.Parameter(eye.clone())
    if hasattr(module, "num_experts"):
        module.num_experts = 1
    ids = torch.zeros(4, 1, dtype=torch.long)
    with torch.no_grad():
        got = type(experts).forward(module, probe, ids, torch.ones(4, 1))
    if not torch.allclose(got, F.gelu(probe), atol=1e-6):
        raise NotImplementedError(f"{type(experts).__name__}: GPT-MoE-layout experts whose "
                                  "activation is not GeLU")
