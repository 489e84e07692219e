"""GQA with tp > kv_heads: the heads split keeps whole query-head groups and replicates only
the KV heads (each held by tp / kv_heads ranks, as vLLM does) instead of refusing the split
(issue 13). Legality, cost, plan.json, and the default runtime on 4 gloo ranks."""

from __future__ import annotations

import numpy as np
import pytest
from cost_graphs import CONFIGS, build_graph
from test_backend_gloo import DENSE, TOL, D, _with

from shardc.backends.verify import Case, run_suites
from shardc.cost import CostModel
from shardc.ir.contract import kv_head_replicas, legal, op_choice
from shardc.ir.space import StrategySpace, megatron_op_choices
from shardc.ir.strategy import Degrees, Mesh, Strategy, Workload

GQA_MODEL = '''"""tiny Qwen2 (k/v biases) with 8 query heads over 2 KV heads"""
import torch
from transformers import Qwen2Config

from shardc.frontends.hf_build import build_causal_lm, token_ids


def config():
    return Qwen2Config(vocab_size=256, hidden_size=64, intermediate_size=128,
                       num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=2,
                       max_position_embeddings=4096, tie_word_embeddings=False)


def build_model():
    return build_causal_lm(config(), device="cpu", dtype=torch.float32)


def example_inputs():
    return token_ids(256)
'''


def test_heads_split_is_legal_when_kv_heads_divide_tp():
    heads = op_choice("attn_core", 0)
    assert legal(heads, 8, 0, 0, 64, 8)
    assert legal(heads, 16, 0, 0, 64, 8)  # each KV head on 2 ranks
    assert not legal(heads, 16, 0, 0, 64, 8, replicate_kv_heads=False)
    assert not legal(heads, 4, 0, 0, 64, 6)  # neither divides the other
    assert not legal(heads, 128, 0, 0, 64, 8)  # tp must divide the query heads
    assert kv_head_replicas(16, 8) == 2 and kv_head_replicas(4, 8) == 1


def _gqa_graph(kv_heads=2):
    c = dict(CONFIGS["llama3_70b"], kv_heads=kv_heads, layers=8)
    return build_graph("llama_gqa", c)


def _strategy(space, tp, **override):
    t = space.values["tp"].index(tp)
    ch = dict(zip(space.op_slots, megatron_op_choices(space, t).tolist()))
    for k, v in override.items():
        ch[f"dense_block.{k}"] = v
    return Strategy(Degrees(tp=tp), 16, ch)


def test_cost_charges_kv_weights_and_cache_at_one_kv_head_per_rank():
    g = _gqa_graph(kv_heads=2)
    wl = Workload(phase="decode", batch=16, context=4096)
    space = StrategySpace(g, Mesh(8, 1), wl)
    cm = CostModel(g, space.mesh, "h100", wl)
    # tp=8 > 2 KV heads: qkv col, heads, out row are legal now
    heads = _strategy(space, 8, qkv=0, attn_core=0, out_proj=1)
    ev = cm.evaluate(space.encode(heads)[None, :], space)
    assert ev.feasible[0]
    hidden, hd, H, KV = 8192, 128, 64, 2
    q_bytes, kv_bytes = hidden * H * hd * 2, hidden * 2 * KV * hd * 2
    want_qkv = q_bytes / 8 + kv_bytes / KV  # q split 8 ways, one whole KV head per rank
    grid = cm.branch_tables(space.encode(heads)[:5], space)
    term = next(t for t in grid.terms if t.kind == "dense_block" and t.branch == "attention")
    i = int(np.flatnonzero((term.combos == [0, 0, 1]).all(axis=1))[0])
    out_bytes = H * hd * hidden * 2 / 8
    assert term.weight_bytes[i] == pytest.approx(want_qkv + out_bytes, rel=1e-9)
    # KV cache: 1/kv_heads of each sequence's cache per rank (not 1/tp)
    kv_cache = 16 * 4096 * 2 * KV * hd * 2 / KV
    assert term.kv_bytes[i] == pytest.approx(kv_cache, rel=1e-9)


def test_megatron_heuristic_still_replicates_attention_beyond_kv_heads():
    g = _gqa_graph(kv_heads=2)
    space = StrategySpace(g, Mesh(8, 1), Workload(batch=16))
    ch = dict(zip(space.op_slots, megatron_op_choices(space, space.values["tp"].index(8))))
    assert ch["dense_block.qkv"] == 2 and ch["dense_block.attn_core"] == 2
    # but the search space offers the heads split with replicated KV heads
    mask = space.op_masks(np.array([space.values["tp"].index(8)]))[0]
    assert mask[space.op_slots.index("dense_block.attn_core"), 0]


