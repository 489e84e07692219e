"""Does a headline ratio against the Megatron heuristic survive a 1% change of the SLO?

A plan's throughput is a step function of the latency SLO: the batch (and the split) a
strategy may run jumps where its TPOT / TTFT crosses the SLO. A ratio "searched plan /
Megatron" measured where one of the two sits just under the SLO and the other just over
(20.01 ms against 19.99 ms) reads as a large gain that any real 1% difference -- the
model's own error is larger -- would erase. :func:`slo_cliff_check` re-evaluates both
plans with the SLO :data:`SLO_SCALES` (0.99x and 1.01x):

* the Megatron heuristic is swept again (every degree split and batch, Megatron's op dims);
* the searched plan keeps its degrees and op choices and takes its best feasible batch of
  the grid (the search is not re-run, which can only lower its ratio: conservative), and,
  as compile never returns a plan worse than the baseline, at least Megatron's value;

and calls the headline *robust* when at both scales Megatron is feasible, the ratio stays
within :data:`SLO_CLIFF_MARGIN` (relative) of the headline and a claimed gain keeps at least
:data:`GAIN_KEPT` of itself (a 1.046x that becomes 1.001x moved by less than the margin, but
its gain vanished). Otherwise the compile summary says the gain is an SLO-cliff artifact and
shows the ratios at the two scales.
"""

from __future__ import annotations

import copy
from dataclasses import replace

import numpy as np

from shardc.ir.space import DEGREE_COMPONENTS, StrategySpace, megatron_op_choices
from shardc.ir.strategy import Strategy
from shardc.validate import MAX_MS

SLO_SCALES = (0.99, 1.01)  # latency SLO multipliers the headline ratio must survive
# Largest relative move of the ratio under a 1% SLO change that is no cliff: each plan's
# throughput may follow the SLO by about 1% where it is smooth, so the ratio by about 2%.
SLO_CLIFF_MARGIN = 0.02
GAIN_KEPT = 0.5  # and a claimed gain (ratio - 1) must keep at least this fraction of itself


def _megatron_best(cost_model, space: StrategySpace) -> float:
    """Best feasible tok/s/GPU of Megatron's sweep over ``space`` (0.0 when none)."""
    import itertools

    idx = [range(len(space.values[c])) for c in DEGREE_COMPONENTS]
    rows = np.array(list(itertools.product(*idx)), dtype=np.int64).reshape(-1, len(idx))
    deg = space.degree_arrays(np.hstack([rows, np.zeros((len(rows), len(space.op_slots)),
                                                        dtype=np.int64)]))
    rows = rows[(deg["dp"] > 0) & space.fixed_degrees_fit(deg["tp"], deg["ep"], deg["pp"])]
    if not len(rows):
        return 0.0
    ops = np.stack([megatron_op_choices(space, t) for t in range(len(space.values["tp"]))])
    ev = cost_model.evaluate(np.hstack([rows, ops[rows[:, 0]]]), space)
    return float(ev.tok_s_per_gpu[ev.feasible].max()) if ev.feasible.any() else 0.0


def _best_batch(cost_model, space: StrategySpace, strategy: Strategy) -> float:
    """Best feasible tok/s/GPU of ``strategy``'s degrees and op choices over the batch grid."""
    acts = np.array([space.encode(replace(strategy, batch=b)) for b in space.values["batch"]])
    ev = cost_model.evaluate(acts, space)
    return float(ev.tok_s_per_gpu[ev.feasible].max()) if ev.feasible.any() else 0.0


def slo_cliff_check(cost_model, space: StrategySpace, strategy: Strategy, value: float,
                    megatron_value: float, megatron_space: StrategySpace | None = None) -> dict:
    """``{"ratio", "slo_scales", "ratios", "margin", "gain_kept", "robust"}`` for the plan
    ``strategy``
    (``value`` tok/s/GPU) against Megatron's best ``megatron_value`` at the workload's SLO
    (see the module docstring); ``ratios[i]`` is None where Megatron is infeasible.
    ``megatron_space``: the space Megatron's sweep ran in when not the plan's ``space`` (a
    plan at an experts re-split)."""
    ratio = value / megatron_value if megatron_value > 0 else None
    wl = cost_model.workload
    ratios = []
    for scale in SLO_SCALES:
        w = replace(wl, tpot_slo_ms=min(wl.tpot_slo_ms * scale, MAX_MS),
                    ttft_slo_ms=min(wl.ttft_slo_ms * scale, MAX_MS))
        cm = copy.copy(cost_model)  # the same model and options, another SLO
        cm.workload = w
        sp = replace(space, workload=w)
        mega = _megatron_best(cm, sp if megatron_space is None
                              else replace(megatron_space, workload=w))
        plan = max(_best_batch(cm, sp, strategy), mega)
        ratios.append(plan / mega if mega > 0 else None)
    robust = ratio is not None and all(
        r is not None and abs(r - ratio) <= SLO_CLIFF_MARGIN * ratio
        and r - 1.0 >= GAIN_KEPT * (ratio - 1.0) for r in ratios)
    return {"ratio": ratio, "slo_scales": list(SLO_SCALES), "ratios": ratios,
            "margin": SLO_CLIFF_MARGIN, "gain_kept": GAIN_KEPT, "robust": bool(robust)}


def cliff_note(check: dict | None) -> str:
    """The compile summary's words when a claimed gain does not survive (else "")."""
    if not check or check.get("robust", True) or not (check.get("ratio") or 0) > 1.0005:
        return ""
    shown = ", ".join("Megatron infeasible" if r is None else f"{r:.3f}x"
                      for r in check["ratios"])
    scales = "/".join(f"{s:g}x" for s in check["slo_scales"])
    return f"an SLO-cliff artifact: {shown} with the latency SLO at {scales}"
