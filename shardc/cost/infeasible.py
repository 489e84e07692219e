"""Why nothing fits: the message of ``InfeasibleError`` names the constraint that binds.

The cost model checks a strategy in a fixed order (:data:`shardc.cost.model.REASONS`):
degrees tile the mesh, op choices legal, batch divides evenly, fits in HBM, meets the SLO.
:func:`infeasible_message` evaluates every degree candidate of the space (tp, ep, pp, sp,
batch, each with Megatron's per-op dims, which are legal at every tp) and reports the *most
advanced* check any candidate reached -- the one that actually binds -- with the numbers of
the candidate closest to passing it (least memory, lowest latency), then the splits that were
stopped earlier and, where a ``--batch`` value would unblock one, that value. Counting the
commonest reason over random strategies instead reported whichever check most random points
fail first (often batch divisibility) rather than what stands between the problem and a plan.
"""

from __future__ import annotations

import itertools
from dataclasses import replace

import numpy as np

from shardc.cost.capacity import gpus_short_message
from shardc.cost.model import BAD_BATCH, NO_MEMORY, OK, TPOT_SLO, TTFT_SLO, CostModel, reason_text
from shardc.ir.space import (
    DEGREE_COMPONENTS,
    MAX_TP,
    StrategySpace,
    cross_node_tp_note,
    megatron_op_choices,
)

MAX_SPLITS_NAMED = 6  # splits listed per earlier-failing check before "and N more"


def _candidate_actions(space: StrategySpace) -> np.ndarray:
    """[B, A] every degree combination that tiles the mesh, with Megatron's op choices."""
    idx = [range(len(space.values[c])) for c in DEGREE_COMPONENTS]
    rows = np.array(list(itertools.product(*idx)), dtype=np.int64).reshape(-1, len(idx))
    rows = rows[space.degrees_valid(np.hstack(
        [rows, np.zeros((len(rows), len(space.op_slots)), dtype=np.int64)]))]
    ops = np.stack([megatron_op_choices(space, t) for t in range(len(space.values["tp"]))])
    return np.hstack([rows, ops[rows[:, 0]]]) if len(rows) else rows


def _split(strategy) -> str:
    """``tp=2 ep=1 pp=3 batch=6`` (sp only when > 1)."""
    d = strategy.degrees
    text = f"tp={d.tp} ep={d.ep} pp={d.pp}"
    return text + (f" sp={d.sp}" if d.sp > 1 else "") + f" batch={strategy.batch}"


def rejection_detail(cost_model, strategy) -> str:
    """One strategy's failed check with its numbers (GB = 1e9 bytes per GPU of the bottleneck
    stage, ms), e.g. ``weights alone need 72.7 GB/GPU at tp=2 ...; 70.0 GB of the 80 GB HBM is
    usable for them (short by 2.7 GB)``."""
    ex = cost_model.simulate(strategy)
    space = cost_model.space_for(strategy)
    code = int(cost_model.evaluate(space.encode(strategy)[None, :], space).reason[0])
    pred, mem = ex.predicted, ex.memory
    wl = cost_model.workload
    if code == NO_MEMORY:  # model bytes against HBM less headroom and workspace, as checked
        room = mem["usable_gb"] - mem["workspace_gb"]
        hbm = f"{room:.1f} GB of the {mem['hbm_gb']:g} GB HBM is usable for them"
        if mem["weights_gb"] > room:
            return (f"weights alone need {mem['weights_gb']:.1f} GB/GPU at {_split(strategy)}; "
                    f"{hbm} (short by {mem['weights_gb'] - room:.1f} GB)")
        need = pred["memory_gb_per_gpu"] - mem["workspace_gb"]
        return (f"weights + KV cache + activations need {need:.1f} GB/GPU at {_split(strategy)} "
                f"(weights {mem['weights_gb']:.1f}, KV cache {mem['kv_cache_gb']:.1f}, "
                + (f"recurrent state {mem['recurrent_state_gb']:.1f}, "
                   if mem.get("recurrent_state_gb") else "")
                + f"activations {mem['activations_gb']:.1f}); {hbm} (short by "
                f"{need - room:.1f} GB)")
    if code == TPOT_SLO:
        return (f"TPOT {pred['tpot_ms']:.3g} ms at {_split(strategy)} exceeds the "
                f"{wl.tpot_slo_ms:g} ms SLO")
    if code == TTFT_SLO:
        return (f"TTFT {pred['ttft_ms']:.3g} ms at {_split(strategy)} exceeds the "
                f"{wl.ttft_slo_ms:g} ms SLO")
    if code == BAD_BATCH:
        d = strategy.degrees
        need = d.pp * d.ep if wl.phase == "decode" else d.ep
        over = "pp x ep micro-batches" if wl.phase == "decode" else "ep attention groups"
        if strategy.batch % need:
            return f"batch {strategy.batch} does not divide over {need} {over} at {_split(strategy)}"
        return f"{reason_text(code)} at {_split(strategy)}"
    return f"{reason_text(code)} at {_split(strategy)}"


