"""Cold `shardc compile` (empty graph cache) of every example and the Qwen3-MoE config.json
models, with the reduced-depth trace (default) and with the full trace
(``SHARDC_FULL_TRACE=1``); CPU s (user + sys) and wall of each process, and whether the two
plan.json files are identical (wall times aside). Writes the table into
benchmarks/compile_cold.md.

Usage: .venv/bin/python benchmarks/compile_cold.py [--out FILE] [MODEL ...]  (both traces, always)
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CASES = {  # model -> (path, mesh)
    "tiny_llama": ("examples/tiny_llama.py", "8x1"),
    "tiny_mixtral": ("examples/tiny_mixtral.py", "8x1"),
    "llama3_70b": ("examples/llama3_70b.py", "8x1"),
    "mixtral_8x7b": ("examples/mixtral_8x7b.py", "8x1"),
    "deepseek_v3": ("examples/deepseek_v3.py", "8x16"),
    "gpt_moe_1p2t": ("examples/gpt_moe_1p2t.py", "8x128"),
    "gpt_moe_1p6t": ("examples/gpt_moe_1p6t.py", "8x128"),
    "qwen3_30b_a3b (config.json)": ("examples/configs/qwen3_30b_a3b/config.json", "8x1"),
    "qwen3_235b_a22b (config.json)": ("examples/configs/qwen3_235b_a22b/config.json", "8x2"),
}


def run(path: str, mesh: str, full: bool, out: Path) -> dict:
    """One cold compile in a fresh process (its own empty cache folder)."""
    with tempfile.TemporaryDirectory(prefix="shardc-cold-") as cache:
        env = {**os.environ, "SHARDC_CACHE_DIR": cache, "SHARDC_FULL_TRACE": "1" if full else "0"}
        cmd = [sys.executable, "-m", "shardc.cli", "compile", path, "--mesh", mesh,
               "--search", "exact", "--out", str(out), "--quiet"]
        start = time.perf_counter()
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL,
                                stderr=subprocess.PIPE, text=True)
        stderr = proc.stderr.read()
        _, status, usage = os.wait4(proc.pid, 0)
        wall = time.perf_counter() - start
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"{path}: compile failed: {stderr.strip()}")
    return {"cpu_s": usage.ru_utime + usage.ru_stime, "wall_s": wall, "note": stderr.strip()}


def plan_without_wall_times(folder: Path):
    def strip(d):
        if isinstance(d, dict):
            return {k: strip(v) for k, v in d.items() if k != "wall_s"}
        if isinstance(d, list):
            return [strip(v) for v in d]
        return d

    return strip(json.loads((folder / "plan.json").read_text()))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("models", nargs="*", default=list(CASES))
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "compile_cold.md"))
    args = ap.parse_args()
    rows = []
    with tempfile.TemporaryDirectory(prefix="shardc-cold-out-") as tmp:
        for model in args.models:
            path, mesh = CASES[model]
            res = {}
            for mode in ("reduced", "full"):
                res[mode] = run(path, mesh, mode == "full", Path(tmp) / model / mode)
                print(f"{model} {mode}: {res[mode]['cpu_s']:.1f} CPU s, "
                      f"{res[mode]['wall_s']:.1f} s wall", flush=True)
            same = (plan_without_wall_times(Path(tmp) / model / "reduced")
                    == plan_without_wall_times(Path(tmp) / model / "full"))
            rows.append((model, mesh, res, same))
    load = os.getloadavg()
    lines = [
        "# Cold `shardc compile`: reduced-depth trace vs full trace",
        "",
        "Measured with `.venv/bin/python benchmarks/compile_cold.py`: one fresh process per run,",
        "`shardc compile MODEL --mesh M --search exact --quiet` with an empty graph cache;",
        "*reduced* = the default (one traced layer per kind and position pattern, expanded,",
        "`shardc/frontends/reduced_depth.py`), *full* = `SHARDC_FULL_TRACE=1`. CPU s = user + sys",
        "of the process (the figure least distorted by other jobs on this shared 2-core machine;",
        f"measured {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, load average at the "
        f"end {load[0]:.1f} / {load[1]:.1f} / {load[2]:.1f}).",
        "*same plan* = the two plan.json files are equal once `wall_s` fields are dropped.",
        "",
        "| model | mesh | reduced CPU s | reduced wall s | full CPU s | full wall s | same plan |",
        "|---|---|---|---|---|---|---|",
    ]
    for model, mesh, res, same in rows:
        r, f = res["reduced"], res["full"]
        lines.append(f"| {model} | {mesh} | {r['cpu_s']:.1f} | {r['wall_s']:.1f} | "
                     f"{f['cpu_s']:.1f} | {f['wall_s']:.1f} | {'yes' if same else 'NO'} |")
    notes = [f"{m}: {res['reduced']['note']}" for m, _, res, _ in rows if res["reduced"]["note"]]
    if notes:
        lines += ["", "Notes printed by the reduced runs:", ""] + [f"- {n}" for n in notes]
    out = Path(args.out)
    # the dated sections below the table (measurements of past changes) are kept
    old = out.read_text().splitlines() if out.is_file() else []
    kept = next((old[i:] for i, line in enumerate(old) if line.startswith("## ")), [])
    out.write_text("\n".join(lines + ([""] + kept if kept else [])) + "\n")
    print(f"wrote {args.out}")
    return 0 if all(same for *_, same in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
