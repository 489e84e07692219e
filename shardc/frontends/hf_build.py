"""Build an HF causal LM for shardc (example files and config.json): build a causal LM from a config, no download.

Full-size models are built on the ``meta`` device in bfloat16 (no memory allocated); tiny
ones on CPU in float32 with seeded weights. Attention uses ``sdpa``; MoE experts use
transformers' ``grouped_mm`` implementation (the ``eager`` one loops over experts with
data-dependent indexing that ``torch.export`` cannot trace).
"""

from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM, PretrainedConfig


def build_causal_lm(config: PretrainedConfig, device: str = "meta",
                    dtype: torch.dtype = torch.bfloat16, seed: int = 0,
                    num_layers: int | None = None) -> torch.nn.Module:
    """``num_layers``: build only the first ``num_layers`` decoder layers (a truncated copy of
    ``config``: :func:`shardc.frontends.reduced_depth.truncate_config`)."""
    if num_layers is not None:
        from shardc.frontends.reduced_depth import truncate_config

        config = truncate_config(config, num_layers)
    kwargs = {"attn_implementation": "sdpa"}
    if _is_moe(config):
        kwargs["experts_implementation"] = "grouped_mm"
    config.use_cache = False
    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, **kwargs)
    return model.eval()


def _is_moe(config: PretrainedConfig) -> bool:
    return any(getattr(config, k, None) for k in ("num_local_experts", "n_routed_experts", "num_experts"))


def token_ids(vocab: int, batch: int = 1, seq: int = 16) -> tuple[torch.Tensor]:
    """Deterministic int64 input_ids of shape [batch, seq]."""
    g = torch.Generator().manual_seed(0)
    return (torch.randint(0, vocab, (batch, seq), generator=g, dtype=torch.int64),)
