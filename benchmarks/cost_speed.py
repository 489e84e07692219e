"""Strategy evaluations per second of the cost model (one core).

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/cost_speed.py

GPT-MoE 1.6T (hand-built fixture graph of tests/cost_graphs.py, same ops and sizes as the
traced example), decode, context 16k, H100, mesh 8x128; random actions in batches of 1024;
priced by the roofline and by the measured kernel tables (``kernels="silicon"``, vLLM).
"""

import os
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))
os.environ.setdefault("OMP_NUM_THREADS", "1")

from cost_graphs import fixture_graph  # noqa: E402

from shardc.cost import CostModel  # noqa: E402
from shardc.ir.space import StrategySpace  # noqa: E402
from shardc.ir.strategy import Mesh, Workload  # noqa: E402


def main() -> None:
    g = fixture_graph("gpt_moe_1p6t")
    mesh, wl = Mesh(8, 128), Workload(context=16384)
    space = StrategySpace(g, mesh, wl)
    rng = np.random.default_rng(0)
    batches = [np.stack([rng.integers(0, n, size=1024) for n in space.nvec], axis=1)
               for _ in range(20)]
    for kernels in ("roofline", "silicon"):
        cm = CostModel(g, mesh, "h100", wl, kernels=kernels)
        cm.evaluate(batches[0], space)
        best = 0.0
        for _ in range(3):
            t = time.perf_counter()
            for a in batches:
                cm.evaluate(a, space)
            best = max(best, 20 * 1024 / (time.perf_counter() - t))
        print(f"{kernels}: {best:,.0f} strategy evaluations/s "
              "(batches of 1024, best of 3 x 20 batches)")


if __name__ == "__main__":
    main()
