"""Validate the cost model against the published serving numbers of REFERENCE.md.

    .venv/bin/python benchmarks/validate_cost.py [--markdown] [--kernels roofline|silicon|both]

Prints, for each published figure, the setup simulated, the published number, the
prediction and their ratio (predicted / published), priced by the roofline and/or by the
measured kernel tables (``--kernels silicon``: the TRT-LLM tables for the TRT-LLM figures,
the engine they were measured with; the H800 cases run on a TOML hardware file, which the
tables do not cover, so the roofline prices them either way). Graphs come from the real frontend
(examples/*.py) when ``shardc.frontends.load_graph`` exists (traced once, then served by
load_graph's on-disk graph cache), else from the hand-built fixtures of tests/cost_graphs.py
(same REFERENCE.md configs).
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

from shardc.cost import CostModel, load_hardware  # noqa: E402
from shardc.ir.graph import Graph  # noqa: E402
from shardc.ir.space import StrategySpace, megatron_op_choices  # noqa: E402
from shardc.ir.strategy import Degrees, Mesh, Strategy, Workload  # noqa: E402

H800 = str(ROOT / "benchmarks" / "hardware" / "h800.toml")
NO_SLO = dict(tpot_slo_ms=1e9, ttft_slo_ms=1e9)


def model_graph(name: str) -> tuple[Graph, str]:
    """(graph, where it came from)."""
    try:
        from shardc.frontends import load_graph  # type: ignore[attr-defined]
    except ImportError:
        load_graph = None
    if load_graph is not None:
        return load_graph(str(ROOT / "examples" / f"{name}.py")), "traced"
    from cost_graphs import fixture_graph

    return fixture_graph(name), "fixture"


def _evaluate(graph, mesh, hw, wl, degrees: Degrees, batch: int, **opts):
    cm = CostModel(graph, mesh, hw, wl, **opts)
    space = StrategySpace(graph, mesh, Workload(**{**wl.__dict__, "batch": batch}))
    tp_idx = space.values["tp"].index(degrees.tp)
    ch = dict(zip(space.op_slots, (int(c) for c in megatron_op_choices(space, tp_idx))))
    ev = cm.evaluate(space.encode(Strategy(degrees, batch, ch))[None, :], space)
    return ev


def trtllm_throughput(graph, n_in: int, n_out: int, hw="h100", kernels: str = "roofline"
                      ) -> tuple[float, str]:
    """Total output tokens/s of a static-batch throughput run on one 8-GPU node at TP8,
    FP8 weights, GEMMs and KV cache: the largest power-of-two batch (<= 4096) that fits at
    context n_in + n_out; prefill in chunks of ~8192 tokens; decode TPOT integrated over
    the growing context (8-point midpoint rule)."""
    mesh, deg = Mesh(8, 1), Degrees(tp=8, dp=1)
    opts = dict(weight_bytes=1, kv_bytes=1, fp8_gemm=True, kernels=kernels, engine="trtllm")
    batch = None
    for b in (2**i for i in range(12, -1, -1)):
        wl = Workload(phase="decode", context=n_in + n_out, batch=b, **NO_SLO)
        if _evaluate(graph, mesh, hw, wl, deg, b, **opts).feasible[0]:
            batch = b
            break
    if batch is None:
        return float("nan"), "does not fit"
    chunk = max(1, 8192 // n_in)
    wl = Workload(phase="prefill", prompt=n_in, batch=chunk, **NO_SLO)
    ev = _evaluate(graph, mesh, hw, wl, deg, chunk, **opts)
    prefill_ms = float(ev.ttft_ms[0]) * batch / chunk
    decode_ms = 0.0
    for i in range(8):
        ctx = int(n_in + n_out * (i + 0.5) / 8)
        wl = Workload(phase="decode", context=ctx, batch=batch, **NO_SLO)
        decode_ms += float(_evaluate(graph, mesh, hw, wl, deg, batch, **opts).tpot_ms[0]) * n_out / 8
    tok_s = batch * n_out / ((prefill_ms + decode_ms) / 1e3)
    return tok_s, f"batch {batch}, prefill {prefill_ms / 1e3:.2f} s, decode {decode_ms / 1e3:.2f} s"


def deepseek_decode(graph, kernels: str = "roofline") -> tuple[float, str]:
    """Output tokens/s per node: H800, 16 nodes, EP128 (EP144 is not a divisor of 256
    experts), attention data-parallel (tp 1), FP8 GEMMs, BF16 KV cache, context 4989,
    88 sequences per GPU (14.8k tok/s/node / ~21 tok/s/user / 8 GPUs)."""
    mesh, deg = Mesh(8, 16), Degrees(tp=1, ep=128, dp=1)
    batch = 88 * 128
    wl = Workload(phase="decode", context=4989, batch=batch, **NO_SLO)
    ev = _evaluate(graph, mesh, H800, wl, deg, batch, weight_bytes=1, kv_bytes=2, fp8_gemm=True,
                   kernels=kernels)
    return float(ev.tok_s_per_gpu[0]) * 8, (f"TPOT {float(ev.tpot_ms[0]):.1f} ms, "
                                            f"{float(ev.memory_gb_per_gpu[0]):.1f} GB/GPU")


def deepseek_prefill(graph, kernels: str = "roofline") -> tuple[float, str]:
    """Input tokens/s per node: H800, 4 nodes, EP32, tp 1, FP8 GEMMs, prompt 4096,
    2 prompts per GPU per pass (batch 64)."""
    mesh, deg = Mesh(8, 4), Degrees(tp=1, ep=32, dp=1)
    wl = Workload(phase="prefill", prompt=4096, batch=64, **NO_SLO)
    ev = _evaluate(graph, mesh, H800, wl, deg, 64, weight_bytes=1, kv_bytes=2, fp8_gemm=True,
                   kernels=kernels)
    return float(ev.tok_s_per_gpu[0]) * 8, f"TTFT {float(ev.ttft_ms[0]):.0f} ms"


@dataclass
class Case:
    name: str
    model: str
    unit: str
    published: float
    run: object


CASES = [
    Case("TRT-LLM Llama-3.1-70B TP8 128/128", "llama3_70b", "tok/s", 14730.69,
         lambda g, k: trtllm_throughput(g, 128, 128, kernels=k)),
    Case("TRT-LLM Llama-3.1-70B TP8 128/2048", "llama3_70b", "tok/s", 17061.82,
         lambda g, k: trtllm_throughput(g, 128, 2048, kernels=k)),
    Case("TRT-LLM Llama-3.1-70B TP8 2048/128", "llama3_70b", "tok/s", 1923.41,
         lambda g, k: trtllm_throughput(g, 2048, 128, kernels=k)),
    Case("TRT-LLM Llama-3.1-70B TP8 2048/2048", "llama3_70b", "tok/s", 8801.95,
         lambda g, k: trtllm_throughput(g, 2048, 2048, kernels=k)),
    Case("TRT-LLM Mixtral-8x7B TP8 128/128", "mixtral_8x7b", "tok/s", 50850.0,
         lambda g, k: trtllm_throughput(g, 128, 128, kernels=k)),
    Case("TRT-LLM Mixtral-8x7B TP8 2048/2048", "mixtral_8x7b", "tok/s", 30983.0,
         lambda g, k: trtllm_throughput(g, 2048, 2048, kernels=k)),
    Case("DeepSeek-V3 decode, per node", "deepseek_v3", "out tok/s/node", 14800.0,
         deepseek_decode),
    Case("DeepSeek-V3 prefill, per node", "deepseek_v3", "in tok/s/node", 73700.0,
         deepseek_prefill),
]


def validation_rows(kernels: str = "roofline") -> list[dict]:
    graphs: dict[str, tuple[Graph, str]] = {}
    rows = []
    for c in CASES:
        if c.model not in graphs:
            graphs[c.model] = model_graph(c.model)
        g, src = graphs[c.model]
        pred, setup = c.run(g, kernels)
        rows.append(dict(case=c.name, unit=c.unit, published=c.published, predicted=pred,
                         ratio=pred / c.published, setup=setup, graph=src, kernels=kernels))
    return rows


def geomean_error(rows: list[dict]) -> float:
    """Geometric-mean error of predicted / published: ``exp(mean |ln ratio|) - 1`` (0.10 =
    10%: a factor-symmetric mean, so 0.8 and 1.25 count alike)."""
    return float(np.exp(np.mean([abs(np.log(r["ratio"])) for r in rows])) - 1.0)


def summary(rows: list[dict], band: float = 0.25) -> str:
    """One line: the geometric-mean error over every published point and over the
    TRT-LLM figures, and how many points lie within ``+-band``."""
    trt = [r for r in rows if r["case"].startswith("TRT-LLM")]
    inside = sum(1 - band <= r["ratio"] <= 1 + band for r in rows)
    return (f"{rows[0]['kernels']}: geomean error {geomean_error(rows):.1%} over all "
            f"{len(rows)} points ({inside} within +-{band:.0%}), "
            f"{geomean_error(trt):.1%} over the {len(trt)} TRT-LLM figures")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--markdown", action="store_true")
    ap.add_argument("--kernels", choices=["roofline", "silicon", "both"], default="both")
    args = ap.parse_args(argv)
    load_hardware("h100")
    if args.kernels == "both":
        roof, sil = validation_rows("roofline"), validation_rows("silicon")
        print("| case | published | roofline | ratio | silicon | ratio | silicon setup |")
        print("|---|---|---|---|---|---|---|")
        for r, q in zip(roof, sil):
            print(f"| {r['case']} | {r['published']:,.0f} {r['unit']} | {r['predicted']:,.0f} | "
                  f"{r['ratio']:.2f} | {q['predicted']:,.0f} | {q['ratio']:.2f} | {q['setup']} |")
        print(f"\n{summary(roof)}\n{summary(sil)}")
        return 0 if all(np.isfinite(r["ratio"]) for r in roof + sil) else 1
    rows = validation_rows(args.kernels)
    if args.markdown:
        print("| case | published | predicted | ratio | setup detail | graph |")
        print("|---|---|---|---|---|---|")
        for r in rows:
            print(f"| {r['case']} | {r['published']:,.0f} {r['unit']} | {r['predicted']:,.0f} | "
                  f"{r['ratio']:.2f} | {r['setup']} | {r['graph']} |")
    else:
        for r in rows:
            print(f"{r['case']:40s} published {r['published']:>10,.0f}  predicted "
                  f"{r['predicted']:>10,.0f}  ratio {r['ratio']:.2f}  ({r['setup']})")
    print(f"\n{summary(rows)}")
    return 0 if all(np.isfinite(r["ratio"]) for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
