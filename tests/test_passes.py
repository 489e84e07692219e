"""Passes: per-kind FLOP/byte formulas, fused-op grouping, layer grouping, decode FLOPs."""

from __future__ import annotations

import copy

import pytest
from traced_examples import TINY, full_graph, tiny_graph

from shardc.ir.graph import Graph, Node, Param
from shardc.passes import canonicalise, group_fused_ops, group_layers
from shardc.passes.canonicalise import node_bytes, node_flops
from shardc.passes.layers import active_params, decode_flops_per_token


def _n(op, ins, out, params=(), dtype="bfloat16", target=""):
    return Node(name="n", op=op, target=target, input_shapes=[list(s) for s in ins],
                output_shape=list(out), dtype=dtype, params=list(params))


def test_linear_formula():
    w = Param("w", [96, 64], "bfloat16")
    n = _n("linear", [[2, 8, 64]], [2, 8, 96], [w])
    assert node_flops(n) == 2 * 16 * 64 * 96
    assert node_bytes(n) == (16 * 64 + 16 * 96) * 2 + 96 * 64 * 2


def test_matmul_formula():
    n = _n("matmul", [[4, 16, 8], [4, 8, 16]], [4, 16, 16], dtype="float32")
    assert node_flops(n) == 2 * 4 * 16 * 16 * 8
    assert node_bytes(n) == (512 + 512 + 1024) * 4


def test_grouped_matmul_counts_routed_rows_and_touched_experts():
    w = Param("e", [8, 64, 32], "bfloat16")
    n = _n("grouped_matmul", [[6, 64], [8]], [6, 32], [w])  # 6 rows -> at most 6 of 8 experts
    assert node_flops(n) == 2 * 6 * 32 * 64
    assert node_bytes(n) == (6 * 64 + 8 + 6 * 32) * 2 + (8 * 64 * 32 * 2) * 6 // 8


def test_attention_formula():
    n = _n("attention", [[1, 8, 16, 24], [1, 8, 16, 24], [1, 8, 16, 16]], [1, 8, 16, 16])
    assert node_flops(n) == 2 * 8 * 16 * 16 * (24 + 16)
    assert node_bytes(n) == (3072 + 3072 + 2048 + 2048) * 2


def test_embedding_reads_rows_not_table():
    n = _n("embedding", [[1, 16]], [1, 16, 64], [Param("t", [1000, 64])])
    assert node_flops(n) == 0
    assert node_bytes(n) == (16 + 2 * 16 * 64) * 2


@pytest.mark.parametrize("op,per_out", [("norm", 5), ("activation", 4), ("elementwise", 1)])
def test_pointwise_formulas(op, per_out):
    n = _n(op, [[4, 10]], [4, 10], [Param("g", [10])] if op == "norm" else [])
    assert node_flops(n) == per_out * 40
    assert node_bytes(n) == 80 * 2 + (20 if op == "norm" else 0)


def test_reduction_router_gather_view_formulas():
    assert node_flops(_n("reduction", [[4, 10]], [4, 1])) == 40
    assert node_flops(_n("router", [[16, 8]], [16, 2])) == 128
    g = _n("gather_scatter", [[16, 64], [32]], [32, 64])
    assert node_flops(g) == 0 and node_bytes(g) == (1024 + 32 + 2048) * 2
    v = _n("view", [[16, 64]], [1024])
    assert node_flops(v) == 0 and node_bytes(v) == 0


def test_canonicalise_maps_targets_and_keeps_frontend_kinds():
    g = Graph(name="g", nodes=[
        Node("a", "other", "aten.mm.default", params=[Param("w", [2, 2])], input_shapes=[[1, 2]],
             output_shape=[1, 2]),
        Node("b", "other", "aten.bmm.default", input_shapes=[[1, 2, 2], [1, 2, 2]],
             output_shape=[1, 2, 2]),
        Node("c", "activation", "Gelu", input_shapes=[[1, 2]], output_shape=[1, 2]),
        Node("d", "other", "aten.frobnicate.default", output_shape=[3]),
    ])
    canonicalise(g)
    assert [n.op for n in g.nodes] == ["linear", "matmul", "activation", "other"]
    assert len(g.warnings) == 1 and "frobnicate" in g.warnings[0]


EXPECTED_KINDS = {"tiny_llama": [("dense_block", 2)], "tiny_mixtral": [("moe_block", 2)],
                  "deepseek_v3": [("dense_block", 1), ("moe_block", 2)],
                  "gpt_moe_1p2t": [("moe_block", 2)]}


@pytest.mark.parametrize("name", TINY)
def test_layer_kinds_of_tiny_models(name):
    g = tiny_graph(name)
    assert [(k.name, k.count) for k in g.layer_kinds] == EXPECTED_KINDS[name]


