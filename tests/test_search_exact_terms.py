"""The exact solver's term tables price each (kind, branch) term alone
(``CostModel.branch_term_cost``); they must be bit for bit the numbers the full step
(``CostModel._simulate``, what ``evaluate`` runs) adds up for that term, on any rows -- so
the exact sweep keeps its candidates, its evaluations and its plan."""

import numpy as np
import pytest

from shardc.cost import CostModel
from shardc.ir.space import StrategySpace
from shardc.ir.strategy import Mesh, Workload
from shardc.search import run_search
from shardc.search.exact_decomposed import _degree_rows
from shardc.search.legal import LegalSampler
from shardc.search.objective import CostModelObjective
from tests.cost_graphs import fixture_graph

CASES = [  # graph, mesh, workload, cost-model options, fixed degrees
    ("deepseek_v3", "8x16", Workload(phase="decode", context=4096), {"kernels": "silicon"}, {}),
    ("deepseek_v3", "8x4", Workload(phase="prefill", prompt=2048), {}, {}),
    ("mixtral_8x7b", "8x2", Workload(phase="decode", context=2048),
     {"kernels": "silicon", "mixed_prefill": 0.25}, {}),
    ("mixtral_8x7b", "8x2", Workload(phase="decode", context=2048), {}, {"moe_tp": 8}),
    ("llama3_70b", "8x2", Workload(phase="prefill", prompt=1024), {"kernels": "silicon"}, {}),
]


def _random_actions(space, n, rng):
    """Legal samples and rows whose op choices are drawn regardless of legality."""
    legal = LegalSampler(space).sample(n, rng)
    wild = legal.copy()
    wild[:, 5:] = rng.integers(0, 3, size=(n, wild.shape[1] - 5))
    return np.concatenate([legal, wild])


def _fields(bc):
    return {f: np.broadcast_to(np.asarray(getattr(bc, f), dtype=float), bc.time_s.shape)
            for f in ("time_s", "weight_bytes", "kv_bytes")}


@pytest.mark.parametrize("name,mesh,wl,opts,fixed", CASES)
def test_a_term_priced_alone_is_the_full_steps_term_bit_for_bit(name, mesh, wl, opts, fixed):
    g, m = fixture_graph(name), Mesh.parse(mesh)
    space = StrategySpace(g, m, wl, fixed=fixed)
    cm = CostModel(g, m, "h100", wl, **opts)
    acts = _random_actions(space, 400, np.random.default_rng(len(name) + len(mesh)))
    full = cm._simulate(acts, space)
    checked = 0
    for ki, (_, brs, _) in enumerate(full["kinds"]):
        for bi, (*_, want) in enumerate(brs):
            got = cm.branch_term_cost(acts, space, ki, bi)
            for f, v in _fields(want).items():
                assert np.array_equal(_fields(got)[f], v), (ki, bi, f)
            checked += 1
    for bi, name_ in enumerate(full["glob"]):
        got = cm.branch_term_cost(acts, space, None, bi)
        for f, v in _fields(full["glob"][name_][4]).items():
            assert np.array_equal(_fields(got)[f], v), (name_, f)
        checked += 1
    assert checked >= 4  # attention, feed-forward (or experts ...), embedding, lm_head


