"""Reduced-depth tracing (shardc.frontends.reduced_depth): a model traced at a reduced depth
and expanded must give exactly the graph (and the plan) of a full trace; a pattern that
cannot be proven falls back to the full trace and says so."""

from __future__ import annotations

import dataclasses
import json
import sys
import textwrap

import pytest
import torch
from traced_examples import EXAMPLES

import shardc
from shardc.frontends import graph_from_module, load_graph, reduced_depth
from shardc.frontends.hf_build import build_causal_lm, token_ids, truncate_config
from shardc.frontends.model_file import ModelSource, load_model_file
from shardc.passes import run_passes

sys.path.insert(0, str(EXAMPLES))
import deepseek_v3  # noqa: E402
import gpt_moe  # noqa: E402
import llama3_70b  # noqa: E402
import mixtral_8x7b  # noqa: E402

_SMALL = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_attention_heads=8,
              num_key_value_heads=4, head_dim=8, max_position_embeddings=8192)


def _hf_source(config, name: str = "m") -> ModelSource:
    """A ModelSource built like a config.json one (meta, bf16), opting in to num_layers."""
    return ModelSource(name=name, source=f"{name}.py",
                       build_model=lambda num_layers=None: build_causal_lm(config, num_layers=num_layers),
                       example_inputs=lambda: token_ids(config.vocab_size))


def _with_layers(config, layers: int, **changes):
    config.num_hidden_layers = layers
    for k, v in changes.items():
        setattr(config, k, v)
    return config


def _gpt_moe_source(layers: int) -> ModelSource:
    cfg = gpt_moe.tiny_config(layers)

    def build_model(num_layers=None):
        return gpt_moe.build(dataclasses.replace(cfg, num_layers=num_layers or layers))

    return ModelSource(name="gpt_moe", source="gpt_moe.py", build_model=build_model,
                       example_inputs=lambda: gpt_moe.example_ids(cfg.vocab_size))


def _auto(model_type: str, layers: int, **extra):
    from transformers import AutoConfig

    return AutoConfig.for_model(model_type, **_SMALL, num_hidden_layers=layers, **extra)


# Tiny, deeper variants of every example architecture, and config families with layer patterns.
CASES = {
    "deepseek_v3": lambda: _hf_source(_with_layers(deepseek_v3.tiny_config(), 7,
                                                   first_k_dense_replace=2)),
    "llama3_70b": lambda: _hf_source(_with_layers(llama3_70b.tiny_config(), 6)),
    "mixtral_8x7b": lambda: _hf_source(_with_layers(mixtral_8x7b.tiny_config(), 5)),
    "gpt_moe": lambda: _gpt_moe_source(6),
    "qwen3_moe_sparse_step_2": lambda: _hf_source(_auto(
        "qwen3_moe", 8, moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2,
        decoder_sparse_step=2)),
    "qwen3_moe_mlp_only_layers": lambda: _hf_source(_auto(
        "qwen3_moe", 8, moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2,
        mlp_only_layers=[0, 3])),
    "qwen3": lambda: _hf_source(_auto("qwen3", 6)),
    "qwen2_max_window_layers": lambda: _hf_source(_auto(
        "qwen2", 8, use_sliding_window=True, sliding_window=4, max_window_layers=3)),
    "gemma3_sliding_pattern": lambda: _hf_source(_auto(
        "gemma3_text", 9, sliding_window=4, sliding_window_pattern=3)),
    # a list that is not per layer (Llama-3.3's 3 end-of-turn ids) as long as the reduced depth
    "llama_eos_token_id_list": lambda: _hf_source(_auto("llama", 6, eos_token_id=[1, 2, 3])),
}


def _trace_both(src: ModelSource):
    """(full-trace graph, reduced-and-expanded graph, reduced depth) of ``src``."""
    torch.set_num_threads(1)
    model, inputs = src.build()
    full = graph_from_module(model, inputs, name=src.name, source=src.source)
    kinds = reduced_depth.kinds_of(reduced_depth.layer_signatures(model))
    raw = reduced_depth.trace_reduced(src, model, inputs)
    assert raw is not None, "no reduced depth chosen"
    return full, run_passes(raw), reduced_depth.choose_depth(kinds)


def _plan_dict(graph, mesh: str) -> dict:
    plan = shardc.compile(graph, mesh=mesh, search="exact", budget=200)
    return _drop_wall_times(plan.to_dict())


def _drop_wall_times(d):
    if isinstance(d, dict):
        return {k: _drop_wall_times(v) for k, v in d.items() if k != "wall_s"}
    if isinstance(d, list):
        return [_drop_wall_times(v) for v in d]
    return d


