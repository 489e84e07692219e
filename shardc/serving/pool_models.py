"""Serving performance (SPEC section 11): requests of ``isl`` input and ``osl`` output tokens
under a TTFT and a TPOT SLO, on the vectorised :class:`~shardc.cost.model.CostModel`.

Throughput is output tokens/s per GPU of the whole mesh; per-user speed is ``1000 / TPOT``
(tokens/s). Nothing here is a second cost model: every step time comes from CostModel.

**Aggregated** (one pool of dp replicas, in-flight batching with chunked prefill):
:func:`agg_cost_model` -- ``batch`` running sequences per replica; the engine's scheduler
(:mod:`shardc.cost.scheduler`) runs their decode tokens every step and fills a per-step token
budget (searched over :data:`~shardc.cost.scheduler.TOKEN_BUDGETS`) with the waiting prompts;
in steady state (request completions = arrivals) ``batch * isl / osl`` prompt tokens arrive
per step (``mixed_prefill = isl / osl`` per running sequence). A step carrying a chunk prices
its GEMMs at decode + chunk tokens and runs context attention for the chunk; decode attention
reads the mean context ``isl + osl / 2``; the KV cache held is ``isl + osl`` per running
sequence. ``TPOT`` = the mean step over a request's decode steps; ``TTFT`` = half a step
joining plus its prompt's chunks under the budget. ``token_budgets=None`` is the budget
binding every step: the chunk ``batch * isl / osl`` rides on every step, ``TPOT`` = that
mixed step, ``TTFT = (ceil(isl / chunk per micro-batch) + 0.5) * TPOT``.

**Disaggregated**: a prefill pool of ``x`` workers (:func:`prefill_cost_model`: the prefill
phase at prompt ``isl``; TTFT = its prefill latency + :func:`kv_transfer_s`) and a decode pool
of ``y`` workers (:func:`decode_cost_model`: the decode phase holding ``isl + osl`` tokens per
sequence, attending ``isl + osl / 2``), each with its own degrees, op choices and batch.
Given a worker's request rates (prefill ``P`` = prompts/s, decode ``D`` = ``batch / TPOT /
osl``), :func:`best_ratio` picks ``x : y`` with ``x * gpus_p + y * gpus_d <= mesh GPUs``
maximising ``min(x P, y D)``; the per-pool choices are independent given the ratio.

Units: seconds in the functions, ms in dicts; bytes; tokens/s.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from shardc.cost.capacity import kv_elems_per_token
from shardc.cost.hardware_presets import Hardware, load_hardware
from shardc.cost.model import CostModel
from shardc.cost.scheduler import TOKEN_BUDGETS
from shardc.ir.graph import Graph
from shardc.ir.strategy import Mesh, Workload

KV_RESERVATION = "paged"  # the KV tokens a mixed / decode pool reserves per sequence

ROLES = ("mixed", "prefill", "decode")
POOL_REWRITTEN = ("phase", "batch", "context", "prompt")  # Workload fields a pool sets itself


def decode_context(wl: Workload) -> tuple[int, float]:
    """(KV tokens held per running sequence, mean positions attended per decode step)."""
    return wl.isl + wl.osl, wl.isl + wl.osl / 2


def pool_workload(wl: Workload, role: str) -> Workload:
    """The single-phase workload a pool's CostModel prices (``role`` in :data:`ROLES`):
    mixed and decode steps hold ``isl + osl`` tokens per sequence; prefill runs ``isl``-token
    prompts; the batch is searched (a serving ``--batch`` is a cap, applied to the space by
    :func:`shardc.serving.search.capped_batches`); every other field (the SLOs, ``weights``,
    ``kv_cache``, ``isl`` / ``osl``, ``mode`` and any field added later) is the serving
    workload's own (:data:`POOL_REWRITTEN` names the fields a pool rewrites)."""
    held, _ = decode_context(wl)
    phase = "prefill" if role == "prefill" else "decode"
    return replace(wl, phase=phase, batch=None, context=held, prompt=wl.isl)


def pool_cost_model(graph: Graph, mesh: Mesh, hardware: Hardware | str, wl: Workload,
                    role: str, mixed_prefill: float | None = None,
                    token_budgets=TOKEN_BUDGETS, kv_reservation: str = KV_RESERVATION,
                    **options) -> CostModel:
    """The CostModel of one pool (``role``: mixed = the aggregated step, prefill, decode);
    ``mixed_prefill`` overrides the mixed step's prompt tokens per running sequence per step
    (default ``isl / osl``; 0 gives the pure decode step); ``token_budgets``: the mixed pool's
    scheduler budget candidates (:mod:`shardc.cost.scheduler`; None = the steady-state chunk
    on every step); ``kv_reservation``: the KV tokens a mixed / decode pool holds per running
    sequence (:data:`~shardc.cost.scheduler.KV_RESERVATIONS`; default paged)."""
    if role not in ROLES:
        raise ValueError(f"unknown pool role {role!r}")
    pw = pool_workload(wl, role)
    if role == "prefill":
        return CostModel(graph, mesh, hardware, pw, **options)
    _, attended = decode_context(wl)
    chunk = (wl.isl / wl.osl if mixed_prefill is None else float(mixed_prefill)) \
        if role == "mixed" else 0.0
    return CostModel(graph, mesh, hardware, pw, attend_context=attended, mixed_prefill=chunk,
                     token_budgets=token_budgets if role == "mixed" else None,
                     kv_reservation=kv_reservation, **options)


