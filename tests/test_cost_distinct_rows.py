"""Pricing each distinct (degrees, chunk, branch choices) once (cost.distinct_rows), with a
branch's tp repairs in one pass, gives the same floats as pricing every row and every repair
on its own (layer_costs.branch_cost per row, _pick_collective per op), on random batches
with many repeated degree rows, for every pool role, the silicon tables and the roofline,
and the experts' all-gather re-split."""

from __future__ import annotations

import numpy as np
import pytest

from shardc.cost import layer_costs
from shardc.cost import model as cost_model
from shardc.cost.distinct_rows import context_ids, distinct_keys
from shardc.cost.layer_costs import branch_cost
from shardc.cost.scheduler import evaluate_scheduled
from shardc.ir.space import DEGREE_COMPONENTS, StrategySpace
from shardc.ir.strategy import Mesh, Workload
from shardc.search.legal import LegalSampler
from shardc.serving.pool_models import pool_cost_model, pool_workload
from tests.cost_graphs import fixture_graph

SERVE = Workload(phase="serve", isl=4096, osl=512, tpot_slo_ms=50, ttft_slo_ms=2000)
EV_FIELDS = ("tok_s_per_gpu", "tpot_ms", "ttft_ms", "memory_gb_per_gpu", "reason",
             "token_budget", "prefill_chunk", "mixed_fraction")


def _every_row(branch, ops, table, combo, b, in_width, ctx, n_ctx):
    """The reference: every row priced on its own."""
    return branch_cost(branch, ops, table, combo, b, in_width)


def _batch(space, rng, n_degree_rows=24, per_row=12):
    """Few degree rows, each with many random op choices (as the exact ceiling's blocks),
    in shuffled order."""
    base = LegalSampler(space).sample(n_degree_rows, rng)
    other = LegalSampler(space).sample(n_degree_rows * per_row, rng)
    d = len(DEGREE_COMPONENTS)
    rows = np.repeat(base, per_row, axis=0)
    rows[:, d:] = other[:, d:]
    legal = space.actions_legal(rows)
    rows[~legal, d:] = np.repeat(base, per_row, axis=0)[~legal, d:]
    return rows[rng.permutation(len(rows))]


def _same(a, b):
    for f in EV_FIELDS:
        x, y = getattr(a, f), getattr(b, f)
        if x is None:
            assert y is None, f
            continue
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y), err_msg=f)


@pytest.mark.parametrize("name,mesh,role,kernels,fixed", [
    ("kimi_k2", "8x8", "mixed", "silicon", {}),
    ("kimi_k2", "8x8", "prefill", "silicon", {}),
    ("deepseek_v2", "8x2", "decode", "silicon", {}),
    ("mixtral_8x7b", "8x2", "mixed", "roofline", {}),
    ("mixtral_8x7b", "8x1", "decode", "silicon", {"moe_tp": 8}),
    ("llama3_70b", "8x2", "mixed", "silicon", {}),
])
def test_distinct_pricing_equals_every_row(monkeypatch, name, mesh, role, kernels, fixed):
    g = fixture_graph(name)
    m = Mesh.parse(mesh)
    space = StrategySpace(g, m, pool_workload(SERVE, role), fixed=fixed)
    cm = pool_cost_model(g, m, "h100", SERVE, role, kernels=kernels)
    rng = np.random.default_rng(len(name) + len(role))
    acts = _batch(space, rng)
    chunk = None if role == "prefill" else rng.choice([0.0, 64.0, 512.0, 4096.0], len(acts))
    if fixed:  # the experts' re-split rows are priced on their own Batch
        deg = space.degree_arrays(acts)
        assert ((deg["moe_tp"] != deg["tp"]) & (deg["dp"] > 0)).any()
    fast = (evaluate_scheduled(cm, acts, space)["ev"] if cm.token_budgets is not None
            else cm._simulate(acts, space)["ev"])
    fast_r = cm._simulate(acts, space, chunk=chunk)
    monkeypatch.setattr(cost_model, "distinct_branch_cost", _every_row)
    monkeypatch.setattr(layer_costs, "_tp_repairs", lambda *a: None)  # each repair alone
    ref = (evaluate_scheduled(cm, acts, space)["ev"] if cm.token_budgets is not None
           else cm._simulate(acts, space)["ev"])
    assert (ref.tok_s_per_gpu > 0).sum() > 10  # the batch prices real strategies
    _same(fast, ref)
    ref_r = cm._simulate(acts, space, chunk=chunk)
    _same(fast_r["ev"], ref_r["ev"])
    for x, y in zip(fast_r["layer_time"], ref_r["layer_time"]):
        np.testing.assert_array_equal(x, y)


def test_context_ids_and_distinct_keys():
    rng = np.random.default_rng(3)
    deg = rng.integers(0, 4, size=(500, 5))
    chunk = rng.choice([0.0, 0.5, 8.0], 500)
    ids, n = context_ids(deg, chunk)
    key = [tuple(r) + (c,) for r, c in zip(deg.tolist(), chunk.tolist())]
    assert n == len(set(key))
    for i in range(0, 500, 7):  # equal ids <=> equal contexts
        same = ids == ids[i]
        assert same.sum() == sum(k == key[i] for k in key)
    for space in (50, 1 << 30):  # the dense table and the sort give the same answer
        k = rng.integers(0, 50, 400)
        first, inv = distinct_keys(k, space)
        assert (k[first][inv] == k).all()
        assert (first == np.array([np.flatnonzero(k == v)[0] for v in np.unique(k)])).all()


def test_tag_selection_equals_the_copied_rows():
    """PoolObjective.table(tags) (memoised, wide columns taken on use) holds the rows of
    those searches, in the order of the list."""
    from shardc.serving.pools import PoolObjective

    g = fixture_graph("mixtral_8x7b")
    m = Mesh.parse("8x1")
    space = StrategySpace(g, m, pool_workload(SERVE, "decode"))
    obj = PoolObjective(pool_cost_model(g, m, "h100", SERVE, "decode"), space, "decode")
    rng = np.random.default_rng(5)
    for tag in ("megatron", "rl", "exact", "rl", "megatron"):
        obj.tag = tag
        obj(LegalSampler(space).sample(int(rng.integers(5, 40)), rng))
    full = obj.table()
    for tags in (["rl", "megatron"], ("exact",), {"rl", "exact"}, ["exact", "rl", "megatron"]):
        for _ in range(2):  # the second read comes from the memo
            t = obj.table(tags)
            order = list(tags) if isinstance(tags, (list, tuple)) else None
            rows = [i for i in range(len(full["tag"])) if full["tag"][i] in tags]
            if order:
                rows.sort(key=lambda i: order.index(full["tag"][i]))
            assert len(t["actions"]) == len(rows)
            for k, v in full.items():
                got = np.array([t[k][j] for j in range(len(rows))])
                np.testing.assert_array_equal(got, v[rows], err_msg=k)
            np.testing.assert_array_equal(t["actions"][np.arange(len(rows))[::2]],
                                          full["actions"][rows[::2]])
    obj.tag = "late"  # a new call drops the memo
    obj(LegalSampler(space).sample(7, rng))
    assert len(obj.table(["late"])["value"]) == 7
