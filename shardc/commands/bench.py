"""``shardc bench --suite paper|zoo|serve``: every searcher on every case of a suite (SPEC section 8).

Cases are data (``shardc/search/suites.toml``). For each case: the graph (traced once, then
read from the graph cache, :mod:`shardc.frontends.graph_cache`), the cost model, then
``rl``, ``sa``, ``rw``, ``ga`` over ``--seeds`` seeds at ``--budget`` evaluations, and the
``megatron``, ``best_practice`` and ``exact`` sweeps once (they are deterministic). Writes ``--json`` (default
``benchmarks/<suite>.json``: ``{"rows": [{case, policy, seeds, mean, best, evaluations,
wall_s}]}``, mean/best in tok/s/GPU over seeds, evaluations and wall_s per search), the
markdown tables ``benchmarks/<suite>.md`` (notes written by hand below its ``NOTES_MARKER`` line
survive a re-run) and ``benchmarks/<suite>_search.png`` (best-so-far
curves of seed 0 on the first case).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

from shardc.commands.compile import add_cross_node_tp_argument, add_quantisation_arguments
from shardc.commands.suites import SEEDED, cached_graph, load_suite
from shardc.errors import InputError
from shardc.search import POLICIES
from shardc.validate import MAX_BUDGET, dumps_strict_json, float_arg, int_arg

HELP = "run the search benchmark suites (paper, zoo, serve) and write tables under benchmarks/"
NOTES_MARKER = "<!-- hand-written notes below this line: shardc bench keeps them -->"


def add_arguments(p) -> None:
    p.add_argument("--suite", required=True, help="paper, zoo or serve (shardc/search/suites.toml)")
    p.add_argument("--budget", type=int_arg(1, MAX_BUDGET, "evaluations"), default=None,
                   help="evaluations per search (default: the suite's)")
    p.add_argument("--seeds", type=int_arg(1, 10_000, "seeds"), default=None,
                   help="seeds per searcher (default: the suite's)")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--jobs", type=int_arg(1, 1024, "processes"), default=1,
                   help="cases in parallel processes")
    g.add_argument("--ray", metavar="ADDRESS", default=None, help="run cases on a Ray cluster")
    p.add_argument("--json", default=None, help="rows JSON (default benchmarks/<suite>.json)")
    p.add_argument("--out", default="benchmarks", help="directory for the markdown and plot")
    p.add_argument("--policies", default=",".join(POLICIES),
                   help="comma-separated subset (default all, both baselines included)")
    p.add_argument("--cases", default=None, help="only cases whose name contains this text")
    from shardc.commands.compile import add_kernel_arguments

    add_kernel_arguments(p)
    add_cross_node_tp_argument(p)
    p.add_argument("--exact-limit", type=float_arg(0.0, 1e7, unit="seconds"), default=600.0,
                   help="seconds before an exact sweep stops (reported as not finished)")
    add_quantisation_arguments(p, default=None)  # given: overrides every case's format


# ------------------------------------------------------------------------------ running
def run_case(case: dict, policies: list[str], budget: int, seeds: int,
             exact_limit: float = 600.0) -> dict:
    """All policies on one case -> {"rows": [...], "curves": {policy: seed-0 curve}}."""
    import numpy as np

    from shardc.cost import CostModel, load_hardware
    from shardc.ir.space import StrategySpace, nvlink_tp_domain
    from shardc.ir.strategy import Mesh, Workload
    from shardc.search.objective import cost_model_objective

    if case["phase"] == "serve":
        from shardc.commands.bench_serve import run_serve_case

        return run_serve_case(case, policies, budget, seeds, exact_limit)
    graph = cached_graph(case["model"])
    mesh = Mesh.parse(case["mesh"])
    wl = Workload(phase=case["phase"], context=int(case["context"]), prompt=int(case["prompt"]),
                  tpot_slo_ms=float(case["tpot_slo_ms"]), ttft_slo_ms=float(case["ttft_slo_ms"]),
                  weights=case.get("weights", "bf16"), kv_cache=case.get("kv_cache", "bf16"))
    hw = load_hardware(case["hardware"])
    domain = nvlink_tp_domain(mesh, hw.nvlink_domain, bool(case.get("allow_cross_node_tp")))
    space = StrategySpace(graph, mesh, wl, tp_domain=domain)
    cm = CostModel(graph, mesh, hw, wl, kernels=case.get("kernels", "silicon"),
                   engine=case.get("engine", "vllm"))
    objective = cost_model_objective(cm, space)
    rows, curves = [], {}
    for pol in policies:
        n = seeds if pol in SEEDED else 1
        opts = {"time_limit_s": exact_limit} if pol == "exact" else {}
        results = [_search(case, pol, space, cm, objective, budget, s, opts)
                   for s in range(n)]
        vals = np.array([r.best_value for r in results])
        row = {"case": case["name"], "policy": pol, "seeds": n, "mean": float(vals.mean()),
               "best": float(vals.max()),
               "evaluations": int(round(np.mean([r.evaluations for r in results]))),
               "wall_s": float(np.mean([r.wall_s for r in results])),
               "values": [float(v) for v in vals]}
        if pol == "exact":
            row["complete"] = bool(results[0].complete)
        if results[0].best_action is not None:
            top = results[int(vals.argmax())]  # an engine's re-split decodes in its space
            row["best_strategy"] = _describe(top.space or space, top.best_action)
        rows.append(row)
        curves[pol] = results[0].curve
    return {"rows": rows, "curves": curves}


def _search(case: dict, policy: str, space, cm, objective, budget: int, seed: int, opts):
    """One search of a case: the whole space, or the space of the case's ``runtime``
    engine (:mod:`shardc.search.engine_search`; an engine expressing nothing: no plan)."""
    from shardc.search import SearchResult, run_search
    from shardc.search.engine_search import search_engine

    runtime = case.get("runtime", "dtensor")
    if runtime == "dtensor":
        return run_search(policy, space, objective, budget=budget, seed=seed, **opts)
    found = search_engine(policy, space, runtime, budget=budget, seed=seed, cost_model=cm,
                          **opts)
    if found is None:
        return SearchResult(None, 0.0, 0, [], 0.0, policy, seed)
    found.result.complete = found.complete
    return found.result


def _describe(space, action) -> str:
    s = space.decode(action)
    d = s.degrees
    ops = ",".join(f"{k.split('.')[-1]}={v}" for k, v in s.choice_names().items())
    split = f" moe_tp={d.moe_tp} moe_ep={d.moe_ep}" if d.experts_resplit else ""
    return f"tp={d.tp} ep={d.ep} pp={d.pp} dp={d.dp} sp={d.sp}{split} batch={s.batch} [{ops}]"


def _run_all(cases, policies, budget, seeds, jobs: int, ray_address: str | None,
             exact_limit: float = 600.0, on_case=None) -> list[dict]:
    for model in dict.fromkeys(c["model"] for c in cases):  # trace once, in this process
        cached_graph(model)
    if ray_address:
        try:
            import ray
        except ImportError:
            raise InputError("--ray needs Ray: pip install 'shardc[ray]'") from None
        ray.init(address=ray_address, ignore_reinit_error=True)
        remote = ray.remote(run_case)
        return ray.get([remote.remote(c, policies, budget, seeds, exact_limit) for c in cases])
    if jobs <= 1:
        out = []
        for c in cases:
            t0 = time.perf_counter()
            out.append(run_case(c, policies, budget, seeds, exact_limit))
            print(f"  {c['name']}: {time.perf_counter() - t0:.0f} s", file=sys.stderr)
            if on_case:
                on_case(out)
        return out
    from concurrent.futures import ProcessPoolExecutor

    with ProcessPoolExecutor(max_workers=jobs) as pool:
        futs = [pool.submit(run_case, c, policies, budget, seeds, exact_limit) for c in cases]
        out = []
        for c, f in zip(cases, futs):
            out.append(f.result())
            print(f"  {c['name']}: done", file=sys.stderr)
            if on_case:
                on_case(out)
        return out


def bench_outputs(suite: str, out: Path, jpath: Path) -> tuple[list[str], tuple[str, ...]]:
    """(the names ``shardc bench --suite suite`` writes into ``out``: the markdown, the plot,
    and the rows JSON when ``jpath`` is in ``out``; the glob patterns of every output a
    run of that suite may leave there). A re-run replaces the whole set as compile's does
    (:func:`shardc.backends.atomic.write_outputs`): an earlier run's ``<suite>.json`` in
    ``out`` goes when this run writes its JSON elsewhere; other suites' files stay."""
    import glob

    from shardc.backends.atomic import resolve_out

    names = [f"{suite}.md", f"{suite}_search.png"]
    if resolve_out(jpath.parent) == resolve_out(out):
        if jpath.name in names:
            raise InputError(f"--json {jpath}: the same file as the {suite} table or plot")
        names.append(jpath.name)
    esc = glob.escape(suite)
    return names, (f"{esc}.md", f"{esc}_search.png", f"{esc}.json")


