"""Serving plans: NVIDIA AIConfigurator `cli default` vs shardc `compile --phase serve`.

    .venv/bin/python benchmarks/aiconfigurator/serve_side_by_side.py [--refresh-aic]

For each traffic case (model, mesh, ISL/OSL, TTFT/TPOT SLOs) records AIConfigurator's best
deployment (agg or disagg, its parallelism, tok/s/GPU, tok/s/user) per backend, and when this
shardc has ``compile --phase serve``, shardc's plan, AIConfigurator's `estimate` of shardc's
chosen degrees, and shardc's `simulate` of AIConfigurator's best aggregated configuration
(each plan judged by the other tool's yardstick); otherwise shardc's columns say pending.
AIConfigurator's answers are cached in benchmarks/aiconfigurator/serve_cache.json (a re-run
recomputes only shardc's side). Writes benchmarks/serve_aiconfigurator.md and .json.
"""

from __future__ import annotations

import argparse
import csv
import json
import re
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import aic_common as ac  # noqa: E402

CACHE = ac.HERE / "serve_cache.json"
OUT_MD = ac.ROOT / "benchmarks" / "serve_aiconfigurator.md"
OUT_JSON = ac.ROOT / "benchmarks" / "serve_aiconfigurator.json"
BACKENDS = ("trtllm", "vllm")
COMMAND = ".venv/bin/python benchmarks/aiconfigurator/serve_side_by_side.py"


@dataclass(frozen=True)
class ServeCase:
    label: str
    model: str       # shardc MODEL argument (repo-relative); AIConfigurator reads the same config
    mesh: str        # GxN
    isl: int
    osl: int
    ttft_ms: float
    tpot_ms: float

    @property
    def gpus(self) -> int:
        g, n = self.mesh.split("x")
        return int(g) * int(n)

    @property
    def name(self) -> str:
        return (f"{self.label} {self.mesh} {self.isl}/{self.osl} "
                f"TTFT {self.ttft_ms:g} TPOT {self.tpot_ms:g}")


CASES = [  # issue 14's serving cases
    ServeCase("Llama-3-70B", "examples/llama3_70b.py", "8x1", 2048, 2048, 2000, 50),
    ServeCase("Mixtral-8x7B", "examples/mixtral_8x7b.py", "8x1", 2048, 512, 2000, 30),
    ServeCase("Mixtral-8x7B", "examples/mixtral_8x7b.py", "8x2", 1024, 1024, 1000, 20),
    ServeCase("Qwen3-30B-A3B", "examples/configs/qwen3_30b_a3b/config.json", "8x2",
              4000, 1000, 2000, 30),
    # 8192 + 256 tokens exceed Llama-3-70B's 8192 positions: Llama-3.1-70B (same dimensions)
    ServeCase("Llama-3.1-70B", "examples/configs/llama3_1_70b/config.json", "8x4",
              8192, 256, 1000, 20),
]


# ---------------------------------------------------------------- AIConfigurator `default`

def _num(v):
    try:
        return float(str(v).replace(",", ""))
    except (TypeError, ValueError):
        return None


def _best_csv_row(path: Path) -> dict | None:
    if not path.exists():
        return None
    rows = list(csv.DictReader(path.open()))
    if not rows:
        return None
    return max(rows, key=lambda r: _num(r.get("tokens/s/gpu_cluster") or r.get("tokens/s/gpu"))
               or 0.0)


