"""Annotation pass: placements on every node; repairs = the shared strategy tables."""

from __future__ import annotations

import functools
import random
from collections import Counter
from pathlib import Path

import pytest

from shardc.ir.contract import BRANCHES, CHOICE_NAMES, branch_collectives
from shardc.ir.strategy import Degrees, Mesh, Strategy, Workload, residual_placement
from shardc.passes.annotate import annotate, redistributions, spmd_dims

ROOT = Path(__file__).resolve().parents[1]
MODELS = ["tiny_llama.py", "tiny_mixtral.py", "gpt_moe_1p6t.py"]


@functools.lru_cache(maxsize=None)
def tiny_graph(name: str):
    from shardc.frontends import load_graph

    return load_graph(str(ROOT / "examples" / name), tiny=True)


def random_strategy(graph, rng: random.Random) -> Strategy:
    tp = rng.choice([1, 2, 4])
    ep = rng.choice([1, 2]) if graph.config.get("num_experts") else 1
    pp = rng.choice([1, 2])
    dp = rng.choice([1, 2])
    sp = tp if rng.random() < 0.3 else 1
    choices = {}
    for k in graph.layer_kinds:
        for o in k.ops:
            if o.name in CHOICE_NAMES:
                choices[f"{k.name}.{o.name}"] = rng.randrange(3)
    for o in graph.global_ops:
        choices[o.name] = rng.randrange(3)
    return Strategy(Degrees(tp=tp, pp=pp, ep=ep, dp=dp, sp=sp), 8, choices)


def expected_repairs(graph, st: Strategy) -> Counter:
    """(layer, branch, before_op, collective, mesh_dim) straight from branch_collectives."""
    res = residual_placement(st.degrees)
    out: Counter = Counter()
    for k in graph.layer_kinds:
        for bname, ops in BRANCHES.items():
            if any(k.op(o) is None for o in ops):
                continue
            walk = branch_collectives(ops, [st.choices[f"{k.name}.{o}"] for o in ops], res, res)
            for layer in k.layers:
                for before, _s, _d, coll in walk:
                    if st.degrees.tp > 1:
                        out[(layer, bname, before, coll, "tp")] += 1
                if bname == "experts" and st.degrees.ep > 1:
                    out[(layer, bname, "dispatch", "all_to_all", "ep")] += 1
                    out[(layer, bname, "combine", "all_to_all", "ep")] += 1
    for op, (start, end) in (("embedding", ("R", res)), ("lm_head", (res, "R"))):
        if graph.global_op(op) is not None:
            for before, _s, _d, coll in branch_collectives((op,), [st.choices[op]], start, end):
                if st.degrees.tp > 1:
                    out[(None, op, before, coll, "tp")] += 1
    return out


@pytest.mark.parametrize("name", MODELS)
def test_every_node_annotated_and_repairs_match_tables(name):
    g = tiny_graph(name)
    rng = random.Random(hash(name) % 1000)
    for _ in range(25):
        st = random_strategy(g, rng)
        a = annotate(g, st)
        dims = spmd_dims(st)
        for n in a.nodes:
            assert n.placements is not None and len(n.placements) == len(dims), n.name
            assert all(p in ("R", "S(0)", "S(1)", "P(sum)") for p in n.placements)
            assert n.stage is not None and 0 <= n.stage < st.degrees.pp
        got = Counter((r["layer"], r["branch"], r["before_op"], r["collective"], r["mesh_dim"])
                      for r in redistributions(a))
        assert got == expected_repairs(g, st), (st, got, expected_repairs(g, st))
        assert g.nodes[0].placements is None  # the input graph is not modified


def test_megatron_llama_placements_and_bytes():
    g = tiny_graph("tiny_llama.py")
    ch = {"embedding": 0, "lm_head": 0}
    for o, c in (("qkv", 0), ("attn_core", 0), ("out_proj", 1), ("ffn1", 0), ("ffn2", 1)):
        ch[f"dense_block.{o}"] = c
    st = Strategy(Degrees(tp=4, dp=2), 8, ch)
    a = annotate(g, st, tokens=8, act_bytes=2)
    assert spmd_dims(st) == ["dp", "tp"]
    by_op = {}
    for n in a.nodes:
        if n.fused_op and n.layer == 0:
            by_op.setdefault(n.fused_op, n.placements)
    assert by_op["qkv"] == ["S(0)", "S(1)"]
    assert by_op["attn_core"] == ["S(0)", "S(1)"]
    assert by_op["out_proj"] == ["S(0)", "P(sum)"]
    assert by_op["ffn2"] == ["S(0)", "P(sum)"]
    reds = [r for r in redistributions(a) if r["layer"] == 0]
    assert [(r["branch"], r["collective"]) for r in reds] == [("attention", "all_reduce"),
                                                               ("mlp", "all_reduce")]
    hidden = g.config["hidden"]
    assert all(r["bytes"] == 8 * hidden * 2 for r in reds)
    # the all-reduce sits on the consumer of out_proj (the residual add), after the linear
    cons = a.node(next(r["node"] for r in reds if r["branch"] == "attention"))
    assert cons.placements == ["S(0)", "R"] and cons.op == "elementwise"
    # pipeline stage: layer 1 of 2 on stage 1 when pp=2
    a2 = annotate(g, Strategy(Degrees(tp=2, pp=2), 8, ch))
    assert {n.stage for n in a2.nodes if n.layer == 1} == {1}
    assert a2.nodes[-1].stage == 1 and a2.nodes[0].stage == 0


def test_repairs_agree_with_cost_model_explain():
    from shardc.cost import CostModel

    g = tiny_graph("tiny_mixtral.py")
    rng = random.Random(7)
    mesh = Mesh(8, 1)
    for _ in range(5):
        st = random_strategy(g, rng)
        deg = st.degrees
        st.degrees = Degrees(tp=deg.tp, ep=deg.ep, pp=deg.pp, sp=1, dp=8 // (deg.tp * deg.ep * deg.pp))
        ex = CostModel(g, mesh, "h100", Workload(batch=8)).simulate(st)
        charged = Counter((lk, b, before, kind, dim) for lk, b, before, kind, dim, _s, ms in ex.collectives)
        a = annotate(g, st)
        marked = Counter()
        for r in redistributions(a):
            if r["layer"] in (None, 0):
                lk = r["layer_kind"] or "global"
                marked[(lk, r["branch"], r["before_op"], r["collective"], r["mesh_dim"])] += 1
        assert marked == charged, (st, marked, charged)
