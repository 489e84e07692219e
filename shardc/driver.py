"""The compile driver: the search pass (IR -> IR with the chosen strategy annotated on every
node), orchestrating search/, cost/ and the annotate pass. It lives outside ``passes/`` so
that editing it does not invalidate the traced-graph cache (keyed on the frontend and pass
code).

Given the layer kinds and fused ops of a graph, a mesh, a hardware preset and a workload, it
builds the strategy space (:class:`shardc.ir.space.StrategySpace`), the cost model
(:class:`shardc.cost.CostModel`) and asks a searcher (:func:`shardc.search.run_search`) for
the strategy maximising predicted tokens/s/GPU under the SLOs and HBM. It always runs the
Megatron heuristic and the best-practice baseline too (same cost model, same run): the
baselines the result is compared to (its gain is claimed against the stronger one).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from shardc.cost import CostModel
from shardc.cost.infeasible import infeasible_message
from shardc.errors import InfeasibleError
from shardc.ir.graph import Graph
from shardc.ir.space import StrategySpace, megatron_ops_at_tp1, nvlink_tp_domain
from shardc.ir.strategy import Mesh, Strategy, Workload
from shardc.passes.annotate import annotate
from shardc.search import SearchResult, cost_model_objective, run_search


@dataclass
class SearchOutcome:
    """Everything the compile step reports about the search."""

    graph: Graph  # annotated
    strategy: Strategy
    space: StrategySpace
    cost_model: CostModel
    result: SearchResult
    megatron: SearchResult
    exact_value: float | None = None
    chosen_from: str = "rl"  # the policy whose strategy was kept (a baseline if it was better)
    searched: SearchResult | None = None  # the requested searcher's own result
    best_practice: SearchResult | None = None  # the best-practice baseline's sweep


def _canonical_when_tp1(space, objective, action, value):
    """With tp = 1 every per-op choice costs the same; report Megatron's names (if the cost
    model agrees the value is unchanged) instead of whatever the searcher happened on."""
    action = np.asarray(action, dtype=np.int64).copy()
    alt = megatron_ops_at_tp1(space, action[None, :])[0]
    if np.array_equal(alt, action):
        return action
    alt_value, alt_ok = objective(alt[None, :])
    if bool(alt_ok[0]) and float(alt_value[0]) >= float(value) * (1 - 1e-12):
        return alt
    return action


def search_pass(graph: Graph, mesh: Mesh, hardware, workload: Workload, policy: str = "rl",
                budget: int = 4000, seed: int = 0, progress=None,
                fixed: dict[str, int] | None = None, kernels: str = "silicon",
                engine: str = "vllm", allow_cross_node_tp: bool = False) -> SearchOutcome:
    """Search the strategy, annotate the graph with it; raise InfeasibleError if none fits.
    ``fixed``: degrees the user fixed (``--degrees``; see :class:`StrategySpace`); the
    searcher and the baselines explore the rest. ``kernels`` / ``engine``: what prices the ops
    (:mod:`shardc.cost.silicon`). tp stays inside one NVLink domain unless
    ``allow_cross_node_tp`` (:func:`shardc.ir.space.nvlink_tp_domain`)."""
    cost_model = CostModel(graph, mesh, hardware, workload, kernels=kernels, engine=engine)
    space = StrategySpace(graph, mesh, workload, fixed=dict(fixed or {}),
                          tp_domain=nvlink_tp_domain(mesh, cost_model.hw.nvlink_domain,
                                                     allow_cross_node_tp))
    objective = cost_model_objective(cost_model, space)  # lets `exact` decompose per branch
    baselines = {name: run_search(name, space, objective, budget=budget, seed=seed)
                 for name in ("megatron", "best_practice")}
    if policy in baselines:
        result = baselines[policy]
    else:
        result = run_search(policy, space, objective, budget=budget, seed=seed, progress=progress)
    searched = result
    chosen_from = policy
    # Never hand back a plan worse than a baseline computed in the same run (a baseline
    # asked for by name is returned as it is).
    for name, base in ({} if policy in baselines else baselines).items():
        if (base.best_action is not None and np.isfinite(base.best_value)
                and (result.best_action is None or base.best_value > result.best_value)):
            result, chosen_from = base, name
    megatron = baselines["megatron"]
    if result.best_action is None or not np.isfinite(result.best_value):
        raise InfeasibleError(
            infeasible_message(graph, mesh, cost_model.hw, workload, cost_model, space))
    best = _canonical_when_tp1(space, objective, result.best_action, result.best_value)
    strategy = space.decode(best)
    # collective bytes for the tokens of one step of one replica (as graph.txt's shapes)
    step_tokens = strategy.batch * (1 if workload.phase == "decode" else workload.prompt)
    annotated = annotate(graph, strategy, tokens=step_tokens)
    exact_value = searched.best_value if policy == "exact" and searched.complete else None
    return SearchOutcome(annotated, strategy, space, cost_model, result, megatron,
                         exact_value=exact_value, chosen_from=chosen_from, searched=searched,
                         best_practice=baselines["best_practice"])
