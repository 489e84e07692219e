"""Two cost-model gaps of issue 13, each from the traced model to the predicted numbers.

1. Sliding-window attention: a layer with window ``W`` reads and holds ``min(context, W)``
   positions per sequence in decode, and its prefill is banded causal attention
   (``sum_i min(i, W)`` query-key pairs). The window comes from the traced model, per
   layer, and a sliding layer is its own layer kind.
2. Whole-projection q/k norms (OLMoE: RMSNorm over the whole q / k projection, not per
   head): under a heads split each norm all-reduces a ``tokens x 1`` fp32 sum of squares
   over tp, per layer.
"""

from __future__ import annotations

import copy

import numpy as np
import pytest
from cost_graphs import fixture_graph
from family_matrix import config_path, tiny_config

from shardc.cost import CostModel
from shardc.cost import collectives as coll
from shardc.cost.capacity import weight_and_kv_bytes
from shardc.cost.topology import mesh_groups
from shardc.frontends import graph_from_module
from shardc.frontends.hf_build import build_causal_lm, token_ids
from shardc.ir.strategy import Mesh, Workload, strategy_from_names
from shardc.passes.layers import decode_flops_per_token

_SMALL = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_attention_heads=8,
              num_key_value_heads=4, head_dim=8, max_position_embeddings=8192)
MEGATRON = {"qkv": "col", "attn_core": "heads", "out_proj": "row", "ffn1": "col", "ffn2": "row"}


def _traced(config):
    return graph_from_module(build_causal_lm(config), token_ids(config.vocab_size))


def _auto(model_type: str, layers: int, **extra):
    from transformers import AutoConfig

    return AutoConfig.for_model(model_type, **_SMALL, num_hidden_layers=layers, **extra)


def _windows(graph) -> dict[int, int | None]:
    """Decoder layer -> the window its layer kind's attention core records."""
    return {i: k.op("attn_core").attrs.get("window") for k in graph.layer_kinds for i in k.layers}


# ------------------------------------------------------------------ 1. the window, traced
def test_alternating_sliding_layers_record_their_window_and_form_their_own_kind():
    """Gemma-2 alternates sliding and full layers (config ``layer_types``): the sliding
    layers' cores carry the config's window, the full ones none, in two layer kinds."""
    config = tiny_config(config_path("gemma2_9b"))
    config.num_hidden_layers = 4
    config.layer_types = ["sliding_attention", "full_attention"] * 2
    g = _traced(config)
    assert _windows(g) == {0: config.sliding_window, 1: None, 2: config.sliding_window, 3: None}
    assert sorted(k.layers for k in g.layer_kinds) == [[0, 2], [1, 3]]


def test_window_from_layer_types_of_another_family():
    """Qwen2 with ``use_sliding_window``: layers from ``max_window_layers`` on slide."""
    g = _traced(_auto("qwen2", 4, use_sliding_window=True, sliding_window=5, max_window_layers=2))
    assert _windows(g) == {0: None, 1: None, 2: 5, 3: 5}


@pytest.mark.parametrize("window, want", [(6, 6), (None, None)])
def test_config_wide_window_applies_to_every_layer(window, want):
    """Mistral masks every layer with ``config.sliding_window`` when it is set."""
    g = _traced(_auto("mistral", 2, sliding_window=window))
    assert _windows(g) == {0: want, 1: want}


def test_model_without_windows_records_none():
    g = _traced(tiny_config(config_path("gpt2")))
    assert set(_windows(g).values()) == {None}


# ------------------------------------------------------------------ 1. the window, costed
W = 256


def _windowed(graph, window=W):
    g = copy.deepcopy(graph)
    for k in g.layer_kinds:
        k.op("attn_core").attrs["window"] = window
    return g


def _megatron(graph, tp, **override):
    ops = {**MEGATRON, **override}
    choices = {"embedding": "vocab", "lm_head": "col"}
    for k in graph.layer_kinds:
        for o in k.ops:
            choices[f"{k.name}.{o.name}"] = ops[o.name]
    return strategy_from_names({"tp": tp}, choices, batch=8)


