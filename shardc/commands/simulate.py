"""``shardc simulate MODEL --mesh GxN --degrees tp=8,ep=8,pp=2``: cost one strategy.

Prints the per-op breakdown (ms per layer per micro-batch), the collectives, the stage
times and the predicted throughput/latency/memory; ``--json FILE`` writes ``model``,
``degrees``, ``workload`` and ``predicted`` (plan.json's keys). ``--batch N`` prices exactly
N sequences per replica (also in ``--phase serve``, where compile reads it as a cap);
``--batch auto`` picks the feasible batch candidate with the highest tok/s/GPU. ``--choices`` = ``megatron`` (default)
or ``rep``, optionally followed by overrides ``SLOT=NAME`` (e.g.
``megatron,moe_block.expert_ffn2=col``; slot names as ``shardc inspect`` lists them).
Exit 3 if the strategy is infeasible (the table is still printed).
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
from tabulate import tabulate

from shardc.backends.atomic import check_single_file_target, write_file_atomic
from shardc.commands.compile import (
    add_cross_node_tp_argument,
    add_workload_arguments,
    workload_from_args,
)
from shardc.errors import InfeasibleError, InputError
from shardc.ir.contract import CHOICE_NAMES
from shardc.ir.space import (
    StrategySpace,
    cross_node_tp_note,
    megatron_op_choices,
    nvlink_tp_domain,
)
from shardc.ir.strategy import Degrees, Mesh, Strategy
from shardc.validate import dumps_strict_json

HELP = "Predict throughput, latency and memory of one sharding strategy (no search)."


def add_arguments(p) -> None:
    p.add_argument("model", help="model file (.py), .onnx, or HF config.json")
    p.add_argument("--mesh", required=True, help="GxN: N nodes of G GPUs, e.g. 8x128")
    p.add_argument("--degrees", required=True, help="e.g. tp=8,ep=8,pp=2 (dp derived); dp_attn=8,moe_tp=8: "
                   "attention data-parallel over 8 ranks, experts tensor-parallel over them")
    add_workload_arguments(p)
    p.add_argument("--choices", default="megatron",
                   help="megatron|rep[,SLOT=NAME...] per-op choices (default megatron)")
    p.add_argument("--json", default=None, help="write model, degrees, predicted to FILE")
    add_cross_node_tp_argument(p)


def parse_choices(text: str, space: StrategySpace, tp_idx: int) -> dict[str, int]:
    parts = [s.strip() for s in str(text).split(",") if s.strip()]
    base = parts[0] if parts and "=" not in parts[0] else "megatron"
    if base == "megatron":
        vals = megatron_op_choices(space, tp_idx)
    elif base == "rep":
        vals = np.full(len(space.op_slots), 2)
    else:
        raise InputError(f"--choices {text!r}: expected megatron or rep, then SLOT=NAME pairs")
    out = {s: int(v) for s, v in zip(space.op_slots, vals)}
    for part in parts[1:] if "=" not in parts[0] else parts:
        slot, _, name = (x.strip() for x in part.partition("="))
        if slot not in out:
            raise InputError(f"--choices: unknown op slot {slot!r} "
                             f"(slots: {', '.join(space.op_slots)})")
        names = CHOICE_NAMES[slot.split(".")[-1]]
        if name not in names:
            raise InputError(f"--choices: {slot}={name!r}; expected one of {', '.join(names)}")
        out[slot] = names.index(name)
    return out


def _degrees(text: str, mesh: Mesh) -> Degrees:
    d = Degrees.parse(text)
    replica = d.tp * d.ep * d.pp
    if mesh.gpus % replica:
        raise InputError(f"--degrees {text}: tp*ep*pp = {replica} does not divide the "
                         f"{mesh.gpus} GPUs of mesh {mesh}")
    dp = mesh.gpus // replica
    if "dp=" in text.replace(" ", "") and d.dp != dp:
        raise InputError(f"--degrees {text}: dp={d.dp} but mesh {mesh} gives dp={dp}")
    return replace(d, dp=dp)


def _fmt(x, nd=3):
    return "-" if x is None else f"{x:.{nd}f}"


def report(ex) -> str:
    p = ex.predicted
    bd = p["breakdown"]
    rows = [[r["layer_kind"], r["op"], r["choice"], r["count"], _fmt(r["compute_ms"], 4),
             _fmt(r["memory_ms"], 4), _fmt(r["comm_ms"], 4), _fmt(r["time_ms"] + r["comm_ms"], 4)]
            for r in ex.ops]
    out = [tabulate(rows, headers=["layer kind", "op", "choice", "layers", "compute ms",
                                   "memory ms", "comm ms (before)", "total ms"],
                    tablefmt="simple"), ""]
    crow = [[k, b, before, kind, dim, f"{S / 1e6:.3f}", _fmt(ms, 4)]
            for k, b, before, kind, dim, S, ms in ex.collectives]
    if crow:
        out += [tabulate(crow, headers=["layer kind", "branch", "at", "collective", "mesh dim",
                                        "MB", "ms"], tablefmt="simple"), ""]
    mem = bd["memory"]
    summary = [
        ["tok/s/GPU", _fmt(p["tok_s_per_gpu"], 2)],
        ["TPOT (ms)", _fmt(p["tpot_ms"])], ["TTFT (ms)", _fmt(p["ttft_ms"], 1)],
        ["stage ms (one micro-batch)", ", ".join(f"{x:.3f}" for x in bd["stage_ms"])],
        ["tick ms / pp send ms", f"{bd['tick_ms']:.3f} / {bd['pp_send_ms']:.4f}"],
        ["micro-batches", f"{bd['micro_batches']:g}"],
        ["bottleneck stage: ops / tp comm / ep comm / norms ms",
         f"{bd['ops_ms']:.3f} / {bd['tp_comm_ms']:.3f} / {bd['ep_comm_ms']:.3f} / "
         f"{bd['norms_ms']:.3f}"],
        ["memory/GPU (GB)", f"{p['memory_gb_per_gpu']:.2f} of {mem['hbm_gb']:g} "
         f"(weights {mem['weights_gb']:.2f}, KV {mem['kv_cache_gb']:.2f}, "
         + (f"recurrent state {mem['recurrent_state_gb']:.2f}, "
            if mem.get("recurrent_state_gb") else "")
         + f"act {mem['activations_gb']:.2f}, workspace {mem['workspace_gb']:.1f})"],
        ["feasible", "yes" if ex.feasible else f"no: {ex.reason}"],
        ["kernels", str(p.get("kernel_source") or "-")],
    ]
    sched = bd.get("scheduler")
    if sched:  # the aggregated pool (shardc.cost.scheduler): what the engine is told
        summary.insert(3, ["scheduler: token budget / prompt chunk / mixed steps",
                           f"{sched['max_batched_tokens']} / {sched['prefill_chunk_tokens']:g} "
                           f"tokens / {100 * sched['mixed_step_fraction']:.1f}%; stage ms = "
                           "the mixed step"])
    out.append(tabulate(summary, tablefmt="simple"))
    return "\n".join(out)


def pick_row(cm, space: StrategySpace, deg, candidates: list, batches: list) -> tuple:
    """(op choices, batch) to price: the only pair, else (``--batch auto`` or several engine
    modes) the feasible pair with the highest tok/s/GPU; when none is feasible, the first
    choices at the smallest batch that splits evenly over the step's work units (decode and
    serve: pp micro-batches x ep attention groups; prefill: ep groups), so the infeasibility
    reported is the one that binds, not the split."""
    rows = [(c, b) for c in candidates for b in batches]
    if len(rows) == 1:
        return rows[0]
    acts = np.array([space.encode(Strategy(deg, b, c)) for c, b in rows])
    ev = cm.evaluate(acts, space)
    if ev.feasible.any():
        return rows[int(np.argmax(np.where(ev.feasible, ev.tok_s_per_gpu, -1.0)))]
    units = deg.ep * (deg.pp if cm.workload.phase == "decode" else 1)
    return candidates[0], next((b for b in batches if b % units == 0), batches[0])


def run(args) -> int:
    from shardc.api import load_model_graph
    from shardc.cost import CostModel, load_hardware
    from shardc.cost.capacity import gpus_short_message
    from shardc.cost.infeasible import rejection_detail

    if args.json:  # before any work: a symlink / device / FIFO is refused, never replaced
        check_single_file_target(Path(args.json), f"--json {args.json}")
    mesh = Mesh.parse(args.mesh)
    workload = workload_from_args(args)
    hw = load_hardware(args.hardware)
    deg = _degrees(args.degrees, mesh)
    graph = load_model_graph(args.model)
    from shardc.ir.checkpoint import checkpoint_line, checkpoint_weights

    workload, checkpoint = checkpoint_weights(graph.config, workload, args.weights is None)
    short = gpus_short_message(graph, workload, hw, mesh.gpus)
    if short:
        raise InfeasibleError(short)
    domain = nvlink_tp_domain(mesh, hw.nvlink_domain, args.allow_cross_node_tp)
    if domain is not None and domain % deg.tp:
        raise InputError(f"--degrees tp={deg.tp}: {cross_node_tp_note(domain)}")
    from shardc.commands.compile import kernel_engine

    kernel_options = {"kernels": args.kernels, "engine": kernel_engine(args)}
    # the experts' split (moe_tp x moe_ep) when it is not (tp, ep)
    split = ({"moe_tp": deg.moe_tp, "moe_ep": deg.moe_ep, "ep": deg.ep}
             if deg.experts_resplit else {})
    if workload.phase == "serve":  # one aggregated pool (SPEC section 3)
        from shardc.serving.pool_models import pool_cost_model, pool_workload
        from shardc.serving.search import check_serve_positions

        if workload.mode == "disagg":
            raise InputError("simulate --phase serve prices one aggregated pool (--mode agg); "
                             "price a disaggregated pool with --phase prefill or decode")
        check_serve_positions(graph, workload)
        cm = pool_cost_model(graph, mesh, hw, workload, "mixed", **kernel_options)
        space = StrategySpace(graph, mesh, pool_workload(workload, "mixed"), tp_domain=domain,
                              fixed=split)
    else:
        cm = CostModel(graph, mesh, hw, workload, **kernel_options)
        space = StrategySpace(graph, mesh, workload, tp_domain=domain, fixed=split)
    if deg.ep > 1 and not int(graph.config.get("num_experts", 0) or 0):
        raise InputError(f"--degrees ep={deg.ep}: the model has no experts, so ep = dp_attn "
                         "must be 1; for data parallelism of a dense model use dp=N")
    for name in ("tp", "ep", "pp"):
        if getattr(deg, name) not in space.values[name]:
            raise InputError(f"--degrees {name}={getattr(deg, name)}: not a candidate for this "
                             f"model and mesh ({space.values[name]})")
    tp_idx = space.values["tp"].index(deg.tp)
    candidates = [parse_choices(args.choices, space, tp_idx)]
    if args.runtime != "dtensor":  # the engine's own per-op choices (each of its modes)
        candidates = runtime_candidates(args, space, deg)
    batch = workload.batch  # one strategy: --batch N is priced at exactly N sequences
    batches = space.values["batch"] if batch is None else [int(batch)]
    choices, batch = pick_row(cm, space, deg, candidates, batches)
    strategy = Strategy(deg, int(batch), choices)
    ex = cm.simulate(strategy)
    print(f"{graph.name} on {mesh} x {hw.name}, {workload.phase}, degrees "
          + " ".join(f"{k}={v}" for k, v in deg.as_dict().items()) + f", batch {batch}")
    if checkpoint:
        print(checkpoint_line(checkpoint, workload.weights))
    print(report(ex))
    if args.json:
        doc = {"model": {"name": graph.name, "params": graph.num_params or None,
                         "layers": graph.num_layers, "source": graph.source,
                         **({"checkpoint": checkpoint} if checkpoint else {})},
               "mesh": {"gpus_per_node": mesh.gpus_per_node, "nodes": mesh.nodes,
                        "hardware": hw.name},
               "workload": {"phase": workload.phase, "batch": int(batch),
                            "context": cm.workload.context, "prompt": cm.workload.prompt,
                            "isl": workload.isl, "osl": workload.osl,
                            "tpot_slo_ms": workload.tpot_slo_ms,
                            "ttft_slo_ms": workload.ttft_slo_ms,
                            "weights": workload.weights, "kv_cache": workload.kv_cache},
               "degrees": deg.as_dict(), "choices": strategy.choice_names(),
               "predicted": ex.predicted}
        write_file_atomic(args.json, dumps_strict_json(doc, indent=2, sort_keys=True) + "\n",
                          f"--json {args.json}")
    if not ex.feasible:
        raise InfeasibleError(f"strategy infeasible: {rejection_detail(cm, strategy)}")
    return 0


def runtime_candidates(args, space: StrategySpace, deg) -> list[dict[str, int]]:
    """The per-op choices ``--runtime``'s engine runs at these degrees (one per mode);
    InputError when it cannot run them or when ``--choices`` asks for others."""
    from shardc.ir.engines import ENGINE_NAMES, runtime_choices

    if args.choices != "megatron":
        raise InputError(f"--choices with --runtime {args.runtime}: the engine's per-op "
                         "choices are its own (drop --choices, or use --runtime dtensor)")
    out, why = runtime_choices(args.runtime, space, deg.tp, deg.ep, deg.sp)
    if not out:
        raise InputError(f"--runtime {args.runtime}: {ENGINE_NAMES[args.runtime]} cannot run "
                         f"tp={deg.tp} ep={deg.ep} sp={deg.sp} here ({why})")
    return out
