"""Llama-3-70B (HF LlamaConfig from REFERENCE.md): 80 layers, hidden 8192, 64/8 heads, ffn 28672."""

import torch
from transformers import LlamaConfig

from shardc.frontends.hf_build import build_causal_lm, token_ids


def config() -> LlamaConfig:
    return LlamaConfig(vocab_size=128256, hidden_size=8192, intermediate_size=28672,
                       num_hidden_layers=80, num_attention_heads=64, num_key_value_heads=8,
                       max_position_embeddings=8192, rms_norm_eps=1e-5, rope_theta=500000.0,
                       tie_word_embeddings=False)


def tiny_config() -> LlamaConfig:
    return LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                       num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=131072,
                       tie_word_embeddings=False)


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
