"""GPT-MoE 1.2T (the paper's workload): 60 layers, 1.197e12 parameters. See gpt_moe.py."""

import gpt_moe

CONFIG = gpt_moe.GPTMoEConfig(num_layers=60)


def build_model():
    return gpt_moe.build(CONFIG, device="meta")


def example_inputs():
    return gpt_moe.example_ids(CONFIG.vocab_size)


def tiny_model():
    return gpt_moe.tiny()


def tiny_inputs():
    return gpt_moe.example_ids(gpt_moe.tiny_config().vocab_size)
