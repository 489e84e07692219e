"""One layout from the degrees: SPMD dims and communicator strides agree everywhere they are
consumed (issue 12)."""

from __future__ import annotations

import itertools
from pathlib import Path

import numpy as np
import pytest

from shardc.backends.layout import spmd_dims as backend_spmd_dims
from shardc.cost.topology import mesh_groups
from shardc.ir.contract import CHOICE_NAMES
from shardc.ir.strategy import MESH_DIM_ORDER, Degrees, Mesh, Strategy, Workload
from shardc.passes.annotate import spmd_dims as annotate_spmd_dims

ROOT = Path(__file__).resolve().parents[1]

DEGREES = [dict(tp=1, ep=1, pp=1, dp=1), dict(tp=1, ep=1, pp=2, dp=1),
           dict(tp=1, ep=1, pp=1, dp=2), dict(tp=2, ep=1, pp=2, dp=1),
           dict(tp=2, ep=2, pp=1, dp=1), dict(tp=1, ep=2, pp=2, dp=2)]


@pytest.mark.parametrize("deg", DEGREES, ids=lambda d: "-".join(f"{k}{v}" for k, v in d.items()))
def test_every_placement_list_refers_to_the_same_spmd_dims(deg):
    from shardc.frontends import load_graph
    from shardc.plan import build_plan

    graph = load_graph(str(ROOT / "examples" / "tiny_mixtral.py"), tiny=True)
    d = Degrees(sp=1, **deg)
    choices = {f"{k.name}.{o.name}": 2 for k in graph.layer_kinds for o in k.ops
               if o.name in CHOICE_NAMES}
    choices.update({o.name: 2 for o in graph.global_ops})
    strategy = Strategy(d, 2 * d.pp * d.ep, choices)
    world = d.tp * d.ep * d.pp * d.dp
    plan = build_plan(graph=graph, strategy=strategy, mesh=Mesh.parse(f"{world}x1"),
                      hardware="h100", workload=Workload(phase="decode", batch=strategy.batch))
    dims = d.spmd_dims()
    shape, names = d.logical_mesh()
    assert dims and set(dims) <= set(names) and "pp" not in dims
    assert annotate_spmd_dims(strategy) == backend_spmd_dims(d) == plan.spmd_dims == dims
    assert list(plan.logical_mesh["dim_names"]) == list(names)
    assert int(np.prod(shape)) == world
    for n in plan.nodes:
        if n.get("placements") is not None:
            assert len(n["placements"]) == len(dims), n["name"]
    for p in plan.params:
        assert len(p["placements"]) == len(dims), p["fqn"]


@pytest.mark.parametrize("tp, ep, dp, pp, gpus_per_node",
                         [c + (g,) for c in itertools.product([1, 2, 4], [1, 2], [1, 2, 4], [1, 2])
                          for g in (4, 8)])
def test_communicator_strides_follow_the_device_mesh(tp, ep, dp, pp, gpus_per_node):
    """Each mesh dim's communicator, found by building the device mesh as the backend does
    (ranks laid out in MESH_DIM_ORDER), has the size and node span the cost model uses."""
    sizes = {"pp": pp, "dp": dp, "ep": ep, "tp": tp}
    ranks = np.arange(tp * ep * dp * pp).reshape([sizes[n] for n in MESH_DIM_ORDER])
    groups = mesh_groups(tp, ep, dp, pp, gpus_per_node)
    for axis, name in enumerate(MESH_DIM_ORDER):
        group = np.moveaxis(ranks, axis, -1).reshape(-1, sizes[name])[0]  # rank 0's group
        nodes = len(set((group // gpus_per_node).tolist()))
        assert int(groups[name].size) == sizes[name]
        assert int(groups[name].nodes) == nodes, name
