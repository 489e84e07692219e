"""Build an HF causal LM for shardc (example files and config.json): build a causal LM from a config, no download.

Full-size models are built on the ``meta`` device in bfloat16 (no memory allocated); tiny
ones on CPU in float32 with seeded weights. Attention uses ``sdpa`` where the model class
supports it and ``eager`` otherwise (Gemma-2 and GPT-OSS refuse sdpa: softcapping, attention
sinks); MoE experts use transformers' ``grouped_mm`` implementation (the ``eager`` one loops
over experts with data-dependent indexing that ``torch.export`` cannot trace).

:func:`static_rope` is the trace-time companion: rotary embeddings whose scaling depends on
the *values* of the positions (``longrope``: short or long factors by the largest position;
``dynamic``: NTK growth) cannot be exported on meta tensors; for the trace they are
evaluated once, on CPU, for the positions of a fresh forward (``0 .. S-1``), which is what
the model computes for the traced input. They hold no parameters and are input-independent,
so the graph, its parameters and its costs are unchanged.
"""

from __future__ import annotations

import contextlib
import copy

import torch
from transformers import AutoModelForCausalLM, PretrainedConfig


def causal_lm_class(config: PretrainedConfig):
    """The ``*ForCausalLM`` class ``AutoModelForCausalLM`` builds for ``config`` (or None)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    try:
        return MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]
    except KeyError:
        return None


def attention_implementation(config: PretrainedConfig) -> str:
    """``sdpa`` when the model class supports it, else ``eager`` (the model's own maths)."""
    cls = causal_lm_class(config)
    return "sdpa" if cls is None or getattr(cls, "_supports_sdpa", True) else "eager"


def truncate_config(config, num_layers: int):
    """A copy of HF ``config`` with ``num_hidden_layers = num_layers`` and every per-layer list
    (a list or tuple as long as the full depth, e.g. ``layer_types``) cut to its first
    ``num_layers`` entries; other fields (``first_k_dense_replace``, ``mlp_only_layers``,
    ``decoder_sparse_step`` ...) stay, so layers ``0 .. num_layers-1`` keep their kinds."""
    full = int(config.num_hidden_layers)
    out = copy.deepcopy(config)
    for key, value in vars(out).items():
        if isinstance(value, (list, tuple)) and len(value) == full and not key.startswith("_"):
            setattr(out, key, type(value)(value[:num_layers]))
    out.num_hidden_layers = num_layers
    return out


def build_causal_lm(config: PretrainedConfig, device: str = "meta",
                    dtype: torch.dtype = torch.bfloat16, seed: int = 0,
                    num_layers: int | None = None) -> torch.nn.Module:
    """``num_layers``: build only the first ``num_layers`` decoder layers (a truncated copy of
    ``config``: :func:`truncate_config`)."""
    if num_layers is not None:
        config = truncate_config(config, num_layers)
    kwargs = {"attn_implementation": attention_implementation(config)}
    cls = causal_lm_class(config)
    if _is_moe(config) and (cls is None or cls._can_set_experts_implementation()):
        kwargs["experts_implementation"] = "grouped_mm"
    config.use_cache = False
    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, **kwargs)
    return model.eval()


def _is_moe(config: PretrainedConfig) -> bool:
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    return any(getattr(c, k, None) for c in (config, text)
               for k in ("num_local_experts", "n_routed_experts", "num_experts"))


_VALUE_DEPENDENT_ROPE = ("longrope", "dynamic")


def _rotary_modules(model: torch.nn.Module):
    for name, mod in model.named_modules():
        rope = getattr(mod, "rope_type", None)
        if isinstance(rope, str) and any(k in rope for k in _VALUE_DEPENDENT_ROPE) \
                and getattr(mod, "config", None) is not None:
            yield name, mod


@contextlib.contextmanager
def static_rope(model: torch.nn.Module, seq_len: int):
    """While tracing ``model`` at ``seq_len`` tokens: value-dependent rotary embeddings
    (module docstring) return cos/sin computed once on CPU for positions ``0 .. seq_len-1``."""
    patched = []
    for _, mod in _rotary_modules(model):
        with torch.device("cpu"):
            twin = type(mod)(mod.config)
        pos = torch.arange(seq_len).unsqueeze(0)
        with torch.no_grad():
            cos, sin = twin(torch.zeros(1, dtype=torch.float32), position_ids=pos)

        def forward(x, position_ids=None, *args, _cs=(cos, sin), **kwargs):
            return tuple(t.to(device=x.device, dtype=x.dtype) for t in _cs)

        mod.forward = forward
        patched.append(mod)
    try:
        yield
    finally:
        for mod in patched:
            del mod.forward


def token_ids(vocab: int, batch: int = 1, seq: int = 16) -> tuple[torch.Tensor]:
    """Deterministic int64 input_ids of shape [batch, seq]."""
    g = torch.Generator().manual_seed(0)
    return (torch.randint(0, vocab, (batch, seq), generator=g, dtype=torch.int64),)
