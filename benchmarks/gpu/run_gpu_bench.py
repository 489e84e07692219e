"""Measured vs predicted on one GPU: the emitted ``parallelize.py`` (the fast runtime) against
shardc's prediction, with HF eager beside it. Writes ``benchmarks/gpu.md`` (device, torch
version, date) and prints the same table.

    python benchmarks/gpu/run_gpu_bench.py                 # on a GPU machine (~10 min)
    python benchmarks/gpu/run_gpu_bench.py --dry-run --out /tmp/gpu.md   # CPU, tiny configs

Rows, in order:

1. ceilings: device copy bandwidth (GB/s, read + write bytes of a 1 GiB ``copy_``) and the
   bf16 GEMM ceiling (TFLOP/s, 8192^3 ``mm``), both timed with CUDA events;
2. Llama-3.1-8B tp=1 decode at batch 1 / 16 / 64 and context 2048 / 4096, prefill 1 x 2048
   and 4 x 4096; Qwen3-30B-A3B decode batch 64 at 4096. For each: ``shardc compile`` at that
   batch / context (``--degrees tp=1 --search megatron``), then the plan's own
   ``parallelize.py --bench`` (random bf16 weights, meta init, cache filled to the context,
   median of the timed steps), the plan's engine prediction (TPOT / TTFT) and
   ``predicted.runtime.step_ms``; the ratio measured / predicted; for batch-1 decode the
   bandwidth the step reaches (weights + KV bytes per step / step time) as a fraction of the
   measured copy bandwidth;
3. HF eager: the same model's ``forward`` of one decode token with its own cache after a
   prefill of the context (``attn_implementation="sdpa"``), median ms;
4. issue 23's op rows (``benchmarks/gpu/op_bench.py``): Qwen3-30B-A3B's expert GEMMs as
   ``torch._grouped_mm`` under random top-k and balanced routing, and Llama-3.1-8B's FP8
   linears as ``torch._scaled_mm`` (with the activation quantisation timed on its own), each
   beside shardc's per-op prediction (``--ops-only`` runs just these, ``--skip-ops`` skips them).

``--dry-run`` runs the same code on CPU with tiny configs of the same families (shardc's
``tiny_config``), small batches and contexts, a few steps: it checks the harness, not speed.
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import op_bench  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = ROOT / "examples" / "configs"

# (label, config folder, phase, batch, context or prompt)
CASES = [
    ("Llama-3.1-8B decode", "llama3_1_8b", "decode", 1, 2048),
    ("Llama-3.1-8B decode", "llama3_1_8b", "decode", 1, 4096),
    ("Llama-3.1-8B decode", "llama3_1_8b", "decode", 16, 2048),
    ("Llama-3.1-8B decode", "llama3_1_8b", "decode", 16, 4096),
    ("Llama-3.1-8B decode", "llama3_1_8b", "decode", 64, 2048),
    ("Llama-3.1-8B decode", "llama3_1_8b", "decode", 64, 4096),
    ("Llama-3.1-8B prefill", "llama3_1_8b", "prefill", 1, 2048),
    ("Llama-3.1-8B prefill", "llama3_1_8b", "prefill", 4, 4096),
    ("Qwen3-30B-A3B decode", "qwen3_30b_a3b", "decode", 64, 4096),
]
DRY_CASES = [
    ("Llama tiny decode", "llama3_1_8b", "decode", 1, 32),
    ("Llama tiny decode", "llama3_1_8b", "decode", 4, 64),
    ("Llama tiny prefill", "llama3_1_8b", "prefill", 2, 16),
    ("Qwen3-MoE tiny decode", "qwen3_30b_a3b", "decode", 4, 64),
]


def _cuda_ms(fn, iters: int) -> float:
    """Median ms of ``fn()`` over ``iters`` calls, CUDA events (perf_counter on CPU)."""
    out = []
    for _ in range(iters):
        if torch.cuda.is_available():
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            torch.cuda.synchronize()
            out.append(a.elapsed_time(b))
        else:
            t = time.perf_counter()
            fn()
            out.append((time.perf_counter() - t) * 1e3)
    return statistics.median(out)


def ceilings(dry: bool) -> dict:
    """Copy bandwidth (GB/s, bytes read + written) and bf16 GEMM ceiling (TFLOP/s)."""
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    n = (1 << 20) if dry else (1 << 30)  # bytes per buffer
    src = torch.empty(n // 2, dtype=torch.bfloat16, device=dev)
    dst = torch.empty_like(src)
    ms = _cuda_ms(lambda: dst.copy_(src), 5 if dry else 50)
    size = 256 if dry else 8192
    dtype = torch.float32 if dev == "cpu" else torch.bfloat16
    a = torch.randn(size, size, dtype=dtype, device=dev)
    b = torch.randn(size, size, dtype=dtype, device=dev)
    mm = _cuda_ms(lambda: a @ b, 3 if dry else 30)
    return {"copy_gb_s": 2 * n / (ms / 1e3) / 1e9, "gemm_tflops": 2 * size ** 3 / (mm / 1e3) / 1e12}


def config_file(folder: str, dry: bool, tmp: Path) -> Path:
    """The config.json to run: the real one, or (dry run) its tiny config."""
    path = CONFIGS / folder / "config.json"
    if not dry:
        return path
    from transformers import AutoConfig

    from shardc.frontends.tiny_config import tiny_config

    raw = json.loads(path.read_text())
    cfg = tiny_config(AutoConfig.for_model(raw.pop("model_type"), **raw), {"tp": 1})
    out = tmp / f"{folder}_tiny.json"
    cfg.to_json_file(str(out))
    return out


def compile_plan(config: Path, phase: str, batch: int, length: int, out: Path) -> dict:
    """``shardc compile`` at this point (tp=1); returns plan.json."""
    size = ["--context", str(length)] if phase == "decode" else ["--prompt", str(length)]
    cmd = [sys.executable, "-m", "shardc.cli", "compile", str(config), "--mesh", "1x1",
           "--degrees", "tp=1", "--search", "megatron", "--phase", phase, "--batch",
           str(batch), *size, "--out", str(out), "--quiet"]
    subprocess.run(cmd, check=True, cwd=ROOT, capture_output=True, text=True)
    return json.loads((out / "plan.json").read_text())


def run_file_bench(folder: Path, config: Path, phase: str, batch: int, length: int,
                   steps: int) -> dict:
    """The emitted file's ``--bench`` JSON line."""
    size = ["--context", str(length)] if phase == "decode" else \
        ["--prompt", str(length), "--phase", "prefill"]
    cmd = [sys.executable, str(folder / "parallelize.py"), "--bench", "--config", str(config),
           "--batch", str(batch), "--steps", str(steps), *size]
    out = subprocess.run(cmd, check=True, cwd=folder, capture_output=True, text=True)
    return json.loads([ln for ln in out.stdout.splitlines() if ln.startswith("{")][-1])


