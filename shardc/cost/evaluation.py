"""What the cost model returns: :class:`Evaluation` (arrays over the evaluated strategies) and
the reason codes of an infeasible strategy (:data:`REASONS`), a leaf both
:mod:`shardc.cost.model` and :mod:`shardc.cost.scheduler` read."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

# reason codes of an infeasible strategy (0 = feasible), checked in this order
REASONS = {
    0: "feasible",
    1: "degrees do not tile the mesh (tp x ep x pp must divide the GPU count)",
    2: "an op choice is illegal at this tp degree (e.g. tp does not divide the heads)",
    3: "batch does not divide evenly (over pp micro-batches x ep attention groups, or over "
       "tp for batch-split attention)",
    4: "does not fit in HBM (weights + KV cache + activations per GPU)",
    5: "TPOT exceeds the SLO",
    6: "TTFT exceeds the SLO",
}
OK, BAD_DEGREES, BAD_CHOICE, BAD_BATCH, NO_MEMORY, TPOT_SLO, TTFT_SLO = range(7)


def reason_text(code: int) -> str:
    return REASONS.get(int(code), f"unknown reason {code}")


@dataclass
class Evaluation:
    """Arrays [B] over the evaluated strategies (ms, GB = 1e9 bytes, tokens/s/GPU)."""

    tok_s_per_gpu: np.ndarray
    tpot_ms: np.ndarray
    ttft_ms: np.ndarray
    memory_gb_per_gpu: np.ndarray
    feasible: np.ndarray
    reason: np.ndarray
    # the aggregated pool's scheduler (shardc.cost.scheduler), None elsewhere: the token
    # budget run (tokens per scheduler step), the prompt tokens a mixed step carries and the
    # fraction of steps that carry them
    token_budget: np.ndarray | None = None
    prefill_chunk: np.ndarray | None = None
    mixed_fraction: np.ndarray | None = None

    def reason_text(self, i: int) -> str:
        return reason_text(int(self.reason[i]))