def _describe_row(mode: str, row: dict, total_gpus: int) -> dict:
    """The numbers and the deployment of one row of AIConfigurator's best_config_topn.csv."""
    out = {"tok_s_per_gpu": _num(row.get("tokens/s/gpu_cluster") or row.get("tokens/s/gpu")),
           "tok_s_per_user": _num(row.get("tokens/s/user")), "ttft_ms": _num(row.get("ttft")),
           "tpot_ms": _num(row.get("tpot")), "concurrency": _num(row.get("concurrency")),
           "perf_db": row.get("version") or row.get("(d)version")}
    if mode == "agg":
        per_worker = int(_num(row.get("num_total_gpus")) or 1)
        out.update(parallel=row.get("parallel"), batch=int(_num(row.get("bs")) or 0),
                   workers=total_gpus // per_worker, gpus_per_worker=per_worker,
                   deployment=f"{row.get('parallel')} bs{row.get('bs')} "
                              f"x{total_gpus // per_worker}")
        for k in ("tp", "pp", "dp", "moe_tp", "moe_ep"):
            out[k] = int(_num(row.get(k)) or 1)
    else:
        out.update(prefill_parallel=row.get("(p)parallel"), decode_parallel=row.get("(d)parallel"),
                   prefill_workers=row.get("(p)workers"), decode_workers=row.get("(d)workers"),
                   prefill_batch=row.get("(p)bs"), decode_batch=row.get("(d)bs"),
                   deployment=f"P {row.get('(p)parallel')} bs{row.get('(p)bs')} "
                              f"x{row.get('(p)workers')} + D {row.get('(d)parallel')} "
                              f"bs{row.get('(d)bs')} x{row.get('(d)workers')} per replica")
    return out


