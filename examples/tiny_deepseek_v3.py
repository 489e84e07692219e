"""A tiny DeepSeek-V3 (hidden 64, MLA ranks 32/16 with 8 heads, 1 dense + 2 MoE layers of 8
routed experts + 1 shared, top-2, vocab 256) with real CPU weights."""

import deepseek_v3


def build_model():
    return deepseek_v3.tiny_model()


def example_inputs():
    return deepseek_v3.tiny_inputs()


def tiny_model():
    return deepseek_v3.tiny_model()


def tiny_inputs():
    return deepseek_v3.tiny_inputs()
