"""`shardc compile` cold and warm (graph cache), before and after the warm-path changes of
issue 15, with the search's share measured separately.

For each case, for the code *before* (a commit, extracted with ``git archive`` into a temp
folder) and *after* (this checkout): a fresh graph-cache folder, then the same default
compile (``--search rl --budget 4000 --seed 0``) twice in fresh processes -- *cold* (traces)
and *warm* (served by the cache) -- and once more warm with ``--search exact`` (no torch). Per process: CPU s (user + sys, ``os.wait4``), wall s, the
load average when it started, and the CPU s and wall s spent inside
``shardc.driver.run_search`` (the Megatron baseline sweep and the requested searcher,
including the RL agent's own imports of torch and gymnasium in the after code), recorded by
a wrapper the child installs before running ``shardc.cli.main``. *rest* = process - search.
The outputs of the two codes' warm runs (rl and exact) must be byte-identical (plan.json with ``wall_s``
dropped; graph.txt, graph.dot, trace.json, parallelize.py, search.png as they are).

Target (issue 15): a warm DeepSeek-V3 8x16 or Qwen3-MoE config.json compile with the default
search spends <= 3 CPU s beyond the search (exit 1 if not met, or if an output differs).

Usage: .venv/bin/python benchmarks/warm_path.py [--before COMMIT] [--out FILE] [CASE ...]
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

sys.path.insert(0, str(Path(__file__).resolve().parent))
from compile_cold import plan_without_wall_times  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
CASES = {  # name -> (model path, mesh)
    "mixtral_8x7b": ("examples/mixtral_8x7b.py", "8x128"),
    "deepseek_v3": ("examples/deepseek_v3.py", "8x16"),
    "llama3_70b": ("examples/llama3_70b.py", "8x1"),
    "qwen3_30b_a3b config.json": ("examples/configs/qwen3_30b_a3b/config.json", "8x2"),
    "qwen3_235b_a22b config.json": ("examples/configs/qwen3_235b_a22b/config.json", "8x2"),
    "qwen2_5_72b config.json": ("examples/configs/qwen2_5_72b/config.json", "8x2"),
}
TARGET_CASES = ("deepseek_v3", "qwen3_30b_a3b config.json", "qwen3_235b_a22b config.json")
TARGET_REST_CPU_S = 3.0
COMPARED_FILES = ("graph.txt", "graph.dot", "trace.json", "parallelize.py", "search.png")

# Runs in the child: time shardc.driver.run_search, then the CLI as `shardc` runs it.
CHILD = """
import json, sys, time
import shardc.driver as driver
spent = {"cpu_s": 0.0, "wall_s": 0.0}
search = driver.run_search
def timed(*args, **kwargs):
    cpu, wall = time.process_time(), time.perf_counter()
    try:
        return search(*args, **kwargs)
    finally:
        spent["cpu_s"] += time.process_time() - cpu
        spent["wall_s"] += time.perf_counter() - wall
driver.run_search = timed
from shardc.cli import main
rc = main(sys.argv[2:])
with open(sys.argv[1], "w") as f:
    json.dump(spent, f)