def aic_default(cache: ac.Cache, folder: Path, case: ServeCase, backend: str) -> dict:
    """AIConfigurator's `cli default` (agg vs disagg sweep) for ``case`` (cached)."""
    args = ["--system", "h100_sxm", "--backend", backend, "--total-gpus", str(case.gpus),
            "--isl", str(case.isl), "--osl", str(case.osl), "--ttft", f"{case.ttft_ms:g}",
            "--tpot", f"{case.tpot_ms:g}"]
    key = json.dumps(["default", ac.config_digest(folder), args])
    hit = cache.get(key)
    if hit is not None:
        return hit
    with tempfile.TemporaryDirectory(prefix="aic_default_", dir=_workdir()) as save:
        rc, out, err, wall = ac.run_aic("default", ["--model-path", str(folder), *args,
                                                    "--save-dir", save, "--top-n", "5"])
        result: dict = {"args": args, "wall_s": round(wall, 1),
                        "run_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
        m = re.search(r"Best Experiment Chosen:\s*(\w+) at ([\d,.]+) tokens/s/gpu", out + err)
        runs = sorted(Path(save).glob("*/"))
        if rc != 0 or not runs:
            result["error"] = ac.aic_error_line(out, err)
        else:
            for mode in ("agg", "disagg"):
                row = _best_csv_row(runs[-1] / mode / "best_config_topn.csv")
                result[mode] = _describe_row(mode, row, case.gpus) if row else None
            if m:
                result["chosen"] = m.group(1)
            else:  # AIConfigurator found no configuration meeting the SLOs
                result["chosen"] = None
                result["note"] = ac.aic_error_line(out, err)
    cache.put(key, result)
    return result


def _workdir() -> str:
    ac.WORK.mkdir(parents=True, exist_ok=True)
    return str(ac.WORK)


# ---------------------------------------------------------------------------- shardc serve

def shardc_has_serve() -> tuple[bool, bool]:
    """(compile has ``--phase serve``, simulate has ``--phase serve``)."""
    comp = ac.flag_choices(ac.shardc_help("compile"), "--phase") or []
    sim = ac.flag_choices(ac.shardc_help("simulate"), "--phase") or []
    return "serve" in comp, "serve" in sim


def shardc_serve_plan(case: ServeCase) -> dict:
    with tempfile.TemporaryDirectory(prefix="shardc_serve_") as tmp:
        t0 = time.perf_counter()
        rc, so, se = ac.run_shardc("compile", [
            case.model, "--mesh", case.mesh, "--phase", "serve", "--isl", str(case.isl),
            "--osl", str(case.osl), "--ttft-slo", f"{case.ttft_ms:g}",
            "--tpot-slo", f"{case.tpot_ms:g}", "--out", tmp, "--quiet"])
        wall = time.perf_counter() - t0
        plan_path = Path(tmp) / "plan.json"
        if rc != 0 or not plan_path.exists():
            return {"error": ac.shardc_error_line(so, se, rc)}
        plan = json.loads(plan_path.read_text())
    serving = plan.get("serving") or {}
    pred = serving.get("predicted") or plan.get("predicted") or {}
    return {"mode": serving.get("mode"), "pools": serving.get("pools") or [],
            "tok_s_per_gpu": pred.get("tok_s_per_gpu"), "tok_s_per_user": pred.get("tok_s_per_user"),
            "ttft_ms": pred.get("ttft_ms"), "tpot_ms": pred.get("tpot_ms"),
            "kernel_source": (plan.get("predicted") or {}).get("kernel_source"),
            "wall_s": round(wall, 1)}


def _pool_aic_flags(pool: dict, moe: bool, prefix: str = "") -> list[str] | None:
    """AIConfigurator flags for one shardc pool: per-worker parallelism (tp, pp, attention DP =
    ep, expert TP x EP = tp x ep), batch per attention-DP rank per micro-batch (AIConfigurator's
    ``--batch-size``: its concurrency is batch-size x pp per rank; shardc's batch counts every
    sequence of the replica, over pp micro-batches and ep attention groups), and workers = the
    pool's GPUs / GPUs per worker (shardc's dp replicas count as workers)."""
    deg = pool.get("degrees") or {}
    tp, pp, ep = (int(deg.get(k, 1)) for k in ("tp", "pp", "ep"))
    batch = pool.get("batch")
    if not batch:
        return None
    per_worker = tp * pp * ep
    pool_gpus = int(pool.get("workers", 1)) * int(pool.get("gpus_per_worker", per_worker))
    p = f"--{prefix}-" if prefix else "--"
    flags = ac.moe_parallel_args(tp, ep, moe, prefix) + [
        f"{p}pp-size", str(pp), f"{p}batch-size", str(max(1, -(-int(batch) // (ep * pp))))]
    if prefix:
        flags += [f"{p}num-workers", str(max(1, pool_gpus // per_worker))]
    return flags


def aic_estimate_of_plan(cache: ac.Cache, folder: Path, moe: bool, case: ServeCase,
                         plan: dict, backend: str) -> dict:
    """AIConfigurator's `estimate` of shardc's chosen degrees, batch and (disagg) workers."""
    pools = {p.get("role"): p for p in plan.get("pools", [])}
    common = ["--system", "h100_sxm", "--backend", backend, "--isl", str(case.isl),
              "--osl", str(case.osl)]
    if plan.get("mode") == "disagg" and "prefill" in pools and "decode" in pools:
        pf = _pool_aic_flags(pools["prefill"], moe, "prefill")
        df = _pool_aic_flags(pools["decode"], moe, "decode")
        flags = None if pf is None or df is None else ["--estimate-mode", "disagg", *pf, *df]
    else:
        pool = next(iter(pools.values()), None)
        pf = _pool_aic_flags(pool, moe) if pool else None
        flags = None if pf is None else ["--estimate-mode", "agg", *pf]
    if flags is None:
        return {"error": "plan.json serving.pools lacks degrees or batch"}
    return ac.aic_estimate(cache, folder, common + flags)


def shardc_simulate_of_aic(case: ServeCase, aic_agg: dict, moe: bool) -> dict:
    """shardc's `simulate --phase serve --mode agg` of AIConfigurator's best aggregated
    worker (degrees and max batch, priced at exactly that batch): attention TP x DP = tp x
    dp_attn, the experts' TP x EP = moe_tp x moe_ep (shardc's degrees say any split whose
    product is tp x dp_attn). An infeasible answer (exit 3: over an SLO or out of memory)
    still carries shardc's numbers."""
    tp, pp, dp, etp, eep = (aic_agg.get(k, 1) for k in ("tp", "pp", "dp", "moe_tp", "moe_ep"))
    if moe and etp * eep != tp * dp:
        return {"error": f"not expressible in shardc's degrees: {aic_agg.get('parallel')}"}
    degrees = f"tp={tp},pp={pp}" + (f",dp_attn={dp},moe_tp={etp},moe_ep={eep}"
                                    if moe and dp * tp > 1 else "")
    batch = aic_agg["batch"] * pp * (dp if moe else 1)  # per rank per micro-batch -> replica
    with tempfile.TemporaryDirectory(prefix="shardc_sim_") as tmp:
        out = Path(tmp) / "sim.json"
        rc, so, se = ac.run_shardc("simulate", [
            case.model, "--mesh", case.mesh, "--degrees", degrees, "--phase", "serve",
            "--mode", "agg", "--isl", str(case.isl), "--osl", str(case.osl),
            "--ttft-slo", f"{case.ttft_ms:g}", "--tpot-slo", f"{case.tpot_ms:g}",
            "--batch", str(batch), "--json", str(out)])
        if rc not in (0, 3) or not out.exists():
            return {"error": ac.shardc_error_line(so, se, rc), "degrees": degrees, "batch": batch}
        data = json.loads(out.read_text())
    pred = (data.get("serving") or {}).get("predicted") or data.get("predicted") or {}
    tpot = pred.get("tpot_ms")
    per_user = pred.get("tok_s_per_user") or (1000.0 / tpot if tpot else None)
    reason = ((pred.get("breakdown") or {}).get("reason") if rc == 3 else None)
    return {"degrees": degrees, "batch": batch,
            "chosen_batch": (data.get("workload") or {}).get("batch"),
            "tok_s_per_gpu": pred.get("tok_s_per_gpu"), "tok_s_per_user": per_user,
            "ttft_ms": pred.get("ttft_ms"), "tpot_ms": tpot, "infeasible": reason}


# ------------------------------------------------------------------------------------ report

def _parallel_gpus(parallel: str | None) -> int | None:
    """GPUs of one worker from AIConfigurator's ``tpXppYdpZ...`` string (tp * pp * dp)."""
    m = re.match(r"tp(\d+)pp(\d+)dp(\d+)", parallel or "")
    return int(m.group(1)) * int(m.group(2)) * int(m.group(3)) if m else None


def _deployment_text(mode: str | None, best: dict, total_gpus: int) -> str:
    """AIConfigurator's deployment: agg ``parallel bsB xW``; disagg the prefill and decode
    workers of one replica and how many replicas fill the mesh."""
    if mode != "disagg":
        return best.get("deployment", "-")
    pg, dg = (_parallel_gpus(best.get(k)) for k in ("prefill_parallel", "decode_parallel"))
    try:
        per_replica = pg * int(best["prefill_workers"]) + dg * int(best["decode_workers"])
    except (TypeError, ValueError, KeyError):
        return best.get("deployment", "-")
    return (f"P {best['prefill_parallel']} bs{best['prefill_batch']} x{best['prefill_workers']}"
            f" + D {best['decode_parallel']} bs{best['decode_batch']} x{best['decode_workers']}"
            f", {total_gpus // per_replica} replica(s) of {per_replica} GPUs")


def _plan_text(plan: dict) -> str:
    parts = []
    for p in plan.get("pools", []):
        deg = p.get("degrees") or {}
        d = ",".join(f"{k}={v}" for k, v in sorted(deg.items()) if isinstance(v, int) and v > 1)
        parts.append(f"{p.get('role', '?')}: {d or 'tp=1'} bs{p.get('batch', '?')} "
                     f"x{p.get('workers', 1)}")
    return "; ".join(parts) or "-"


def _aic_refusal(res: dict) -> str:
    """Why AIConfigurator's ``estimate`` gave no numbers (both database modes failed)."""
    err = res.get("error_silicon") or res.get("error_hybrid") or "no numbers"
    if "OOM" in err:
        return "AIC: OOM at these degrees and batch"
    if "MoE data missing" in err:
        return "AIC: no measured MoE table for this shape"
    return f"AIC: {err[:120]}"


def _estimate_cell(cross: dict | None, case: ServeCase) -> str:
    if not cross:
        return "-"
    if "error" in cross:
        return f"error: {cross['error']}"
    if cross.get("tok_s_per_gpu") is None:
        return _aic_refusal(cross)
    return (f"{ac.fmt(cross.get('tok_s_per_gpu'))} ({ac.fmt(cross.get('tok_s_per_user'))})"
            + _slo_mark(cross, case))


def _simulate_cell(sim: dict | None, case: ServeCase) -> str:
    if not sim:
        return "-"
    if "error" in sim:
        return f"error: {sim['error']}"
    batch = sim.get("chosen_batch")
    mark = _slo_mark(sim, case)
    if sim.get("infeasible") and not mark:  # infeasible for a reason other than the SLOs
        mark = f" (infeasible in shardc: {sim['infeasible']})"
    return (f"{ac.fmt(sim.get('tok_s_per_gpu'))} ({ac.fmt(sim.get('tok_s_per_user'))})"
            + (f" at batch {batch}" if batch is not None else "") + mark)


def _slo_mark(res: dict, case: ServeCase) -> str:
    ttft, tpot = res.get("ttft_ms"), res.get("tpot_ms")
    if ttft is None or tpot is None:
        return ""
    ok = ttft <= case.ttft_ms and tpot <= case.tpot_ms
    return "" if ok else f" (misses SLO: TTFT {ttft:,.0f}, TPOT {tpot:,.1f})"


def markdown(rows: list[dict], versions: dict, revision: str, serve: tuple[bool, bool]) -> str:
    aic_dates = sorted({r["aic"][b].get("run_at", "")[:10] for r in rows for b in BACKENDS})
    dbs = {b: next((m["perf_db"] for r in rows for m in (r["aic"][b].get("agg"),
                                                         r["aic"][b].get("disagg"))
                    if m and m.get("perf_db")), None) for b in BACKENDS}
    w = [r["aic"][b].get("wall_s") for r in rows for b in BACKENDS if r["aic"][b].get("wall_s")]
    walls = f"{min(w):.0f}-{max(w):.0f} s wall at nice 10 on a shared 2-core machine" if w else "-"
    lines = [
        "# Serving plans: shardc `compile --phase serve` vs AIConfigurator `cli default`",
        "",
        f"Reproduce (one command; creates AIConfigurator's venv on first use): `{COMMAND}`",
        "(`--refresh-aic` re-runs AIConfigurator; its answers are cached in",
        "`benchmarks/aiconfigurator/serve_cache.json`). Raw: `benchmarks/serve_aiconfigurator.json`.",
        "",
        f"- AIConfigurator {versions.get('aiconfigurator')} + aiconfigurator-core "
        f"{versions.get('aiconfigurator-core')}: `aiconfigurator cli default --system h100_sxm "
        "--backend B --total-gpus N --isl --osl --ttft --tpot` (its agg vs disagg sweep, SILICON "
        "database, BF16 as the configs say), backends "
        + ", ".join(f"{b} (perf DB {dbs.get(b) or 'current'})" for b in BACKENDS)
        + f"; run {', '.join(aic_dates)}; each `default` run took {walls}.",
        f"- shardc at `{revision}`: `shardc compile MODEL --mesh GxN --phase serve --isl --osl "
        "--ttft-slo --tpot-slo` (defaults otherwise: h100, search rl, budget 4000, seed 0).",
        "- tok/s/GPU = output tokens/s per GPU of the whole mesh (both tools; AIConfigurator's "
        "`tokens/s/gpu_cluster`); tok/s/user = 1000 / TPOT; TTFT/TPOT in ms. AIConfigurator's "
        "parallel string `tpXppYdpZetpUepV` = attention TP, PP, attention DP, expert TP, expert "
        "EP of one worker; `bsB` = max batch per attention-DP rank; `xW` = workers.",
        "- Cross-yardsticks: *AIC estimate of shardc's plan* = `aiconfigurator cli estimate "
        "--estimate-mode agg|disagg` at shardc's chosen degrees (shardc tp=T,ep=E -> `--tp T "
        "--attention-dp-size E --moe-tp-size T --moe-ep-size E`), batch (per attention-DP "
        "rank) and workers; *shardc simulate of AIC's agg* = `shardc simulate --phase serve "
        "--mode agg` at AIConfigurator's best aggregated worker (only when its expert TP equals "
        "its attention TP, which shardc's degrees can express).",
        "- Cases: issue 14's must-show commands, on the same model files: its \"Qwen3-MoE "
        "config\" is Qwen3-30B-A3B (`examples/configs/qwen3_30b_a3b/config.json`), and the "
        "8x4 8192/256 case runs Llama-3.1-70B (`examples/configs/llama3_1_70b/config.json`, "
        "Llama-3-70B's dimensions with 131072 positions; 8192 + 256 tokens exceed "
        "Llama-3-70B's 8192, which shardc refuses). Both tools read the same config.json "
        "(for example .py models, their `config()` written out). shardc prices with its "
        "defaults (`--kernels silicon --engine vllm`) for both AIC backends' rows.",
        "",
    ]
    if not serve[0]:
        lines += ["**shardc columns pending**: this shardc has no `compile --phase serve` yet "
                  "(issue 14); re-run the command above once it has.", ""]
    lines += ["## Each tool's own best", "",
              "| case | AIC backend | AIC choice | AIC tok/s/GPU | AIC tok/s/user | AIC deployment "
              "| AIC agg best | AIC disagg best | shardc choice | shardc tok/s/GPU | "
              "shardc tok/s/user | shardc plan |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        sh = r["shardc"]
        for b in BACKENDS:
            a = r["aic"][b]
            if "error" in a:
                aic_cells = [f"error: {a['error']}", "-", "-", "-", "-", "-"]
            else:
                best = a.get(a.get("chosen") or "") or {}
                aic_cells = [a.get("chosen") or "none meets SLOs",
                             ac.fmt(best.get("tok_s_per_gpu")), ac.fmt(best.get("tok_s_per_user")),
                             _deployment_text(a.get("chosen"), best, r["c"].gpus)]
                aic_cells += [ac.fmt((a.get(m) or {}).get("tok_s_per_gpu")) for m in
                              ("agg", "disagg")]
            if sh is None:
                sh_cells = ["pending"] * 4
            elif "error" in sh:
                sh_cells = [f"error: {sh['error']}", "-", "-", "-"]
            else:
                sh_cells = [str(sh.get("mode")), ac.fmt(sh.get("tok_s_per_gpu")),
                            ac.fmt(sh.get("tok_s_per_user")), _plan_text(sh)]
            lines.append("| " + " | ".join([r["case"], b, *aic_cells, *sh_cells]) + " |")
    lines += ["", "## By the other tool's yardstick", "",
              "| case | AIC backend | AIC estimate of shardc's plan: tok/s/GPU (tok/s/user) | "
              "AIC's own best | shardc simulate of AIC's agg best: tok/s/GPU (tok/s/user) | "
              "shardc's own plan |",
              "|---|---|---|---|---|---|"]
    for r in rows:
        sh = r["shardc"]
        for b in BACKENDS:
            a = r["aic"][b]
            best = a.get(a.get("chosen") or "") or {}
            cross = r["aic_of_shardc"].get(b)
            sim = r["shardc_of_aic"].get(b)
            if sh is None:
                c1 = c3 = c4 = "pending"
            else:
                c1 = _estimate_cell(cross, r["c"])
                c3 = _simulate_cell(sim, r["c"])
                c4 = ("-" if "error" in sh else f"{ac.fmt(sh.get('tok_s_per_gpu'))} "
                      f"({ac.fmt(sh.get('tok_s_per_user'))})")
            c2 = f"{ac.fmt(best.get('tok_s_per_gpu'))} ({ac.fmt(best.get('tok_s_per_user'))})"
            lines.append(f"| {r['case']} | {b} | {c1} | {c2} | {c3} | {c4} |")
    lines += ["", "## Known differences behind the cross-yardstick cells (facts about the "
              "tools, not fitted)", ""] + [f"- {n}" for n in NOTES]
    return "\n".join(lines) + "\n"


NOTES = [
    "shardc's mixed / decode pools reserve the KV cache a paged engine holds per running "
    "sequence (ISL + OSL/2 + a preemption margin; plan.json pools' kv_reservation), and "
    "`shardc simulate`'s up-front capacity check (shardc/cost/capacity.py) counts the same "
    "ISL + OSL/2 lower bound in --phase serve, so AIConfigurator's Llama-3-70B 8x1 TRT-LLM "
    "best (tp8 bs320) is priced at the batch it runs (runs before 2026-11-26 counted ISL + "
    "OSL = 4,096 tokens per sequence there, 429.5 GB of KV, and refused it with exit 3).",
    "AIConfigurator's --batch-size is per attention-DP rank per micro-batch (its concurrency "
    "is batch-size x pp); runs before the fix passed shardc's whole replica batch, so "
    "shardc's Llama-3-70B 8x1 plan of then (tp4 pp2, 256 sequences) reached it as 256 per "
    "micro-batch and was refused as OOM -- the mapping's error. With the fix, today's plan "
    "(tp4 pp2, 384 sequences) reaches it as --pp-size 2 --batch-size 192 and is still "
    "refused as OOM, for a different reason: AIConfigurator holds ISL + OSL = 4,096 tokens "
    "of KV per sequence (its estimate of tp4 pp2 --batch-size 128, 256 sequences, is "
    "60.5 GB per GPU, about 17.6 GB of weights + 42.9 GB of KV; 384 sequences need about "
    "82 GB), where shardc's paged reservation (3,140 tokens per sequence) puts the plan at "
    "69.4 GB: the KV reservation rule, not the mapping.",
    "Its vLLM tables lack the MoE shapes of several shardc plans (moe_tp x moe_ep = 2 x 2, "
    "2 x 4 for Mixtral, 2 x 2 for Qwen3-30B-A3B), in SILICON and HYBRID mode alike.",
    "AIConfigurator prices MoE with its power-law routing tables, which at small token "
    "counts are not monotone: for Qwen3-30B-A3B at moe_tp 2 x moe_ep 2 (TRT-LLM "
    "1.3.0rc20) power_law_1.2 reads 0.82 ms at 384 tokens and 0.16 ms at 512 (balanced: "
    "0.15 ms at both). shardc's Qwen3 plan lands in that "
    "row region: its decode pool (tp2 ep2, 448 sequences, so 448 tokens through the MoE per "
    "step; 384 in the run of 2026-11-23) gets 47.7 ms TPOT from "
    "AIConfigurator's disagg estimate where shardc (balanced rows x its uniform-routing "
    "rank load) predicts 28.4 ms.",
    "shardc's `simulate --phase serve --batch N` prices exactly N running sequences (since "
    "`38c6624`; runs before that read N as a cap and reported the best batch below it), so "
    "the shardc-of-AIC cells are AIConfigurator's max batch priced by shardc, marked where "
    "they miss an SLO.",
    "The AIC-of-shardc cells use shardc's degrees through the mapping above, which cannot say "
    "shardc's per-op choices (e.g. the sequence-parallel prefill pool of the Llama-3.1-70B "
    "plan): AIConfigurator prices its own kernels for those degrees.",
]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--refresh-aic", action="store_true",
                    help="re-run AIConfigurator instead of reading its cached answers")
    args = ap.parse_args(argv)
    cache = ac.Cache(CACHE, refresh=args.refresh_aic)
    serve = shardc_has_serve()
    rows = []
    for i, case in enumerate(CASES):
        folder, cfg = ac.model_folder(case.model)
        moe = ac.model_is_moe(cfg)
        aic = {b: aic_default(cache, folder, case, b) for b in BACKENDS}
        sh = shardc_serve_plan(case) if serve[0] else None
        aic_of_shardc, shardc_of_aic = {}, {}
        for b in BACKENDS:
            if sh and "error" not in sh:
                aic_of_shardc[b] = aic_estimate_of_plan(cache, folder, moe, case, sh, b)
            if serve[1] and aic[b].get("agg"):
                shardc_of_aic[b] = shardc_simulate_of_aic(case, aic[b]["agg"], moe)
        rows.append({"case": case.name, "c": case, "aic": aic, "shardc": sh,
                     "aic_of_shardc": aic_of_shardc, "shardc_of_aic": shardc_of_aic})
        print(f"[{i + 1}/{len(CASES)}] {case.name}: AIC " + ", ".join(
            f"{b} {aic[b].get('chosen')}" for b in BACKENDS)
            + f"; shardc {'pending' if sh is None else sh.get('mode', sh.get('error'))}",
            file=sys.stderr, flush=True)
    versions = ac.aic_versions() if cache.misses or ac.aic_exe().exists() else \
        {"aiconfigurator": ac.AIC_VERSION, "aiconfigurator-core": ac.AIC_VERSION}
    revision = ac.shardc_revision()
    ac.write_atomic(OUT_MD, markdown(rows, versions, revision, serve))
    ac.write_json(OUT_JSON, {"shardc_revision": revision, "aiconfigurator": versions,
                             "shardc_has_serve": serve[0],
                             "rows": [{k: v for k, v in r.items() if k != "c"} for r in rows]})
    print(f"wrote {OUT_MD.relative_to(ac.ROOT)} ({cache.hits} AIConfigurator answers from the "
          f"cache, {cache.misses} computed)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
