"""``shardc compile MODEL --mesh GxN``: trace, search, annotate, emit (SPEC section 3)."""

from __future__ import annotations

import sys
from pathlib import Path

from tabulate import tabulate

from shardc.errors import InputError
from shardc.ir.strategy import QUANT_FORMATS, Workload, parse_degree_fields
from shardc.search import POLICIES
from shardc.text import out_dir_name
from shardc.validate import (
    MAX_BATCH,
    MAX_BUDGET,
    MAX_MS,
    MAX_SEED,
    MAX_TOKENS,
    batch_arg,
    float_arg,
    int_arg,
)

HELP = "Search the sharding of MODEL for a GPU mesh and emit plan.json + DTensor code."


HARDWARE_HELP = ("h100|h200|b200 (a preset) or a TOML file; a value that ends in .toml or "
                 "contains a path separator is a file, anything else a preset name")


def add_workload_arguments(p) -> None:
    """Flags shared by compile, simulate and bench-like commands (SPEC section 3 defaults).
    Numbers are checked at parse time (:mod:`shardc.validate`): finite and in range."""
    p.add_argument("--hardware", default="h100", help=HARDWARE_HELP)
    p.add_argument("--phase", default="decode", choices=["decode", "prefill", "serve"],
                   help="decode or prefill (one phase at a batch), or serve (requests of "
                        "--isl/--osl tokens under both SLOs, SPEC section 11)")
    p.add_argument("--context", type=int_arg(1, MAX_TOKENS, "tokens"), default=4096,
                   help=f"KV length per decode step (tokens, at most {MAX_TOKENS:,})")
    p.add_argument("--prompt", type=int_arg(1, MAX_TOKENS, "tokens"), default=2048,
                   help=f"prompt length for prefill (tokens, at most {MAX_TOKENS:,})")
    p.add_argument("--isl", type=int_arg(1, MAX_TOKENS, "tokens"), default=2048,
                   help="serve: input (prompt) tokens per request")
    p.add_argument("--osl", type=int_arg(1, MAX_TOKENS, "tokens"), default=512,
                   help="serve: output tokens per request")
    p.add_argument("--mode", default="auto", choices=["auto", "agg", "disagg"],
                   help="serve: one aggregated pool, prefill + decode pools, or the better")
    p.add_argument("--batch", type=batch_arg, default=None, metavar="N|auto",
                   help=f"sequences per model replica (at most {MAX_BATCH:,}), or auto (default)")
    p.add_argument("--tpot-slo", type=float_arg(0.0, MAX_MS, unit="ms"), default=50.0,
                   help="time per output token SLO (ms; 1000000 = no SLO)")
    p.add_argument("--ttft-slo", type=float_arg(0.0, MAX_MS, unit="ms"), default=2000.0,
                   help="time to first token SLO (ms)")
    add_quantisation_arguments(p)
    p.set_defaults(weights=None)  # None: the checkpoint's format (quantization_config), else bf16
    add_kernel_arguments(p)
    add_routing_arguments(p)


def add_routing_arguments(p) -> None:
    """``--routing`` / ``--redundant-experts`` (the expert load model, shardc.cost.routing)."""
    from shardc.ir.strategy import DEFAULT_ROUTING

    p.add_argument("--routing", default=DEFAULT_ROUTING, metavar="balanced|uniform|powerlaw:A",
                   help="MoE expert routing model: the busiest EP rank's load follows it "
                        f"(default {DEFAULT_ROUTING}; powerlaw:0.37 / 0.9 reproduce the expert "
                        "skew NVIDIA reports for DeepSeek-V3 / Qwen3-235B)")
    p.add_argument("--redundant-experts", type=int_arg(0, 4096, "experts"), default=0,
                   help="EPLB: extra expert slots per EP group holding replicas of the most "
                        "loaded experts (vLLM --enable-eplb, SGLang --ep-num-redundant-experts)")
    p.add_argument("--fp8-scaling", default="per-tensor",
                   choices=["per-tensor", "per-token", "block"],
                   help="with --weights fp8: how activations are scaled to FP8 (priced as its "
                        "own quantisation kernel; block = 1x128 groups with the block-scaled "
                        "GEMM, DeepSeek-V3's format)")