sys.exit(rc)
"""


RUNS = {"cold": [], "warm": [], "warm exact": ["--search", "exact"]}  # run -> extra flags


def compile_once(code: Path, cache: Path, path: str, mesh: str, out: Path,
                 extra: list[str]) -> dict:
    """One `shardc compile` in a fresh process running the package in ``code``."""
    env = {**os.environ, "SHARDC_CACHE_DIR": str(cache), "PYTHONPATH": str(code)}
    env.pop("SHARDC_FULL_TRACE", None)
    report = out.parent / f".{out.name}-search.json"
    cmd = [sys.executable, "-c", CHILD, str(report), "compile", path, "--mesh", mesh,
           "--out", str(out), "--quiet", *extra]
    load = os.getloadavg()[0]
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=code, env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    stderr = proc.stderr.read()
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - start
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"{path} ({code}): compile failed: {stderr.strip()}")
    search = json.loads(report.read_text())
    cpu = usage.ru_utime + usage.ru_stime
    return {"cpu_s": cpu, "wall_s": wall, "load": load, "search_cpu_s": search["cpu_s"],
            "search_wall_s": search["wall_s"], "rest_cpu_s": cpu - search["cpu_s"],
            "rest_wall_s": wall - search["wall_s"]}


def same_outputs(a: Path, b: Path) -> list[str]:
    """Names of the output files that differ between folders ``a`` and ``b``."""
    differ = [] if plan_without_wall_times(a) == plan_without_wall_times(b) else ["plan.json"]
    for name in COMPARED_FILES:
        if (a / name).exists() != (b / name).exists() or (
                (a / name).exists() and (a / name).read_bytes() != (b / name).read_bytes()):
            differ.append(name)
    return differ


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("cases", nargs="*", default=list(CASES))
    ap.add_argument("--before", default="dc8ca6c", help="commit of the code before")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "warm_path.md"))
    args = ap.parse_args()
    rows, ok = [], True
    with tempfile.TemporaryDirectory(prefix="shardc-warm-") as tmp:
        tmp = Path(tmp)
        before = tmp / "before"
        before.mkdir()
        archive = subprocess.run(["git", "-C", str(ROOT), "archive", args.before],
                                 check=True, capture_output=True).stdout
        subprocess.run(["tar", "-x", "-C", str(before)], input=archive, check=True)
        for case in args.cases:
            path, mesh = CASES[case]
            res = {}
            for label, code in (("before", before), ("after", ROOT)):
                cache = tmp / "cache" / label / case.replace(" ", "_")
                for run, extra in RUNS.items():
                    out = tmp / "out" / label / case.replace(" ", "_") / run.replace(" ", "_")
                    res[label, run] = r = compile_once(code, cache, path, mesh, out, extra)
                    print(f"{case} {mesh} {label} {run}: {r['cpu_s']:.1f} CPU s "
                          f"(search {r['search_cpu_s']:.1f}), {r['wall_s']:.1f} s wall "
                          f"(search {r['search_wall_s']:.1f}), load {r['load']:.1f}", flush=True)
            differ = [f"{name} ({run})" for run in ("warm", "warm_exact")
                      for name in same_outputs(tmp / "out" / "before" / case.replace(" ", "_")
                                               / run,
                                               tmp / "out" / "after" / case.replace(" ", "_")
                                               / run)]
            ok = ok and not differ
            rows.append((case, mesh, res, differ))
    lines = [
        "# `shardc compile` cold and warm, before and after the warm-path changes (issue 15)",
        "",
        f"Generated by `.venv/bin/python benchmarks/warm_path.py` (before = commit "
        f"`{args.before}`, after = this checkout): default search (`rl`, budget 4000, seed 0),",
        "decode, H100. *cold* = empty graph cache, *warm* = the same command again, *warm",
        "exact* = again with `--search exact` (a search that needs no torch). CPU s =",
        "user + sys of the process; *search* = inside `shardc.driver.run_search` (Megatron sweep",
        "+ the RL agent, whose torch / gymnasium imports fall in it after the change; before,",
        "torch was already imported at start-up); *rest* = process - search. Load = 1-min load",
        "average when the run started (2 shared cores). *outputs* = whether the warm runs (rl",
        "and exact) of both codes wrote byte-identical files (plan.json without `wall_s`).",
        "",
        "| model | mesh | code | run | CPU s | search CPU s | rest CPU s | wall s | "
        "search wall s | rest wall s | load |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for case, mesh, res, _ in rows:
        for (label, run), r in res.items():
            lines.append(f"| {case} | {mesh} | {label} | {run} | {r['cpu_s']:.1f} | "
                         f"{r['search_cpu_s']:.1f} | {r['rest_cpu_s']:.1f} | "
                         f"{r['wall_s']:.1f} | {r['search_wall_s']:.1f} | "
                         f"{r['rest_wall_s']:.1f} | {r['load']:.1f} |")
    lines += ["", "| model | outputs before = after |", "|---|---|"]
    lines += [f"| {case} | {'identical' if not d else 'DIFFER: ' + ', '.join(d)} |"
              for case, _, _, d in rows]
    checked = [(case, res["after", "warm"]["rest_cpu_s"]) for case, _, res, _ in rows
               if case in TARGET_CASES]
    met = all(rest <= TARGET_REST_CPU_S for _, rest in checked)
    lines += ["", f"Target: warm compile <= {TARGET_REST_CPU_S:g} CPU s beyond the search: "
              + ", ".join(f"{case} {rest:.1f}" for case, rest in checked)
              + (" -- met." if met else " -- NOT MET.")]
    Path(args.out).write_text("\n".join(lines) + "\n")
    print(f"wrote {args.out}")
    return 0 if ok and met and checked else 1


if __name__ == "__main__":
    sys.exit(main())