def test_fused_ops_llama():
    k = tiny_graph("tiny_llama").layer_kinds[0]
    assert [o.name for o in k.ops] == ["qkv", "attn_core", "out_proj", "ffn1", "ffn2"]
    qkv, core, out, f1, f2 = k.ops
    assert (qkv.in_features, qkv.out_features, qkv.params) == (64, 64 + 32 + 32, 64 * 128)
    assert core.attrs == {"heads": 8, "kv_heads": 4, "head_dim": 8, "v_head_dim": 8,
                          "kv_cache_elems_per_token": 64, "kv_cache_split_by_heads": True,
                          "flops_per_token_per_context": 2 * 8 * 16,
                          "decode_flops_per_token_per_context": 2 * 8 * 16}
    assert (out.in_features, out.out_features) == (64, 64)
    assert (f1.out_features, f1.attrs["gated"], f2.in_features) == (256, True, 128)
    assert f1.flops_per_token == 2 * f1.params


def test_fused_ops_mla_moe_shared():
    g = tiny_graph("deepseek_v3")
    moe = g.layer_kind("moe_block")
    qkv, core = moe.op("qkv"), moe.op("attn_core")
    # q_b (32->8*16) and kv_b (16->8*(8+8)) are shardable; q_a, kv_a (64->32, 64->24) are not
    assert qkv.out_features == 128 + 128 and qkv.shardable_params == 32 * 128 + 16 * 128
    assert qkv.params == qkv.shardable_params + 64 * 32 + 64 * 24
    assert core.attrs["kv_cache_elems_per_token"] == 16 + 8  # kv_lora + rope
    assert core.attrs["kv_cache_split_by_heads"] is False
    assert core.attrs["head_dim"] == 16 and core.attrs["v_head_dim"] == 8
    # traced (non-absorbed) form vs the absorbed-MLA decode form over the latent cache
    assert core.attrs["flops_per_token_per_context"] == 2 * 8 * (16 + 8)
    assert core.attrs["decode_flops_per_token_per_context"] == 2 * 8 * ((16 + 8) + 16)
    e1, e2 = moe.op("expert_ffn1"), moe.op("expert_ffn2")
    assert (e1.in_features, e1.out_features, e1.params) == (64, 64, 8 * 64 * 64)
    assert e1.attrs == {"num_experts": 8, "top_k": 2, "gated": True}
    assert e2.flops_per_token == 2 * 2 * 32 * 64
    assert moe.op("shared_ffn1").attrs["num_shared"] == 1
    assert moe.op("router").out_features == 8
    assert g.config["num_experts"] == 8 and g.config["num_shared_experts"] == 1
    assert g.config["ffn"] == 128 and g.config["expert_ffn"] == 32


def test_gpt_moe_fused_qkv_and_ungated_experts():
    k = tiny_graph("gpt_moe_1p2t").layer_kinds[0]
    assert k.op("qkv").out_features == 3 * 64 and k.op("attn_core").attrs["kv_heads"] == 8
    assert k.op("expert_ffn1").attrs["gated"] is False
    assert k.op("expert_ffn1").out_features == 128


def test_passes_do_not_read_targets():
    """An ONNX frontend gives other target strings: fused/layer passes must not care."""
    g = copy.deepcopy(tiny_graph("deepseek_v3"))
    for n in g.nodes:
        n.target = "onnx-op"
    group_layers(group_fused_ops(g))
    ref = tiny_graph("deepseek_v3")
    assert g.layer_kinds == ref.layer_kinds and g.global_ops == ref.global_ops
    assert [n.fused_op for n in g.nodes] == [n.fused_op for n in ref.nodes]


@pytest.mark.parametrize("name", TINY)
def test_decode_flops_match_two_active_params_plus_attention(name):
    g = tiny_graph(name)
    ctx = 4096
    attn = sum(k.count * k.op("attn_core").attrs["decode_flops_per_token_per_context"]
               for k in g.layer_kinds)
    want = 2 * active_params(g) + ctx * attn
    assert abs(decode_flops_per_token(g, ctx) - want) / want < 0.02


@pytest.mark.slow
@pytest.mark.parametrize("name,kinds", [("llama3_70b", [("dense_block", 80)]),
                                        ("deepseek_v3", [("dense_block", 3), ("moe_block", 58)])])
def test_full_size_layer_grouping_and_flops(name, kinds):
    g = full_graph(name)
    assert [(k.name, k.count) for k in g.layer_kinds] == kinds
    for ctx in (16, 4096):
        attn = sum(k.count * k.op("attn_core").attrs["decode_flops_per_token_per_context"]
                   for k in g.layer_kinds)
        want = 2 * active_params(g) + ctx * attn
        assert abs(decode_flops_per_token(g, ctx) - want) / want < 0.02
    # node-level FLOPs of the traced 16-token forward agree with the traced attention form
    traced = sum(k.count * k.op("attn_core").attrs["flops_per_token_per_context"]
                 for k in g.layer_kinds)
    per_token = sum(n.flops for n in g.nodes) / g.tokens
    want16 = 2 * active_params(g) + 16 * traced
    assert abs(per_token - want16) / want16 < 0.02


@pytest.mark.slow
def test_full_size_mixtral_is_32_moe_blocks():
    g = full_graph("mixtral_8x7b")
    assert [(k.name, k.count) for k in g.layer_kinds] == [("moe_block", 32)]
    assert g.config["top_k"] == 2 and g.config["expert_ffn"] == 14336