@pytest.mark.parametrize("case", sorted(CASES))
def test_expanded_graph_equals_full_trace(case):
    full, expanded, depth = _trace_both(CASES[case]())
    assert depth < full.num_layers  # the reduced path was taken
    assert expanded.to_dict() == full.to_dict()  # node for node, params, kinds, config
    assert expanded.num_params == full.num_params
    assert [(k.name, k.count, k.layers) for k in expanded.layer_kinds] == \
        [(k.name, k.count, k.layers) for k in full.layer_kinds]


@pytest.mark.parametrize("case", ["deepseek_v3", "llama3_70b", "mixtral_8x7b", "gpt_moe",
                                  "qwen3_moe_sparse_step_2"])
def test_plan_from_reduced_trace_equals_full(case):
    full, expanded, _ = _trace_both(CASES[case]())
    assert _plan_dict(expanded, "4x1") == _plan_dict(full, "4x1")


def test_full_size_mixtral_expansion_equals_full_trace():
    src = load_model_file(EXAMPLES / "mixtral_8x7b.py")
    full, expanded, depth = _trace_both(src)
    assert (depth, full.num_layers) == (3, 32)
    assert len(expanded.nodes) == len(full.nodes)
    assert expanded.to_dict() == full.to_dict()
    assert _plan_dict(expanded, "8x2") == _plan_dict(full, "8x2")


@pytest.mark.parametrize("example", ["deepseek_v3", "llama3_70b", "mixtral_8x7b",
                                     "gpt_moe_1p2t", "gpt_moe_1p6t"])
def test_full_size_examples_opt_in_with_a_consistent_reduced_build(example):
    """Every full-size example takes num_layers and its reduced build has the full model's
    first layers (the trace itself is compared on the tiny variants above and Mixtral)."""
    src = load_model_file(EXAMPLES / f"{example}.py")
    assert reduced_depth.accepts_num_layers(src.build_model)
    signatures = reduced_depth.layer_signatures(src.build_model())
    depth = reduced_depth.choose_depth(reduced_depth.kinds_of(signatures))
    assert depth is not None and depth <= 5 < len(signatures)
    assert reduced_depth.layer_signatures(src.build_model(num_layers=depth)) == signatures[:depth]


def test_layer_kinds_of_deepseek_v3_come_from_first_k_dense_replace():
    model = load_model_file(EXAMPLES / "deepseek_v3.py").build_model()
    kinds = reduced_depth.kinds_of(reduced_depth.layer_signatures(model))
    assert kinds == [0, 0, 0] + [1] * 58
    assert reduced_depth.choose_depth(kinds) == 5


@pytest.mark.parametrize("kinds, depth", [
    ([0] * 80, 3),                          # one kind: layers 0 (reads the embedding), 1, 2
    ([0, 0, 0] + [1] * 58, 5),              # dense-first
    ([0, 1] * 24, 6),                       # MoE every 2nd layer: 1..5 hold both twice, end on 1
    ([0, 0, 1] * 4, 6),                     # 2:1 alternation, last layer kind 1
    ([0, 1, 2], None),                      # nothing to gain
    ([0] * 10 + [1], None),                 # a kind only in the last layer
])
def test_choose_depth(kinds, depth):
    assert reduced_depth.choose_depth(kinds) == depth


def test_truncate_config_cuts_per_layer_lists_only():
    config = _auto("gemma3_text", 9, sliding_window=4, sliding_window_pattern=3)
    cut = truncate_config(config, 4)
    assert cut.num_hidden_layers == 4 and config.num_hidden_layers == 9
    assert cut.layer_types == config.layer_types[:4]
    ds = truncate_config(deepseek_v3.config(), 5)
    assert (ds.num_hidden_layers, ds.first_k_dense_replace) == (5, 3)


def test_config_json_compile_writes_the_same_plan_as_a_full_trace(tmp_path, monkeypatch):
    """`shardc compile config.json` end to end: reduced (default) and SHARDC_FULL_TRACE=1."""
    from shardc.cli import main

    cfg = _auto("qwen3_moe", 8, moe_intermediate_size=32, num_experts=4,
                num_experts_per_tok=2, decoder_sparse_step=2)
    path = tmp_path / "qwen3_moe_tiny" / "config.json"
    path.parent.mkdir()
    path.write_text(cfg.to_json_string())
    monkeypatch.setenv("SHARDC_NO_CACHE", "1")
    calls = []
    real = reduced_depth.trace_reduced
    monkeypatch.setattr(reduced_depth, "trace_reduced",
                        lambda *a: calls.append(1) or real(*a))
    plans = {}
    for mode in ("reduced", "full"):
        if mode == "full":
            monkeypatch.setenv(reduced_depth.FULL_TRACE_ENV, "1")
        out = tmp_path / mode
        assert main(["compile", str(path), "--mesh", "4x1", "--search", "exact",
                     "--out", str(out), "--quiet"]) == 0
        plans[mode] = _drop_wall_times(json.loads((out / "plan.json").read_text()))
        assert len(calls) == 1  # the first run took the reduced path, the second did not
    assert plans["reduced"] == plans["full"]
    assert plans["reduced"]["model"]["layers"] == 8


