"""Tiny GPT-MoE whose routers carry a bias (drawn, large enough to move the top-k):
the fast runtime's sharded router with a bias (tests/test_fast_runtime_gpt_moe.py)."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
import gpt_moe  # noqa: E402
import torch  # noqa: E402
from torch import nn  # noqa: E402


def _with_router_bias(model):
    g = torch.Generator().manual_seed(7)
    for layer in model.layers:
        old = layer.moe.router
        new = nn.Linear(old.in_features, old.out_features, bias=True,
                        device=old.weight.device, dtype=old.weight.dtype)
        with torch.no_grad():
            if old.weight.device.type != "meta":
                new.weight.copy_(old.weight)
                new.bias.copy_(torch.randn(new.bias.shape, generator=g) * 0.5)
        layer.moe.router = new
    return model


def build_model():
    return _with_router_bias(gpt_moe.build(gpt_moe.tiny_config(), device="meta"))


def example_inputs():
    return gpt_moe.example_ids(gpt_moe.tiny_config().vocab_size)


def tiny_model():
    return _with_router_bias(gpt_moe.tiny())


tiny_inputs = example_inputs
