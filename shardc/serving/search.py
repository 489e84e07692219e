"""The serving search (SPEC section 11): ``--phase serve``, aggregated or disaggregated pools.

Each pool is searched in its own :class:`~shardc.ir.space.StrategySpace` with the pool's
CostModel (:mod:`shardc.serving.pool_models`) through a :class:`PoolObjective`, which records every
evaluated row (action, value, TPOT, TTFT, whether memory and divisibility pass, which search
produced it). Everything reported is then *solved from the recorded rows*:

* agg: the best row that meets both SLOs (its value is output tok/s/GPU of the mesh: dp
  replicas tile it);
* disagg: per prefill worker size the best prompts/s meeting TTFT (prefill + KV transfer),
  per decode row its requests/s meeting TPOT, combined over worker ratios
  (:func:`shardc.serving.pool_models.best_ratio`) -- the per-pool choices are independent given the
  ratio, so searching each pool and combining is exact when each pool's search is;
* the Pareto front: the same solve with the TPOT SLO lifted, upper envelope of (tok/s/user,
  tok/s/GPU);
* the SLO sensitivity: the same solve with both SLOs x0.8 and x1.2;
* baselines: the same solve over the rows of the Megatron sweep only.

The disaggregated pools are searched on half the mesh (a worker must leave room for the
other pool), each with half the budget (a mode gets ``budget`` evaluations: agg one pool,
disagg two); a pool's ``dp`` in the reported strategy is its number of workers.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace

import numpy as np

from shardc.errors import InfeasibleError, InputError
from shardc.ir.graph import Graph
from shardc.ir.space import DECODE_BATCHES, StrategySpace
from shardc.ir.strategy import Mesh, Workload
from shardc.search import POLICIES, run_search
from shardc.search.engine_search import search_engine
from shardc.search.fronts import best_per_key
from shardc.serving.explain import binding_constraint, nothing_fits
from shardc.serving.pool_models import (
    kv_transfer_s,
    pool_cost_model,
    pool_workload,
    upper_envelope,
)
from shardc.serving.pools import (
    PoolObjective,
    PoolSearch,
    ServeChoice,
    agg_choice,
    agg_points,
    disagg_points,
    point_of,
    solve_agg,
    solve_disagg,
)
from shardc.serving.splits import best_over_splits, serve_splits

SLO_MOVES = (0.8, 1.2)
EXACT_LIMIT_S = 20.0  # CPU seconds per pool, for the optimum fraction
TOP_ALTERNATIVES = 5


@dataclass
class ServeOutcome:
    workload: Workload
    mesh: Mesh
    choice: ServeChoice
    by_mode: dict  # mode -> ServeChoice | None (the searcher's)
    pools: dict  # role -> PoolSearch
    megatron: ServeChoice | None
    best_practice: ServeChoice | None
    exact: ServeChoice | None
    exact_complete: bool
    pareto: dict  # mode -> [point dicts]
    alternatives: list
    binding: str
    slo_moves: list
    chosen_from: str = "rl"
    own: ServeChoice | None = None  # the searcher's own best (without the Megatron sweep's)
    agent: ServeChoice | None = None  # the searcher's and the baselines' best (no exact rows)
    pool_plans: dict = field(default_factory=dict)  # role -> Plan (filled by shardc.api)


# ------------------------------------------------------------------------------ solving


# ----------------------------------------------------------------------------- searching
def half_mesh(mesh: Mesh) -> Mesh | None:
    """The mesh a disaggregated pool's workers are searched on (half the GPUs), or None."""
    if mesh.nodes > 1:
        return Mesh(mesh.gpus_per_node, mesh.nodes // 2)
    return Mesh(mesh.gpus_per_node // 2, 1) if mesh.gpus_per_node > 1 else None


def _search_pool(graph, mesh, hw, wl, role, policy, budget, seed, fixed, progress,
                 extra_policies, full_mesh: Mesh | None = None, kernel_options=None,
                 tp_domain: int | None = None, runtime: str = "dtensor") -> PoolSearch:
    """Search one pool on ``mesh``: the Megatron sweep, ``policy`` and ``extra_policies``,
    each row recorded under its policy's tag (prefill TTFT adds the KV transfer on
    ``full_mesh``, the physical mesh; ``kernel_options``: the CostModel's ``kernels`` /
    ``engine``; ``tp_domain``: :func:`shardc.ir.space.nvlink_tp_domain`; ``runtime``: an
    engine searches only what it expresses, :mod:`shardc.search.engine_search`)."""
    pw = pool_workload(wl, role)
    space = StrategySpace(graph, mesh, pw, fixed=dict(fixed or {}), tp_domain=tp_domain)
    if role != "prefill":
        space.values["batch"] = capped_batches(DECODE_BATCHES, wl.batch)
    cm = pool_cost_model(graph, mesh, hw, wl, role, **(kernel_options or {}))
    transfer = None
    if role == "prefill":
        def transfer(gpus):
            return kv_transfer_s(graph, full_mesh or mesh, hw, wl.isl, gpus)
    obj = PoolObjective(cm, space, role, transfer)
    pool = PoolSearch(role, space, cm, obj)
    for tag in dict.fromkeys(["megatron", policy, *extra_policies]):
        obj.tag = tag
        # the ceiling's limit counts CPU seconds: whether it completes does not depend on
        # the machine's load
        opts = {"time_limit_s": EXACT_LIMIT_S, "clock": time.process_time} \
            if tag == "exact" and policy != "exact" else {}
        prog = progress if tag == policy else None
        if runtime == "dtensor":
            pool.results[tag] = run_search(tag, space, obj, budget=budget, seed=seed,
                                           progress=prog, **opts)
            continue
        found = search_engine(tag, space, runtime, budget=budget, seed=seed, resplit=False,
                              objective_for=lambda ms: obj, progress=prog, **opts)
        if found is None:
            raise InfeasibleError(f"--runtime {runtime}: the engine expresses no "
                                  f"configuration of the {role} pool on {mesh}")
        found.result.complete = found.complete  # every mode's sweep, not only the best's
        pool.results[tag] = found.result
    return pool


def capped_batches(grid, cap: int | None) -> list[int]:
    """The batch candidates of a mixed or decode pool under ``--batch cap`` (running
    sequences per replica): the grid values below the cap, and the cap (the grid if None)."""
    if cap is None:
        return list(grid)
    return sorted({b for b in grid if b < cap} | {int(cap)})


def check_serve_positions(graph: Graph, wl: Workload) -> None:
    """InputError when a request (``isl + osl`` tokens) is longer than the model's
    ``max_position_embeddings`` (as ``--context`` is checked in decode)."""
    limit = int(graph.config.get("max_position_embeddings", 0) or 0)
    if limit and wl.isl + wl.osl > limit:
        raise InputError(f"--isl {wl.isl} + --osl {wl.osl} = {wl.isl + wl.osl} tokens is "
                         f"longer than {graph.name or 'the model'}'s max_position_embeddings "
                         f"{limit}")


def serve_search(graph: Graph, mesh: Mesh, hardware, wl: Workload, policy: str = "rl",
                 budget: int = 4000, seed: int = 0, progress=None,
                 fixed: dict | None = None, extra_policies=None, kernels: str = "silicon",
                 engine: str = "vllm", allow_cross_node_tp: bool = False,
                 runtime: str = "dtensor") -> ServeOutcome:
    """Search the serving deployment (``wl.phase == "serve"``); InfeasibleError if neither
    mode meets the SLOs (naming what binds). The Megatron sweep always runs;
    ``extra_policies`` (default: ``best_practice`` where search/ has it, and ``exact`` for
    the optimum fraction, time-limited) run besides ``policy``. ``kernels`` / ``engine``: what
    prices the ops; tp stays in one NVLink domain unless ``allow_cross_node_tp``. With a MoE
    model, every experts split the ``runtime`` runs (an engine: what it spells; dtensor: none
    unless ``DTENSOR_SEARCH_SWEEPS_RESPLITS``) is searched as its own fixed-split search and the best deployment kept
    (:mod:`shardc.serving.splits`)."""
    args = dict(policy=policy, budget=budget, seed=seed, progress=progress,
                extra_policies=extra_policies, kernels=kernels, engine=engine,
                allow_cross_node_tp=allow_cross_node_tp, runtime=runtime)
    return best_over_splits(
        lambda f: _serve_search_one(graph, mesh, hardware, wl, fixed=f, **args), fixed,
        lambda: serve_splits(graph, mesh, hardware, wl, fixed, runtime, allow_cross_node_tp))


def _serve_search_one(graph: Graph, mesh: Mesh, hardware, wl: Workload, policy: str,
                      budget: int, seed: int, progress, fixed: dict | None, extra_policies,
                      kernels: str, engine: str, allow_cross_node_tp: bool,
                      runtime: str) -> ServeOutcome:
    """:func:`serve_search` at one experts split (``fixed``'s, else the default)."""
    from shardc.cost import load_hardware
    from shardc.cost.capacity import gpus_short_message
    from shardc.ir.space import nvlink_tp_domain

    hardware = load_hardware(hardware)
    pool_options = {"kernel_options": {"kernels": kernels, "engine": engine},
                    "runtime": runtime,
                    "tp_domain": nvlink_tp_domain(mesh, hardware.nvlink_domain,
                                                  allow_cross_node_tp)}

    check_serve_positions(graph, wl)
    short = gpus_short_message(graph, replace(wl, batch=1), hardware, mesh.gpus)
    if short:
        raise InfeasibleError(short)
    if extra_policies is None:
        extra_policies = ("best_practice", "exact")
    extra = [p for p in extra_policies if p in POLICIES and p != policy]
    modes = ("agg", "disagg") if wl.mode == "auto" else (wl.mode,)
    pools: dict[str, PoolSearch] = {}
    if "agg" in modes:
        pools["mixed"] = _search_pool(graph, mesh, hardware, wl, "mixed", policy, budget, seed,
                                      fixed, progress, extra, **pool_options)
    half = half_mesh(mesh)
    if "disagg" in modes and half is not None:
        if fixed and "dp" in fixed:
            raise InputError("--degrees dp: a disaggregated pool's dp is its worker count; "
                             "fix tp/ep/pp, or use --mode agg")
        for role in ("prefill", "decode"):
            try:
                pools[role] = _search_pool(graph, half, hardware, wl, role, policy,
                                           max(budget // 2, 1), seed, fixed, None, extra,
                                           full_mesh=mesh, **pool_options)
            except (InputError, InfeasibleError) as e:
                if wl.mode == "disagg":
                    raise type(e)(f"{e} (--mode disagg: a pool's worker has at most "
                                  f"{half.gpus} of the {mesh.gpus} GPUs)") from None
                pools.pop("prefill", None)
                break
    elif wl.mode == "disagg":
        raise InputError(f"--mode disagg: mesh {mesh} has one GPU; a prefill and a decode pool "
                         "need at least two")
    return summarise(pools, wl, mesh, policy, extra)


def summarise(pools: dict, wl: Workload, mesh: Mesh, policy: str, extra) -> ServeOutcome:
    """The outcome solved from the pools' recorded rows (module docstring): the choice is
    the best feasible deployment over every search's rows; ``own`` / ``agent`` the policy's
    alone / with the baselines'; the Pareto fronts, alternatives and SLO moves over every row
    too, so none of them beats the choice at the asked SLOs. InfeasibleError if nothing
    meets them."""
    G = mesh.gpus

    def solve(tags, scale=1.0, tpot=None):
        tpot_slo = wl.tpot_slo_ms * scale if tpot is None else tpot
        ttft_slo = wl.ttft_slo_ms * scale
        out = {}
        if "mixed" in pools:
            out["agg"] = solve_agg(pools["mixed"], tags, tpot_slo, ttft_slo, G, wl.osl)
        if "decode" in pools:
            out["disagg"] = solve_disagg(pools["prefill"], pools["decode"], tags, tpot_slo,
                                         ttft_slo, G, wl)
        return out

    def best(by_mode):
        got = [c for c in by_mode.values() if c is not None]
        return max(got, key=lambda c: c.tok_s_per_gpu) if got else None

    baselines = [t for t in ("megatron", "best_practice") if t == "megatron" or t in extra]
    # every search's rows, the policy's first (a tie keeps the searcher's plan); a ceiling
    # sweep stopped by its time limit is left out (its rows depend on the machine's speed)
    stopped = {t for p in pools.values() for t, r in p.results.items()
               if t != policy and not r.complete}
    everything = tuple(t for t in dict.fromkeys([policy, *baselines, *extra, *(
        t for p in pools.values() for t in p.results)]) if t not in stopped)
    # the returned plan is the best feasible point the run evaluated (the searcher's, the
    # baselines', the exact sweep's rows): no alternative or SLO move printed can beat it
    searched = solve(everything)
    choice = best(searched)
    if choice is None:
        raise InfeasibleError(nothing_fits(wl, mesh, pools))
    own = best(solve({policy}))
    agent = best(solve((policy, *baselines)))  # what the run is without the exact ceiling
    base = {t: best(solve({t})) for t in baselines}
    chosen_from = chosen_tag(choice, pools, (policy, *baselines, *extra))
    mega = base["megatron"]
    bp = own if policy == "best_practice" else base.get("best_practice")
    exact, complete = None, False
    if "exact" in (policy, *extra):
        exact = best(solve({"exact", "megatron"}))
        complete = all(p.results["exact"].complete for p in pools.values())
    pareto = {}
    if "mixed" in pools:
        pts = agg_points(pools["mixed"], everything, wl, G)
        pareto["agg"] = [point_of(c) for c in upper_envelope(pts, "user", "gpu")
                         for c in [c["choice"]]]
    if "decode" in pools:
        pts = disagg_points(pools["prefill"], pools["decode"], everything, np.inf,
                            wl.ttft_slo_ms, G, wl)
        pareto["disagg"] = [point_of(c) for c in upper_envelope(
            [{"user": c.tok_s_per_user, "gpu": c.tok_s_per_gpu, "choice": c} for c in pts],
            "user", "gpu") for c in [c["choice"]]]
    moves = []
    for scale in SLO_MOVES:
        alt = best(solve(everything, scale))
        moves.append({"slo_scale": scale,
                      "tpot_slo_ms": wl.tpot_slo_ms * scale, "ttft_slo_ms": wl.ttft_slo_ms * scale,
                      "plan": alt.describe() if alt else None,
                      "tok_s_per_gpu": alt.tok_s_per_gpu if alt else None,
                      "changes": bool(alt and alt.describe() != choice.describe())})
    return ServeOutcome(wl, mesh, choice, searched, pools, mega, bp, exact, complete, pareto,
                        _alternatives(choice, pools, everything, wl, G),
                        binding_constraint(choice, pools, wl), moves, chosen_from, own, agent)


def chosen_tag(choice: ServeChoice, pools: dict, order) -> str:
    """The search that found ``choice``: the first of ``order`` (search tags, the policy
    first) that evaluated each pool row of it; a disaggregated choice whose pools come from
    two searches is ``"<prefill tag>+<decode tag>"``."""
    tags = []
    for role, _, _, row in choice.pools:
        t = pools[role].objective.table()
        same = (t["actions"] == row["actions"][None, :]).all(axis=1)
        found = set(t["tag"][same].tolist())
        tags.append(next((o for o in order if o in found), str(row["tag"])))
    return tags[0] if len(set(tags)) == 1 else "+".join(tags)


def _alternatives(choice: ServeChoice, pools, tags, wl: Workload, G: int) -> list[dict]:
    """The best plans of other shapes (distinct describe()) meeting the SLOs, with deltas."""
    cands = []
    if "mixed" in pools:  # the best row of each shape (degrees, batch), decoded
        pool = pools["mixed"]
        t = pool.objective.table(tags)
        if t:
            ok = np.flatnonzero(pool.objective.feasible(t, wl.tpot_slo_ms, wl.ttft_slo_ms))
            deg = pool.space.degree_arrays(t["actions"][ok])
            keys = np.zeros((len(t["value"]), 4), dtype=np.int64)
            keys[ok] = np.stack([deg[k] for k in ("tp", "ep", "pp", "batch")], axis=1)
            best = best_per_key(keys, t["value"], ok)[:TOP_ALTERNATIVES + 1]
            cands += [agg_choice(pool, t, int(i), wl, G) for i in best]
    if "decode" in pools:
        cands += disagg_points(pools["prefill"], pools["decode"], tags, wl.tpot_slo_ms,
                               wl.ttft_slo_ms, G, wl)
    seen, out = {choice.describe()}, []
    for c in sorted(cands, key=lambda c: (-c.tok_s_per_gpu, c.describe())):
        if c.describe() in seen:
            continue
        seen.add(c.describe())
        out.append({**point_of(c), "delta_pct": 100.0 * (c.tok_s_per_gpu / choice.tok_s_per_gpu - 1)})
        if len(out) >= TOP_ALTERNATIVES:
            break
    return out
