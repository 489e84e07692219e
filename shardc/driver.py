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
from shardc.search import SWEEPS, SearchResult, cost_model_objective, run_search
from shardc.search.engine_search import search_engine


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
    # the space the search ran in (the user's fixed degrees, every experts split), where
    # ``space`` is the experts re-split copy the plan decodes in; None: ``space``
    search_space: StrategySpace | None = None


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


def baseline_over_splits(name: str, space, cost_model, default: SearchResult, budget: int,
                         seed: int) -> SearchResult:
    """Baseline ``name`` (``megatron``, ``best_practice``) over the experts splits:
    ``default`` (its sweep at the default split) and its sweep in every re-split copy of
    ``space`` some engine runs (:func:`shardc.ir.engines.searched_splits` with ``"any"``:
    the experts TP, EP or both over the tp x dp_attn ranks, as the engines deploy them), the
    best kept (ties: ``default``); a re-split winner's ``space`` is the copy
    its action decodes in."""
    from shardc.ir.engines import split_spaces

    best, evals = default, int(default.evaluations)
    for sp in split_spaces(space, "any")[1:]:
        r = run_search(name, sp, cost_model_objective(cost_model, sp), budget=budget,
                       seed=seed)
        evals += int(r.evaluations)
        if r.best_action is not None and np.isfinite(r.best_value) and (
                best.best_action is None or r.best_value > best.best_value):
            r.space, best = sp, r
    best.evaluations = evals
    return best


def best_practice_over_splits(space, cost_model, default: SearchResult, budget: int,
                              seed: int) -> SearchResult:
    """:func:`baseline_over_splits` of the best-practice baseline."""
    return baseline_over_splits("best_practice", space, cost_model, default, budget, seed)


def _dtensor_resplits(policy, space, cost_model, result: SearchResult, budget: int,
                      seed: int, seeds: list | None = None) -> SearchResult:
    """``result`` (the search at the default experts split) against the experts re-splits
    the DTensor backend runs (:func:`shardc.ir.engines.dtensor_runs_split`), the best kept
    (ties: ``result``): with ``DTENSOR_SEARCH_SWEEPS_RESPLITS``, the same search in every
    re-split copy of ``space``; else (the default) ``result``'s best rows and ``seeds`` (the
    baselines' bests) re-priced at every re-split and the best polished there
    (:func:`shardc.search.resplit.reprice_at_splits`, a few hundred evaluations)."""
    from shardc.ir.engines import DTENSOR_SEARCH_SWEEPS_RESPLITS, split_spaces
    from shardc.search.resplit import reprice_at_splits

    if not DTENSOR_SEARCH_SWEEPS_RESPLITS:
        rows = list(result.extra.get("top_rows", [])) + [result.best_action] + list(seeds or [])
        r = reprice_at_splits(space, cost_model, rows, seed=seed)
        if r is None:
            return result
        result.evaluations += int(r.evaluations)
        if r.best_action is not None and (result.best_action is None
                                          or r.best_value > result.best_value):
            r.evaluations, r.curve, r.policy = result.evaluations, result.curve, result.policy
            r.wall_s, r.extra = result.wall_s, result.extra
            result = r
        return result
    for sp in split_spaces(space, "dtensor")[1:]:
        r = run_search(policy, sp, cost_model_objective(cost_model, sp), budget=budget,
                       seed=seed)
        result.evaluations += int(r.evaluations)
        if r.best_action is not None and r.best_value > result.best_value:
            r.space, r.evaluations, result = sp, result.evaluations, r
    return result


