"""A tiny DeepSeek-V3 whose layers are all dense (MLA attention, gated MLP): the fast
runtime's MLA paths tested apart from its MoE blocks (tests/test_fast_runtime_attn.py)."""

import torch
from transformers import DeepseekV3Config

from shardc.frontends.hf_build import build_causal_lm, token_ids


def config() -> DeepseekV3Config:
    """2 dense layers, 8 heads, MLA ranks 32/16 (the example's tiny_config without MoE)."""
    return DeepseekV3Config(vocab_size=256, hidden_size=64, intermediate_size=128,
                            moe_intermediate_size=32, num_hidden_layers=2, first_k_dense_replace=2,
                            num_attention_heads=8, num_key_value_heads=8, n_routed_experts=8,
                            n_shared_experts=1, num_experts_per_tok=2, n_group=1, topk_group=1,
                            q_lora_rank=32, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8,
                            v_head_dim=8, max_position_embeddings=4096, tie_word_embeddings=False)


def build_model():
    return build_causal_lm(config(), device="cpu", dtype=torch.float32)


def example_inputs():
    return token_ids(config().vocab_size)