def add_quantisation_arguments(p, default: str | None = "bf16") -> None:
    """``--weights`` / ``--kv-cache`` (:data:`shardc.ir.strategy.QUANT_FORMATS`)."""
    p.add_argument("--weights", default=default, choices=list(QUANT_FORMATS),
                   help="weight format: fp8 = 1 byte per weight, GEMMs at the FP8 peak "
                        "(compile, simulate: default the format of a config.json's FP8 "
                        "quantization_config, else bf16)")
    p.add_argument("--kv-cache", default=default, choices=list(QUANT_FORMATS),
                   help="KV-cache format: fp8 = 1 byte per cached element")


def _kernels_arg(choices):
    """argparse type of ``--kernels``: a choice or an existing ``.npz`` table."""
    import argparse
    from pathlib import Path

    def check(value: str) -> str:
        if value in choices or (value.endswith(".npz") and Path(value).is_file()):
            return value
        raise argparse.ArgumentTypeError(
            f"{value!r}: expected {', '.join(choices)} or an existing calibrated table "
            "(.npz, `shardc calibrate --out FILE.npz`)")

    return check


def add_kernel_arguments(p) -> None:
    """``--kernels`` / ``--engine`` (SPEC section 10): what prices the ops."""
    from shardc.cost.silicon import DEFAULT_ENGINE, DEFAULT_KERNELS, KERNEL_CHOICES
    from shardc.cost.silicon_tables import ENGINES

    p.add_argument("--kernels", default=DEFAULT_KERNELS, type=_kernels_arg(KERNEL_CHOICES),
                   metavar="silicon|roofline|FILE.npz",
                   help="silicon: NVIDIA's measured kernel latencies where they cover the "
                        "hardware (h100, h200, b200 presets), roofline elsewhere; roofline: "
                        "the datasheet roofline everywhere; FILE.npz: this machine's kernels "
                        "measured by `shardc calibrate`")
    p.add_argument("--engine", default=None, choices=list(ENGINES),
                   help="whose measured kernels price the ops (with --kernels silicon; default "
                        f"the --runtime's engine, else {DEFAULT_ENGINE})")
    add_runtime_argument(p)


def add_runtime_argument(p) -> None:
    """``--runtime dtensor|vllm|sglang|trtllm`` (compile, simulate, bench)."""
    from shardc.ir.engines import RUNTIMES

    p.add_argument("--runtime", default="dtensor", choices=list(RUNTIMES),
                   help="dtensor: the whole strategy space (parallelize.py runs it); an "
                        "engine: only what that engine's flags express, priced with its "
                        "kernels (the plan is the engine's configuration)")


def kernel_engine(args) -> str:
    """The engine whose kernels price the ops: ``--engine``, else the ``--runtime``'s
    engine, else vLLM's (InputError when --engine names another engine than --runtime)."""
    from shardc.api import resolve_engine

    return resolve_engine(args.runtime, args.engine)


def workload_from_args(args) -> Workload:
    """The :class:`Workload` of the parsed flags (``args.batch`` None = auto)."""
    return Workload(phase=args.phase, batch=args.batch, context=args.context, prompt=args.prompt,
                    tpot_slo_ms=args.tpot_slo, ttft_slo_ms=args.ttft_slo,
                    weights=args.weights or "bf16", kv_cache=args.kv_cache, isl=args.isl,
                    osl=args.osl, mode=args.mode, routing=args.routing,
                    redundant_experts=args.redundant_experts, fp8_scaling=args.fp8_scaling)


def add_arguments(p) -> None:
    p.add_argument("model", help="model file (.py), .onnx, or HF config.json")
    p.add_argument("--mesh", required=True, help="GxN: N nodes of G GPUs, e.g. 8x128")
    add_workload_arguments(p)
    p.add_argument("--search", default="rl", choices=list(POLICIES))
    p.add_argument("--degrees", default=None,
                   help="fix any subset of degrees, search the rest, e.g. tp=8,pp=2 "
                        "(tp, ep = dp_attn, pp, dp, moe_tp, moe_ep; sp=on|off)")
    p.add_argument("--budget", type=int_arg(1, MAX_BUDGET, "evaluations"), default=4000,
                   help=f"simulator evaluations (at most {MAX_BUDGET:,})")
    p.add_argument("--seed", type=int_arg(0, MAX_SEED), default=0)
    p.add_argument("--out", default=None, help="output directory (default ./shardc_out/<model>)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.add_argument("--standalone", action="store_true",
                   help="parallelize.py on torch's parallel API importing only torch")
    p.add_argument("--hf-id", default=None, metavar="ID",
                   help="model id the launch scripts serve: a hub id (org/name) or a path "
                        "(default: the config's _name_or_path)")
    add_cross_node_tp_argument(p)


