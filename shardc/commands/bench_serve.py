"""``shardc bench --suite serve``: the serving cases (SPEC section 8), one row per policy.

A row's value is the serving deployment's output tok/s/GPU of the whole mesh
(:func:`shardc.serving.search.serve_search` with only that policy besides the Megatron sweep, whose
plan is kept when better, as compile does); ``megatron`` (and ``best_practice`` where
search/ has it) are the baselines solved under the same serving model; ``exact`` the
certified optimum (``complete`` False when a pool's sweep hit the time limit). The case's
``mode`` (agg or disagg) fixes the serving mode; each row also says which deployment won.
"""

from __future__ import annotations

import time

import numpy as np

from shardc.commands.suites import SEEDED, cached_graph


def _serve_workload(case: dict):
    from shardc.ir.strategy import Workload

    return Workload(phase="serve", isl=int(case["isl"]), osl=int(case["osl"]),
                    mode=case.get("mode", "auto"), tpot_slo_ms=float(case["tpot_slo_ms"]),
                    ttft_slo_ms=float(case["ttft_slo_ms"]),
                    weights=case.get("weights", "bf16"), kv_cache=case.get("kv_cache", "bf16"))


def run_serve_case(case: dict, policies: list[str], budget: int, seeds: int,
                   exact_limit: float = 600.0) -> dict:
    """All policies on one serving case -> {"rows": [...], "curves": {policy: seed-0 curve of
    the throughput-setting pool}}."""
    from shardc.errors import InfeasibleError
    from shardc.ir.strategy import Mesh
    from shardc.serving.search import serve_search

    graph = cached_graph(case["model"])
    mesh = Mesh.parse(case["mesh"])
    wl = _serve_workload(case)
    rows, curves = [], {}
    for pol in policies:
        n = seeds if pol in SEEDED else 1
        vals, evals, walls, plans, complete = [], [], [], [], True
        for s in range(n):
            t0 = time.perf_counter()
            try:
                out = serve_search(graph, mesh, case["hardware"], wl, policy=pol, budget=budget,
                                   seed=s, extra_policies=(),
                                   kernels=case.get("kernels", "silicon"),
                                   engine=case.get("engine", "vllm"),
                                   runtime=case.get("runtime", "dtensor"),
                                   allow_cross_node_tp=bool(case.get("allow_cross_node_tp")))
            except InfeasibleError:
                vals.append(0.0)
                evals.append(0)
                walls.append(time.perf_counter() - t0)
                plans.append(None)
                continue
            walls.append(time.perf_counter() - t0)
            choice = out.own  # the policy's own result, as the other suites report it
            vals.append(float(choice.tok_s_per_gpu) if choice else 0.0)
            evals.append(sum(p.results[pol].evaluations for p in out.pools.values()))
            plans.append(choice.describe() if choice else None)
            complete &= all(p.results[pol].complete for p in out.pools.values())
            if s == 0:
                role = out.choice.pools[-1][0]
                curves[pol] = out.pools[role].results[pol].curve
        v = np.array(vals)
        row = {"case": case["name"], "policy": pol, "seeds": n, "mean": float(v.mean()),
               "best": float(v.max()), "evaluations": int(round(np.mean(evals))),
               "wall_s": float(np.mean(walls)), "values": [float(x) for x in v]}
        if pol == "exact":
            row["complete"] = bool(complete)
        if plans[int(v.argmax())]:
            row["best_strategy"] = plans[int(v.argmax())]
        rows.append(row)
    return {"rows": rows, "curves": curves}