def hf_eager_ms(config: Path, phase: str, batch: int, length: int, steps: int) -> float | None:
    """HF eager: one decode token with the model's own cache after a prefill of ``length``
    (decode), or the prefill forward itself; random weights. None on out-of-memory."""
    from transformers import AutoConfig, AutoModelForCausalLM

    cuda = torch.cuda.is_available()
    dev, dtype = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float32)
    raw = json.loads(config.read_text())
    cfg = AutoConfig.for_model(raw.pop("model_type"), **raw)
    try:
        with torch.device(dev):
            model = AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa",
                                                     dtype=dtype).eval()
        ids = torch.randint(0, 100, (batch, length), device=dev)
        with torch.no_grad():
            if phase == "prefill":
                return _cuda_ms(lambda: model(input_ids=ids, logits_to_keep=1), steps)
            out = model(input_ids=ids, use_cache=True, logits_to_keep=1)
            cache = getattr(out, "cache", None) or getattr(out, "past_key_values", None)
            kw = "cache" if hasattr(out, "cache") else "past_key_values"
            tok = torch.zeros(batch, 1, dtype=torch.long, device=dev)
            return _cuda_ms(lambda: model(input_ids=tok, **{kw: cache}, logits_to_keep=1),
                            steps)
    except torch.OutOfMemoryError:
        return None
    finally:
        if cuda:
            torch.cuda.empty_cache()


