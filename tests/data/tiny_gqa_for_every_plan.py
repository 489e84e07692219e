"""tiny Qwen2 (k/v biases) with 8 query heads over 2 KV heads"""
import torch
from transformers import Qwen2Config

from shardc.frontends.hf_build import build_causal_lm, token_ids


def config():
    return Qwen2Config(vocab_size=256, hidden_size=64, intermediate_size=128,
                       num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=2,
                       max_position_embeddings=4096, tie_word_embeddings=False)


def build_model():
    return build_causal_lm(config(), device="cpu", dtype=torch.float32)


def example_inputs():
    return token_ids(256)
