"""A tiny Llama (hidden 64, 8/4 heads, ffn 128, 2 layers, vocab 256) with real CPU weights."""

import llama3_70b


def build_model():
    return llama3_70b.tiny_model()


def example_inputs():
    return llama3_70b.tiny_inputs()


def tiny_model():
    return llama3_70b.tiny_model()


def tiny_inputs():
    return llama3_70b.tiny_inputs()
