"""What the emitted runtime (:mod:`shardc.runtime.fast`) is expected to run: plan.json
``predicted.runtime {step_ms, overhead_ms, source}`` beside the engine prediction.

The kernels are the ones the cost model prices (torch calls cuBLAS GEMMs, SDPA, NCCL: the
per-op times of ``predicted.breakdown``); what the runtime adds is host work per step:

* a decode step captured as a CUDA graph (pp = 1; MoE layers only on their capture-safe path
  -- ep = 1, no all-gather dispatch, no row gather over tp: ``moe_capturable`` --;
  ``FastModel.graphable``) costs one graph replay plus the sampler and the token copy:
  :data:`GRAPH_STEP_MS` per step;
* an eager step (MoE layers with host-read split sizes, pipeline stages, or prefill, which
  the runtime does not capture) launches every torch op from Python:
  :data:`EAGER_OP_MS` per op, :data:`OPS_PER_LAYER` ops per decoder layer of a stage
  (counted on the runtime's forward: norms, projections, rotary, cache write, mask,
  attention, MLP), plus one host sync per MoE layer (:data:`HOST_SYNC_MS`);
* with pp > 1 the runtime runs the batch as one micro-batch through the stages in turn, so
  its step is the sum of the stages' times at the whole batch, not the engine's pipelined
  tick: ``sum(stage_ms) x micro_batches`` (each stage's time per micro-batch times the
  micro-batches the engine cut the batch into), plus the sends -- an upper bound, since a
  stage reads its weights once for the whole batch where the engine reads them once per
  micro-batch.

The host constants are assumptions (typical H100 + CPython figures; not measured by this
repository on this machine): ``source`` says so, and ``benchmarks/gpu/`` measures them.
"""

from __future__ import annotations

GRAPH_STEP_MS = 0.03  # one CUDA graph replay + sampling + token copy per decode step (ms)
EAGER_OP_MS = 0.008  # one eager torch op: Python, dispatcher and kernel launch (ms)
HOST_SYNC_MS = 0.02  # one device->host read (MoE split sizes) per MoE layer (ms)
OPS_PER_LAYER = {"dense": 70, "moe": 60}  # eager ops per decoder layer (+ 5 per local expert)
SOURCE = ("engine kernels + runtime host model (assumed: graph replay 0.03 ms/step, "
          "eager 0.008 ms/op; unmeasured here)")
PP_NOTE = "; pp: stages in turn at the whole batch (upper bound)"


def runtime_prediction(predicted: dict, degrees: dict, layers: int, moe_layers: int,
                       local_experts: int, phase: str,
                       moe_capturable: bool = False) -> dict | None:
    """``{step_ms, overhead_ms, source}`` for a plan whose engine prediction is
    ``predicted`` (plan.json's, with ``breakdown``); None when the engine predicts no step."""
    bd = predicted.get("breakdown") or {}
    tick = bd.get("tick_ms")
    if tick is None:
        return None
    pp = int(degrees.get("pp", 1))
    ep = int(degrees.get("ep", 1))
    stages = bd.get("stage_ms") or [tick]
    if pp > 1:
        kernels = sum(float(s) for s in stages) * float(bd.get("micro_batches") or 1) \
            + float(bd.get("pp_send_ms") or 0.0) * (pp - 1)
    else:
        kernels = float(tick)
    graphable = phase == "decode" and pp == 1 and ep == 1 and (moe_layers == 0
                                                               or moe_capturable)
    if graphable:
        overhead = GRAPH_STEP_MS
    else:
        per_stage = -(-layers // pp)
        moe_share = min(moe_layers, per_stage)
        ops = (per_stage - moe_share) * OPS_PER_LAYER["dense"] \
            + moe_share * (OPS_PER_LAYER["moe"] + 5 * local_experts)
        overhead = pp * (ops * EAGER_OP_MS + moe_share * HOST_SYNC_MS)
    return {"step_ms": round(kernels + overhead, 4), "overhead_ms": round(overhead, 4),
            "cuda_graph": graphable, "source": SOURCE + (PP_NOTE if pp > 1 else "")}