def test_replicating_kv_heads_beats_replicating_attention():
    g = _gqa_graph(kv_heads=2)
    wl = Workload(phase="decode", batch=16, context=4096)
    space = StrategySpace(g, Mesh(8, 1), wl)
    cm = CostModel(g, space.mesh, "h100", wl)
    rep = cm.simulate(_strategy(space, 8))  # Megatron: attention replicated at tp=8
    kv = cm.simulate(_strategy(space, 8, qkv=0, attn_core=0, out_proj=1))
    assert kv.predicted["tpot_ms"] < rep.predicted["tpot_ms"]
    assert kv.memory["kv_cache_gb"] < rep.memory["kv_cache_gb"] / 1.9


@pytest.fixture(scope="module")
def gqa_plans(tmp_path_factory):
    from shardc.frontends import load_graph
    from shardc.plan import build_plan

    tmp = tmp_path_factory.mktemp("gqa")
    model = tmp / "tiny_gqa.py"
    model.write_text(GQA_MODEL)
    graph = load_graph(str(model), tiny=True)
    assert graph.config["kv_heads"] == 2
    plans = {}
    for name, choices in {"megatron dims": DENSE,
                          "qkv rep": _with(DENSE, D, qkv="rep"),
                          "qkv row": _with(DENSE, D, qkv="row")}.items():
        from shardc.ir.strategy import strategy_from_names

        st = strategy_from_names({"tp": 4}, choices, 8)
        plans[name] = build_plan(graph, st, Mesh(4, 1), "h100", Workload(batch=8, context=512))
    return str(model), plans, tmp


def test_plan_json_places_one_kv_head_per_rank(gqa_plans):
    _, plans, _ = gqa_plans
    params = {p["fqn"]: p for p in plans["megatron dims"].params}
    k = params["model.layers.0.self_attn.k_proj.weight"]
    assert k["shape"] == [16, 64] and k["placements"] == ["S(0)"]
    assert k["local_shape"] == [8, 64]  # one KV head (head_dim 8), not 16 / 4 rows
    assert params["model.layers.0.self_attn.k_proj.bias"]["local_shape"] == [8]
    assert params["model.layers.0.self_attn.q_proj.weight"]["local_shape"] == [16, 64]
    assert plans["megatron dims"].model["kv_heads"] == 2


def test_standalone_file_repeats_kv_heads_with_torch_styles(gqa_plans):
    """The standalone file (imports only torch) places one KV head per rank: the k / v
    projections' heads are repeated before their split (col: the weight; row: the partial
    sums before the reduce-scatter; rep: the output before the slice) and the attention
    module reads H / tp query heads per KV head."""
    _, plans, _ = gqa_plans
    code = plans["megatron dims"].code(standalone=True)
    assert "import shardc" not in code and "from shardc" not in code
    assert "'self_attn.k_proj': WeightColwiseParallel(out_dim=0, kv_repeat=(8, 2))" in code
    assert "'self_attn.q_proj': ColwiseParallel()" in code
    assert "'self_attn': GroupedKVAttention(kv_replicas=2)" in code
    row = plans["qkv row"].code(standalone=True)
    assert "WeightRowwiseParallel(in_dim=1, input_layouts=Replicate(), " \
        "output_layouts=Shard(-1), kv_repeat=(8, 2))" in row
    rep = plans["qkv rep"].code(standalone=True)
    assert "ReplicateParallel(input_layouts=Replicate(), output_layouts=Shard(-1), " \
        "kv_repeat=(8, 2))" in rep


def test_default_runtime_matches_the_unsharded_model(gqa_plans):
    model, plans, tmp = gqa_plans
    cases = []
    for name, plan in plans.items():
        path = tmp / f"{name.replace(' ', '_')}.py"
        path.write_text(plan.code(standalone=True))
        cases.append(Case(name, {}, {}, None, code=str(path)))
    cases.append(Case("megatron dims, KV cache", {}, {}, None,
                      code=str(tmp / "megatron_dims.py"), kv_cache=2))
    results = run_suites([(model, cases)], world=4)
    for r in results:
        assert r["error"] is None, (r["name"], r["error"])
        assert r["rel_err"] is not None and r["rel_err"] < TOL, r
