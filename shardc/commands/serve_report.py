"""What ``shardc compile --phase serve`` writes and prints (SPEC sections 3, 4, 11).

Files: ``plan.json`` (schema 2 with ``serving``), ``parallelize.py`` (agg) or
``parallelize_prefill.py`` + ``parallelize_decode.py`` (disagg; each one pool's plan, the
emitter of :meth:`shardc.plan.Plan.code`), ``pareto.png``, ``graph.txt`` / ``graph.dot`` /
``trace.json`` of the throughput-setting pool (mixed or decode), ``search.png``, and
``launch/{vllm,sglang}_<role>.sh`` per pool of each engine's best deployment
(:mod:`shardc.launch_plan`). The summary
names the choice, both modes' best, the baselines, the top alternatives with their deltas,
the binding constraint and how the choice moves when both SLOs move by -20% / +20%.
"""

from __future__ import annotations

from pathlib import Path

from tabulate import tabulate

from shardc.text import number_or_dash, one_line


def serve_summary(plan) -> str:
    """The summary table and the explanation lines (plan.json's ``serving`` section)."""
    sv = plan.serving
    pred = sv["predicted"]
    rows = []
    for p in sv["pools"]:
        d = p["degrees"]
        deg = " ".join(f"{k}={d[k]}" for k in ("tp", "ep", "pp") if k in d)
        rows.append([f"{p['role']} pool", f"{p['workers']} x [{deg}] batch={p['batch']}"])
    def ratio(name: str) -> str:
        base = ((plan.baseline or {}).get(name) or {}).get("tok_s_per_gpu")
        return f"{pred['tok_s_per_gpu'] / base:.3f}x" if base else "-"

    rows += [
        ["mode", sv["mode"]],
        ["predicted tok/s/GPU", number_or_dash(pred["tok_s_per_gpu"], ".1f")],
        ["tok/s/user", number_or_dash(pred["tok_s_per_user"], ".1f")],
        ["TPOT (ms)", number_or_dash(pred["tpot_ms"], ".2f")],
        ["TTFT (ms)", number_or_dash(pred["ttft_ms"], ".1f")],
        ["requests/s", number_or_dash(pred["req_s"], ".2f")],
        ["memory/GPU (GB)", number_or_dash((plan.predicted or {}).get("memory_gb_per_gpu"), ".1f")],
        ["vs Megatron heuristic", ratio("megatron")],
        ["vs best practice", ratio("best_practice")],
    ]
    frac = plan.search.get("optimum_fraction")
    if frac is not None:
        rows.append(["vs exact optimum", f"{frac:.4f}"])
    lines = [tabulate(rows, tablefmt="simple"), ""]
    for mode, best in sv.get("modes", {}).items():
        lines.append(f"best {mode}: " + (f"{best['tok_s_per_gpu']:.1f} tok/s/GPU at "
                                         f"{best['tpot_ms']:.1f} ms TPOT ({one_line(best['plan'])})"
                                         if best else "nothing meets the SLOs"))
    bp = (plan.baseline or {}).get("best_practice")
    if bp:
        lines.append(f"best-practice baseline: {bp['tok_s_per_gpu']:.1f} tok/s/GPU "
                     f"({one_line(bp['plan'])})")
    lines.append(f"binding constraint (what stops a larger batch): {sv['binding']}")
    if sv["alternatives"]:
        lines.append("top alternatives:")
        for a in sv["alternatives"]:
            lines.append(f"  {a['delta_pct']:+6.1f}%  {a['tok_s_per_gpu']:8.1f} tok/s/GPU  "
                         f"TPOT {a['tpot_ms']:6.1f} ms  TTFT {a['ttft_ms']:7.1f} ms  "
                         f"{one_line(a['plan'])}")
    for m in sv["slo_moves"]:
        pct = round((m["slo_scale"] - 1) * 100)
        what = ("nothing meets them" if m["plan"] is None else
                ("same plan" if not m["changes"] else one_line(m["plan"]))
                + f", {m['tok_s_per_gpu']:.1f} tok/s/GPU")
        lines.append(f"SLOs {pct:+d}% (TPOT {m['tpot_slo_ms']:g} ms, TTFT "
                     f"{m['ttft_slo_ms']:g} ms): {what}")
    return "\n".join(lines)


