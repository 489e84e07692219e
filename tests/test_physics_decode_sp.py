"""Sequence parallelism in decode: the residual token-split between tp regions is a degree
choice of the decode search, priced by the cost model and run by the backend (issue 13)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from cost_graphs import fixture_graph
from test_backend_fake import assert_records_match
from test_runtime_styles import CASES
from test_runtime_styles_bytes import BATCH, exempt_extras, run_standalone_file

from shardc.cli import main
from shardc.cost import CostModel
from shardc.ir.space import StrategySpace
from shardc.ir.strategy import Degrees, Mesh, Strategy, Workload
from shardc.search import cost_model_objective, run_search

TINY = str(Path(__file__).resolve().parents[1] / "examples" / "tiny_llama.py")


def test_decode_space_offers_sp_and_the_search_prices_it():
    g = fixture_graph("llama3_70b")
    wl = Workload(phase="decode", batch=64, context=4096)
    space = StrategySpace(g, Mesh(8, 1), wl)
    assert space.values["sp"] == [0, 1]
    cm = CostModel(g, space.mesh, "h100", wl)
    on = Strategy(Degrees(tp=8, sp=8), 64, _megatron(space))
    off = Strategy(Degrees(tp=8), 64, dict(on.choices))
    ex_on, ex_off = cm.simulate(on), cm.simulate(off)
    assert ex_on.feasible and ex_off.feasible
    kinds_on = {(c[3], c[4]) for c in ex_on.collectives}
    kinds_off = {(c[3], c[4]) for c in ex_off.collectives}
    # Megatron SP: all-gather before qkv / ffn1, reduce-scatter after out_proj / ffn2 instead
    # of the all-reduce
    assert ("all_gather", "tp") in kinds_on and ("reduce_scatter", "tp") in kinds_on
    assert ("all_reduce", "tp") in kinds_off and ("reduce_scatter", "tp") not in kinds_off
    # the norms run on 1/tp of the tokens
    assert ex_on.predicted["breakdown"]["norms_ms"] < ex_off.predicted["breakdown"]["norms_ms"]
    # exact search over the decode space evaluates sp-on strategies
    obj = cost_model_objective(cm, space)
    res = run_search("exact", space, obj)
    assert res.found


def _megatron(space):
    from shardc.ir.space import megatron_op_choices

    t = space.values["tp"].index(8)
    return dict(zip(space.op_slots, megatron_op_choices(space, t).tolist()))


def test_decode_sp_needs_the_batch_divisible_over_tp():
    g = fixture_graph("llama3_70b")
    wl = Workload(phase="decode", batch=4, context=4096)
    space = StrategySpace(g, Mesh(8, 1), wl)
    cm = CostModel(g, space.mesh, "h100", wl)
    s = Strategy(Degrees(tp=8, sp=8), 4, _megatron(space))
    ev = cm.evaluate(space.encode(s)[None, :], space)
    assert not ev.feasible[0] and "batch does not divide" in cm.reason_text(ev.reason[0])


def test_cli_decode_sp(tmp_path, capsys):
    code = main(["simulate", TINY, "--mesh", "4x1", "--degrees", "tp=4,sp=on", "--batch", "8"])
    assert code == 0, capsys.readouterr().err
    code = main(["compile", TINY, "--mesh", "4x1", "--degrees", "tp=4,sp=on", "--search",
                 "megatron", "--quiet", "--standalone", "--out", str(tmp_path)])
    assert code == 0, capsys.readouterr().err
    import json

    plan = json.loads((tmp_path / "plan.json").read_text())
    assert plan["workload"]["phase"] == "decode" and plan["degrees"]["sp"] == 4
    assert "Shard(0)" in (tmp_path / "parallelize.py").read_text()  # the token-split residual


def test_decode_sp_collectives_are_what_the_torch_style_file_issues():
    """One decode step ([batch, 1] ids) of the torch-style file under sp issues exactly the
    collectives the decode cost model charges (as tests/test_runtime_styles_bytes.py)."""

    from shardc.frontends import load_graph
    from shardc.ir.strategy import strategy_from_names
    from shardc.plan import build_plan

    name = "llama megatron + sequence parallel tp4"
    model_file, degrees, choices = CASES[name]
    graph = load_graph(model_file, tiny=True)
    strategy = strategy_from_names(degrees, choices, BATCH)
    wl = Workload(phase="decode", batch=BATCH, context=512)
    plan = build_plan(graph, strategy, Mesh(strategy.degrees.world, 1), "h100", wl)
    records, vocab = run_standalone_file(plan, model_file, strategy, "decode sp")
    got = list(records)
    for extra in exempt_extras(graph, strategy, vocab):
        got.remove(extra)
    cm = CostModel(graph, Mesh(strategy.degrees.world, 1), "h100", wl, expert_imbalance=1.0)
    ex = cm.simulate(strategy)
    want = []
    for kind, _b, _before, coll, dim, nbytes, _ms in ex.collectives:
        n = 1 if kind == "global" else graph.layer_kind(kind).count
        want += [(coll, dim, nbytes, 1)] * n
    assert any(c == "reduce_scatter" for c, *_ in want)
    assert_records_match(got, want, name)


def test_fixed_sp_on_is_accepted_in_decode():
    g = fixture_graph("llama3_70b")
    space = StrategySpace(g, Mesh(8, 1), Workload(phase="decode"), fixed={"tp": 8, "sp": -1})
    assert space.values["sp"] == [1]
    assert np.asarray(space.values["tp"]).tolist() == [8]