def add_cross_node_tp_argument(p) -> None:
    """``--allow-cross-node-tp`` (compile, simulate, bench)."""
    p.add_argument("--allow-cross-node-tp", action="store_true",
                   help="let tp groups span nodes (default: tp stays inside one NVLink domain)")


def _progress_bar(budget: int, quiet: bool):
    if quiet or not sys.stderr.isatty():
        return None, None
    from tqdm import tqdm

    bar = tqdm(total=budget, desc="search", unit="eval", leave=False, file=sys.stderr)

    def update(evals: int, best: float) -> None:
        bar.n = min(int(evals), budget)
        bar.set_postfix_str(f"best {best:.1f} tok/s/GPU")
        bar.refresh()

    return update, bar


def summary_table(plan) -> str:
    """The short table printed after compile (SPEC section 3); a number the phase does not
    predict (TPOT in prefill, TTFT in decode) is shown as "-"."""
    from shardc.text import number_or_dash

    d = plan.degrees
    pred = plan.predicted
    ratios = baseline_ratios(plan)
    if "megatron" in ratios:  # does the ratio survive a +-1% SLO change?
        from shardc.cost.slo_cliff import cliff_note

        note = cliff_note(((plan.baseline or {}).get("megatron") or {}).get("slo_check"))
        ratios["megatron"] += f" ({note})" if note else ""
    deg = " ".join(f"{k}={d[k]}" for k in ("tp", "ep", "pp", "dp", "sp", "moe_tp", "moe_ep")
                   if k in d)
    rows = [
        ["degrees", f"{deg} batch={plan.workload['batch']}"],
        ["predicted tok/s/GPU", number_or_dash(pred.get("tok_s_per_gpu"), ".1f")],
        ["TPOT (ms)", number_or_dash(pred.get("tpot_ms"), ".2f")],
        ["TTFT (ms)", number_or_dash(pred.get("ttft_ms"), ".1f")],
        ["memory/GPU (GB)", number_or_dash(pred.get("memory_gb_per_gpu"), ".1f")],
        ["vs Megatron heuristic", ratios.get("megatron", "-")],
        ["vs best practice", ratios.get("best_practice", "-")],
        ["kernels", str(pred.get("kernel_source") or "-")],
    ]
    rt = pred.get("runtime") or {}
    engine = pred.get("tpot_ms") if plan.workload.get("phase") != "prefill" else None
    runs = (getattr(plan, "backend", None) or {}).get("runs", True)  # no parallelize.py: no line
    if runs and rt.get("step_ms") is not None and engine and abs(rt["step_ms"] / engine - 1) > 0.10:
        rows.insert(3, ["parallelize.py step (ms)",  # the emitted runtime's, > 10% apart
                        f"{number_or_dash(rt['step_ms'], '.2f')} (host overhead "
                        f"{number_or_dash(rt.get('overhead_ms'), '.2f')})"])
    checkpoint = plan.model.get("checkpoint")
    if checkpoint:
        from shardc.ir.checkpoint import checkpoint_line

        rows.append(["weights", checkpoint_line(checkpoint, plan.workload.get("weights"))])
    if "stronger" in ratios:
        rows.append([f"gain vs stronger baseline ({BASELINE_NAMES[ratios['stronger']]})",
                     ratios[ratios["stronger"]]])
    chosen = plan.search.get("chosen_from")
    if chosen in BASELINE_NAMES and plan.search.get("policy") != chosen:
        rows.append(["note", f"{plan.search['policy']} found nothing better than the "
                             f"{BASELINE_NAMES[chosen]} baseline within its budget; its plan "
                             "is kept"])
    return tabulate(rows, tablefmt="simple")