def search_pass(graph: Graph, mesh: Mesh, hardware, workload: Workload, policy: str = "rl",
                budget: int = 4000, seed: int = 0, progress=None,
                fixed: dict[str, int] | None = None, kernels: str = "silicon",
                engine: str = "vllm", allow_cross_node_tp: bool = False,
                runtime: str = "dtensor") -> SearchOutcome:
    """Search the strategy, annotate the graph with it; raise InfeasibleError if none fits.
    ``fixed``: degrees the user fixed (``--degrees``; see :class:`StrategySpace`); the
    searcher and the baselines explore the rest. ``kernels`` / ``engine``: what prices the ops
    (:mod:`shardc.cost.silicon`). tp stays inside one NVLink domain unless
    ``allow_cross_node_tp`` (:func:`shardc.ir.space.nvlink_tp_domain`). ``runtime``: an engine
    (``vllm``, ``sglang``, ``trtllm``) searches only what that engine expresses
    (:mod:`shardc.search.engine_search`; the baselines still run in the whole space, as the
    comparison); ``dtensor``: the whole space."""
    cost_model = CostModel(graph, mesh, hardware, workload, kernels=kernels, engine=engine)
    space = StrategySpace(graph, mesh, workload, fixed=dict(fixed or {}),
                          tp_domain=nvlink_tp_domain(mesh, cost_model.hw.nvlink_domain,
                                                     allow_cross_node_tp))
    objective = cost_model_objective(cost_model, space)  # lets `exact` decompose per branch
    baselines = {name: run_search(name, space, objective, budget=budget, seed=seed)
                 for name in ("megatron", "best_practice")}
    # the plan is never worse than a baseline the plan's runtime runs (the baselines below
    # may pick an experts re-split only the engines run)
    runnable = dict(baselines)
    for name in baselines:  # reported over the splits, as the engines deploy them
        baselines[name] = baseline_over_splits(name, space, cost_model, baselines[name],
                                               budget=budget, seed=seed)
    engine_result = None
    if runtime != "dtensor":
        engine_result = search_engine(policy, space, runtime, budget=budget, seed=seed,
                                      cost_model=cost_model, progress=progress)
        if engine_result is None or engine_result.result.best_action is None:
            raise InfeasibleError(runtime_infeasible(runtime, engine_result, graph, mesh,
                                                     cost_model, workload, space))
        result = engine_result.result
        result.evaluations = engine_result.evaluations  # every mode's, not only the best's
    elif policy in baselines:
        result = runnable[policy]
    else:
        result = run_search(policy, space, objective, budget=budget, seed=seed, progress=progress)
        if policy not in SWEEPS:  # exact's certificate is of the default split's space
            result = _dtensor_resplits(
                policy, space, cost_model, result, budget, seed,
                seeds=[b.best_action for b in (*runnable.values(), *baselines.values())])
    searched = result
    chosen_from = policy
    # Never hand back a plan worse than a baseline computed in the same run (a baseline
    # asked for by name is returned as it is; with an engine runtime the plan must stay in
    # the engine's space, so the baselines are only compared with).
    skip = policy in baselines or runtime != "dtensor"
    for name, base in ({} if skip else runnable).items():
        if (base.best_action is not None and np.isfinite(base.best_value)
                and (result.best_action is None or base.best_value > result.best_value)):
            result, chosen_from = base, name
    megatron = baselines["megatron"]
    if result.best_action is None or not np.isfinite(result.best_value):
        raise InfeasibleError(
            infeasible_message(graph, mesh, cost_model.hw, workload, cost_model, space))
    search_space = None
    if result.space is not None:  # an engine's experts re-split: the plan's space is its
        for base in baselines.values():  # the baselines keep decoding in the whole space
            base.space = base.space or space
        search_space, space = space, result.space
        objective = cost_model_objective(cost_model, space)
    best = _canonical_when_tp1(space, objective, result.best_action, result.best_value)
    strategy = space.decode(best)
    # collective bytes for the tokens of one step of one replica (as graph.txt's shapes)
    step_tokens = strategy.batch * (1 if workload.phase == "decode" else workload.prompt)
    annotated = annotate(graph, strategy, tokens=step_tokens)
    complete = engine_result.complete if engine_result is not None else searched.complete
    exact_value = searched.best_value if policy == "exact" and complete else None
    return SearchOutcome(annotated, strategy, space, cost_model, result, megatron,
                         exact_value=exact_value, chosen_from=chosen_from, searched=searched,
                         best_practice=baselines["best_practice"], search_space=search_space)


def runtime_infeasible(runtime: str, engine_result, graph, mesh, cost_model, workload,
                       space) -> str:
    """Why ``--runtime <engine>`` found no plan: nothing the engine expresses here, or
    nothing it expresses fits (then the whole space's reason, which names what is short)."""
    from shardc.ir.engines import ENGINE_NAMES

    name = ENGINE_NAMES[runtime]
    if engine_result is None:
        return (f"--runtime {runtime}: {name} expresses no configuration of {mesh} for "
                f"{graph.name or 'this model'} (docs/deploy.md lists what it runs)")
    return (f"--runtime {runtime}: no configuration {name} expresses fits: "
            + infeasible_message(graph, mesh, cost_model.hw, workload, cost_model, space))
