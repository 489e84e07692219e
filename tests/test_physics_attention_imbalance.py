"""Batch-split attention with uneven sequence lengths: the busiest rank sets the time
(shardc.cost.imbalance, issue 13)."""

from __future__ import annotations

import math

import numpy as np
import pytest
from cost_graphs import fixture_graph

from shardc.cost import CostModel, imbalance
from shardc.cost.imbalance import CONTEXT_CV, batch_split_imbalance, expected_max_normal
from shardc.ir.space import StrategySpace, megatron_op_choices
from shardc.ir.strategy import Degrees, Mesh, Strategy, Workload


def test_imbalance_grows_with_ranks_and_shrinks_with_sequences_per_rank():
    assert CONTEXT_CV == pytest.approx(1 / math.sqrt(3))
    assert batch_split_imbalance(1, 4)[()] == 1.0
    f = batch_split_imbalance(np.array([2, 4, 8, 8, 8]), np.array([8, 8, 8, 32, 128]))
    assert f[0] < f[1] < f[2] and f[2] > f[3] > f[4] > 1.0
    assert f[2] == pytest.approx(1 + CONTEXT_CV * expected_max_normal(8) / math.sqrt(8))
    assert expected_max_normal(8) == pytest.approx(1.42, abs=0.02)  # E[max of 8 N(0,1)]


def _attn_ms(cm, space, strategy):
    ex = cm.simulate(strategy)
    return next(r["time_ms"] for r in ex.ops if r["op"] == "attn_core")


def test_batch_split_attention_is_charged_the_busiest_rank(monkeypatch):
    g = fixture_graph("llama3_70b")
    wl = Workload(phase="decode", batch=64, context=4096)
    space = StrategySpace(g, Mesh(8, 1), wl)
    cm = CostModel(g, space.mesh, "h100", wl)
    ch = dict(zip(space.op_slots, megatron_op_choices(space, space.values["tp"].index(8))))
    batch = dict(ch, **{"dense_block.qkv": 2, "dense_block.attn_core": 1,
                        "dense_block.out_proj": 0})
    s_batch = Strategy(Degrees(tp=8), 64, batch)
    s_heads = Strategy(Degrees(tp=8), 64, ch)
    uneven_b, uneven_h = _attn_ms(cm, space, s_batch), _attn_ms(cm, space, s_heads)
    monkeypatch.setattr(imbalance, "CONTEXT_CV", 0.0)  # even lengths
    even_b, even_h = _attn_ms(cm, space, s_batch), _attn_ms(cm, space, s_heads)
    assert uneven_h == pytest.approx(even_h, rel=1e-12)  # a heads split stays balanced
    want = 1 + CONTEXT_CV * expected_max_normal(8) / math.sqrt(64 / 8)
    # the kernel launch overhead is not scaled: compare the roofline parts
    assert uneven_b > even_b * (1 + 0.9 * (want - 1))
    assert uneven_b <= even_b * want + 1e-9
