"""One stage map: the layers the cost model charges to each pipeline stage (trace.json's
lanes) are the layers whose parameters plan.json places on that stage (issue 12)."""

from __future__ import annotations

import re
from collections import defaultdict
from pathlib import Path

import pytest

from shardc.cost import CostModel
from shardc.ir.contract import CHOICE_NAMES
from shardc.ir.strategy import Degrees, Mesh, Strategy, Workload
from shardc.plan import build_plan

ROOT = Path(__file__).resolve().parents[1]
_LAYER = re.compile(r"^L(\d+) ")
_PARAM_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def _replicated_everywhere(graph) -> dict:
    choices = {f"{k.name}.{o.name}": 2 for k in graph.layer_kinds for o in k.ops
               if o.name in CHOICE_NAMES}
    choices.update({o.name: 2 for o in graph.global_ops})
    return choices


@pytest.mark.parametrize("example", ["deepseek_v3.py", "llama3_70b.py"])
@pytest.mark.parametrize("pp", [2, 3, 4])
def test_trace_lanes_hold_the_layers_plan_places_on_each_stage(example, pp):
    from shardc.frontends import load_graph

    graph = load_graph(str(ROOT / "examples" / example))
    mesh = Mesh.parse(f"{pp}x1")
    workload = Workload(phase="decode", batch=pp, context=4096, tpot_slo_ms=1e6)
    strategy = Strategy(Degrees(tp=1, pp=pp, ep=1, dp=1, sp=1), pp, _replicated_everywhere(graph))
    cm = CostModel(graph, mesh, "h100", workload)

    simulated = defaultdict(set)
    for ev in cm.chrome_trace(strategy)["traceEvents"]:
        m = _LAYER.match(ev.get("name", ""))
        if m and ev.get("ph") == "X":
            simulated[ev["tid"]].add(int(m.group(1)))
    plan = build_plan(graph=graph, strategy=strategy, mesh=mesh, hardware="h100",
                      workload=workload)
    deployed = defaultdict(set)
    for p in plan.params:
        m = _PARAM_LAYER.search(p["fqn"])
        if m:
            deployed[p["stage"]].add(int(m.group(1)))
    assert sorted(simulated) == list(range(pp))
    assert dict(simulated) == dict(deployed)
    counts = cm.stage_counts(pp).sum(axis=1)
    assert [len(simulated[s]) for s in range(pp)] == list(counts)
    # the annotated nodes agree as well
    node_stage = defaultdict(set)
    for n in plan.nodes:
        if n.get("layer") is not None and n.get("stage") is not None:
            node_stage[n["stage"]].add(n["layer"])
    assert dict(node_stage) == dict(deployed)
