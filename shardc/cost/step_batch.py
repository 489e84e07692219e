"""What every branch of a simulated step sees (``CostModel._simulate`` and
``CostModel.branch_term_cost`` share it): per action row the degrees, the
:class:`~shardc.cost.layer_costs.Batch` the branches are priced on (tokens, sequences,
context, groups, routed-token imbalance), the experts' re-split Batch and the gathered Batch
a re-split's router runs on."""

from __future__ import annotations

import numpy as np

from shardc.cost.layer_costs import Batch
from shardc.cost.moe_dispatch import gathered_batch
from shardc.cost.topology import mesh_groups
from shardc.ir.space import StrategySpace


def step_batch(cm, a: np.ndarray, space: StrategySpace, detail: bool = False,
               chunk=None) -> dict:
    """What every branch of cost model ``cm``'s step sees at each action row [B, A]:
    degrees, the :class:`Batch` (and the experts' re-split one, ``bx`` / ``resplit``),
    tokens and sequences per attention group, micro-batches; ``chunk`` as in
    ``CostModel._simulate``."""
    deg = space.degree_arrays(a)
    tp, ep, pp, sp, batch, dp = (deg[k] for k in ("tp", "ep", "pp", "sp", "batch", "dp"))
    wl = cm.workload
    tpf, epf, ppf, bf = (x.astype(np.float64) for x in (tp, ep, pp, batch))
    residual = (sp > 1).astype(np.int64)
    if wl.phase == "decode":
        seqs = bf / ppf / epf
        # chunked-prefill tokens riding on the step
        chunk = seqs * cm.mixed_prefill if chunk is None else np.asarray(chunk, float)
        tokens = seqs + chunk
        micro = ppf
        context, kv_context = cm.attend_context, float(wl.context)
        if cm.kv_reservation == "paged":
            kv_context = cm.kv_tokens_per_sequence(bf / epf)
        batch_ok = batch % (pp * ep) == 0
    else:
        seqs = np.where(pp > 1, 1.0, bf / epf)
        tokens = seqs * wl.prompt
        micro = np.where(pp > 1, bf / epf, 1.0)
        context, kv_context = float(wl.prompt), float(wl.prompt)
        batch_ok = batch % ep == 0
    imb = cm.imbalance(tokens * epf, ep)
    b = Batch(hw=cm.hw, phase=wl.phase, tp=tpf, ep=epf, sp=sp, seqs=seqs,
              seqs_resident=bf / epf, tokens=tokens,
              expert_tokens=tokens * cm.top_k * imb,
              lm_tokens=seqs, chunk_tokens=chunk if wl.phase == "decode" else 0.0,
              context=context, kv_context=kv_context, prompt=float(wl.prompt),
              residual=residual,
              groups=mesh_groups(tp, ep, np.maximum(dp, 1), pp, cm.mesh.gpus_per_node),
              hidden=cm.hidden, top_k=cm.top_k, num_experts=cm.num_experts,
              weight_bytes=cm.weight_bytes, act_bytes=cm.act_bytes,
              kv_bytes=cm.kv_bytes, ssm_bytes=cm.ssm_bytes, gemm_peak=cm.hw.peak_flops(cm.fp8_gemm),
              detail=detail, expert_imbalance=imb, fp8_dispatch=cm.fp8_dispatch,
              moe_layouts=cm.moe_layouts, kernels=cm.kernels,
              redundant_experts=int(wl.redundant_experts), fp8_scaling=wl.fp8_scaling)
    bx, resplit = cm._resplit(b, deg, tokens * epf)
    b_routed = gathered_batch(b) if bx is not None else None  # what a re-split routes
    return dict(deg=deg, b=b, bx=bx, resplit=resplit, b_routed=b_routed, tokens=tokens,
                seqs=seqs, chunk=chunk, micro=micro, batch_ok=batch_ok, residual=residual)