def _batch_that_unblocks(graph, mesh, hardware, workload, blocked, fixed=None,
                         kernel_options=None, tp_domain: int | None = None) -> str:
    """``--batch N`` that makes one of the batch-blocked splits feasible (the best one), or ""
    (priced like the search: ``kernel_options`` of its cost model)."""
    if workload.batch is not None:
        return ""
    best = None
    for need in sorted({s.degrees.pp * s.degrees.ep if workload.phase == "decode"
                        else s.degrees.ep for s in blocked}):
        for mult in (1, 2, 4, 8, 16, 32, 64):
            wl = replace(workload, batch=need * mult)
            space = StrategySpace(graph, mesh, wl, fixed=dict(fixed or {}), tp_domain=tp_domain)
            acts = _candidate_actions(space)
            if not len(acts):
                continue
            ev = CostModel(graph, mesh, hardware, wl, **(kernel_options or {})).evaluate(acts, space)
            if ev.feasible.any():
                i = int(np.argmax(np.where(ev.feasible, ev.tok_s_per_gpu, -1.0)))
                if best is None or ev.tok_s_per_gpu[i] > best[0]:
                    best = (float(ev.tok_s_per_gpu[i]), space.decode(acts[i]))
    if best is None:
        return ""
    return (f"; --batch {best[1].batch} makes {_split(best[1])} feasible "
            f"({best[0]:.1f} tok/s/GPU predicted)")


def infeasible_message(graph, mesh, hardware, workload, cost_model, space: StrategySpace) -> str:
    """Say what is short (see the module docstring); ``hardware`` is a loaded preset."""
    short = gpus_short_message(graph, workload, hardware, mesh.gpus)
    if short:
        return short
    head = f"no feasible plan on mesh {mesh} ({hardware.name}): "
    if space.fixed:
        head += "with " + ",".join(f"{k}={v}" for k, v in space.fixed.items()) + " fixed: "
    hidden = int(graph.config.get("hidden", 0) or 0)
    excluded = [d for d in range(2, min(mesh.gpus, MAX_TP) + 1)
                if mesh.gpus % d == 0 and d not in space.values["tp"] and "tp" not in space.fixed]
    by_hidden = [d for d in excluded if hidden % d]
    by_domain = [d for d in excluded if not hidden % d and space.tp_domain is not None
                 and space.tp_domain % d]
    not_tp = (f"; tp={', '.join(map(str, by_hidden))} cannot be used (tp must divide hidden "
              f"{hidden})") if by_hidden else ""
    if by_domain:
        not_tp += (f"; tp={', '.join(map(str, by_domain))} not tried: "
                   + cross_node_tp_note(space.tp_domain))
    acts = _candidate_actions(space)
    if not len(acts):
        return head + "no tp x ep x pp split tiles the mesh" + not_tp
    ev = cost_model.evaluate(acts, space)
    if ev.feasible.any():  # the searcher missed a plan the sweep finds
        s = space.decode(acts[int(np.argmax(np.where(ev.feasible, ev.tok_s_per_gpu, -1)))])
        return head + f"the search found none within its budget, but {_split(s)} is feasible"
    binding = int(ev.reason.max())
    at = np.flatnonzero(ev.reason == binding)
    if binding == NO_MEMORY:
        closest = at[np.argmin(ev.memory_gb_per_gpu[at])]
    elif binding in (TPOT_SLO, TTFT_SLO):
        lat = ev.tpot_ms if binding == TPOT_SLO else ev.ttft_ms
        closest = at[np.argmin(lat[at])]
    else:
        closest = at[0]
    text = head + rejection_detail(cost_model, space.decode(acts[closest]))
    furthest: dict[tuple, tuple[int, object]] = {}  # split -> (most advanced check, strategy)
    for i in np.flatnonzero(ev.reason != OK):
        s = space.decode(acts[i])
        key = (s.degrees.tp, s.degrees.ep, s.degrees.pp, s.degrees.sp)
        if key not in furthest or int(ev.reason[i]) > furthest[key][0]:
            furthest[key] = (int(ev.reason[i]), s)
    if binding == BAD_BATCH:
        text += _batch_that_unblocks(graph, mesh, hardware, workload,
                                     [space.decode(acts[i]) for i in at], space.fixed,
                                     cost_model.kernel_options, space.tp_domain)
    for code in sorted({c for c, _ in furthest.values() if c < binding}):
        stopped = [s for key, (c, s) in sorted(furthest.items()) if c == code]
        names = [_split(s).rsplit(" batch=", 1)[0] for s in stopped]
        shown = ", ".join(names[:MAX_SPLITS_NAMED]) + (
            f" and {len(names) - MAX_SPLITS_NAMED} more" if len(names) > MAX_SPLITS_NAMED else "")
        text += f"; {shown}: {reason_text(code).split(' (')[0]} at every batch candidate"
        if code == BAD_BATCH:
            text += _batch_that_unblocks(graph, mesh, hardware, workload, stopped, space.fixed,
                                         cost_model.kernel_options, space.tp_domain)
    return text + not_tp
