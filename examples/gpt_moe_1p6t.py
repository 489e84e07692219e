"""GPT-MoE 1.6T (the paper's workload): 80 layers, 1.596e12 parameters. See gpt_moe.py."""

import dataclasses

import gpt_moe

CONFIG = gpt_moe.GPTMoEConfig(num_layers=80)


def build_model(num_layers=None):
    """The full model on meta; ``num_layers`` builds only the first layers (shardc traces a
    reduced depth and expands it exactly)."""
    cfg = CONFIG if num_layers is None else dataclasses.replace(CONFIG, num_layers=num_layers)
    return gpt_moe.build(cfg, device="meta")


def example_inputs():
    return gpt_moe.example_ids(CONFIG.vocab_size)


def tiny_model():
    return gpt_moe.tiny()


def tiny_inputs():
    return gpt_moe.example_ids(gpt_moe.tiny_config().vocab_size)
