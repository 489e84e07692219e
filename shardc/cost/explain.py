"""Explain one strategy: per-op rows, collectives, stages, memory, and a Chrome trace.

:func:`simulate` runs the same vectorised code as :meth:`CostModel.evaluate` on a batch of
one, with detail recording on, so its totals are the evaluated numbers exactly.
Per-op and per-collective times are for ONE micro-batch through ONE layer (ms); ``count``
is the number of layers of that kind in the model.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from shardc.cost.collectives import COLLECTIVE_KINDS
from shardc.cost.layer_costs import INNER_REDUCE, QK_NORMS
from shardc.ir.contract import MODES, choice_name
from shardc.ir.recurrent import is_recurrent
from shardc.ir.strategy import Strategy, stage_layer_ranges

MAX_TRACE_MICROBATCHES = 16


@dataclass
class Breakdown:
    """One strategy simulated: what :meth:`CostModel.simulate` returns."""

    strategy: Strategy
    ops: list[dict] = field(default_factory=list)
    # (layer_kind, branch, before_op, kind, mesh_dim, bytes_full, ms); ep all-to-all bytes
    # are per rank (tokens x top_k x hidden x bytes)
    collectives: list[tuple] = field(default_factory=list)
    stage_ms: list[float] = field(default_factory=list)
    # bytes of one inter-stage send (one micro-batch's activations, per stage boundary)
    pp_send_bytes: float = 0.0
    totals: dict = field(default_factory=dict)
    memory: dict = field(default_factory=dict)
    predicted: dict = field(default_factory=dict)
    feasible: bool = True
    reason: str = "feasible"


def _f(x) -> float:
    return float(np.asarray(x).reshape(-1)[0])


def _finite_or_none(x: float):
    """``x``, or None where it is undefined (NaN) or unbounded (inf): plan.json is strict JSON."""
    return x if math.isfinite(x) else None


def _simulate_one(cm, strategy: Strategy):
    space = cm.space_for(strategy)
    action = space.encode(strategy)
    if cm.token_budgets is not None:  # the aggregated pool: the chosen budget's mixed step
        return cm._scheduled(action[None, :], space, detail=True)
    return cm._simulate(action[None, :], space, detail=True)


def _layer_segments(kind_name, brs, nt) -> list[tuple[str, str, float]]:
    """[(name, 'compute'|'comm', seconds)] of one layer of a kind, in execution order."""
    segs = [(f"{kind_name}.norms", "compute", _f(nt))]
    for bname, _fops, _table, _combo, bc in brs:
        colls = {c[0]: c for c in bc.collectives}
        _tp_repair(segs, colls, "before dispatch")
        if "dispatch" in colls and _f(colls["dispatch"][4]) > 0:
            segs.append(("ep dispatch all_to_all", "comm", _f(colls["dispatch"][4])))
        for op, _mode, oc, c_s in bc.ops:
            code = int(colls[op][1][0]) if op in colls else 0
            if _f(c_s) > 0:
                segs.append((f"{COLLECTIVE_KINDS[code]} before {op}", "comm", _f(c_s)))
            if op == "attn_core" and QK_NORMS in colls and _f(colls[QK_NORMS][4]) > 0:
                segs.append(("all_reduce q/k norms", "comm", _f(colls[QK_NORMS][4])))
            if op == "attn_core" and INNER_REDUCE in colls and _f(colls[INNER_REDUCE][4]) > 0:
                segs.append(("all_reduce x_proj", "comm", _f(colls[INNER_REDUCE][4])))
            segs.append((f"{kind_name}.{op}", "compute", _f(oc.time_s)))
        end = colls.get("<end>")
        if end is not None and _f(end[4]) > 0:
            segs.append((f"{COLLECTIVE_KINDS[int(end[1][0])]} end of {bname}", "comm",
                         _f(end[4])))
        if "combine" in colls and _f(colls["combine"][4]) > 0:
            segs.append(("ep combine all_to_all", "comm", _f(colls["combine"][4])))
        _tp_repair(segs, colls, "after combine")
    return segs


def _tp_repair(segs: list, colls: dict, key: str) -> None:
    """Append the MoE exchange's tp repair ``key`` ("before dispatch" / "after combine")."""
    if key in colls and _f(colls[key][4]) > 0:
        segs.append((f"{COLLECTIVE_KINDS[int(colls[key][1][0])]} {key}", "comm",
                     _f(colls[key][4])))