BASELINE_NAMES = {"megatron": "Megatron heuristic", "best_practice": "best practice"}


def baseline_ratios(plan) -> dict[str, str]:
    """The plan's tok/s/GPU over each baseline's in plan.json ``baseline`` ({name: "1.234x"},
    names of :data:`BASELINE_NAMES` with a feasible plan) and ``"stronger"``: the name of the
    stronger baseline (the one the search's gain is claimed against; Megatron on a tie)."""
    value = (plan.predicted or {}).get("tok_s_per_gpu")
    out, best = {}, None
    for name in BASELINE_NAMES:
        base = ((plan.baseline or {}).get(name) or {}).get("tok_s_per_gpu")
        if value is None or not base:
            continue
        out[name] = f"{value / base:.3f}x"
        if best is None or base > best[1]:
            best = (name, base)
    if best is not None:
        out["stronger"] = best[0]
    return out


def run(args) -> int:
    import shardc.api as api
    from shardc.commands.reports import (
        COMPILE_OUTPUTS,
        graph_dot,
        graph_table,
        launch_files,
        launch_summary_lines,
        plan_note,
        print_backend_refusal,
        write_outputs,
    )

    model_path = Path(args.model)
    if args.standalone and model_path.suffix.lower() == ".onnx":
        raise InputError("--standalone: an ONNX model gets no parallelize.py (no torch module)")
    workload = workload_from_args(args)
    fixed = parse_degree_fields(args.degrees) if args.degrees else None  # bad input before tracing
    progress, bar = _progress_bar(args.budget, args.quiet)
    try:
        plan, outcome = api.compile_with_outcome(
            str(model_path), mesh=args.mesh, hardware=args.hardware, workload=workload,
            search=args.search, budget=args.budget, seed=args.seed, progress=progress,
            degrees=fixed, kernels=args.kernels, engine=args.engine,
            allow_cross_node_tp=args.allow_cross_node_tp, runtime=args.runtime,
            hf_id=args.hf_id, weights_from_checkpoint=args.weights is None)
    finally:
        if bar is not None:
            bar.close()
    out = Path(args.out) if args.out else Path("shardc_out") / out_dir_name(plan.model["name"])
    if workload.phase == "serve":
        from shardc.commands.serve_report import write_serve_outputs

        return write_serve_outputs(out, plan, outcome, args)
    from_onnx = str(plan.model.get("source", "")).endswith(".onnx")
    files = {
        "plan.json": plan.to_dict(),
        "graph.txt": graph_table(plan.nodes, plan_note(plan)),
        "graph.dot": graph_dot(plan.model["name"], plan.nodes, plan_note(plan)),
        "trace.json": outcome.cost_model.chrome_trace(outcome.strategy),
        "search.png": lambda p: _plot(p, outcome, plan),
    }
    if not from_onnx and plan.backend_runs:  # DTensor code needs the torch module
        files["parallelize.py"] = plan.code(standalone=args.standalone)
    files.update(launch_files(plan))
    written = write_outputs(out, files, owned=COMPILE_OUTPUTS)
    print(summary_table(plan))
    for line in launch_summary_lines(plan):
        print(line)
    print(f"wrote {', '.join(p.relative_to(out).as_posix() for p in written)} to {out}/")
    print_backend_refusal(out, plan, written)
    if from_onnx:
        from shardc.frontends.onnx_frontend import ONNX_PARALLELIZE_NOTE

        print(ONNX_PARALLELIZE_NOTE)
    return 0


def _plot(path, outcome, plan) -> str:
    """search.png, titled with the model, mesh, workload and searcher of ``plan``."""
    from shardc.search import plot_search_curve
    from shardc.search.plot import search_title

    mesh = f"{plan.mesh['gpus_per_node']}x{plan.mesh['nodes']}"
    title = search_title(plan.model["name"], mesh, plan.mesh["hardware"], plan.workload,
                         plan.search["policy"], plan.search["budget"])
    curves = {outcome.searched.policy: outcome.searched.curve}
    bp = outcome.best_practice
    return plot_search_curve(path, curves, megatron=outcome.megatron.best_value,
                             exact=outcome.exact_value, title=title,
                             best_practice=bp.best_value if bp is not None and bp.found else None)
