"""Benchmark tables from result rows (``shardc bench``): the paper's Table 1 and Figure 3.

A row (one case x one policy) is ``{case, policy, seeds, mean, best, evaluations, wall_s}``
(mean / best over seeds, tok/s/GPU; evaluations and wall_s per search, mean over seeds),
plus optional ``values`` (per seed) and ``complete`` (exact sweeps).
"""

from __future__ import annotations

from tabulate import tabulate

SEARCHERS = ("rw", "sa", "ga", "rl")
BASELINES = ("megatron", "best_practice")


def _by_case(rows: list[dict]) -> dict[str, dict[str, dict]]:
    out: dict[str, dict[str, dict]] = {}
    for r in rows:
        out.setdefault(r["case"], {})[r["policy"]] = r
    return out


def _ratio(a: float | None, b: float | None) -> str:
    if a is None or b is None or b <= 0:
        return "-"
    return f"{a / b:.3f}"


def table1(rows: list[dict]) -> str:
    """Mean over seeds, normalised to random walk (the paper's Table 1), with Megatron and
    the exact optimum on the same scale, RL's lead over SA and RW, and RL mean / exact."""
    head = ["case", "RW tok/s/GPU", "RW", "SA", "GA", "RL", "Megatron", "exact",
            "RL/SA", "RL/RW", "RL mean / exact"]
    body = []
    for case, p in _by_case(rows).items():
        rw = p.get("rw", {}).get("mean")
        g = {k: p.get(k, {}).get("mean") for k in (*SEARCHERS, "megatron")}
        ex = p.get("exact")
        exv = ex["best"] if ex and ex.get("complete", True) else None
        body.append([case, f"{rw:.2f}" if rw else "-", *(_ratio(g[k], rw) for k in SEARCHERS),
                     _ratio(g["megatron"], rw), _ratio(exv, rw), _ratio(g["rl"], g["sa"]),
                     _ratio(g["rl"], rw),
                     f"{100 * g['rl'] / exv:.2f}%" if exv and g["rl"] is not None else "-"])
    return tabulate(body, head, tablefmt="github", disable_numparse=True)


def figure3(rows: list[dict]) -> str:
    """Best over seeds, normalised to the Megatron heuristic (the paper's Figure 3)."""
    head = ["case", "Megatron tok/s/GPU", "RW", "SA", "GA", "RL", "RL mean", "exact"]
    body = []
    for case, p in _by_case(rows).items():
        mg = p.get("megatron", {}).get("best")
        ex = p.get("exact")
        exv = ex["best"] if ex and ex.get("complete", True) else None
        body.append([case, f"{mg:.2f}" if mg else "-",
                     *(_ratio(p.get(k, {}).get("best"), mg) for k in SEARCHERS),
                     _ratio(p.get("rl", {}).get("mean"), mg), _ratio(exv, mg)])
    return tabulate(body, head, tablefmt="github", disable_numparse=True)


def baselines(rows: list[dict]) -> str:
    """Both baselines (the Megatron heuristic and best practice, tok/s/GPU) and each
    searcher's best over the stronger of the two: the gain shardc claims."""
    head = ["case", "Megatron tok/s/GPU", "best practice tok/s/GPU", "best practice / Megatron",
            "stronger", *(f"{k.upper()} / stronger" for k in SEARCHERS), "exact / stronger"]
    body = []
    for case, p in _by_case(rows).items():
        vals = {k: p.get(k, {}).get("best") for k in BASELINES}
        known = [(v, k) for k, v in vals.items() if v]
        strong_v, strong = max(known, key=lambda vk: vk[0]) if known else (None, None)
        ex = p.get("exact")
        exv = ex["best"] if ex and ex.get("complete", True) else None
        body.append([case, *(f"{vals[k]:.2f}" if vals[k] else "-" for k in BASELINES),
                     _ratio(vals["best_practice"], vals["megatron"]),
                     {"megatron": "Megatron", "best_practice": "best practice"}.get(strong, "-"),
                     *(_ratio(p.get(k, {}).get("best"), strong_v) for k in SEARCHERS),
                     _ratio(exv, strong_v)])
    return tabulate(body, head, tablefmt="github", disable_numparse=True)


def absolute(rows: list[dict]) -> str:
    """Every row as measured: mean / best tok/s/GPU, evaluations and wall seconds per search."""
    head = ["case", "policy", "seeds", "mean", "best", "evaluations", "wall_s"]
    body = [[r["case"], r["policy"], r["seeds"], f"{r['mean']:.2f}", f"{r['best']:.2f}",
             r["evaluations"], f"{r['wall_s']:.2f}"
             + ("" if r.get("complete", True) else " (stopped)")] for r in rows]
    return tabulate(body, head, tablefmt="github", disable_numparse=True)


def markdown(suite: str, rows: list[dict], command: str, notes: str = "") -> str:
    parts = [
        f"# `shardc bench --suite {suite}`", "",
        f"Command: `{command}`", "",
        "Throughput in tokens/s per GPU from shardc's cost model. Every searcher gets the same "
        "evaluation budget (every simulator call counts, infeasible ones included); Megatron, "
        "best practice and exact are sweeps (their evaluations are the sweep size).", "",
    ]
    if notes:
        parts += [notes, ""]
    parts += ["## Table 1 shape: mean over seeds, normalised to random walk", "",
              table1(rows), "",
              "## Figure 3 shape: best over seeds, normalised to the Megatron heuristic", "",
              figure3(rows), "",
              "## Against the stronger baseline (Megatron heuristic or best practice; best "
              "over seeds)", "",
              baselines(rows), "",
              "## Absolute numbers and wall time (seconds per search, mean over seeds)", "",
              absolute(rows), ""]
    return "\n".join(parts)