def simulate(cm, strategy: Strategy) -> Breakdown:
    r = _simulate_one(cm, strategy)
    ev = r["ev"]
    deg = strategy.degrees
    ex = Breakdown(strategy, feasible=bool(ev.feasible[0]), reason=ev.reason_text(0))
    pp = deg.pp
    counts = cm.stage_counts(pp)
    stage_t = r["stage_t"][0, :pp]
    stage_m = r["stage_m"][0, :pp]
    bott_t, bott_m = int(np.argmax(stage_t)), int(np.argmax(stage_m))
    # overlap_hidden_ms: communication run under compute (the presets' *_comm_overlap)
    comp = {"ops_ms": 0.0, "tp_comm_ms": 0.0, "ep_comm_ms": 0.0, "norms_ms": 0.0,
            "overlap_hidden_ms": 0.0}
    weights = kv = state = 0.0

    def add_branch(kind_name, bname, bc, n_t, n_m):
        nonlocal weights, kv, state
        for op, mode, oc, c_s in bc.ops:
            slot = op if kind_name is None else f"{kind_name}.{op}"
            if kind_name is not None and op == "attn_core" and is_recurrent(
                    cm.graph.layer_kind(kind_name).op(op).attrs):
                state += n_m * _f(oc.kv_bytes)  # a recurrent state, not a KV cache
                kv -= n_m * _f(oc.kv_bytes)
            ex.ops.append(dict(
                layer_kind=kind_name or "global", branch=bname, op=op,
                choice=choice_name(op, strategy.choices[slot]), mode=MODES[int(mode[0])],
                compute_ms=_f(oc.compute_s) * 1e3, memory_ms=_f(oc.memory_s) * 1e3,
                time_ms=_f(oc.time_s) * 1e3, comm_ms=_f(c_s) * 1e3, kernel_source=oc.source,
                act_quant_ms=_f(oc.quant_s) * 1e3,
                weight_bytes=_f(oc.weight_bytes), kv_bytes=_f(oc.kv_bytes)))
            comp["ops_ms"] += n_t * _f(oc.time_s) * 1e3
            weights += n_m * _f(oc.weight_bytes)
            kv += n_m * _f(oc.kv_bytes)
        serial = sum(_f(oc.time_s) for _, _, oc, _ in bc.ops)
        for before, code, dim, S, t in bc.collectives:
            ms = _f(t) * 1e3
            serial += _f(t)
            comp[f"{dim}_comm_ms"] += n_t * ms
            if int(code[0]) and ms > 0:
                ex.collectives.append((kind_name or "global", bname, before,
                                       COLLECTIVE_KINDS[int(code[0])], dim, _f(S), ms))
        hidden = serial - _f(bc.time_s)  # 0 up to rounding when nothing overlaps
        comp["overlap_hidden_ms"] += n_t * (hidden if hidden > 1e-9 * serial else 0.0) * 1e3

    for ki, (k, brs, nt) in enumerate(r["kinds"]):
        comp["norms_ms"] += counts[bott_t, ki] * _f(nt) * 1e3
        weights += counts[bott_m, ki] * k.other_params * cm.weight_bytes
        for bname, _fops, _table, _combo, bc in brs:
            add_branch(k.name, bname, bc, counts[bott_t, ki], counts[bott_m, ki])
    for name, (_, _, _, _, bc) in r["glob"].items():
        on_t = (bott_t == 0) if name == "embedding" else (bott_t == pp - 1)
        on_m = (bott_m == 0) if name == "embedding" else (bott_m == pp - 1)
        add_branch(None, name, bc, float(on_t), float(on_m))
    for row in ex.ops:
        row["count"] = (1 if row["layer_kind"] == "global"
                        else cm.graph.layer_kind(row["layer_kind"]).count)
    send_ms = _f(r["send"]) * 1e3
    tick_ms = _f(r["tick"]) * 1e3
    micro = _f(r["micro"]) if cm.workload.phase == "prefill" else float(pp)
    ex.stage_ms = [float(x) * 1e3 for x in stage_t]
    ex.pp_send_bytes = _f(r["send_bytes"]) if pp > 1 else 0.0
    ex.totals = dict(bottleneck_stage=bott_t, tick_ms=tick_ms, pp_send_ms=send_ms,
                     micro_batches=micro, **comp)
    act = _f(r["act"])
    ex.memory = dict(weights_gb=weights / 1e9, kv_cache_gb=kv / 1e9,
                     recurrent_state_gb=state / 1e9, activations_gb=act / 1e9,
                     workspace_gb=cm.hw.workspace_gb, bottleneck_stage=bott_m,
                     usable_gb=cm.hw.usable_hbm_bytes / 1e9 + cm.hw.workspace_gb,
                     hbm_gb=cm.hw.hbm_gb)
    breakdown = dict(ex.totals)
    breakdown.update(stage_ms=ex.stage_ms, memory=ex.memory, feasible=ex.feasible,
                     reason=ex.reason, hardware=cm.hw.name, phase=cm.workload.phase)
    breakdown["kernel_tables"] = (dict(cm.kernels.versions) if cm.kernels is not None else {})
    breakdown["ops"] = [  # per fused op, one layer, one micro-batch: what priced it
        {"op": r["op"] if r["layer_kind"] == "global" else f"{r['layer_kind']}.{r['op']}",
         "time_ms": r["time_ms"], "kernel_source": r["kernel_source"]} for r in ex.ops]
    if ev.token_budget is not None:  # shardc.cost.scheduler: what the engine is told
        breakdown["scheduler"] = scheduler_entry(
            ev, 0, cm.workload.prompt, strategy.batch / (deg.pp * deg.ep))
    ex.predicted = dict(tok_s_per_gpu=_finite_or_none(float(ev.tok_s_per_gpu[0])),
                        tpot_ms=_finite_or_none(float(ev.tpot_ms[0])),
                        ttft_ms=_finite_or_none(float(ev.ttft_ms[0])),
                        memory_gb_per_gpu=_finite_or_none(float(ev.memory_gb_per_gpu[0])),
                        breakdown=breakdown, kernel_source=cm.kernel_source,
                        kernel_fallbacks=kernel_fallbacks(cm, r["b"]))
    return ex


