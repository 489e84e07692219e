"""Partial compute/communication overlap as a preset parameter, applied per branch (issue 13):
branch time = compute + (1 - overlap) x comm, never below max(compute, comm); the decomposed
exact search stays exact."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from shardc.cost import CostModel, load_hardware
from shardc.cost.layer_costs import overlapped
from shardc.errors import InputError
from shardc.ir.space import StrategySpace
from shardc.ir.strategy import Mesh, Workload
from shardc.search import cost_model_objective, run_search
from shardc.search.legal import LegalSampler
from shardc.search.synthetic import toy_graph


def test_presets_state_the_overlap_and_user_files_may_set_it(tmp_path):
    h100 = load_hardware("h100")
    assert h100.tp_comm_overlap == 0.0 and h100.ep_comm_overlap == 0.0  # vLLM defaults
    f = tmp_path / "tbo.toml"
    f.write_text('base = "h100"\nep_comm_overlap = 0.8\ntp_comm_overlap = 0.25\n')
    hw = load_hardware(str(f))
    assert hw.ep_comm_overlap == 0.8 and hw.tp_comm_overlap == 0.25
    for bad in ("1.5", "-0.1", "nan"):
        f.write_text(f'base = "h100"\nep_comm_overlap = {bad}\n')
        with pytest.raises(InputError, match="ep_comm_overlap"):
            load_hardware(str(f))


def test_overlap_formula_and_its_bound():
    hw = replace(load_hardware("h100"), tp_comm_overlap=0.5, ep_comm_overlap=1.0)
    compute = np.array([10.0, 1.0, 10.0])
    tp = np.array([4.0, 4.0, 0.0])
    ep = np.array([0.0, 0.0, 30.0])
    got = overlapped(compute, tp, ep, hw)
    np.testing.assert_allclose(got, [12.0, 4.0, 30.0])  # 10 + 0.5*4; bound: comm; bound
    assert (got >= np.maximum(compute, tp + ep)).all()
    assert (got <= compute + tp + ep).all()
    np.testing.assert_allclose(overlapped(compute, tp, ep, load_hardware("h100")),
                               compute + tp + ep)


def _problem(hw, batch=64):
    g = toy_graph(layers=32, hidden=8192, heads=64, experts=8, ffn=28672, vocab=32000)
    wl = Workload(phase="decode", batch=batch, context=4096)
    space = StrategySpace(g, Mesh.parse("8x2"), wl)
    return space, cost_model_objective(CostModel(g, space.mesh, hw, wl), space)


def test_overlap_lowers_the_step_per_branch():
    serial = load_hardware("h100")
    tbo = replace(serial, tp_comm_overlap=0.3, ep_comm_overlap=0.8)
    space, obj = _problem(serial)
    _, obj_tbo = _problem(tbo)
    acts = LegalSampler(space).sample(256, np.random.default_rng(0))
    ep_rows = space.degree_arrays(acts)["ep"] > 1
    lat0 = obj.cost_model.evaluate(acts, space).tpot_ms
    lat1 = obj_tbo.cost_model.evaluate(acts, space).tpot_ms
    assert (lat1 <= lat0 + 1e-12).all() and (lat1[ep_rows] < lat0[ep_rows]).all()
    # the breakdown says how much was hidden
    s = space.decode(acts[np.flatnonzero(ep_rows)[0]])
    assert obj_tbo.cost_model.simulate(s).predicted["breakdown"]["overlap_hidden_ms"] > 0
    assert obj.cost_model.simulate(s).predicted["breakdown"]["overlap_hidden_ms"] == 0


def test_decomposed_exact_equals_brute_force_with_overlap():
    hw = replace(load_hardware("h100"), tp_comm_overlap=0.5, ep_comm_overlap=0.8)
    space, obj = _problem(hw)
    fast = run_search("exact", space, obj)
    brute = run_search("exact", space, obj, decompose=False, monotone_batch=False)
    assert fast.best_value == pytest.approx(brute.best_value, rel=1e-12)
    serial = run_search("exact", *_problem(load_hardware("h100")))
    assert fast.best_value > serial.best_value  # the overlap changed the answer
