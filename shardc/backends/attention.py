"""Layout-aware attention forwards for the families in :mod:`shardc.backends.models`.

The models' own attention code derives the token count of its output from its *input*
(``reshape(*input_shape, -1)``), which is only right when the rows a rank holds are the same
at the block's input and at the attention core. Sharding strategies move rows too:
sequence parallelism gathers them before qkv, batch-split attention scatters them after.
These forwards compute the same maths (projections, rotary, causal scaled-dot-product
attention with grouped KV heads, output projection) but take every shape from the tensor at
hand, so each placement the strategy walk leaves between the ops is handled.

Supported: causal self-attention without padding masks and without a KV cache (the verify
and serving-step setting). The projections are the model's own modules, so the hooks that
place and redistribute their tensors run as usual.
"""

from __future__ import annotations

import sys

import torch
import torch.nn.functional as F

from shardc.backends.models import AttentionSite


def _model_function(module, name: str):
    fn = getattr(sys.modules[type(module).__module__], name, None)
    if fn is None:
        raise ValueError(f"{type(module).__module__} has no {name}(); cannot shard its attention")
    return fn


def install_attention(site: AttentionSite, family: str) -> None:
    mod = site.module
    if family == "hf":
        rotary = _model_function(mod, "apply_rotary_pos_emb")
        hd = int(mod.head_dim)

        def forward(hidden_states, position_embeddings=None, attention_mask=None, **kwargs):
            q, k, v = (proj(hidden_states) for proj, _ in site.qkv)
            b, s = q.shape[0], q.shape[1]
            q, k, v = (t.reshape(b, s, -1, hd).transpose(1, 2) for t in (q, k, v))
            cos, sin = position_embeddings
            q, k = rotary(q, k, cos, sin)
            y = F.scaled_dot_product_attention(q, k, v, is_causal=s > 1, scale=mod.scaling,
                                               enable_gqa=q.shape[1] != k.shape[1])
            return site.out[0](y.transpose(1, 2).reshape(b, s, -1)), None

    elif family == "gpt_moe":
        rotary = _model_function(mod, "_rotary")
        hd, theta = int(mod.head_dim), mod.theta

        def forward(x: torch.Tensor) -> torch.Tensor:
            qkv = site.qkv[0][0](x)
            b, s = qkv.shape[0], qkv.shape[1]
            q, k, v = (t.transpose(1, 2) for t in qkv.view(b, s, 3, -1, hd).unbind(dim=2))
            q, k = rotary(q, theta), rotary(k, theta)
            y = F.scaled_dot_product_attention(q, k, v, is_causal=s > 1)
            return site.out[0](y.transpose(1, 2).reshape(b, s, -1))

    else:
        raise ValueError(f"unknown attention family {family!r}")
    mod.forward = forward
