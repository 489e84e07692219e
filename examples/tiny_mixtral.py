"""A tiny Mixtral (hidden 64, 8/4 heads, 4 experts of ffn 128 top-2, 2 layers, vocab 256) with real CPU weights."""

import mixtral_8x7b


def build_model():
    return mixtral_8x7b.tiny_model()


def example_inputs():
    return mixtral_8x7b.tiny_inputs()


def tiny_model():
    return mixtral_8x7b.tiny_model()


def tiny_inputs():
    return mixtral_8x7b.tiny_inputs()
