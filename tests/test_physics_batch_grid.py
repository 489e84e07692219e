"""A batch grid finer than powers of two near the SLO, and headline ratios that must survive
a +-1% latency SLO change (issue 13)."""

from __future__ import annotations

import numpy as np
import pytest
from cost_graphs import fixture_graph

from shardc.api import compile_with_outcome
from shardc.commands.compile import summary_table
from shardc.cost.slo_cliff import SLO_CLIFF_MARGIN, cliff_note, slo_cliff_check
from shardc.driver import search_pass
from shardc.ir.space import DECODE_BATCHES, PREFILL_BATCHES, StrategySpace
from shardc.ir.strategy import Mesh, Workload
from shardc.search import run_search


@pytest.mark.parametrize("grid, top", [(DECODE_BATCHES, 4096), (PREFILL_BATCHES, 256)])
def test_grid_steps_are_at_most_25_percent_and_keep_powers_of_two(grid, top):
    assert grid[0] == 1 and grid[-1] == top
    assert all(2**k in grid for k in range(top.bit_length()))
    big = [b for b in grid if b >= 4]
    assert max(b / a for a, b in zip(big, big[1:])) <= 1.25
    assert len(grid) <= 48  # one action component: still small for the RL agent


def test_plan_near_the_slo_keeps_most_of_its_batch():
    """Llama-3-70B on 8 H100: with the SLO just under the TPOT of Megatron's best plan
    (batch 256 at SLO 50 ms) the next feasible batch is at most 25% smaller (powers of two:
    half)."""
    g = fixture_graph("llama3_70b")
    loose = search_pass(g, Mesh(8, 1), "h100", Workload(context=4096), policy="megatron")
    t = loose.cost_model.simulate(loose.strategy).predicted["tpot_ms"]
    tight = search_pass(g, Mesh(8, 1), "h100", Workload(context=4096, tpot_slo_ms=t * 0.999),
                        policy="megatron")
    assert tight.strategy.batch < loose.strategy.batch
    assert tight.strategy.batch >= 0.75 * loose.strategy.batch
    assert tight.result.best_value >= 0.75 * loose.result.best_value


class _DivisibleBatches:
    """tok/s/GPU grows with the batch (and a little with op choice 0); feasible up to batch
    200 when the batch divides over 4 micro-batches (or is 1 or 2): the memory-like limit is
    monotone, the divisibility is not (3, 5, 6, 7, 10, 14 fail between feasible values)."""

    def __init__(self, space):
        self.space = space

    def __call__(self, actions):
        a = np.atleast_2d(actions)
        b = np.asarray(self.space.values["batch"])[a[:, 4]]
        value = b * (1.0 + 0.01 * (a[:, 5:] == 0).sum(axis=1))
        return value.astype(float), (b <= 200) & ((b % 4 == 0) | (b <= 2))


def test_exact_batch_pruning_runs_along_doubling_chains():
    """Batch pruning on the finer grid: a combination feasible at 2 and infeasible at 3
    (divisibility) must still be tried at 4 .. 192 -- pruning only along 1, 2, 4, ...;
    3, 6, 12, ...; 5, 10, 20, ... keeps the sweep exact."""
    from shardc.ir.graph import FusedOp, Graph, LayerKind

    ops = [FusedOp("qkv", 64, 192, 64 * 192, 64 * 192, 2 * 64 * 192),
           FusedOp("attn_core", 192, 64, attrs={"heads": 4, "kv_heads": 4, "head_dim": 16}),
           FusedOp("out_proj", 64, 64, 64 * 64, 64 * 64, 2 * 64 * 64)]
    g = Graph(name="tiny", layer_kinds=[LayerKind("dense_block", 2, [0, 1], ops)],
              config={"hidden": 64, "heads": 4, "kv_heads": 4, "num_layers": 2})
    space = StrategySpace(g, Mesh(2, 1), Workload(phase="decode"))
    obj = _DivisibleBatches(space)
    pruned = run_search("exact", space, obj)
    plain = run_search("exact", space, obj, monotone_batch=False)
    assert space.decode(plain.best_action).batch == 192
    assert pruned.best_value == plain.best_value
    assert pruned.evaluations < plain.evaluations


def _cliff_case():
    """An SLO between the TPOT of Megatron's best plan and that of the same plan with a
    replicated embedding (0.1% faster): the exact search keeps batch 256, Megatron drops."""
    g = fixture_graph("llama3_70b")
    m = search_pass(g, Mesh(8, 1), "h100", Workload(context=4096), policy="megatron")
    t_m = m.cost_model.simulate(m.strategy).predicted["tpot_ms"]
    x = search_pass(g, Mesh(8, 1), "h100", Workload(context=4096, batch=m.strategy.batch,
                                                    tpot_slo_ms=t_m * 0.99999), policy="exact")
    t_x = x.cost_model.simulate(x.strategy).predicted["tpot_ms"]
    assert t_x < t_m
    return g, Workload(context=4096, tpot_slo_ms=(t_m + t_x) / 2)


def test_a_gain_made_by_the_slo_cliff_is_reported_as_such():
    g, wl = _cliff_case()
    plan, out = compile_with_outcome(g, mesh="8x1", workload=wl, search="exact")
    check = plan.baseline["megatron"]["slo_check"]
    assert check["ratio"] > 1.02  # the headline: the plan kept a batch Megatron lost
    assert not check["robust"]
    assert all(r is not None and r < 1 + (check["ratio"] - 1) / 2 for r in check["ratios"])
    table = summary_table(plan)
    assert "SLO-cliff artifact" in table and "0.99x/1.01x" in table


def test_a_gain_that_survives_the_slo_change_is_reported_plainly():
    g = fixture_graph("llama3_70b")
    wl = Workload(context=4096, tpot_slo_ms=50)
    out = search_pass(g, Mesh(8, 1), "h100", wl, policy="megatron")
    check = slo_cliff_check(out.cost_model, out.space, out.strategy,
                            out.result.best_value, out.megatron.best_value)
    assert check["robust"] and check["ratio"] == pytest.approx(1.0)
    assert cliff_note(check) == ""
    # a ratio that moves by more than the margin is a cliff even when the gain stays
    moved = dict(check, ratio=1.5, ratios=[1.5 * (1 - 2 * SLO_CLIFF_MARGIN), 1.5],
                 robust=False)
    assert "SLO-cliff artifact" in cliff_note(moved)
    assert np.isfinite(check["ratios"]).all()
