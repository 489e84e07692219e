"""plan.json ``launch``: the best configuration each engine expresses, found by the search.

For every engine (vLLM, SGLang, TensorRT-LLM) the compile searches the space that engine
expresses (:mod:`shardc.ir.engines`) with ``exact`` (one op row per tp makes it a sweep of
degrees x batch: small), priced with that engine's kernel tables (the traced graph is
reused; only the engine's CostModel is new). Single-phase compiles search the plan's own
space (its fixed degrees and NVLink rule); ``--phase serve`` runs the serving search
(:func:`shardc.serving.search.serve_search`) restricted to the engine, so each pool (mixed, or
prefill + decode) is the engine's best and the SLOs hold. The engine the plan was searched
for (``--runtime``) gets the plan itself. When nothing the engine expresses fits, the entry
has no pools and says why (no script is written; the compile still succeeds). Every pool
found gets a script (:func:`shardc.backends.launch.launch_scripts`; TensorRT-LLM's
disaggregated, FP8 and multi-node pools through :mod:`shardc.backends.launch_trtllm`, plus
``launch/trtllm_disagg.sh`` for a prefill + decode pair).

Entry: ``{engine, checked_against, pools [{role, workers, gpus_per_worker, degrees, batch,
mode, flags, script}], predicted {tok_s_per_gpu, tpot_ms, ttft_ms}, same_as_plan,
gap_vs_plan (fraction: -0.05 = 5% below the plan), reason, search {policy, complete,
evaluations}}``.
"""

from __future__ import annotations

from dataclasses import replace

from shardc.backends.launch import (
    LaunchPool,
    engine_flag_table,
    no_script_reason,
    pool_entry,
    role_for_phase,
    script_name,
)
from shardc.cost import CostModel
from shardc.errors import InfeasibleError, InputError
from shardc.ir.engines import ENGINE_NAMES, ENGINES
from shardc.search.engine_search import search_engine

LAUNCH_EXACT_LIMIT_S = 60.0  # per engine; a sweep stopped here is reported incomplete


def _same(a, b) -> bool:
    return (a.degrees.as_dict() == b.degrees.as_dict() and int(a.batch) == int(b.batch)
            and {k: int(v) for k, v in a.choices.items()}
            == {k: int(v) for k, v in b.choices.items()})


def _entry(engine: str, pools: list[LaunchPool], predicted: dict | None, plan_value,
           same: bool, reason: str | None, search: dict, gpus_per_node: int = 8) -> dict:
    value = (predicted or {}).get("tok_s_per_gpu")
    gap = (float(value) / float(plan_value) - 1.0) if value and plan_value else None
    rows, notes = [], []
    for p in pools:
        why = no_script_reason(engine, p, gpus_per_node)
        rows.append(pool_entry(engine, p, None if why else
                               f"launch/{script_name(engine, p.role)}"))
        if why:
            notes.append(f"{p.role}: {why}")
    out = {"engine": ENGINE_NAMES[engine],
           "checked_against": engine_flag_table()[engine]["checked_against"],
           "pools": rows, "predicted": predicted, "same_as_plan": bool(same and pools),
           "gap_vs_plan": gap, "reason": reason, "search": search}
    if notes:
        out["note"] = "no script for " + "; ".join(notes)
    return out


def _numbers(pred: dict) -> dict:
    return {k: (None if pred.get(k) is None else float(pred[k]))
            for k in ("tok_s_per_gpu", "tpot_ms", "ttft_ms")}


def single_phase_entry(engine: str, plan, outcome, *, graph, mesh, hw, workload, kernels,
                       runtime) -> dict:
    """``launch.<engine>`` of a decode or prefill compile (module docstring)."""
    wl = plan.workload
    role = role_for_phase(wl["phase"])
    length = int(wl["context"] if wl["phase"] == "decode" else wl["prompt"])
    mem = 1.0 - float(outcome.cost_model.hw.headroom)
    fmt = {"kv_cache": str(wl.get("kv_cache") or "bf16"),
           "weights": str(wl.get("weights") or "bf16")}
    plan_value = (plan.predicted or {}).get("tok_s_per_gpu")
    space = outcome.space
    if runtime == engine:
        s = outcome.strategy
        pool = LaunchPool.of(role, s, space, length, mem, **fmt)
        return _entry(engine, [pool], _numbers(plan.predicted or {}), plan_value, True, None,
                      {"policy": plan.search.get("policy"), "complete": True,
                       "evaluations": int(plan.search.get("evaluations") or 0)},
                      mesh.gpus_per_node)
    cm = (outcome.cost_model if outcome.cost_model.kernel_options["engine"] == engine
          else CostModel(graph, mesh, hw, workload, kernels=kernels, engine=engine))
    # the engine searches the space the plan's search ran in (every experts split), not the
    # re-split copy the plan decodes in
    space = outcome.search_space or space
    found = search_engine("exact", space, engine, cost_model=cm,
                          time_limit_s=LAUNCH_EXACT_LIMIT_S)
    name = ENGINE_NAMES[engine]
    if found is None:
        return _entry(engine, [], None, plan_value, False, (
            f"{name} expresses no configuration of this mesh"
            + (" with the fixed --degrees" if space.fixed else "")), {})
    search = {"policy": "exact", "complete": bool(found.complete),
              "evaluations": int(found.evaluations)}
    if found.result.best_action is None:
        return _entry(engine, [], None, plan_value, False, (
            f"nothing {name} expresses fits this workload (memory or the SLOs)"), search)
    space = found.result.space or space  # an experts re-split decodes in its own space
    s = space.decode(found.result.best_action)
    pred = cm.simulate(s).predicted
    pool = LaunchPool.of(role, s, space, length, mem, **fmt)
    return _entry(engine, [pool], _numbers(pred), plan_value, _same(s, outcome.strategy),
                  None, search, mesh.gpus_per_node)