def test_the_term_grid_is_the_full_steps_terms_at_megatron_elsewhere():
    """``branch_term_grid`` (every degree row x combination) equals reading the term off a
    full simulation of the same rows (the grid's former path) -- also for the MoE layers'
    attention, which the grid prices once with the dense layers' equal one."""
    from shardc.cost.decomposition import _base_actions

    g, m = fixture_graph("deepseek_v3"), Mesh.parse("8x4")
    wl = Workload(phase="decode", context=4096)
    space = StrategySpace(g, m, wl)
    cm = CostModel(g, m, "h100", wl, kernels="silicon")
    rows = _degree_rows(LegalSampler(space))[::7]
    terms = cm.branch_term_grid(rows, space)
    base = _base_actions(space, rows)
    col = {s: 5 + i for i, s in enumerate(space.op_slots)}
    groups = [(ki, k.branches) for ki, k in enumerate(cm.kinds)] + [(None, cm.globals)]
    flat = [(ki, bi, br) for ki, brs in groups for bi, br in enumerate(brs)]
    assert len(flat) == len(terms)
    attention = [t for t in terms if t.branch == "attention"]  # dense and MoE layers: one
    assert len(attention) == 2 and np.shares_memory(attention[0].time_s, attention[1].time_s)
    for (ki, bi, (bname, _, table, slots)), term in zip(flat, terms):
        combos = table.combos()
        acts = np.repeat(base, len(combos), axis=0)
        for j, s in enumerate(slots):
            acts[:, col[s]] = np.tile(combos[:, j], len(rows))
        r = cm._simulate(acts, space)
        bc = r["kinds"][ki][1][bi][4] if ki is not None else r["glob"][bname][4]
        assert np.array_equal(term.time_ms, (bc.time_s * 1e3).reshape(len(rows), -1))
        assert np.array_equal(term.weight_bytes, bc.weight_bytes.reshape(len(rows), -1))


class _Compared(CostModelObjective):
    """Each call that brings the sweep's term costs is also evaluated without them (the
    cost model pricing every branch) and the two Evaluations compared field by field."""

    def __init__(self, cm, space):
        super().__init__(cm, space)
        self.calls, self.reused, self.mismatches = 0, 0, []

    def __call__(self, actions):
        a = np.atleast_2d(actions)
        if self.term_costs is not None:
            self.reused += 1
            read = self.cost_model.evaluate(a, self.space, term_costs=self.term_costs)
            priced = self.cost_model.evaluate(a, self.space)
            for f in ("tok_s_per_gpu", "tpot_ms", "ttft_ms", "memory_gb_per_gpu", "feasible",
                      "reason"):
                x, y = np.asarray(getattr(read, f)), np.asarray(getattr(priced, f))
                if not np.array_equal(x, y, equal_nan=x.dtype.kind == "f"):
                    self.mismatches.append((self.calls, f))
        self.calls += 1
        return super().__call__(actions)


class _Unaided(CostModelObjective):
    """Drops the sweep's term costs: every branch priced by the cost model (the sweep's
    evaluation before it read the grid)."""

    @property
    def term_costs(self):
        return None

    @term_costs.setter
    def term_costs(self, value):
        pass


@pytest.mark.parametrize("name,mesh,wl,opts,fixed", [
    ("deepseek_v3", "8x4", Workload(phase="decode", context=4096, batch=256),
     {"kernels": "silicon"}, {}),
    ("deepseek_v3", "8x2", Workload(phase="prefill", prompt=2048, batch=8),
     {"kernels": "silicon"}, {}),
    ("mixtral_8x7b", "8x2", Workload(phase="decode", context=2048), {}, {"moe_tp": 8}),
    ("llama3_70b", "8x2", Workload(phase="decode", context=8192),
     {"kernels": "silicon", "mixed_prefill": 0.5}, {}),
])
def test_the_sweep_reading_the_grid_evaluates_as_the_cost_model_prices(name, mesh, wl, opts,
                                                                         fixed):
    """Every call of the decomposed exact sweep, which reads the branch costs off the term
    grid, gives the Evaluation the cost model gives pricing every branch itself -- and the
    sweep returns the same optimum, curve and evaluation count as without the grid."""
    g, m = fixture_graph(name), Mesh.parse(mesh)
    space = StrategySpace(g, m, wl, fixed=fixed)
    compared = _Compared(CostModel(g, m, "h100", wl, **opts), space)
    fast = run_search("exact", space, compared, chunk=4096)
    assert compared.reused == compared.calls >= 3 and not compared.mismatches
    ref = run_search("exact", space, _Unaided(CostModel(g, m, "h100", wl, **opts), space),
                     chunk=4096)
    assert (ref.evaluations, ref.best_value, ref.curve) == (fast.evaluations, fast.best_value,
                                                             fast.curve)
    assert np.array_equal(ref.best_action, fast.best_action)
