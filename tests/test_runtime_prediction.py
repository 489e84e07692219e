"""plan.json ``predicted.runtime``: the emitted runtime's step beside the engine's
(:mod:`shardc.cost.runtime_step`), in the schema, and printed by the compile summary when
the two differ by more than 10%."""

from __future__ import annotations

import pytest
from test_backend_gloo import DENSE, LLAMA, MIXTRAL, MOE

from shardc.cost.runtime_step import EAGER_OP_MS, GRAPH_STEP_MS, runtime_prediction


def _plan(model_file, degrees, choices):
    from shardc.cost import CostModel
    from shardc.frontends import load_graph
    from shardc.ir.strategy import Mesh, Workload, strategy_from_names
    from shardc.plan import build_plan

    graph = load_graph(model_file, tiny=True)
    st = strategy_from_names(degrees, choices, 8)
    wl = Workload(phase="decode", batch=8, context=512)
    pred = CostModel(graph, Mesh(st.degrees.world, 1), "h100", wl).simulate(st).predicted
    return build_plan(graph, st, Mesh(st.degrees.world, 1), "h100", wl, predicted=pred)


def test_graph_captured_dense_decode_adds_one_replay():
    plan = _plan(LLAMA, {"tp": 4}, DENSE)
    rt = plan.predicted["runtime"]
    tick = plan.predicted["breakdown"]["tick_ms"]
    assert rt["cuda_graph"] is True and rt["overhead_ms"] == pytest.approx(GRAPH_STEP_MS)
    assert rt["step_ms"] == pytest.approx(tick + GRAPH_STEP_MS, abs=1e-3)
    assert "unmeasured" in rt["source"]


def test_moe_dispatch_runs_eager_and_costs_more_host_time():
    plan = _plan(MIXTRAL, {"ep": 2, "tp": 2}, MOE)
    rt = plan.predicted["runtime"]
    assert rt["cuda_graph"] is False and rt["overhead_ms"] > 100 * EAGER_OP_MS
    assert rt["step_ms"] > plan.predicted["breakdown"]["tick_ms"] + rt["overhead_ms"] - 1e-3


def test_pipeline_runs_stages_in_turn():
    bd = {"tick_ms": 2.0, "stage_ms": [2.0, 1.5], "micro_batches": 2.0, "pp_send_ms": 0.1}
    rt = runtime_prediction({"breakdown": bd}, {"pp": 2}, 4, 0, 0, "decode")
    assert rt["step_ms"] == pytest.approx((2.0 + 1.5) * 2 + 0.1 + rt["overhead_ms"])
    assert runtime_prediction({}, {"pp": 1}, 4, 0, 0, "decode") is None


def test_runtime_block_validates_and_summary_prints_both_when_apart():
    import json
    from pathlib import Path

    import jsonschema

    from shardc.commands.compile import summary_table

    plan = _plan(MIXTRAL, {"ep": 2, "tp": 2}, MOE)
    schema = json.loads((Path(__file__).resolve().parents[1] / "shardc" / "schema"
                         / "plan.schema.json").read_text())
    jsonschema.validate(json.loads(json.dumps(plan.to_dict())), schema)
    bad = json.loads(json.dumps(plan.to_dict()))
    del bad["predicted"]["runtime"]["source"]
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(bad, schema)
    plan.baseline = {}
    plan.search = {}
    assert "parallelize.py step (ms)" in summary_table(plan)  # eager MoE: > 10% apart
    plan.predicted["runtime"]["step_ms"] = plan.predicted["tpot_ms"] * 1.05
    assert "parallelize.py step (ms)" not in summary_table(plan)
