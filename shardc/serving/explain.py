"""Why a serving plan stops where it does (:mod:`shardc.serving.search`): the constraint binding the
throughput-setting pool, and what is short when nothing meets the SLOs."""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from shardc.cost.model import NO_MEMORY, OK, TPOT_SLO, TTFT_SLO
from shardc.ir.strategy import Mesh, Strategy, Workload


def binding_constraint(choice, pools, wl: Workload) -> str:
    """What stops the throughput-setting pool (mixed / decode) from running the next larger
    batch candidate (one that divides over its pp x ep micro-batches): ``memory``, ``TPOT``
    or ``TTFT`` (``batch grid`` past the largest candidate, ``--batch cap`` at the user's)."""
    role, _, strategy, _ = choice.pools[-1]
    pool = pools[role]
    d = strategy.degrees
    larger = [b for b in pool.space.values["batch"]
              if b > strategy.batch and b % (d.pp * d.ep) == 0]
    if not larger:
        return "--batch cap" if wl.batch and strategy.batch >= wl.batch else "batch grid"
    s = Strategy(replace(d, dp=pool.space.mesh.gpus // d.replica_gpus), larger[0],
                 strategy.choices)
    ev = pool.cost_model.evaluate(pool.space.encode(s)[None, :], pool.space)
    code = int(ev.reason[0])
    if code == NO_MEMORY:
        return "memory"
    if code == TPOT_SLO or float(ev.tpot_ms[0]) > wl.tpot_slo_ms:
        return "TPOT"
    if code == TTFT_SLO:
        return "TTFT"
    return "batch divisibility" if code != OK else "none"


def nothing_fits(wl: Workload, mesh: Mesh, pools: dict) -> str:
    """Why no serving plan meets the SLOs: the closest rows of each pool."""
    parts = []
    for role, pool in pools.items():
        t = pool.objective.table()
        if not t or not t["fits"].any():
            parts.append(f"{role}: nothing fits in HBM")
            continue
        fits = t["fits"]
        if role != "prefill":
            parts.append(f"{role}: best TPOT {np.nanmin(np.where(fits, t['tpot'], np.inf)):.3g} "
                         f"ms (SLO {wl.tpot_slo_ms:g})")
        if role != "decode":
            parts.append(f"{role}: best TTFT {np.nanmin(np.where(fits, t['ttft'], np.inf)):.3g} "
                         f"ms (SLO {wl.ttft_slo_ms:g})")
    return (f"no serving plan on {mesh} meets TTFT <= {wl.ttft_slo_ms:g} ms and TPOT <= "
            f"{wl.tpot_slo_ms:g} ms for {wl.isl}/{wl.osl} tokens: " + "; ".join(parts))
