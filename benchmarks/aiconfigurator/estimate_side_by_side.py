"""shardc `simulate` vs NVIDIA AIConfigurator `cli estimate`, side by side on the same configs.

    .venv/bin/python benchmarks/aiconfigurator/estimate_side_by_side.py [--refresh-aic]

Every case is one static batch on H100 SXM in BF16 (weights, activations, KV cache): decode
cases compare the time per output token at a KV length, prefill cases the time to first token
of a batch of prompts. AIConfigurator runs in its own virtualenv (setup_venv.sh, created on
first use); its answers are cached in benchmarks/aiconfigurator/estimate_cache.json, so a re-run
only recomputes shardc's side (``--refresh-aic`` recomputes both). Writes
benchmarks/aiconfigurator_estimate.md and benchmarks/aiconfigurator_estimate.json.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import aic_common as ac  # noqa: E402

CACHE = ac.HERE / "estimate_cache.json"
OUT_MD = ac.ROOT / "benchmarks" / "aiconfigurator_estimate.md"
OUT_JSON = ac.ROOT / "benchmarks" / "aiconfigurator_estimate.json"
BACKENDS = ("trtllm", "vllm")
NO_SLO = ["--tpot-slo", "1000000", "--ttft-slo", "1000000"]
COMMAND = ".venv/bin/python benchmarks/aiconfigurator/estimate_side_by_side.py"

MODELS = {  # name -> shardc MODEL argument (repo-relative); AIConfigurator reads the same config
    "Llama-3-70B": "examples/llama3_70b.py",
    "Mixtral-8x7B": "examples/mixtral_8x7b.py",
    "Qwen3-30B-A3B": "examples/configs/qwen3_30b_a3b/config.json",
    "Qwen3-235B-A22B": "examples/configs/qwen3_235b_a22b/config.json",
    "DeepSeek-V3": "examples/deepseek_v3.py",
}


@dataclass(frozen=True)
class Case:
    """One static batch: ``batch`` sequences per model replica (tp * ep GPUs); ``length`` is
    the KV length of a decode step or the prompt length of a prefill."""

    model: str
    phase: str
    tp: int
    ep: int
    batch: int
    length: int

    @property
    def gpus(self) -> int:
        return self.tp * self.ep

    @property
    def mesh(self) -> str:
        per_node = min(self.gpus, 8)
        return f"{per_node}x{self.gpus // per_node}"

    @property
    def degrees(self) -> str:
        return f"tp={self.tp}" + (f",ep={self.ep}" if self.ep > 1 else "")

    @property
    def name(self) -> str:
        what = "ctx" if self.phase == "decode" else "prompt"
        return (f"{self.model} {self.phase} {self.degrees.replace(',', ' ')} b{self.batch} "
                f"{what} {self.length}")


def _cases() -> list[Case]:
    d, p = "decode", "prefill"
    rows = [
        ("Llama-3-70B", d, 8, 1, 1, 128), ("Llama-3-70B", d, 8, 1, 1, 2048),
        ("Llama-3-70B", d, 8, 1, 64, 2048), ("Llama-3-70B", d, 8, 1, 256, 1024),
        ("Llama-3-70B", d, 8, 1, 512, 512), ("Llama-3-70B", d, 4, 1, 16, 4096),
        ("Llama-3-70B", d, 4, 1, 1, 8192), ("Llama-3-70B", d, 4, 1, 128, 2048),
        ("Llama-3-70B", p, 8, 1, 1, 128), ("Llama-3-70B", p, 8, 1, 1, 2048),
        ("Llama-3-70B", p, 8, 1, 4, 8192), ("Llama-3-70B", p, 4, 1, 8, 1024),
        ("Mixtral-8x7B", d, 8, 1, 64, 2048), ("Mixtral-8x7B", d, 1, 8, 64, 2048),
        ("Mixtral-8x7B", d, 2, 1, 1, 128), ("Mixtral-8x7B", d, 4, 1, 256, 1024),
        ("Mixtral-8x7B", d, 2, 4, 128, 4096), ("Mixtral-8x7B", d, 8, 1, 512, 512),
        ("Mixtral-8x7B", d, 1, 4, 32, 8192),
        ("Mixtral-8x7B", p, 8, 1, 1, 2048), ("Mixtral-8x7B", p, 1, 8, 8, 1024),
        ("Mixtral-8x7B", p, 4, 1, 2, 4096), ("Mixtral-8x7B", p, 2, 1, 16, 128),
        ("Qwen3-30B-A3B", d, 1, 1, 32, 1024), ("Qwen3-30B-A3B", d, 2, 1, 128, 2048),
        ("Qwen3-30B-A3B", d, 1, 4, 64, 4096), ("Qwen3-30B-A3B", d, 1, 8, 512, 1024),
        ("Qwen3-30B-A3B", p, 1, 1, 1, 4096), ("Qwen3-30B-A3B", p, 4, 1, 4, 2048),
        ("Qwen3-30B-A3B", p, 1, 8, 8, 8192),
        ("Qwen3-235B-A22B", d, 8, 1, 64, 2048), ("Qwen3-235B-A22B", p, 8, 1, 1, 4096),
        ("Qwen3-235B-A22B", d, 4, 2, 64, 2048), ("Qwen3-235B-A22B", p, 4, 2, 2, 4096),
        ("DeepSeek-V3", d, 8, 4, 64, 2048), ("DeepSeek-V3", d, 8, 4, 256, 4096),
        ("DeepSeek-V3", p, 8, 4, 4, 2048), ("DeepSeek-V3", p, 8, 4, 8, 8192),
    ]
    return [Case(*r) for r in rows]


CASES = _cases()


def aic_args(case: Case, backend: str, moe: bool) -> list[str]:
    """AIConfigurator `estimate` flags for ``case``: static_gen at ISL = the KV length and
    OSL 2 (one generation step) for decode, static_ctx for prefill; ``--batch-size`` is per
    attention-DP rank, so shardc's per-replica batch is divided by ep."""
    mode, osl = ("static_gen", "2") if case.phase == "decode" else ("static_ctx", "1")
    return ["--system", "h100_sxm", "--backend", backend, "--estimate-mode", mode,
            "--isl", str(case.length), "--osl", osl, "--batch-size", str(case.batch // case.ep),
            *ac.moe_parallel_args(case.tp, case.ep, moe), *ac.BF16_QUANT]


def shardc_args(case: Case, json_path: Path, extra: list[str]) -> list[str]:
    length = ["--context" if case.phase == "decode" else "--prompt", str(case.length)]
    return [MODELS[case.model], "--mesh", case.mesh, "--degrees", case.degrees,
            "--phase", case.phase, *length, "--batch", str(case.batch), *NO_SLO, *extra,
            "--json", str(json_path)]


def shardc_variants() -> tuple[list[tuple[str, list[str]]], list[tuple[str, str]], str]:
    """(variants [(label, extra flags)], comparisons [(variant label, AIC backend)], note):
    the roofline, and when this shardc has ``--kernels``, its measured-kernel mode per
    engine AIConfigurator also prices."""
    help_text = ac.shardc_help("simulate")
    common: list[str] = []
    for flag in ("--weights", "--kv-cache"):
        if ac.flag_choices(help_text, flag) is not None:
            common += [flag, "bf16"]
    kernels = ac.flag_choices(help_text, "--kernels")
    if kernels is None:
        variants = [("roofline", common)]
        note = "this shardc has no `--kernels` flag: its only cost source is the roofline"
        return variants, [("roofline", b) for b in BACKENDS], note
    engines = ac.flag_choices(help_text, "--engine") or []
    variants = [("roofline", common + ["--kernels", "roofline"])]
    pairs = [("roofline", b) for b in BACKENDS]
    for b in BACKENDS:
        if "silicon" in kernels and b in engines:
            variants.append((f"silicon/{b}", common + ["--kernels", "silicon", "--engine", b]))
            pairs.append((f"silicon/{b}", b))
    return variants, pairs, "shardc `--kernels roofline` and `--kernels silicon --engine E`"


def run_shardc_case(case: Case, extra: list[str]) -> dict:
    import json
    import tempfile

    with tempfile.TemporaryDirectory(prefix="shardc_aic_") as tmp:
        out = Path(tmp) / "sim.json"
        rc, so, se = ac.run_shardc("simulate", shardc_args(case, out, extra))
        if rc != 0 or not out.exists():
            return {"error": ac.shardc_error_line(so, se, rc)}
        pred = json.loads(out.read_text()).get("predicted", {})
    bd = pred.get("breakdown") or {}
    return {"ttft_ms": pred.get("ttft_ms"), "tpot_ms": pred.get("tpot_ms"),
            "memory_gb": pred.get("memory_gb_per_gpu"), "feasible": bd.get("feasible"),
            "reason": bd.get("reason"), "kernel_source": pred.get("kernel_source")}


def metric(case: Case) -> str:
    return "tpot_ms" if case.phase == "decode" else "ttft_ms"


def ratio_stats(ratios: list[tuple[float, str]]) -> dict:
    """Median ratio, geometric-mean deviation exp(mean |ln r|) - 1, worst (largest |ln r|)
    and how many are within +-30% (0.7 <= r <= 1.3)."""
    if not ratios:
        return {"n": 0}
    vals = [r for r, _ in ratios]
    worst = max(ratios, key=lambda rc: abs(math.log(rc[0])))
    return {"n": len(vals), "median": statistics.median(vals),
            "geo_dev": math.exp(statistics.fmean(abs(math.log(r)) for r in vals)) - 1,
            "worst": worst[0], "worst_case": worst[1],
            "within_30": sum(0.7 <= r <= 1.3 for r in vals)}


def build_rows(cache: ac.Cache) -> tuple[list[dict], list, list, str]:
    variants, pairs, note = shardc_variants()
    folders = {m: ac.model_folder(path) for m, path in MODELS.items()}
    rows = []
    for i, case in enumerate(CASES):
        folder, cfg = folders[case.model]
        moe = ac.model_is_moe(cfg)
        aic = {b: ac.aic_estimate(cache, folder, aic_args(case, b, moe)) for b in BACKENDS}
        sh = {label: run_shardc_case(case, extra) for label, extra in variants}
        key = metric(case)
        ratios = {}
        for label, b in pairs:
            a, s = aic[b].get(key), sh[label].get(key)
            ratios[f"{label}|{b}"] = (s / a) if (a and s) else None
        rows.append({"case": case.name, "model": case.model, "phase": case.phase, "moe": moe,
                     "mesh": case.mesh, "degrees": case.degrees, "batch": case.batch,
                     "length": case.length, "metric": key, "aic": aic, "shardc": sh,
                     "ratios": ratios})
        print(f"[{i + 1}/{len(CASES)}] {case.name}: " + ", ".join(
            f"{k}={ac.fmt(v, 3)}" for k, v in ratios.items()), file=sys.stderr, flush=True)
    return rows, variants, pairs, note


def summaries(rows: list[dict], pairs) -> list[dict]:
    out = []
    for label, b in pairs:
        for group in ("all", "decode", "prefill", "dense", "MoE"):
            rs = [(r["ratios"][f"{label}|{b}"], r["case"]) for r in rows
                  if r["ratios"].get(f"{label}|{b}")
                  and group in ("all", r["phase"], "MoE" if r["moe"] else "dense")]
            out.append({"shardc": label, "aic_backend": b, "cases": group, **ratio_stats(rs)})
    return out


def _aic_cell(res: dict, key: str) -> str:
    val = res.get(key)
    if val is None:
        return "n/a"
    mark = "" if res.get("database_mode") == "SILICON" else " (H)"
    return ac.fmt(val) + mark + (" (OOM)" if res.get("oom") else "")


def _shardc_cell(res: dict, key: str) -> str:
    if res.get(key) is None:
        return "error" if "error" in res else "-"
    return ac.fmt(res[key]) + ("" if res.get("feasible") in (True, None) else " (infeasible)")


def markdown(rows, variants, pairs, note, versions, revision, wall_s) -> str:
    backends_seen = sorted({r["aic"][b]["backend"] for r in rows for b in BACKENDS
                            if r["aic"][b].get("backend")})
    n_hybrid = sum(r["aic"][b].get("database_mode") == "HYBRID" for r in rows for b in BACKENDS)
    n_fail = sum(r["aic"][b].get("database_mode") is None for r in rows for b in BACKENDS)
    aic_dates = sorted({r["aic"][b].get("run_at", "")[:10] for r in rows for b in BACKENDS})
    lines = [
        "# shardc vs AIConfigurator `estimate`: the same static batch priced by both",
        "",
        f"Reproduce (one command; creates AIConfigurator's venv on first use): `{COMMAND}`",
        "(add `--refresh-aic` to re-run AIConfigurator too; its answers are cached in",
        "`benchmarks/aiconfigurator/estimate_cache.json`, so a plain re-run only recomputes",
        "shardc). Raw rows: `benchmarks/aiconfigurator_estimate.json`.",
        "",
        f"- AIConfigurator {versions.get('aiconfigurator')} + aiconfigurator-core "
        f"{versions.get('aiconfigurator-core')} (PyPI; venv from "
        "`benchmarks/aiconfigurator/setup_venv.sh`), system `h100_sxm`, backends "
        + ", ".join(f"`{b}`" for b in backends_seen)
        + f", database `SILICON` (measured kernel tables); run {', '.join(aic_dates)}.",
        f"- shardc at `{revision}`, `shardc simulate MODEL --mesh GxN --degrees ... --batch B "
        "--tpot-slo 1000000 --ttft-slo 1000000 --json FILE`, hardware preset `h100`, Megatron "
        f"per-op choices; {note}. Run {time.strftime('%Y-%m-%d', time.gmtime())}, "
        f"{wall_s:.0f} s wall for the whole table. Cost source per variant (plan.json "
        "`predicted.kernel_source`): " + "; ".join(
            f"{lab}: " + (", ".join(f"`{k}`" for k in sorted(
                {str(r["shardc"][lab]["kernel_source"]) for r in rows
                 if r["shardc"][lab].get("kernel_source")})) or "not reported")
            for lab, _ in variants) + ".",
        "- Both tools get the same model dimensions: HF config.json files are passed to both; "
        "for the example .py models the script writes their `config()` to a config.json for "
        "AIConfigurator. All weights, activations and KV cache BF16 (AIConfigurator: "
        "`--gemm-quant-mode/--kvcache-quant-mode/--fmha-quant-mode/--moe-quant-mode bfloat16`).",
        "",
        "## What the numbers are",
        "- **decode** rows: time per output token (ms) of one decode step of `B` sequences at "
        "KV length `ctx` (AIConfigurator: `--estimate-mode static_gen --isl ctx --osl 2`, the "
        "single generation step; shardc: `--phase decode --context ctx`).",
        "- **prefill** rows: time to first token (ms) of `B` prompts of `prompt` tokens "
        "processed together (AIConfigurator: `--estimate-mode static_ctx --isl prompt "
        "--osl 1`; shardc: `--phase prefill --prompt prompt`).",
        "- Degrees: shardc `tp=T,ep=E` on T x E GPUs = AIConfigurator `--tp T "
        "--attention-dp-size E --moe-tp-size T --moe-ep-size E` (attention TP T, data-parallel "
        "over E; experts TP T x EP E, Megatron's rule); `B` is per model replica in shardc and "
        "`--batch-size B/E` per attention-DP rank in AIConfigurator.",
        "- ratio = shardc / AIConfigurator (1.00 = same; > 1: shardc predicts slower). "
        "`(H)`: AIConfigurator's SILICON tables do not cover the case and it was priced in "
        "its HYBRID mode (measured tables + speed-of-light x empirical factors); `n/a`: "
        "AIConfigurator refused the case in both modes (reason in the JSON); `(OOM)`: "
        "AIConfigurator says it does not fit. Geo. dev = exp(mean |ln ratio|) - 1; worst = the "
        "ratio farthest from 1 in log terms.",
        "- Scope: DeepSeek-V3 in BF16 (1.34 TB) does not fit 8 H100s, so its cases run on "
        "8x4 (TP8 inside a node x EP4 across nodes); every other case is TP/EP 1-8 on one node. "
        "No pipeline parallelism (the two tools define a pipelined static step differently). "
        f"AIConfigurator HYBRID fallbacks: {n_hybrid}; refused: {n_fail} (of "
        f"{len(rows) * len(BACKENDS)} runs).",
        "",
        "## Known modelling differences (facts about the tools, not fitted to the table)",
        "- AIConfigurator prices MoE layers from tables measured with a power-law "
        "token-to-expert distribution (alpha 1.2 for Mixtral/Qwen3-style MoE, 1.01 for "
        "DeepSeek; `aiconfigurator_core/sdk/models/moe.py`, `deepseek.py`), so the busiest "
        "expert sets the time; shardc `--kernels silicon` reads the `balanced` rows of the same "
        "tables and multiplies the tokens by the busiest EP rank's expected load under its "
        "routing model (`--routing`, default `uniform`: `shardc/cost/routing.py`; about 1.03 "
        "for Mixtral's 8 experts on 8 ranks at 8192 tokens, 1 at ep = 1; before issue 23 a "
        "fixed 1.3 when ep > 1). The two differ most where the grouped GEMM is compute-bound "
        "and each rank owns few experts: for Mixtral (8 experts, top-2, moe_ep 8) at 8192 "
        "tokens the TRT-LLM table reads 0.92 ms balanced and 3.64 ms power_law_1.2 per layer, "
        "which is the gap of the worst row (Mixtral prefill tp=1 ep=8 b8 prompt 1024). "
        "shardc's `--routing powerlaw:ALPHA` prices a skewed load instead; the default "
        "follows the deployments that rebalance hot experts (docs/validation.md, \"Expert "
        "routing\").",
        "- AIConfigurator's two backends are two sets of measured kernels (TRT-LLM and vLLM "
        "differ by up to tens of percent on the same shape); a shardc cost source is one "
        "engine's tables, so the spread between the two AIC columns is the scale of "
        "engine-to-engine difference a single prediction cannot match both ways.",
        "- shardc's default prices the expert dispatch the emitted code runs: every tp rank "
        "sends its whole (tp-replicated) tokens' routed rows (docs/validation.md; "
        "`CostModel(moe_layouts=\"best\")` charges 1/tp of them). With ep across nodes "
        "this dominates DeepSeek-V3 prefill at tp=8 ep=4 (1.6 s of shardc's 2.4 s TTFT at "
        "b8 x 8192, `--kernels silicon --engine trtllm`, is the expert exchange), where "
        "shardc predicts slower.",
        "- Expert-parallel prefill of the fine-grained MoE (Qwen3-30B-A3B tp=1 ep=8 b8 x 8192, "
        "0.70 against TRT-LLM) is the same routing difference as Mixtral's: shardc's uniform "
        "routing puts the busiest of 8 ranks 0.5% above the mean at 65,536 tokens x top-8, "
        "AIConfigurator's power-law tables let the busiest expert set the time.",
        "- A case shardc marks `error` with `strategy infeasible` does not fit its memory "
        "model (Qwen3-235B-A22B at tp=8: 70.6 GB of BF16 weights per GPU against the 70 GB "
        "shardc leaves for weights on an 80 GB H100; AIConfigurator prices it).",
        "",
        "## Summary",
        "",
        "| shardc | vs AIConfigurator | cases | n | median ratio | geo. dev | worst | "
        "within +-30% |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for s in summaries(rows, pairs):
        if not s["n"]:
            continue
        lines.append(f"| {s['shardc']} | {s['aic_backend']} | {s['cases']} | {s['n']} | "
                     f"{s['median']:.2f} | {100 * s['geo_dev']:.0f}% | {s['worst']:.2f} "
                     f"({s['worst_case']}) | {s['within_30']}/{s['n']} |")
    head = ["case", "mesh", "metric"] + [f"AIC {b}" for b in BACKENDS] + \
        [f"shardc {lab}" for lab, _ in variants] + [f"{lab} / AIC {b}" for lab, b in pairs]
    lines += ["", "## Cases (ms)", "", "| " + " | ".join(head) + " |",
              "|" + "---|" * len(head)]
    for r in rows:
        k = r["metric"]
        cells = [r["case"], r["mesh"], "TPOT" if k == "tpot_ms" else "TTFT"]
        cells += [_aic_cell(r["aic"][b], k) for b in BACKENDS]
        cells += [_shardc_cell(r["shardc"][lab], k) for lab, _ in variants]
        cells += [ac.fmt(r["ratios"][f"{lab}|{b}"]) for lab, b in pairs]
        lines.append("| " + " | ".join(cells) + " |")
    errs = [(r["case"], lab, r["shardc"][lab]["error"]) for r in rows for lab, _ in variants
            if "error" in r["shardc"][lab]]
    refused = [(r["case"], b, f"SILICON: {r['aic'][b].get('error_silicon', '?')[:200]}; "
                f"HYBRID: {r['aic'][b].get('error_hybrid', '?')[:200]}")
               for r in rows for b in BACKENDS if r["aic"][b].get("database_mode") is None]
    if errs or refused:
        lines += ["", "## Failures", ""]
        lines += [f"- shardc {lab}, {c}: `{e}`" for c, lab, e in errs]
        lines += [f"- AIConfigurator {b}, {c}: `{e}`" for c, b, e in refused]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--refresh-aic", action="store_true",
                    help="re-run AIConfigurator instead of reading its cached answers")
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    cache = ac.Cache(CACHE, refresh=args.refresh_aic)
    rows, variants, pairs, note = build_rows(cache)
    versions = ac.aic_versions() if cache.misses or ac.aic_exe().exists() else \
        {"aiconfigurator": ac.AIC_VERSION, "aiconfigurator-core": ac.AIC_VERSION}
    wall = time.perf_counter() - t0
    revision = ac.shardc_revision()
    ac.write_json(OUT_JSON, {"shardc_revision": revision, "aiconfigurator": versions,
                             "summary": summaries(rows, pairs), "rows": rows})
    ac.write_atomic(OUT_MD, markdown(rows, variants, pairs, note, versions, revision, wall))
    print(f"wrote {OUT_MD.relative_to(ac.ROOT)} ({cache.hits} AIConfigurator answers from the "
          f"cache, {cache.misses} computed)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
