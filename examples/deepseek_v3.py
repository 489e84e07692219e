"""DeepSeek-V3 671B (HF DeepseekV3Config): MLA attention, 3 dense + 58 MoE layers,
256 routed experts (+1 shared) of ffn 2048, top-8, dense ffn 18432, vocab 129280."""

import torch
from transformers import DeepseekV3Config

from shardc.frontends.hf_build import build_causal_lm, token_ids


def config() -> DeepseekV3Config:
    return DeepseekV3Config(vocab_size=129280, hidden_size=7168, intermediate_size=18432,
                            moe_intermediate_size=2048, num_hidden_layers=61, first_k_dense_replace=3,
                            num_attention_heads=128, num_key_value_heads=128, n_routed_experts=256,
                            n_shared_experts=1, num_experts_per_tok=8, n_group=8, topk_group=4,
                            q_lora_rank=1536, kv_lora_rank=512, qk_rope_head_dim=64,
                            qk_nope_head_dim=128, v_head_dim=128, tie_word_embeddings=False,
                            max_position_embeddings=163840)  # the public config (YaRN x40 of 4096)


def tiny_config() -> DeepseekV3Config:
    """3 layers (1 dense + 2 MoE), 8 heads, MLA ranks 32/16, 8 routed + 1 shared experts, top-2."""
    return DeepseekV3Config(vocab_size=256, hidden_size=64, intermediate_size=128,
                            moe_intermediate_size=32, num_hidden_layers=3, first_k_dense_replace=1,
                            num_attention_heads=8, num_key_value_heads=8, n_routed_experts=8,
                            n_shared_experts=1, num_experts_per_tok=2, n_group=1, topk_group=1,
                            q_lora_rank=32, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8,
                            v_head_dim=8, max_position_embeddings=131072, tie_word_embeddings=False)


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
