"""A plan's *decision*, with the traced graph's node-level detail normalised away.

Golden files pin what shardc decided -- degrees, per-op choices, parameter placements, the
placements of the model's sharded activations and every collective inserted -- not the node
names and helper ops (position ids, masks, views) that transformers' code happens to trace
to, which change between its minor releases (5.24 traces a ``cumsum`` where 5.23 had an
``expand``). A changed plan changes the decision; a renamed mask op does not.
"""

from __future__ import annotations

import json
import math

SIGNIFICANT = 4  # predicted numbers are compared to 4 significant digits


def rounded(value):
    """``value`` with every float rounded to :data:`SIGNIFICANT` significant digits
    (recursively through dicts and lists); other values as they are."""
    if isinstance(value, float):
        if value == 0 or not math.isfinite(value):
            return value
        return round(value, SIGNIFICANT - 1 - int(math.floor(math.log10(abs(value)))))
    if isinstance(value, dict):
        return {k: rounded(v) for k, v in value.items()}
    if isinstance(value, list):
        return [rounded(v) for v in value]
    return value


def _model_op_node(node: dict) -> bool:
    """A node of one of the model's fused ops (projections, attention core, experts, norms,
    embedding, head): its placements are the sharded activations the plan chose."""
    return node.get("fused_op") is not None


def plan_decision(plan: dict) -> dict:
    """The decision of a plan.json dict (see the module docstring). Node names are dropped;
    the model's op nodes are kept as (layer, fused op, kind, shape, placements, stage) rows
    in trace order, collectives as their records (branch, before_op, layer, kind, mesh dim,
    bytes, placements) in trace order. Wall times and the model file's folder are dropped."""
    d = json.loads(json.dumps(plan))
    d.get("search", {}).pop("wall_s", None)
    if "source" in d.get("model", {}):
        d["model"]["source"] = d["model"]["source"].replace("\\", "/").rsplit("/", 1)[-1]
    nodes = d.pop("nodes", [])
    d["activations"] = [[n.get("layer"), n.get("fused_op"), n.get("op"), n.get("shape"),
                         n.get("placements"), n.get("stage")]
                        for n in nodes if _model_op_node(n)]
    d["collectives"] = [n["redistribute"] for n in nodes if n.get("redistribute")]
    return rounded(d)


def decision_graph_txt(plan: dict, note: str = "") -> str:
    """graph.txt of the plan restricted to the model's op nodes and the nodes that carry a
    collective, each named by its layer and fused op instead of the traced node name."""
    from shardc.commands.reports import graph_table

    rows = []
    for n in plan["nodes"]:
        if _model_op_node(n) or n.get("redistribute"):
            layer = "-" if n.get("layer") is None else n["layer"]
            rows.append({**n, "name": f"L{layer}.{n.get('fused_op') or '-'}"})
    return graph_table(rows, note)
