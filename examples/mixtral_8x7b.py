"""Mixtral-8x7B (HF MixtralConfig from REFERENCE.md): 32 MoE layers, 8 experts top-2, ffn 14336."""

import torch
from transformers import MixtralConfig

from shardc.frontends.hf_build import build_causal_lm, token_ids


def config() -> MixtralConfig:
    return MixtralConfig(vocab_size=32000, hidden_size=4096, intermediate_size=14336,
                         num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                         num_local_experts=8, num_experts_per_tok=2, max_position_embeddings=32768,
                         rope_theta=1e6, tie_word_embeddings=False)


def tiny_config() -> MixtralConfig:
    return MixtralConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=8, num_key_value_heads=4, num_local_experts=4,
                         num_experts_per_tok=2, max_position_embeddings=131072, tie_word_embeddings=False)


def build_model(num_layers=None):
    """The full model on meta; ``num_layers`` builds only the first layers (shardc traces a
    reduced depth and expands it exactly)."""
    return build_causal_lm(config(), num_layers=num_layers)


def example_inputs():
    return token_ids(config().vocab_size)


def tiny_model():
    return build_causal_lm(tiny_config(), device="cpu", dtype=torch.float32)


def tiny_inputs():
    return token_ids(tiny_config().vocab_size)
