"""Lower bound on the GPUs needed to hold a model's weights and KV cache."""

from __future__ import annotations

import math

from shardc.cost.hardware_presets import Hardware, load_hardware
from shardc.ir.graph import Graph
from shardc.ir.recurrent import state_elems_per_sequence
from shardc.ir.strategy import Workload, format_bytes
from shardc.ir.windows import attended_positions, op_window


def kv_elems_per_token(graph: Graph) -> float:
    """KV-cache elements one token adds over all layers (unsharded)."""
    total = 0.0
    for k in graph.layer_kinds:
        core = k.op("attn_core")
        if core is not None:
            total += k.count * float(core.attrs.get("kv_cache_elems_per_token", 0))
    return total


def weight_and_kv_bytes(graph: Graph, workload: Workload, dtype_bytes: float | None = None
                        ) -> tuple[float, float]:
    """(all weight bytes, KV-cache bytes of ``workload.batch`` sequences (1 if auto) at the
    phase's cache length: context in decode, prompt in prefill, in serve the least a paged
    engine holds per running sequence on average, ``isl + osl / 2`` (the pools' paged
    reservation adds a preemption margin: :func:`shardc.cost.scheduler.paged_kv_tokens`;
    this is a lower bound); a sliding-window layer holds
    at most its window; a linear-attention / Mamba layer its constant state, at the model's
    dtype), in the workload's weight and KV-cache formats."""
    db = float(dtype_bytes or graph.config.get("dtype_bytes", 2) or 2)
    params = sum(o.params for o in graph.global_ops)
    length = {"decode": workload.context, "prefill": workload.prompt,
              "serve": workload.isl + workload.osl / 2}[workload.phase]
    kv_per_seq = 0.0  # KV-cache elements of one sequence
    state_per_seq = 0.0  # recurrent + conv state elements of one sequence
    for k in graph.layer_kinds:
        params += k.count * (sum(o.params for o in k.ops)
                             + int((getattr(k, "attrs", None) or {}).get("other_params", 0) or 0))
        core = k.op("attn_core")
        if core is not None:
            held = attended_positions(length, op_window(core.attrs))
            kv_per_seq += k.count * held * float(core.attrs.get("kv_cache_elems_per_token", 0))
            state_per_seq += k.count * state_elems_per_sequence(core.attrs)
    seqs = workload.batch or 1
    return (params * format_bytes(workload.weights, db),
            seqs * (kv_per_seq * format_bytes(workload.kv_cache, db) + state_per_seq * db))


def min_gpus_needed(graph: Graph, workload: Workload, hardware: Hardware | str) -> int:
    """Smallest GPU count whose usable HBM (capacity - headroom - workspace) could hold all
    weights plus the KV cache, assuming perfect sharding (a lower bound)."""
    hw = load_hardware(hardware)
    w, kv = weight_and_kv_bytes(graph, workload)
    return max(1, math.ceil((w + kv) / hw.usable_hbm_bytes))


def gpus_short_message(graph: Graph, workload: Workload, hardware: Hardware | str,
                       gpus: int) -> str | None:
    """The infeasibility line when even perfect sharding over ``gpus`` GPUs cannot hold the
    weights + KV cache (GB = 1e9 bytes), else None."""
    hw = load_hardware(hardware)
    need = min_gpus_needed(graph, workload, hw)
    if need <= gpus:
        return None
    w, kv = weight_and_kv_bytes(graph, workload)
    return (f"needs >= {need} GPUs to hold weights + KV cache; mesh has {gpus} (weights "
            f"{w / 1e9:.1f} GB + KV cache {kv / 1e9:.1f} GB; {hw.usable_hbm_bytes / 1e9:.1f} GB "
            f"of HBM usable per GPU)")