_MODEL_FILE = '''
import torch
from torch import nn


class Block(nn.Module):
    def __init__(self, layer_idx):
        super().__init__()
        self.layer_idx = layer_idx
        self.fc = nn.Linear(16, 16)

    def forward(self, x, first):
        {body}


class Net(nn.Module):
    def __init__(self, layers):
        super().__init__()
        self.embed = nn.Embedding(32, 16)
        self.layers = nn.ModuleList(Block(i) for i in range(layers))
        self.head = nn.Linear(16, 32)

    def forward(self, ids):
        x = first = self.embed(ids)
        for layer in self.layers:
            x, first = layer(x, first), x
        return self.head(x)


def build_model({params}):
    torch.manual_seed(0)
    return Net({layers})


def example_inputs():
    return (torch.randint(0, 32, (1, 4)),)
'''


@pytest.mark.parametrize("why, body, params, layers", [
    # the forward uses the layer index (not a module difference): layer 1 != layer 2
    ("differently", "return self.fc(x) * float(self.layer_idx + 1)", "num_layers=None",
     "num_layers or 8"),
    # every layer from 2 on reads the output of the layer before the previous one
    ("outside its layer", "return self.fc(x) + first", "num_layers=None", "num_layers or 8"),
    # build_model ignores num_layers
    ("does not build", "return self.fc(x)", "num_layers=None", "8"),
])
def test_unprovable_pattern_falls_back_to_full_trace(tmp_path, monkeypatch, capsys, why, body,
                                                     params, layers):
    path = tmp_path / "model.py"
    path.write_text(textwrap.dedent(_MODEL_FILE).format(body=body, params=params, layers=layers))
    monkeypatch.setenv("SHARDC_NO_CACHE", "1")
    graph = load_graph(path)
    err = capsys.readouterr().err
    assert err.startswith("shardc: note: ") and "tracing every layer" in err and why in err
    assert err.count("\n") == 1
    src = load_model_file(path)
    model, inputs = src.build()
    assert graph.to_dict() == graph_from_module(model, inputs, name=src.name,
                                                source=src.source).to_dict()


def test_model_file_without_num_layers_keeps_the_full_trace(tmp_path, monkeypatch, capsys):
    path = tmp_path / "model.py"
    path.write_text(textwrap.dedent(_MODEL_FILE).format(body="return self.fc(x)", params="",
                                                        layers="8"))
    monkeypatch.setenv("SHARDC_NO_CACHE", "1")
    monkeypatch.setattr(reduced_depth, "trace_reduced",
                        lambda *a: pytest.fail("reduced path taken without the opt-in"))
    assert load_graph(path).num_layers == 8
    assert capsys.readouterr().err == ""


def test_opted_in_model_file_is_reduced_through_load_graph(tmp_path, monkeypatch, capsys):
    path = tmp_path / "model.py"
    path.write_text(textwrap.dedent(_MODEL_FILE).format(body="return self.fc(x)",
                                                        params="num_layers=None",
                                                        layers="num_layers or 8"))
    monkeypatch.setenv("SHARDC_NO_CACHE", "1")
    depths = []
    real = reduced_depth.expand
    monkeypatch.setattr(reduced_depth, "expand", lambda g, ep, kinds: depths.append(
        len({n.layer for n in g.nodes if n.layer is not None})) or real(g, ep, kinds))
    graph = load_graph(path)
    assert depths == [3] and capsys.readouterr().err == ""
    monkeypatch.setenv(reduced_depth.FULL_TRACE_ENV, "1")
    assert load_graph(path).to_dict() == graph.to_dict()
    assert depths == [3]


def test_a_copied_node_equals_its_template_and_shares_nothing_mutable():
    from dataclasses import fields

    from shardc.frontends.reduced_depth import _copy_node
    from shardc.ir.graph import Node, Param

    shape = [4, 8]
    n = Node("mm_3", "linear", target="aten.mm.default", inputs=["x"], input_shapes=[shape, [8, 8]],
             output_shape=shape, params=[Param("model.layers.2.w", [8, 8])], layer=2,
             placements=["S(0)"], redistribute={"a": [1]}, attrs={"k": {"v": [1, 2]}})
    c = _copy_node(n, name="mm_9", layer=5)
    assert (c.name, c.layer) == ("mm_9", 5)
    for f in fields(Node):
        if f.name not in ("name", "layer"):
            assert getattr(c, f.name) == getattr(n, f.name), f.name
            v = getattr(c, f.name)
            if isinstance(v, (list, dict)):
                assert v is not getattr(n, f.name), f.name
    assert c.input_shapes[0] is c.output_shape  # shared inside the node, as in the template
    c.attrs["k"]["v"].append(3)
    c.params[0].shape.append(1)
    assert n.attrs == {"k": {"v": [1, 2]}} and n.params[0].shape == [8, 8]