def plot_pareto(path, plan) -> str:
    """pareto.png: tok/s/GPU against tok/s/user, one curve per mode, the chosen point and
    the TPOT SLO as a vertical line (per-user speed 1000 / TPOT SLO)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sv = plan.serving
    fig, ax = plt.subplots(figsize=(7, 4.2), dpi=110)
    for mode, style in (("agg", "o-"), ("disagg", "s-")):
        pts = [p for p in sv["pareto"] if p["mode"] == mode]
        if pts:
            ax.plot([p["tok_s_per_user"] for p in pts], [p["tok_s_per_gpu"] for p in pts],
                    style, markersize=3.5, linewidth=1.4, label=f"{mode} front")
    pred = sv["predicted"]
    ax.plot([pred["tok_s_per_user"]], [pred["tok_s_per_gpu"]], "*", color="tab:red",
            markersize=14, label=f"chosen ({sv['mode']})")
    slo = 1000.0 / plan.workload["tpot_slo_ms"]
    ax.axvline(slo, color="tab:gray", linestyle="--", linewidth=1.2,
               label=f"TPOT SLO {plan.workload['tpot_slo_ms']:g} ms")
    title = (f"{plan.model['name']} on {plan.mesh['gpus_per_node']}x{plan.mesh['nodes']} "
             f"{plan.mesh['hardware']} | ISL {plan.workload['isl']} OSL {plan.workload['osl']}, "
             f"TTFT <= {plan.workload['ttft_slo_ms']:g} ms")
    from shardc.text import clean_text  # no control character reaches matplotlib

    title = clean_text(title, 400)
    ax.set_title(title, fontsize=9)
    ax.set_xlabel("tokens/s per user (1000 / TPOT)")
    ax.set_ylabel("output tokens/s per GPU")
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return title


def _plot_search(path, plan, outcome) -> str:
    from shardc.search import plot_search_curve
    from shardc.search.plot import search_title

    role = plan.serving["pools"][-1]["role"]
    pool = outcome.pools[role]
    policy = plan.search["policy"]
    mesh = f"{plan.mesh['gpus_per_node']}x{plan.mesh['nodes']}"
    title = search_title(plan.model["name"], mesh, plan.mesh["hardware"], plan.workload,
                         policy, plan.search["budget"]) + f" | {role} pool"
    def line(name, complete_only=False):
        r = pool.results.get(name)
        ok = r is not None and r.found and (r.complete or not complete_only)
        return r.best_value if ok else None

    return plot_search_curve(path, {policy: pool.results[policy].curve},
                             megatron=line("megatron"), exact=line("exact", True), title=title,
                             best_practice=line("best_practice"))


def write_serve_outputs(out: Path, plan, outcome, args) -> int:
    from shardc.commands.reports import (
        COMPILE_OUTPUTS,
        graph_dot,
        graph_table,
        launch_files,
        launch_summary_lines,
        plan_note,
        print_backend_refusal,
        write_outputs,
    )

    role = plan.serving["pools"][-1]["role"]
    pool = outcome.pools[role]
    strategy = outcome.choice.pools[-1][2]
    files = {
        "plan.json": plan.to_dict(),
        "graph.txt": graph_table(plan.nodes, plan_note(plan)),
        "graph.dot": graph_dot(plan.model["name"], plan.nodes, plan_note(plan)),
        "trace.json": pool.cost_model.chrome_trace(strategy),
        "search.png": lambda p: _plot_search(p, plan, outcome),
        "pareto.png": lambda p: plot_pareto(p, plan),
    }
    if not str(plan.model.get("source", "")).endswith(".onnx") and plan.backend_runs:
        if plan.serving["mode"] == "agg":
            files["parallelize.py"] = plan.code(standalone=args.standalone)
        else:
            for r, p in outcome.pool_plans.items():
                files[f"parallelize_{r}.py"] = p.code(standalone=args.standalone)

    files.update(launch_files(plan))
    written = write_outputs(out, files, owned=COMPILE_OUTPUTS)
    print(serve_summary(plan))
    for line in launch_summary_lines(plan):
        print(line)
    print(f"wrote {', '.join(p.relative_to(out).as_posix() for p in written)} to {out}/")
    print_backend_refusal(out, plan, written)
    return 0