def kv_bytes_per_token(graph: Graph, kv_bytes: float | None = None) -> float:
    """KV-cache bytes one token adds over all layers (the unsharded total)."""
    db = float(kv_bytes or graph.config.get("dtype_bytes", 2) or 2)
    return kv_elems_per_token(graph) * db


def kv_transfer_s(graph: Graph, mesh: Mesh, hardware: Hardware | str, isl: int,
                  prefill_gpus, bandwidth_scale: float = 1.0, kv_bytes: float | None = None):
    """Seconds to ship one request's KV cache (``isl`` tokens) from a prefill worker of
    ``prefill_gpus`` GPUs (array or int) to a decode worker: each GPU sends its shard over its
    own link in parallel -- NVLink when the mesh is one node, else the scale-out NIC -- plus
    one hop latency. ``bandwidth_scale`` multiplies the bandwidth (``inf`` = a free network)."""
    hw = load_hardware(hardware)
    one_node = mesh.nodes == 1
    bw = (hw.nvlink_bytes_s if one_node else hw.nic_bytes_s) * bandwidth_scale
    hop = (hw.nvlink_hop_us if one_node else hw.net_hop_us) * 1e-6
    if not np.isfinite(bw):
        return np.zeros(np.shape(prefill_gpus)) if np.ndim(prefill_gpus) else 0.0
    return isl * kv_bytes_per_token(graph, kv_bytes) / (np.asarray(prefill_gpus) * bw) + hop


def best_ratio(prefill_rates: dict[int, float], decode_gpus: int, decode_rate: float,
               mesh_gpus: int) -> tuple[int, int, int, float] | None:
    """The disaggregated deployment around one decode worker (``decode_gpus`` GPUs serving
    ``decode_rate`` requests/s): over prefill worker sizes ``g`` (``prefill_rates[g]`` =
    prompts/s of the best worker of that size) and counts ``x >= 1``, with as many decode
    workers ``y >= 1`` as fit and the prefill can feed, maximise ``min(x P, y D)``
    (requests/s). Returns
    ``(prefill_gpus, x, y, requests/s)`` or None if no pair fits; ties keep fewer GPUs.
    A size ``g = 0`` is a prefill needing no GPUs (the limit of free prefill): every GPU
    decodes."""
    best = None
    for g, p_rate in sorted(prefill_rates.items()):
        if p_rate <= 0 or g + decode_gpus > mesh_gpus:
            continue
        if g == 0:
            y = mesh_gpus // decode_gpus
            cand = (0, 1, y, float(min(p_rate, y * decode_rate)))
            best = cand if best is None or cand[3] > best[3] * (1 + 1e-12) else best
            continue
        x = np.arange(1, (mesh_gpus - decode_gpus) // g + 1)
        y_max = (mesh_gpus - x * g) // decode_gpus
        # no more decode workers than the prefill workers can feed
        y = np.clip(np.ceil(x * p_rate / decode_rate - 1e-9), 1, y_max).astype(np.int64)
        rate = np.minimum(x * p_rate, y * decode_rate)
        used = x * g + y * decode_gpus
        i = int(np.lexsort((used, -rate))[0])
        cand = (int(g), int(x[i]), int(y[i]), float(rate[i]))
        if best is None or cand[3] > best[3] * (1 + 1e-12):
            best = cand
    return best


def upper_envelope(points: list[dict], x: str = "tok_s_per_user",
                   y: str = "tok_s_per_gpu") -> list[dict]:
    """The Pareto front of ``points`` (dicts with keys ``x`` and ``y``): the points no other
    point beats in both (higher ``x`` and higher ``y``), sorted by ``x`` ascending -- so ``y``
    is non-increasing along it (best throughput at every achievable per-user speed)."""
    pts = [p for p in points if np.isfinite(p[x]) and np.isfinite(p[y]) and p[y] > 0]
    pts.sort(key=lambda p: (-p[x], -p[y]))
    front, best_y = [], -np.inf
    for p in pts:  # faster users first; keep a point only if it adds throughput
        if p[y] > best_y:
            front.append(p)
            best_y = p[y]
    return front[::-1]
