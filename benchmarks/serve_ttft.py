"""Aggregated-pool TTFT / TPOT at batch 1 and 16: the engines' scheduler vs the steady state.

    .venv/bin/python benchmarks/serve_ttft.py [--markdown]

Llama-3.1-70B (examples/configs/llama3_1_70b/config.json) at tp=8, priced with the measured
kernel tables (``--kernels silicon``), for the aggregated pool of ``--phase serve``:

* ``steady state``: the chunk ``batch * isl / osl`` on every step (the model before the
  scheduler; ``token_budgets=None``);
* ``budget B``: the scheduler (shardc.cost.scheduler) with the token budget fixed at B;
* ``searched``: the budget the search picks under the case's SLOs.

The reference column holds the published or measured value where one exists (REFERENCE.md);
the figures printed are what ``shardc simulate --phase serve`` prints for the same setup.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from shardc.api import load_model_graph  # noqa: E402
from shardc.ir.space import StrategySpace, megatron_op_choices  # noqa: E402
from shardc.ir.strategy import Degrees, Mesh, Strategy, Workload  # noqa: E402
from shardc.serving.pool_models import pool_cost_model, pool_workload  # noqa: E402

CONFIG = ROOT / "examples" / "configs" / "llama3_1_70b" / "config.json"
# (hardware, engine, isl, osl, TTFT SLO ms, TPOT SLO ms, {batch: reference text})
CASES = [
    ("h200", "vllm", 1024, 256, 500.0, 10.0,
     {1: "AIConfigurator 0.12 agg estimate (vLLM tables, BF16; a model, not a measurement): "
         "TTFT 108.5 / TPOT 7.90 ms = prefill 44.5 ms + 64 ms fitted vLLM host dispatch",
      16: "AIConfigurator 0.12 agg estimate, same: TTFT 164.6 / TPOT 11.37 ms = (prefill + "
          "64 ms) x 1.5 fitted queueing factor"}),
    ("h100", "trtllm", 2048, 128, 1000.0, 50.0,
     {1: "93.7 ms: AIConfigurator 0.12 estimate (TRT-LLM tables), REFERENCE.md; a model, "
         "not a measurement", 16: "-"}),
]
BUDGETS = (None, 2048, 8192)


def row(graph, hw, engine, isl, osl, ttft_slo, tpot_slo, batch, budgets):
    wl = Workload(phase="serve", isl=isl, osl=osl, ttft_slo_ms=ttft_slo, tpot_slo_ms=tpot_slo)
    mesh = Mesh(8, 1)
    kw = {} if budgets == "searched" else {"token_budgets": budgets}
    cm = pool_cost_model(graph, mesh, hw, wl, "mixed", kernels="silicon", engine=engine, **kw)
    space = StrategySpace(graph, mesh, pool_workload(wl, "mixed"))
    space.values["batch"] = [batch]
    ch = dict(zip(space.op_slots, (int(c) for c in megatron_op_choices(
        space, space.values["tp"].index(8)))))
    ev = cm.evaluate(space.encode(Strategy(Degrees(tp=8), batch, ch))[None, :], space)
    budget = "-" if ev.token_budget is None else f"{int(ev.token_budget[0])}"
    return float(ev.ttft_ms[0]), float(ev.tpot_ms[0]), budget


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--markdown", action="store_true")
    args = ap.parse_args()
    graph = load_model_graph(str(CONFIG))
    head = ["setup", "batch", "model", "budget", "TTFT ms", "TPOT ms", "reference"]
    lines = []
    for hw, engine, isl, osl, ttft_slo, tpot_slo, refs in CASES:
        for batch in (1, 16):
            for b in (*BUDGETS, "searched"):
                ttft, tpot, budget = row(graph, hw, engine, isl, osl, ttft_slo, tpot_slo, batch,
                                         None if b is None else ((b,) if b != "searched" else b))
                model = ("steady state" if b is None else "searched" if b == "searched"
                         else "fixed budget")
                lines.append([f"{hw} {engine} {isl}/{osl} (SLO {ttft_slo:g}/{tpot_slo:g})",
                              str(batch), model, budget, f"{ttft:.1f}", f"{tpot:.2f}",
                              refs[batch] if b == "searched" else ""])
    if args.markdown:
        print("| " + " | ".join(head) + " |")
        print("|" + "---|" * len(head))
        for r in lines:
            print("| " + " | ".join(r) + " |")
    else:
        for r in [head] + lines:
            print("  ".join(r))


if __name__ == "__main__":
    main()