def _weights_kv_bytes(plan: dict, batch: int, context: int) -> float:
    """Bytes a decode step reads: the weights + the KV cache at ``context`` (plan.json)."""
    mem = plan["predicted"]["breakdown"]["memory"]
    kv_per_token = mem["kv_cache_gb"] * 1e9 / max(plan["workload"]["batch"] *
                                                  plan["workload"]["context"], 1)
    return mem["weights_gb"] * 1e9 + kv_per_token * batch * context


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dry-run", action="store_true", help="CPU, tiny configs: the harness only")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "gpu.md"))
    p.add_argument("--steps", type=int, default=None)
    p.add_argument("--skip-hf", action="store_true", help="no HF eager baseline")
    p.add_argument("--ops-only", action="store_true", help="only the op rows (op_bench.py)")
    p.add_argument("--skip-ops", action="store_true", help="no op rows (op_bench.py)")
    p.add_argument("--hardware", default=None,
                   help="preset pricing the op rows (default: from the GPU's name)")
    args = p.parse_args(argv)
    if not args.dry_run and not torch.cuda.is_available():
        raise SystemExit("no GPU: run with --dry-run to check the harness on CPU")
    steps = args.steps or (2 if args.dry_run else 30)
    ceil = ceilings(args.dry_run)
    rows = []
    with tempfile.TemporaryDirectory(prefix="shardc-gpu-bench-") as tmp:
        tmp = Path(tmp)
        for i, (label, folder, phase, batch, length) in enumerate(
                [] if args.ops_only else DRY_CASES if args.dry_run else CASES):
            config = config_file(folder, args.dry_run, tmp)
            out = tmp / f"case{i}"
            plan = compile_plan(config, phase, batch, length, out)
            rec = run_file_bench(out, config, phase, batch, length, steps)
            pred = plan["predicted"]
            engine = pred.get("tpot_ms") if phase == "decode" else pred.get("ttft_ms")
            runtime = (pred.get("runtime") or {}).get("step_ms")
            hf = None if args.skip_hf else hf_eager_ms(config, phase, batch, length, steps)
            row = {"case": f"{label} {batch}x{length}", "measured_ms": rec["step_ms"],
                   "engine_ms": engine, "runtime_ms": runtime,
                   "ratio": rec["step_ms"] / engine if engine else None,
                   "hf_eager_ms": hf, "cuda_graph": rec.get("cuda_graph")}
            if phase == "decode" and batch == 1:
                gbs = _weights_kv_bytes(plan, batch, length) / (rec["step_ms"] / 1e3) / 1e9
                row["bw_fraction"] = gbs / ceil["copy_gb_s"]
            rows.append(row)
            print(json.dumps(row), flush=True)
        ops = None if args.skip_ops else run_op_rows(args, steps, tmp)
    text = render(rows, ceil, args.dry_run) + (op_bench.render_ops(*ops) if ops else "")
    Path(args.out).write_text(text)
    print(text)


def run_op_rows(args, steps: int, tmp: Path) -> tuple[list, list, str]:
    """Issue 23's op rows (op_bench.py): MoE experts and FP8 linears, with the preset."""
    hardware = args.hardware or op_bench.hardware_for_device(
        "h200" if args.dry_run else "h100")
    moe = op_bench.moe_rows(config_file("qwen3_30b_a3b", args.dry_run, tmp), _cuda_ms,
                            hardware, steps, args.dry_run)
    for r in moe:
        print(json.dumps(r), flush=True)
    fp8 = op_bench.fp8_rows(config_file("llama3_1_8b", args.dry_run, tmp), _cuda_ms,
                            hardware, steps, args.dry_run)
    for r in fp8:
        print(json.dumps(r), flush=True)
    return moe, fp8, hardware


def _fmt(x, spec=".2f") -> str:
    return "-" if x is None else format(x, spec)


def render(rows: list[dict], ceil: dict, dry: bool) -> str:
    dev = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    head = [f"# GPU benchmark: the emitted runtime, measured vs predicted{' (DRY RUN, CPU)' if dry else ''}",
            "", f"Device: {dev}; torch {torch.__version__}; "
            f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M UTC}; "
            "`python benchmarks/gpu/run_gpu_bench.py`.", "",
            f"Ceilings: copy {ceil['copy_gb_s']:.3g} GB/s, GEMM {ceil['gemm_tflops']:.3g} TFLOP/s.",
            "", "| case | measured ms | engine predicted ms | runtime predicted ms | "
            "measured / engine | batch-1 bandwidth / copy | CUDA graph | HF eager ms |",
            "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        head.append(f"| {r['case']} | {_fmt(r['measured_ms'])} | {_fmt(r['engine_ms'])} | "
                    f"{_fmt(r['runtime_ms'])} | {_fmt(r['ratio'])} | "
                    f"{_fmt(r.get('bw_fraction'), '.0%')} | {r['cuda_graph']} | "
                    f"{_fmt(r['hf_eager_ms'])} |")
    return "\n".join(head) + "\n"


if __name__ == "__main__":
    main()
