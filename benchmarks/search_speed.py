"""Wall time of one 4000-evaluation RL search (target <= 2 s on the project's 2-core machine).

    .venv/bin/python benchmarks/search_speed.py [--seeds 3] [--out benchmarks/search_speed.md]

Case: GPT-MoE 1.2T, decode, context 16k, H100, mesh 8x128, TPOT SLO 50 ms (the paper suite's
first case). Reports per seed: wall seconds, evaluations, the best tok/s/GPU and the load
average at the start (the machine is shared; the number is only meaningful with it).
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time
from pathlib import Path


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--budget", type=int, default=4000)
    ap.add_argument("--out", default=str(Path(__file__).with_name("search_speed.md")))
    args = ap.parse_args()

    from shardc.commands.suites import cached_graph
    from shardc.cost import CostModel
    from shardc.ir.space import StrategySpace
    from shardc.ir.strategy import Mesh, Workload
    from shardc.search import cost_model_objective, run_search

    graph = cached_graph("examples/gpt_moe_1p2t.py")
    wl = Workload(phase="decode", context=16384, tpot_slo_ms=50.0)
    mesh = Mesh.parse("8x128")
    space = StrategySpace(graph, mesh, wl)
    obj = cost_model_objective(CostModel(graph, mesh, "h100", wl), space)
    run_search("rl", space, obj, budget=256, seed=99)  # warm-up (lazy torch init)
    lines = ["| seed | wall s | evaluations | best tok/s/GPU | load avg (1 min) at start |",
             "|---|---|---|---|---|"]
    walls = []
    for seed in range(args.seeds):
        load = os.getloadavg()[0]
        t0 = time.perf_counter()
        r = run_search("rl", space, obj, budget=args.budget, seed=seed)
        wall = time.perf_counter() - t0
        walls.append(wall)
        lines.append(f"| {seed} | {wall:.2f} | {r.evaluations} | {r.best_value:.2f} | {load:.1f} |")
        print(lines[-1], flush=True)
    text = "\n".join([
        "# RL search wall time (4000 evaluations)", "",
        f"Command: `.venv/bin/python benchmarks/search_speed.py --seeds {args.seeds}`", "",
        f"Machine: {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs "
        "(shared with other jobs: see the load column), one torch thread.",
        "Case: GPT-MoE 1.2T decode 16k, H100, 8x128, TPOT SLO 50 ms. Target: <= 2 s.", "",
        *lines, "",
        f"Mean {sum(walls) / len(walls):.2f} s, max {max(walls):.2f} s.", ""])
    Path(args.out).write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