def _attn_row(graph, tp, **wl):
    cm = CostModel(graph, Mesh(tp, 1), "h100", Workload(batch=8, **wl))
    ex = cm.simulate(_megatron(graph, tp))
    row = next(r for r in ex.ops if r["op"] == "attn_core")
    return row, ex


def test_decode_beyond_the_window_costs_a_window_of_context():
    """At context 4W a sliding core reads, computes and holds exactly what a full core does
    at context W: KV-cache bytes, FLOPs and HBM traffic all stop growing at the window."""
    full = fixture_graph("tiny_llama")
    slid, ref = _attn_row(_windowed(full), 2, context=4 * W)[0], _attn_row(full, 2, context=W)[0]
    for key in ("kv_bytes", "compute_ms", "memory_ms", "time_ms"):
        assert slid[key] == pytest.approx(ref[key], rel=1e-12), key
    longer = _attn_row(full, 2, context=4 * W)[0]
    assert longer["kv_bytes"] == pytest.approx(4 * ref["kv_bytes"], rel=1e-12)


def test_decode_within_the_window_is_unchanged():
    full = fixture_graph("tiny_llama")
    slid, ref = _attn_row(_windowed(full), 2, context=W // 2)[0], _attn_row(full, 2, context=W // 2)[0]
    assert slid == ref


def test_prefill_flops_are_banded_causal():
    """Each query attends to min(position, W) keys: sum_{i=1..P} min(i, W) pairs."""
    full = fixture_graph("tiny_llama")
    P = 4 * W
    slid = _attn_row(_windowed(full), 2, phase="prefill", prompt=P)[0]
    ref = _attn_row(full, 2, phase="prefill", prompt=P)[0]
    banded = sum(min(i, W) for i in range(1, P + 1))
    assert slid["compute_ms"] / ref["compute_ms"] == pytest.approx(banded / (P * (P + 1) / 2),
                                                                   rel=1e-12)
    assert slid["kv_bytes"] == pytest.approx(ref["kv_bytes"] * W / P, rel=1e-12)


def test_measured_kernels_see_the_window_too():
    """--kernels silicon: decode looks up the generation kernel at min(context, W) cached
    positions; the measured causal prefill kernel is scaled to the band's pairs."""
    full = fixture_graph("tiny_llama")
    slid = _windowed(full)

    def row(graph, **wl):
        cm = CostModel(graph, Mesh(2, 1), "h100", Workload(batch=8, **wl), kernels="silicon")
        assert cm.kernels is not None, cm.kernel_reason
        ex = cm.simulate(_megatron(graph, 2))
        return next(r for r in ex.ops if r["op"] == "attn_core")

    assert row(slid, context=4 * W)["time_ms"] == row(full, context=W)["time_ms"]
    P = 4 * W
    ratio = sum(min(i, W) for i in range(1, P + 1)) / (P * (P + 1) / 2)
    s, f = row(slid, phase="prefill", prompt=P), row(full, phase="prefill", prompt=P)
    assert s["time_ms"] < f["time_ms"]
    assert s["time_ms"] >= ratio * f["time_ms"] * (1 - 1e-12)


def test_capacity_and_decode_flops_count_the_window():
    full = fixture_graph("tiny_llama")
    slid = _windowed(full)
    far, near = Workload(batch=4, context=4 * W), Workload(batch=4, context=W)
    assert weight_and_kv_bytes(slid, far) == weight_and_kv_bytes(full, near)
    assert decode_flops_per_token(slid, 4 * W) == decode_flops_per_token(full, W)


def test_only_the_sliding_kind_is_capped():
    """A model with a sliding and a full kind: the KV cache is the sum of both, the full
    kind at the whole context."""
    full = fixture_graph("tiny_llama")
    mixed = copy.deepcopy(full)
    kind = mixed.layer_kinds[0]
    second = copy.deepcopy(kind)
    kind.count, kind.layers = 2, [0, 2]
    second.name, second.count, second.layers = "dense_block_2", 2, [1, 3]
    second.op("attn_core").attrs["window"] = W
    mixed.layer_kinds.append(second)
    C = 4 * W
    kv = weight_and_kv_bytes(mixed, Workload(batch=1, context=C))[1]
    per_token = full.layer_kinds[0].op("attn_core").attrs["kv_cache_elems_per_token"] * 2
    assert kv == 2 * per_token * C + 2 * per_token * W
    ex = _attn_row(mixed, 2, context=C)[1]
    rows = {r["layer_kind"]: r["kv_bytes"] for r in ex.ops if r["op"] == "attn_core"}
    assert rows["dense_block"] == pytest.approx(4 * rows["dense_block_2"], rel=1e-12)


# -------------------------------------------------- 2. whole-projection q/k norms, traced
def test_whole_projection_qk_norms_are_recorded_per_head_norms_are_not():
    olmoe = _traced(tiny_config(config_path("olmoe_1b_7b")))
    assert {k.op("attn_core").attrs.get("whole_projection_norms") for k in olmoe.layer_kinds} == {2}
    qwen3 = _traced(_auto("qwen3", 2))  # q/k RMSNorm over each head's features
    assert {k.op("attn_core").attrs.get("whole_projection_norms") for k in qwen3.layer_kinds} \
        == {None}


# -------------------------------------------------- 2. whole-projection q/k norms, costed
def _with_norms(graph, norms=2):
    g = copy.deepcopy(graph)
    for k in g.layer_kinds:
        k.op("attn_core").attrs["whole_projection_norms"] = norms
    return g


@pytest.mark.parametrize("phase", ["decode", "prefill"])
def test_heads_split_all_reduces_each_norms_sum_of_squares(phase):
    """tp=4, heads split: per layer 2 all-reduces of T x 1 fp32 over the tp group, where T
    is the tokens of the tp group (8 sequences x 1 decode token / x prompt)."""
    full = fixture_graph("tiny_llama")
    wl = dict(context=512) if phase == "decode" else dict(phase="prefill", prompt=128)
    tp = 4
    st = _megatron(full, tp)
    cms = [CostModel(g, Mesh(tp, 1), "h100", Workload(batch=8, **wl))
           for g in (full, _with_norms(full))]
    base, normed = (cm.simulate(st) for cm in cms)
    tokens = 8 * (1 if phase == "decode" else 128)
    rows = [c for c in normed.collectives if c[2] == "attn_core q/k norms"]
    # one row per layer kind: both norms' all-reduces, their bytes summed
    assert rows and all(c[3] == "all_reduce" and c[5] == 2 * tokens * 4.0 for c in rows)
    group = mesh_groups(np.array([tp]), np.array([1]), np.array([1]), np.array([1]), tp)["tp"]
    one = float(coll.all_reduce(tokens * 4.0, group, cms[1].hw)[0]) * 1e3
    layers = sum(k.count for k in full.layer_kinds)
    assert normed.totals["tp_comm_ms"] - base.totals["tp_comm_ms"] == \
        pytest.approx(2 * layers * one, rel=1e-9)
    assert normed.stage_ms[0] - base.stage_ms[0] == pytest.approx(2 * layers * one, rel=1e-9)
    # the Chrome trace shows them as a comm segment and still adds up to the stage time
    x = [e for e in cms[1].chrome_trace(st)["traceEvents"] if e["ph"] == "X"
         and e["tid"] == 0 and e["args"]["microbatch"] == 0]
    assert any(e["name"].endswith(" all_reduce q/k norms") and e["cat"] == "comm" for e in x)
    assert sum(e["dur"] for e in x) / 1e3 == pytest.approx(
        normed.stage_ms[0] + normed.totals["pp_send_ms"], rel=1e-6)


@pytest.mark.parametrize("tp, attn", [(1, "heads"), (4, "batch"), (4, "rep")])
def test_no_norm_all_reduce_without_a_heads_split(tp, attn):
    """Whole rows on each rank (tp = 1, batch-split or replicated attention): normalised
    locally, nothing more to pay."""
    full = fixture_graph("tiny_llama")
    st = _megatron(full, tp, attn_core=attn, qkv="rep" if attn != "heads" else "col",
                   out_proj="rep" if attn != "heads" else "row")
    base, normed = (CostModel(g, Mesh(tp, 1), "h100", Workload(batch=8, context=512)).simulate(st)
                    for g in (full, _with_norms(full)))
    assert normed.stage_ms == base.stage_ms
