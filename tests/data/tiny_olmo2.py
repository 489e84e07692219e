"""Tiny OLMo-2 (``Olmo2ForCausalLM``: norms after the attention / MLP branches only, no input
norms; q / k RMSNorms over the whole projection): tests/test_fast_runtime_olmo2.py."""
import torch
from transformers import Olmo2Config, Olmo2ForCausalLM

from shardc.frontends.hf_build import token_ids

CONFIG = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=1024,
              pad_token_id=0, bos_token_id=1, eos_token_id=2)


def _build(device):
    cfg = Olmo2Config(**CONFIG)
    cfg.use_cache = False
    torch.manual_seed(0)
    with torch.device(device):
        model = Olmo2ForCausalLM(cfg)
    return model.float().eval()


def build_model():
    return _build("meta")


def example_inputs():
    return token_ids(256)


def tiny_model():
    model = _build("cpu")
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():  # norm weights drawn (HF initialises them to 1)
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.3 * torch.randn(p.shape, generator=g))
    return model


tiny_inputs = example_inputs
