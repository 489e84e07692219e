"""Trace every example at full size (torch.export on meta + passes) and record wall time
and peak RSS of a fresh process per model into benchmarks/trace.md.

Usage: .venv/bin/python benchmarks/trace_examples.py [--out benchmarks/trace.md] [--full-trace] [MODEL ...]

The graph cache is off in the children (``SHARDC_NO_CACHE=1``); models that opt in are traced
at a reduced depth and expanded (``shardc/frontends/reduced_depth.py``) unless ``--full-trace``
(``SHARDC_FULL_TRACE=1``).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MODELS = ["tiny_llama", "tiny_mixtral", "llama3_70b", "mixtral_8x7b", "deepseek_v3",
          "gpt_moe_1p2t", "gpt_moe_1p6t"]

_CHILD = r"""
import json, sys, time, torch
torch.set_num_threads(1)
t0 = time.perf_counter()
from shardc.frontends import load_graph
t1 = time.perf_counter()
g = load_graph(sys.argv[1])
t2 = time.perf_counter()
print(json.dumps({"import_s": t1 - t0, "trace_s": t2 - t1, "nodes": len(g.nodes),
                  "params": g.num_params,
                  "kinds": [[k.name, k.count] for k in g.layer_kinds]}))
"""


def measure(model: str, full_trace: bool = False) -> dict:
    path = ROOT / "examples" / f"{model}.py"
    start = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-c", _CHILD, str(path)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, cwd=ROOT,
                            env={**os.environ, "OMP_NUM_THREADS": "1", "SHARDC_NO_CACHE": "1",
                                 "SHARDC_FULL_TRACE": "1" if full_trace else "0"})
    stdout, stderr = proc.stdout.read(), proc.stderr.read()
    _, status, usage = os.wait4(proc.pid, 0)  # this child's own rusage
    wall = time.perf_counter() - start
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"{model}: failed: {stderr.strip().splitlines()[-1]}")
    row = json.loads(stdout.strip().splitlines()[-1])
    row.update(model=model, wall_s=wall, peak_rss_mb=usage.ru_maxrss / 1024,
               cpu_s=usage.ru_utime + usage.ru_stime)
    return row


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("models", nargs="*", default=MODELS)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "trace.md"))
    ap.add_argument("--full-trace", action="store_true", help="trace every layer")
    args = ap.parse_args()
    rows = []
    for m in args.models:
        row = measure(m, args.full_trace)
        rows.append(row)
        print(f"{m}: {row['wall_s']:.1f} s, {row['peak_rss_mb']:.0f} MB", flush=True)
    load = os.getloadavg()
    lines = [
        "# Tracing the examples (torch.export on `meta` + passes)",
        "",
        "Measured with: `.venv/bin/python benchmarks/trace_examples.py` (one fresh process per",
        "model, `torch.set_num_threads(1)`; *trace* = `shardc.frontends.load_graph` = build on",
        "meta + non-strict torch.export + canonicalise/fused/layer passes; *wall* adds Python,",
        "torch and transformers start-up; *CPU s* = user + system CPU time of the process, the",
        "figure least distorted by other jobs; *peak RSS* = `ru_maxrss` of the process;",
        "graph cache off). " + ("Every layer traced (`--full-trace`)." if args.full_trace else
                                "Default path: models that opt in are traced at a reduced depth "
                                "and expanded exactly (`--full-trace` traces every layer)."),
        f"Machine: 2 CPU cores shared with other jobs; load average at the end of the run "
        f"{load[0]:.1f} / {load[1]:.1f} / {load[2]:.1f} (1/5/15 min), so times are upper bounds.",
        "",
        "| model | params | layer kinds | IR nodes | trace s | wall s | CPU s | peak RSS MB |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        kinds = ", ".join(f"{n} x{c}" for n, c in r["kinds"])
        lines.append(f"| {r['model']} | {r['params']:.4g} | {kinds} | {r['nodes']} | "
                     f"{r['trace_s']:.1f} | {r['wall_s']:.1f} | {r['cpu_s']:.1f} | "
                     f"{r['peak_rss_mb']:.0f} |")
    ds = next((r for r in rows if r["model"] == "deepseek_v3"), None)
    if ds:
        lines += ["", f"Target (issue 2): full-size DeepSeek-V3 in <= 60 s and <= 2 GB peak. Here: "
                  f"{ds['cpu_s']:.1f} CPU s ({ds['wall_s']:.1f} s wall at the load above), "
                  f"{ds['peak_rss_mb']:.0f} MB peak RSS."]
    Path(args.out).write_text("\n".join(lines) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
