"""FP8 linears as two kernels: the activation quantisation and the FP8 GEMM.

An FP8 linear (``--weights fp8``: FP8 weights, FP8 tensor cores) first quantises its BF16
input to FP8 -- a memory-bound kernel of its own -- then runs the GEMM on FP8 operands. The
activation scaling (``fp8_scaling`` of :class:`~shardc.cost.model.CostModel`) sets the
quantisation's traffic and kernels (``m`` tokens x ``k`` input features per GPU, input at
``a`` bytes per element):

* ``per-tensor`` (dynamic, one scale per tensor; vLLM's ``--quantization fp8`` of a BF16
  checkpoint): an amax pass then the quantise pass -- 2 kernels, ``m k a`` read twice,
  ``m k`` bytes written;
* ``per-token`` (one scale per row): one kernel, ``m k a`` read, ``m k`` + ``4 m`` written;
* ``block`` (one scale per 1 x 128 group of a row; DeepSeek-V3's checkpoint, with 128 x 128
  weight blocks): one kernel, ``m k a`` read, ``m k`` + ``4 m ceil(k / 128)`` written, and the
  GEMM is the block-scaled kernel (the ``fp8_block`` GEMM table where the engine has one).

Roofline pricing (:func:`shardc.cost.layer_costs.linear_cost`): the GEMM reads FP8
activations (1 byte) at the FP8 peak, plus :func:`quant_time`. Measured pricing: the FP8
tables time the engine's whole FP8 linear (vLLM ``CutlassFP8ScaledMMLinearKernel``, SGLang
``sgl_kernel fp8_scaled_mm``, TRT-LLM's torch flow: input quantisation included), so the
measured time stands for both kernels and the split is reported (the quantisation at its
roofline, the GEMM the rest, never below its own floor). Units: seconds, bytes.
"""

from __future__ import annotations

import numpy as np

from shardc.cost.roofline import memory_time
from shardc.ir.strategy import FP8_SCALINGS  # noqa: E402,F401  (the Workload's values)

DEFAULT_FP8_SCALING = "per-tensor"
BLOCK = 128  # activation group (and weight block side) of the block scaling, elements


def quant_bytes(m, k, scaling: str, act_bytes: float) -> np.ndarray:
    """HBM bytes the activation quantisation of an ``m x k`` input moves."""
    m, k = np.asarray(m, dtype=np.float64), np.asarray(k, dtype=np.float64)
    if scaling == "per-tensor":
        return 2.0 * m * k * act_bytes + m * k + 4.0
    scales = 4.0 * m * (np.ceil(k / BLOCK) if scaling == "block" else 1.0)
    return m * k * act_bytes + m * k + scales


def quant_kernels(scaling: str) -> int:
    """Kernels the activation quantisation launches."""
    if scaling not in FP8_SCALINGS:
        raise ValueError(f"fp8_scaling {scaling!r}: expected one of {FP8_SCALINGS}")
    return 2 if scaling == "per-tensor" else 1


def quant_time(m, k, scaling: str, act_bytes: float, hw) -> np.ndarray:
    """Seconds of the activation quantisation (memory-bound kernels + their launches);
    0 where ``m`` is 0."""
    m = np.asarray(m, dtype=np.float64)
    t = memory_time(quant_bytes(m, k, scaling, act_bytes), hw) \
        + quant_kernels(scaling) * hw.kernel_overhead_us * 1e-6
    return np.where(m > 0, t, 0.0)
