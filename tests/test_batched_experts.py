"""Batched experts (transformers' ``batched_mm``: a bmm against expert weights gathered per
routed token) are recognised as expert matmuls, exactly like the ``grouped_mm`` path."""

from __future__ import annotations

import copy

import pytest
from traced_examples import EXAMPLES

from shardc.frontends import graph_from_module
from shardc.frontends.model_file import load_model_file
from shardc.ir.graph import Graph, Node, Param
from shardc.passes import group_fused_ops, group_layers
from shardc.passes.fused import recognise_batched_experts


def _mixtral(impl: str) -> Graph:
    model, inputs = load_model_file(EXAMPLES / "tiny_mixtral.py").build(tiny=True)
    model.set_experts_implementation(impl)
    return graph_from_module(model, inputs, name=f"tiny_mixtral_{impl}")


@pytest.fixture(scope="module")
def both() -> tuple[Graph, Graph]:
    return _mixtral("grouped_mm"), _mixtral("batched_mm")


def _kinds(g: Graph):
    return [(k.name, k.count, k.layers, k.attrs,
             [(o.name, o.params, o.shardable_params, o.in_features, o.out_features,
               o.flops_per_token, o.attrs) for o in k.ops]) for k in g.layer_kinds]


def _param_owners(g: Graph):
    """(fused op, op kind, parameter FQN) of every node that reads a parameter."""
    return sorted((n.fused_op, n.op, p.fqn) for n in g.nodes for p in n.params)


def test_batched_and_grouped_mixtral_agree(both):
    grouped, batched = both
    assert [k.name for k in batched.layer_kinds] == ["moe_block"]
    assert _kinds(batched) == _kinds(grouped)
    assert batched.config == grouped.config
    assert batched.global_ops == grouped.global_ops
    assert _param_owners(batched) == _param_owners(grouped)
    moe = batched.layer_kind("moe_block")
    assert [o.name for o in moe.ops][-3:] == ["router", "expert_ffn1", "expert_ffn2"]
    assert moe.op("router").params == 4 * 64  # the gate only, not the expert weights


def test_batched_expert_flops_count_only_routed_rows(both):
    grouped, batched = both
    exp_b = [n for n in batched.nodes if n.op == "grouped_matmul"]
    exp_g = [n for n in grouped.nodes if n.op == "grouped_matmul"]
    assert len(exp_b) == len(exp_g) == 4  # 2 layers x (gate_up, down)
    # 16 tokens x top-2 rows; gate_up: 64 -> 256, down: 128 -> 64 (4 experts stored)
    assert [n.flops for n in exp_b] == [n.flops for n in exp_g] == \
        [2 * 32 * 64 * 256, 2 * 32 * 128 * 64] * 2
    assert [n.attrs["expert_features"] for n in exp_b] == [[64, 256], [128, 64]] * 2
    assert not [n for n in batched.nodes if n.op == "matmul"]
    assert batched.flops_by_kind()["grouped_matmul"] == grouped.flops_by_kind()["grouped_matmul"]


def test_batched_recognition_ignores_targets_and_is_idempotent(both):
    _, batched = both
    g = copy.deepcopy(batched)
    for n in g.nodes:
        n.target = "onnx-op"
    group_layers(group_fused_ops(g))
    assert _kinds(g) == _kinds(batched)
    assert [n.fused_op for n in g.nodes] == [n.fused_op for n in batched.nodes]


def _node(name, op, inputs, ins, out, params=()):
    return Node(name=name, op=op, target="", inputs=inputs, input_shapes=ins, output_shape=out,
                dtype="bfloat16", params=list(params))


def test_transposed_layout_and_non_expert_gathers():
    """x [S,1,k] @ W[ids] [S,k,n] (weight on the right, seen through a view) -> features [k, n];
    a gather of a 2-D table or a bmm of two activations stays as it is."""
    w = Param("experts.w_in", [8, 32, 96], "bfloat16")
    table = Param("table", [100, 32], "bfloat16")
    nodes = [
        _node("ids", "input", [], [], [12]),
        _node("x", "input", [], [], [12, 1, 32]),
        _node("pick", "gather_scatter", ["ids"], [[12]], [12, 32, 96], [w]),
        _node("alias", "view", ["pick"], [[12, 32, 96]], [12, 32, 96]),
        _node("mm", "matmul", ["x", "alias"], [[12, 1, 32], [12, 32, 96]], [12, 1, 96]),
        _node("rows", "gather_scatter", ["ids"], [[12]], [12, 32], [table]),
        _node("act", "matmul", ["x", "x"], [[12, 1, 32], [12, 32, 1]], [12, 1, 1]),
    ]
    g = Graph(name="t", nodes=nodes, params=[w, table])
    assert recognise_batched_experts(g) == 1
    mm = g.node("mm")
    assert mm.op == "grouped_matmul" and mm.params == [w] and g.node("pick").params == []
    assert mm.attrs["expert_features"] == [32, 96] and mm.attrs["expert_gather"] == "pick"
    assert g.node("rows").params == [table] and g.node("act").op == "matmul"
    assert recognise_batched_experts(g) == 0
