"""Shared traces of the example models for the IR / frontend / passes tests.

``load_graph`` serves repeated loads from its on-disk graph cache (across processes and
runs; a change to a model file or to the frontend / passes code invalidates it); the
``lru_cache`` here only keeps one parsed Graph per process. Callers that mutate a graph
deep-copy it first."""

from __future__ import annotations

import functools
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"
TINY = ["tiny_llama", "tiny_mixtral", "deepseek_v3", "gpt_moe_1p2t"]  # traced via tiny_model()

torch.set_num_threads(1)


@functools.lru_cache(maxsize=None)
def tiny_graph(name: str):
    from shardc.frontends import load_graph

    return load_graph(EXAMPLES / f"{name}.py", tiny=True)


@functools.lru_cache(maxsize=None)
def full_graph(name: str):
    from shardc.frontends import load_graph

    return load_graph(EXAMPLES / f"{name}.py")


@functools.lru_cache(maxsize=None)
def tiny_module(name: str):
    from shardc.frontends.model_file import load_model_file

    return load_model_file(EXAMPLES / f"{name}.py").build(tiny=True)[0]
