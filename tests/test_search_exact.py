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


def _pareto_reference(t, m, key):
    """The per-row step's Pareto filter (before vectorisation), kept as the reference."""
    keep = []
    for k in np.unique(key):
        idx = np.flatnonzero(key == k)
        best_m = np.inf
        for i in idx[np.lexsort((m[idx], t[idx]))]:
            if m[i] < best_m:
                keep.append(i)
                best_m = m[i]
    return np.array(sorted(keep), dtype=np.int64)


def _candidates_reference(d, deg_row, terms, space):
    """The per-row candidate step the vectorised block replaced (same output, row by row)."""
    col = {s: N_DEG + i for i, s in enumerate(space.op_slots)}
    parts = []
    for kname in dict.fromkeys(t.kind for t in terms):
        kterms = [t for t in terms if t.kind == kname]
        if kname == "global":
            for t in kterms:
                ok = np.flatnonzero(t.legal[d])
                part = np.full((len(ok), len(space.op_slots)), -1, dtype=np.int64)
                for j, s in enumerate(t.slots):
                    part[:, col[s] - N_DEG] = t.combos[ok, j]
                parts.append(part)
            continue
        ft, fm, fk = np.zeros(1), np.zeros(1), np.zeros(1, dtype=np.int64)
        fa = np.full((1, len(space.op_slots)), -1, dtype=np.int64)
        for t in kterms:
            ok = np.flatnonzero(t.legal[d])
            tt = (ft[:, None] + t.time_ms[d, ok][None, :]).ravel()
            mm = (fm[:, None] + (t.weight_bytes + t.kv_bytes)[d, ok][None, :]).ravel()
            kk = (fk[:, None] | t.needs[d, ok][None, :]).ravel()
            aa = np.repeat(fa, len(ok), axis=0)
            for j, s in enumerate(t.slots):
                aa[:, col[s] - N_DEG] = np.tile(t.combos[ok, j], len(fa))
            keep = _pareto_reference(tt, mm, kk)
            ft, fm, fk, fa = tt[keep], mm[keep], kk[keep], aa[keep]
        parts.append(fa)
    ops = np.full((1, len(space.op_slots)), -1, dtype=np.int64)
    for part in parts:
        ops = np.where(np.tile(part, (len(ops), 1)) >= 0, np.tile(part, (len(ops), 1)),
                       np.repeat(ops, len(part), axis=0))
    acts = np.empty((len(ops), N_DEG + len(space.op_slots)), dtype=np.int64)
    acts[:, :N_DEG] = deg_row
    acts[:, N_DEG:] = ops
    return acts


@pytest.mark.parametrize("name,mesh,wl", [
    ("deepseek_v3", "8x4", Workload(phase="decode", context=4096)),
    ("mixtral_8x7b", "8x2", Workload(phase="prefill", prompt=2048))])
def test_vectorised_candidates_are_the_per_row_candidates_in_order(name, mesh, wl):
    """The decomposed exact sweep's candidates, built 256 degree rows at a time, are the
    per-row step's (tests' reference copy of it), row by row and in the same order -- so the
    sweep evaluates the same actions in the same calls and returns the same plan and curve."""
    from shardc.search.exact_decomposed import BLOCK_ROWS, candidates_block
    from tests.cost_graphs import fixture_graph

    g, m = fixture_graph(name), Mesh.parse(mesh)
    space = StrategySpace(g, m, wl)
    rows = _degree_rows(LegalSampler(space))
    terms = CostModel(g, m, "h100", wl).branch_term_grid(rows, space)
    for lo in range(0, len(rows), BLOCK_ROWS):
        hi = min(lo + BLOCK_ROWS, len(rows))
        acts, counts = candidates_block(lo, hi, rows, terms, space)
        ref = [_candidates_reference(d, rows[d], terms, space) for d in range(lo, hi)]
        assert counts.tolist() == [len(r) for r in ref]
        assert np.array_equal(acts, np.concatenate(ref))