def scheduler_entry(ev, i: int, isl: int, decode_seqs: float) -> dict:
    """The aggregated pool's scheduler at row ``i`` of an Evaluation: ``max_batched_tokens``
    (tokens per scheduler step, decode + prompt: vLLM ``--max-num-batched-tokens``),
    ``prefill_budget_tokens`` (its prompt part after the ``decode_seqs`` decode tokens of a
    micro-batch: SGLang ``--chunked-prefill-size``), ``prefill_chunk_tokens`` (prompt tokens a
    mixed step carries), ``mixed_step_fraction`` and the prompt's steps."""
    c = float(ev.prefill_chunk[i])
    budget = int(ev.token_budget[i])
    return {"max_batched_tokens": budget,
            "prefill_budget_tokens": max(int(budget - math.ceil(decode_seqs - 1e-9)), 0),
            "prefill_chunk_tokens": round(c, 3),
            "mixed_step_fraction": float(ev.mixed_fraction[i]),
            "prompt_steps": int(math.ceil(isl / c - 1e-9)) if c > 0 else None}


def kernel_fallbacks(cm, b) -> list[dict]:
    """What the roofline priced although measured kernels were asked for, once per (op,
    shape): ``[{op, shape, source, reason}]`` (empty under ``--kernels roofline``)."""
    if cm.kernel_source == "roofline":
        if cm.kernel_reason == "--kernels roofline":
            return []
        return [{"op": "all", "shape": "", "source": "roofline", "reason": cm.kernel_reason}]
    out = list(b.fallbacks) + [{
        "op": "embedding, norms, residual adds, pipeline send/recv", "shape": "",
        "source": "roofline", "reason": "no measured table for these kernels"}]
    recurrent = sorted({k.name for k in cm.graph.layer_kinds
                        if k.op("attn_core") is not None and is_recurrent(k.op("attn_core").attrs)})
    if recurrent:
        out.append({"op": ", ".join(f"{k}.attn_core" for k in recurrent), "shape": "",
                    "source": "roofline", "reason": "linear-attention / Mamba conv and scan "
                    "kernels: no measured table"})
    if float(np.asarray(b.ep).reshape(-1)[0]) > 1:
        out.append({"op": "ep dispatch/combine all_to_all", "shape": "",
                    "source": "deepep-model",
                    "reason": "expert all-to-all is priced by shardc's DeepEP model "
                              "(shardc.cost.moe_dispatch), not a measured table"})
    seen, unique = set(), []
    for row in out:
        key = (row["op"], row["shape"])
        if key not in seen:
            seen.add(key)
            unique.append(row)
    return unique


