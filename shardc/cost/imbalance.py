"""Load imbalance of batch-split attention when the sequences' lengths differ.

Batch-split attention (``attn_core`` choice ``batch``: whole sequences per tp rank, as
DP-attention) gives each rank ``n = sequences / tp`` sequences; the layer waits for the rank
whose sequences hold the most context. The workload's ``--context`` (decode) / ``--prompt``
(prefill) is the *mean* length: in continuous batching the running sequences are at every
stage of their generation, so their KV lengths spread around it. Modelled with one named
constant, :data:`CONTEXT_CV`, the coefficient of variation of a sequence's length:

* a rank's load is the sum of ``n`` lengths: mean ``n mu``, standard deviation
  ``sqrt(n) sigma`` (independent lengths);
* the busiest of ``tp`` ranks sits ``z(tp)`` standard deviations above the mean, ``z`` the
  expected maximum of ``tp`` standard normals (Blom's approximation
  ``Phi^-1((tp - 0.375) / (tp + 0.25))``: 0.59, 1.05, 1.43, 1.77 at tp = 2, 4, 8, 16);

so the attention time of batch-split attention is multiplied by
``1 + CONTEXT_CV x z(tp) / sqrt(n)`` (1 at tp = 1). A heads split gives every rank a slice of
every sequence and stays balanced. :data:`CONTEXT_CV` = 1/sqrt(3) ~ 0.58 is the spread of
lengths uniform between 0 and twice their mean -- sequences met at a uniformly random point of
their generation -- a first-principles value, not fitted to any measurement; prompts of
different lengths (prefill) are treated alike.
"""

from __future__ import annotations

import math
from statistics import NormalDist

import numpy as np

CONTEXT_CV = 1.0 / math.sqrt(3.0)  # coefficient of variation of sequence lengths


def expected_max_normal(n: int) -> float:
    """Expected maximum of ``n`` independent standard normals (Blom); 0 for n <= 1."""
    if n <= 1:
        return 0.0
    return NormalDist().inv_cdf((n - 0.375) / (n + 0.25))


def batch_split_imbalance(tp, sequences_per_rank, cv: float | None = None) -> np.ndarray:
    """Busiest rank's attention load / mean rank's under a batch split over ``tp`` ranks of
    ``sequences_per_rank`` sequences each (arrays; ``cv`` default :data:`CONTEXT_CV`; see
    the module docstring)."""
    cv = CONTEXT_CV if cv is None else float(cv)
    tp = np.asarray(tp, dtype=np.int64)
    z = np.zeros(tp.shape, dtype=np.float64)
    for t in np.unique(tp):
        z[tp == t] = expected_max_normal(int(t))
    n = np.maximum(np.asarray(sequences_per_rank, dtype=np.float64), 1.0)
    return 1.0 + cv * z / np.sqrt(n)
