"""exact: the decomposed optimum equals brute force over the whole legal space."""

import numpy as np
import pytest

from shardc.cost import CostModel
from shardc.ir.space import StrategySpace, megatron_op_choices
from shardc.ir.strategy import Mesh, Workload
from shardc.search import cost_model_objective, run_search
from shardc.search.exact_decomposed import _degree_rows
from shardc.search.legal import N_DEG, LegalSampler
from shardc.search.synthetic import toy_graph


def problem(phase, batch):
    # big enough (~130e9 parameters) that memory forces a non-trivial optimum on 16 GPUs
    g = toy_graph(layers=32, hidden=8192, heads=64, experts=8, ffn=28672, vocab=32000)
    wl = Workload(phase=phase, batch=batch, context=4096, prompt=2048)
    space = StrategySpace(g, Mesh.parse("8x2"), wl)
    return space, cost_model_objective(CostModel(g, space.mesh, "h100", wl), space)


@pytest.mark.parametrize("phase,batch", [("decode", 64), ("prefill", 4)])
def test_decomposed_exact_equals_brute_force(phase, batch):
    space, obj = problem(phase, batch)
    fast = run_search("exact", space, obj)
    brute = run_search("exact", space, obj, decompose=False, monotone_batch=False)
    assert brute.evaluations == LegalSampler(space).count_legal()
    assert fast.evaluations < brute.evaluations / 20
    assert fast.best_value == pytest.approx(brute.best_value, rel=1e-12)
    megatron = run_search("megatron", space, obj)
    assert fast.best_value >= megatron.best_value
    assert fast.best_action[0] > 0  # not the trivial tp=1 corner


def test_branch_terms_at_a_row_sum_to_the_cost_models_step():
    """The decomposition's terms, composed at Megatron's choices, give the latency the cost
    model itself reports (an independent path: evaluate() does not use the terms)."""
    space, obj = problem("decode", 64)
    cm = obj.cost_model
    rows = _degree_rows(LegalSampler(space))
    for d in (0, len(rows) // 2, len(rows) - 1):
        tables = cm.branch_tables(rows[d], space)
        action = np.concatenate([rows[d], megatron_op_choices(space, int(rows[d][0]))])
        selection = {}
        for t in tables.terms:
            chosen = [int(action[N_DEG + space.op_slots.index(s)]) for s in t.slots]
            selection[(t.kind, t.branch)] = int(np.flatnonzero((t.combos == chosen).all(axis=1))[0])
        ev = cm.evaluate(action[None, :], space)
        assert tables.compose(selection)["latency_ms"] == pytest.approx(float(ev.tpot_ms[0]),
                                                                        rel=1e-9)


def test_batch_pruning_keeps_the_optimum_and_saves_evaluations():
    from shardc.search.synthetic import SyntheticObjective, toy_space

    s = toy_space()
    o = SyntheticObjective(s, seed=1)
    a = run_search("exact", s, o)
    b = run_search("exact", s, o, monotone_batch=False)
    assert a.best_value == b.best_value and a.evaluations < b.evaluations


def test_vectorised_candidates_keep_the_plan_of_the_per_row_sweep():
    """The decomposed exact sweep of the DeepSeek-V3 fixture at 8x16 (decode, 4k context)
    returns the action, value, evaluation count and best-so-far curve recorded from the
    per-row candidate step it replaced (tests/data/exact/, written by the code before the
    vectorisation): same candidates in the same order."""
    import json
    from pathlib import Path

    from tests.cost_graphs import fixture_graph

    golden = json.loads((Path(__file__).parent / "data" / "exact" /
                         "deepseek_v3_8x16_decode.json").read_text())["deepseek_v3 8x16 decode"]
    g, mesh, wl = fixture_graph("deepseek_v3"), Mesh.parse("8x16"), Workload(phase="decode",
                                                                             context=4096)
    space = StrategySpace(g, mesh, wl)
    r = run_search("exact", space, cost_model_objective(CostModel(g, mesh, "h100", wl), space))
    assert r.best_action.tolist() == golden["action"]
    assert r.best_value == golden["tok_s_per_gpu"]
    assert r.evaluations == golden["evaluations"]
    assert [[int(a), float(b)] for a, b in r.curve] == golden["curve"]
