"""Layout-aware attention forwards for the families in :mod:`shardc.backends.models`.

The models' own attention code derives the token count of its output from its *input*
(``reshape(*input_shape, -1)``), which is only right when the rows a rank holds are the same
at the block's input and at the attention core. Sharding strategies move rows too:
sequence parallelism gathers them before qkv, batch-split attention scatters them after.
These forwards compute the same maths (projections, rotary, causal scaled-dot-product
attention with grouped KV heads, output projection) but take every shape from the tensor at
hand, so each placement the strategy walk leaves between the ops is handled.

Supported: causal self-attention, with a 2-D padding mask on the model's input and the
model's KV cache when given (HF families: ``past_key_values``, updated with this rank's local keys and values -- its heads
or its rows, whichever the strategy gives it -- so each rank caches exactly what it attends
over; a step's queries are the last positions of the cached sequence). The projections are
the model's own modules, so the hooks that place and redistribute their tensors run as usual.
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


def kv_cache_arg(cache, past_key_values):
    """The KV cache a transformers attention module was called with: the ``cache`` keyword
    from transformers 5.24, ``past_key_values`` before (either may be absent)."""
    return cache if cache is not None else past_key_values


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None = None,
           cache=None, layer_idx: int | None = None, rt=None, window: int | None = None,
           softcap: float | None = None) -> torch.Tensor:
    """Causal scaled-dot-product attention of ``q`` [b, h, s_q, d] over ``k``/``v``
    [b, h_kv, s, d]; with ``cache`` (an HF ``Cache``) the new keys and values are appended
    first and the queries are the last ``s_q`` positions of the cached sequence. Padding:
    ``rt.padding_mask`` (the model input's [B, s] 0/1 mask for the rows this rank holds at
    the model level, recorded by :func:`shardc.backends.pipeline.install_batch_io`) hides
    padded keys; when attention splits those rows further over tp, this rank's chunk of
    them is taken. The model's own 4-D mask is not used: under sequence parallelism it is
    built from a sequence shard. ``window``: sliding-window attention (a query sees the keys
    less than ``window`` positions back, as transformers' sliding-window mask);
    ``softcap``: scores become ``softcap * tanh(scores / softcap)`` before the mask (Gemma-2)."""
    if cache is not None:
        k, v = cache.update(k, v, layer_idx)
    s_q, s_k = q.shape[2], k.shape[2]
    gqa = q.shape[1] != k.shape[1]
    keys = getattr(rt, "padding_mask", None)
    if keys is None and s_q == s_k and not window and softcap is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=s_q > 1, scale=scale,
                                              enable_gqa=gqa)
    k_pos, q_pos = torch.arange(s_k)[None, :], torch.arange(s_k - s_q, s_k)[:, None]
    visible = k_pos <= q_pos
    if window:
        visible = visible & (k_pos > q_pos - int(window))
    if keys is not None:
        if keys.shape[0] != q.shape[0]:
            keys = keys.chunk(keys.shape[0] // q.shape[0], dim=0)[rt.mesh.get_local_rank("tp")]
        visible = visible[None, None] & keys[:, None, None, :s_k].bool()
    if softcap is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=visible, scale=scale,
                                              enable_gqa=gqa)
    if gqa:
        k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
        v = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)
    scores = q @ k.transpose(-1, -2) * (scale if scale is not None else q.shape[-1] ** -0.5)
    scores = torch.tanh(scores / softcap) * softcap
    scores = scores.masked_fill(~visible, torch.finfo(scores.dtype).min)  # as HF's eager mask
    return F.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype) @ v


def qk_norm(norm, x: torch.Tensor, rt=None) -> torch.Tensor:
    """RMSNorm ``norm`` (replicated weight) over the last dim of ``x``. When ``x`` holds a
    tp slice of the normalised features (OLMoE's norm over the whole q / k projection under
    a heads split) the sum of squares is all-reduced over tp and this rank's slice of the
    weight is used: one [tokens, 1] all-reduce per norm (charged by the cost model:
    ``shardc.cost.layer_costs.qk_norm_all_reduce``)."""
    w = norm.weight.to_local() if hasattr(norm.weight, "to_local") else norm.weight
    eps = getattr(norm, "variance_epsilon", getattr(norm, "eps", 1e-6))
    dtype, h, n = x.dtype, x.float(), w.shape[0]
    sq = h.pow(2).sum(-1, keepdim=True)
    if x.shape[-1] != n:
        if rt is None or rt.mesh is None or x.shape[-1] * rt.tp != n:
            raise ValueError(f"q/k norm over {n} features on a tensor of {x.shape[-1]}")
        torch.distributed.all_reduce(sq, group=rt.mesh.get_group("tp"))
        w = w.chunk(rt.tp)[rt.mesh.get_local_rank("tp")]
    return w * (h * torch.rsqrt(sq / n + eps)).to(dtype)


def install_attention(site: AttentionSite, family: str, rt=None) -> None:
    mod = site.module
    if family == "hf":
        rotary = _model_function(mod, "apply_rotary_pos_emb")
        hd = int(mod.head_dim)
        norms = {pre.rsplit(".", 1)[-1]: m for m, pre in site.qk_norms}
        per_head = all(int(m.weight.shape[0]) == hd for m in norms.values())
        # per layer on the module (Qwen2, Gemma-2), else the model's mask uses the config's
        # (Mistral, Mixtral, Phi-3.5-MoE)
        window = mod.sliding_window if hasattr(mod, "sliding_window") else \
            getattr(mod.config, "sliding_window", None)
        softcap = getattr(mod, "attn_logit_softcapping", None)

        def normed(t, name):
            return qk_norm(norms[name], t, rt) if name in norms else t

        def forward(hidden_states, position_embeddings=None, attention_mask=None,
                    past_key_values=None, cache=None, **kwargs):
            q, k, v = (proj(hidden_states) for proj, _ in site.qkv)
            b, s = q.shape[0], q.shape[1]
            if not per_head:  # norms over the whole projection (OLMoE)
                q, k = normed(q, "q_norm"), normed(k, "k_norm")
            q, k, v = (t.reshape(b, s, -1, hd) for t in (q, k, v))
            if per_head:  # norms over each head's features (Qwen3)
                q, k = normed(q, "q_norm"), normed(k, "k_norm")
            q, k, v = (t.transpose(1, 2) for t in (q, k, v))
            cos, sin = position_embeddings
            q, k = rotary(q, k, cos, sin)
            kv = kv_cache_arg(cache, past_key_values)
            y = attend(q, k, v, mod.scaling, kv, mod.layer_idx, rt, window, softcap)
            return site.out[0](y.transpose(1, 2).reshape(b, s, -1)), None

    elif family == "gpt2":
        hd = int(mod.head_dim)

        def forward(hidden_states, past_key_values=None, attention_mask=None, cache=None,
                    **kwargs):
            qkv = site.qkv[0][0](hidden_states)  # q|k|v (this rank's heads of each)
            b, s = qkv.shape[0], qkv.shape[1]
            q, k, v = (t.transpose(1, 2) for t in qkv.view(b, s, 3, -1, hd).unbind(dim=2))
            kv = kv_cache_arg(cache, past_key_values)
            y = attend(q, k, v, mod.scaling, kv, mod.layer_idx, rt)
            return site.out[0](y.transpose(1, 2).reshape(b, s, -1)), None

    elif family == "gpt_moe":
        rotary = _model_function(mod, "_rotary")
        hd, theta = int(mod.head_dim), mod.theta

        def forward(x: torch.Tensor) -> torch.Tensor:
            qkv = site.qkv[0][0](x)
            b, s = qkv.shape[0], qkv.shape[1]
            q, k, v = (t.transpose(1, 2) for t in qkv.view(b, s, 3, -1, hd).unbind(dim=2))
            q, k = rotary(q, theta), rotary(k, theta)
            y = attend(q, k, v)
            return site.out[0](y.transpose(1, 2).reshape(b, s, -1))

    else:
        raise ValueError(f"unknown attention family {family!r}")
    mod.forward = forward
