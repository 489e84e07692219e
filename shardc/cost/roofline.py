"""Operator time: a roofline with efficiency that falls for small kernels.

For one kernel doing ``flops`` FLOPs and moving ``bytes`` bytes of HBM traffic::

    time = max(flops / (peak * eff_flops), bytes / (hbm_bw * eff_bytes)) + kernels * overhead

* GEMM FLOP efficiency ``eff_flops = gemm_eff * m / (m + m_half) * nk / (nk + nk_half)``:
  ``m`` = tokens per matrix (tensor-core tiles are wasted below ~64 rows) and ``nk`` = the
  per-device weight-shard elements (a thin shard cannot fill 132 SMs). With the H100 preset
  (m_half 32, nk_half 2^20): m = 4096 -> 99% of gemm_eff; m = 64 -> 67%; an 8192 x 1280 shard
  -> 91%, an 8192 x 160 shard (TP 64) -> 56%. This is what gives over-sharding its price.
* HBM efficiency ``eff_bytes = hbm_eff * bytes / (bytes + bytes_half)``: a kernel reading a
  few hundred KB never reaches streaming bandwidth (launch, ramp-up, tail).
* attention kernels use ``attention_eff`` of the bf16 peak for FLOPs.
* ``overhead`` = ``kernel_overhead_us`` per kernel (launch gap under CUDA graphs).

All inputs are numpy arrays (broadcast together); times are seconds.
"""

from __future__ import annotations

import numpy as np

from shardc.cost.hardware_presets import Hardware


def gemm_flop_efficiency(m, nk, hw: Hardware):
    """Achieved fraction of peak FLOP/s for a GEMM with ``m`` rows and an ``nk`` weight."""
    m = np.maximum(np.asarray(m, dtype=np.float64), 1e-9)
    nk = np.maximum(np.asarray(nk, dtype=np.float64), 1.0)
    return hw.gemm_eff * m / (m + hw.gemm_m_half) * nk / (nk + hw.gemm_nk_half)


def hbm_efficiency(nbytes, hw: Hardware):
    """Achieved fraction of peak HBM bandwidth for a kernel moving ``nbytes``."""
    b = np.maximum(np.asarray(nbytes, dtype=np.float64), 1.0)
    return hw.hbm_eff * b / (b + hw.hbm_bytes_half)


def compute_time(flops, eff, peak_flops: float):
    """Seconds of FLOPs at ``eff`` x ``peak_flops``."""
    return np.asarray(flops, dtype=np.float64) / (peak_flops * np.maximum(eff, 1e-12))


def memory_time(nbytes, hw: Hardware):
    """Seconds to move ``nbytes`` of HBM traffic in one kernel."""
    b = np.asarray(nbytes, dtype=np.float64)
    return b / (hw.hbm_bytes_s * hbm_efficiency(b, hw))


def kernel_time(compute_s, memory_s, kernels, hw: Hardware):
    """Roofline of one fused op: max(compute, memory) + launch overhead (seconds)."""
    return np.maximum(compute_s, memory_s) + kernels * hw.kernel_overhead_us * 1e-6