def check_output_place(out: Path, names: list[str]) -> None:
    """InputError before a long run when ``out`` cannot take ``names``: an entry on their way
    is a symlink or not a regular file (:func:`shardc.backends.atomic.check_entries`), or
    the nearest existing folder on the way is not a writable folder. Creates nothing (the
    writer creates ``out`` with the first tables; ``o/a/../b`` never creates ``o/a``)."""
    import os

    from shardc.backends.atomic import check_entries, resolve_out

    folder = resolve_out(out)
    check_entries(folder, names, out)
    while not os.path.lexists(folder) and folder != folder.parent:
        folder = folder.parent
    if not folder.is_dir() or not os.access(folder, os.W_OK | os.X_OK):
        raise InputError(f"{out}: cannot write outputs there ({folder} is not a writable "
                         "folder)")


def run(args) -> int:
    from shardc.search import plot_search_curve
    from shardc.search.report import markdown

    cases = load_suite(args.suite)
    if args.cases:
        cases = [c for c in cases if args.cases in c["name"]]
        if not cases:
            raise InputError(f"--cases {args.cases!r}: no case of suite {args.suite} matches")
    for flag in ("weights", "kv_cache"):
        if getattr(args, flag):
            cases = [{**c, flag: getattr(args, flag)} for c in cases]
    from shardc.commands.compile import kernel_engine

    cases = [{**c, "kernels": args.kernels, "engine": kernel_engine(args),
              "runtime": args.runtime} for c in cases]
    if args.allow_cross_node_tp:
        cases = [{**c, "allow_cross_node_tp": True} for c in cases]
    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    bad = [p for p in policies if p not in POLICIES]
    if bad:
        raise InputError(f"--policies: unknown {', '.join(bad)} (expected {', '.join(POLICIES)})")
    budget = args.budget or int(cases[0]["budget"])
    seeds = args.seeds or int(cases[0]["seeds"])
    if budget < 1 or seeds < 1 or args.jobs < 1:
        raise InputError("--budget, --seeds and --jobs must be positive")
    out = Path(args.out)
    jpath = Path(args.json) if args.json else out / f"{args.suite}.json"
    names, owned = bench_outputs(args.suite, out, jpath)
    check_output_place(out, names)  # before the run, creating nothing
    cmd = " ".join(["shardc", "bench"] + sys.argv[2:]) if sys.argv[1:2] == ["bench"] else \
        f"shardc bench --suite {args.suite} --budget {budget} --seeds {seeds}"

    def write(results: list[dict]) -> None:
        """(Re)write the JSON, markdown and plot from the cases finished so far (atomically;
        hand-written notes below :data:`NOTES_MARKER` in an existing markdown are kept)."""
        from shardc.commands.reports import write_outputs

        rows = [r for res in results for r in res["rows"]]
        note = "" if len(results) == len(cases) else \
            f"Partial: {len(results)} of {len(cases)} cases finished."
        md_path = out / f"{args.suite}.md"
        text = markdown(args.suite, rows, cmd, note)
        kept = md_path.read_text().partition(NOTES_MARKER) if md_path.exists() else ("", "", "")
        text = text.rstrip("\n") + "\n\n" + NOTES_MARKER + (kept[2] if kept[1] else "\n")
        first = results[0]
        by = {r["policy"]: r for r in first["rows"]}

        def plot(path):
            plot_search_curve(path, {p: c for p, c in first["curves"].items() if p in SEEDED},
                              megatron=by.get("megatron", {}).get("best"),
                              best_practice=by.get("best_practice", {}).get("best"),
                              exact=by.get("exact", {}).get("best"),
                              title=cases[0]["name"] + " (seed 0)")

        rows_json = dumps_strict_json({"rows": rows}, indent=1) + "\n"
        files = {md_path.name: text, f"{args.suite}_search.png": plot}
        if len(names) == 3:  # the JSON beside them: one set
            files[jpath.name] = rows_json
        write_outputs(out, files, owned=owned)  # this suite's earlier outputs it lacks: removed
        if len(names) == 2:  # --json elsewhere: its own file
            write_outputs(jpath.parent, {jpath.name: rows_json})

    results = _run_all(cases, policies, budget, seeds, args.jobs, args.ray, args.exact_limit,
                       on_case=write)
    write(results)
    print(f"wrote {jpath}, {out / (args.suite + '.md')}")
    return 0