def chrome_trace(cm, strategy: Strategy) -> dict:
    """Chrome-trace JSON of one step: pid 0, one tid per pipeline stage; compute and
    communication slices (cat ``compute`` / ``comm``); timestamps in microseconds. Decode
    shows the pp micro-batches of one TPOT; prefill the first
    :data:`MAX_TRACE_MICROBATCHES` micro-batches of the GPipe schedule."""
    r = _simulate_one(cm, strategy)
    pp = strategy.degrees.pp
    counts = cm.stage_counts(pp)
    kind_segs = [_layer_segments(k.name, brs, nt) for k, brs, nt in r["kinds"]]
    glob = {name: _layer_segments("global", [br], np.zeros(1))[1:]
            for name, br in r["glob"].items()}
    order = cm._layer_kind
    stage_layers = stage_layer_ranges(len(order), pp)
    tick = _f(r["tick"])
    send = _f(r["send"])
    micro = pp if cm.workload.phase == "decode" else int(round(_f(r["micro"])))
    shown = min(micro, MAX_TRACE_MICROBATCHES)
    events = [{"name": "process_name", "ph": "M", "pid": 0, "args": {"name": "shardc step"}}]
    for s in range(pp):
        events.append({"name": "thread_name", "ph": "M", "pid": 0, "tid": s,
                       "args": {"name": f"stage {s} ({int(counts[s].sum())} layers)"}})
    for mb in range(shown):
        for s in range(pp):
            t = (mb + s) * tick
            segs = list(glob.get("embedding", [])) if s == 0 else []
            for layer in stage_layers[s]:
                segs += [(f"L{layer} {n}", c, d) for n, c, d in kind_segs[order[layer]]]
            if s == pp - 1:
                segs += glob.get("lm_head", [])
            if pp > 1 and send > 0:
                segs.append(("pp send/recv", "comm", send))
            for name, cat, dur in segs:
                if dur <= 0:
                    continue
                events.append({"name": name, "cat": cat, "ph": "X", "pid": 0, "tid": s,
                               "ts": t * 1e6, "dur": dur * 1e6, "args": {"microbatch": mb}})
                t += dur
    pred = simulate(cm, strategy).predicted
    return {"traceEvents": events, "displayTimeUnit": "ms",
            "otherData": {"micro_batches": micro, "shown_micro_batches": shown,
                          "tok_s_per_gpu": pred["tok_s_per_gpu"], "tpot_ms": pred["tpot_ms"],
                          "ttft_ms": pred["ttft_ms"]}}
