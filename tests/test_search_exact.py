"""exact: the decomposed optimum equals brute force over the whole legal space."""

import numpy as np
import pytest

from shardc.cost import CostModel
from shardc.ir.space import StrategySpace
from shardc.ir.strategy import Mesh, Workload
from shardc.search import cost_model_objective, run_search
from shardc.search.exact_decomposed import _degree_rows, term_tables
from shardc.search.legal import LegalSampler
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


def test_term_tables_match_the_cost_models_branch_tables():
    space, obj = problem("decode", 64)
    cm = obj.cost_model
    rows = _degree_rows(LegalSampler(space))
    terms = term_tables(cm, space, rows)
    for d in (0, len(rows) // 2, len(rows) - 1):
        ref = cm.branch_tables(rows[d], space)
        for mine, theirs in zip(terms, ref.terms):
            assert (mine["kind"], mine["branch"]) == (theirs.kind, theirs.branch)
            np.testing.assert_allclose(mine["time"][d] * 1e3, theirs.time_ms, rtol=1e-12)
            np.testing.assert_array_equal(mine["legal"][d], theirs.legal)


def test_batch_pruning_keeps_the_optimum_and_saves_evaluations():
    from shardc.search.synthetic import SyntheticObjective, toy_space

    s = toy_space()
    o = SyntheticObjective(s, seed=1)
    a = run_search("exact", s, o)
    b = run_search("exact", s, o, monotone_batch=False)
    assert a.best_value == b.best_value and a.evaluations < b.evaluations