def serve_entry(engine: str, plan, outcome, *, graph, mesh, hw, workload, fixed, kernels,
                runtime, allow_cross_node_tp, serve_search) -> dict:
    """``launch.<engine>`` of a ``--phase serve`` compile (module docstring);
    ``serve_search``: :func:`shardc.serving.search.serve_search` (passed in: same import rank)."""
    wl = plan.workload
    length = int(wl["isl"]) + int(wl["osl"])
    mem = 1.0 - float(hw.headroom)
    fmt = {"kv_cache": str(wl.get("kv_cache") or "bf16"),
           "weights": str(wl.get("weights") or "bf16")}
    plan_value = plan.serving["predicted"]["tok_s_per_gpu"]
    if runtime == engine:
        out, same, search = outcome, True, {"policy": plan.search.get("policy"),
                                            "complete": True}
    else:
        try:
            out = serve_search(graph, mesh, hw, workload, policy="exact", budget=1, seed=0,
                               fixed=fixed, extra_policies=(), kernels=kernels, engine=engine,
                               allow_cross_node_tp=allow_cross_node_tp, runtime=engine)
        except (InfeasibleError, InputError) as e:
            return _entry(engine, [], None, plan_value, False, str(e), {"policy": "exact"})
        search = {"policy": "exact", "complete": all(
            p.results["exact"].complete for p in out.pools.values())}
        same = len(out.choice.pools) == len(outcome.choice.pools) and all(
            r1 == r2 and w1 == w2 and _same(s1, s2) for (r1, w1, s1, _), (r2, w2, s2, _)
            in zip(out.choice.pools, outcome.choice.pools))
    pools = []
    for role, workers, strategy, _row in out.choice.pools:
        s = replace(strategy, degrees=replace(strategy.degrees, dp=int(workers)))
        pred = out.pools[role].cost_model.simulate(strategy).predicted
        sched = (pred.get("breakdown") or {}).get("scheduler")
        pools.append(LaunchPool.of(role, s, out.pools[role].space, length, mem, **fmt,
                                   scheduler=sched))
    pred = out.choice.predicted()
    return _entry(engine, pools, _numbers(pred), plan_value, same, None, search,
                  mesh.gpus_per_node)


def attach_launch(plan, outcome, *, graph, mesh, hw, workload, fixed, kernels, runtime,
                  model_id, allow_cross_node_tp, serve_search=None) -> dict:
    """Fill ``plan.launch`` (every engine) and ``plan.model["hf_id"]`` (the id the scripts
    serve, None when unknown); returns ``plan.launch``. ``serve_search``: the serving
    search, for ``--phase serve``."""
    launch = {}
    for engine in ENGINES:
        if workload.phase == "serve":
            launch[engine] = serve_entry(engine, plan, outcome, graph=graph, mesh=mesh, hw=hw,
                                         workload=workload, fixed=fixed, kernels=kernels,
                                         runtime=runtime, serve_search=serve_search,
                                         allow_cross_node_tp=allow_cross_node_tp)
        else:
            launch[engine] = single_phase_entry(engine, plan, outcome, graph=graph, mesh=mesh,
                                                hw=hw, workload=workload, kernels=kernels,
                                                runtime=runtime)
    plan.launch = launch
    plan.model["hf_id"] = model_id
    return launch


def launch_summary_lines(plan) -> list[str]:
    """One line per engine: what it can run and how far from the plan, or why nothing."""
    out = []
    for engine, entry in (plan.launch or {}).items():
        name = ENGINE_NAMES.get(engine, engine)
        if not entry.get("pools"):
            out.append(f"{name}: no launch configuration ({entry.get('reason') or 'none found'})")
            continue
        parts = []
        for p in entry["pools"]:
            d = p["degrees"]
            deg = " ".join(f"{k}={d[k]}" for k in ("tp", "ep", "pp", "dp", "moe_tp", "moe_ep")
                           if d.get(k, 1) > 1 or (k == "moe_tp" and k in d))
            mode = " dp-attention" if p.get("mode") == "dp-attention" else ""
            parts.append(f"{p['role']} {p['workers']}x[{deg or 'tp=1'} batch={p['batch']}{mode}]")
        value = (entry.get("predicted") or {}).get("tok_s_per_gpu")
        gap = entry.get("gap_vs_plan")
        if entry.get("same_as_plan"):
            tail = ("the plan itself" if gap is None or abs(gap) < 5e-4 else
                    f"the plan's configuration, {100 * gap:+.1f}% priced with {name}'s kernels")
        else:
            tail = "-" if gap is None else f"{100 * gap:+.1f}% vs the plan"
        out.append(f"{name} can run: {', '.join(parts)}, "
                   f"{'-' if value is None else f'{value:.1f}'} tok/s/GPU, {tail}")
    return out
