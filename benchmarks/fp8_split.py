"""FP8 linears on the measured tables: fp8 / bf16 and the activation quantisation's share.

    .venv/bin/python benchmarks/fp8_split.py

Llama-3.1-8B's linear shapes on H200 with vLLM's GEMM tables (docs/validation.md, "FP8
linears"): the BF16 GEMM, the engine's whole FP8 linear (its input quantisation included),
their ratio, the per-tensor quantisation at its roofline (shardc.cost.quantisation) and the
ratio without it. Prints a markdown table.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from shardc.cost import load_hardware  # noqa: E402
from shardc.cost.quantisation import quant_time  # noqa: E402
from shardc.cost.silicon import kernels_for  # noqa: E402

SHAPES = {"qkv": (6144, 4096), "out_proj": (4096, 4096), "ffn1": (28672, 4096),
          "ffn2": (4096, 14336)}  # (n, k) of Llama-3.1-8B at tp = 1
TOKENS = (16, 256, 2048, 16384)


def main() -> None:
    hw = load_hardware("h200")
    k, _, reason = kernels_for(hw, "silicon", "vllm")
    if k is None:
        raise SystemExit(f"no measured tables: {reason}")
    print("| op (n x k) | tokens | bf16 ms | fp8 linear ms (table) | fp8 / bf16 | per-tensor "
          "quant ms (roofline) | fp8 GEMM without the quant / bf16 |")
    print("|---|---|---|---|---|---|---|")
    for op, (n, kk) in SHAPES.items():
        for m in TOKENS:
            b, _ = k.gemm(np.array([float(m)]), n, kk, False)
            f, _ = k.gemm(np.array([float(m)]), n, kk, True)
            q = float(quant_time(m, kk, "per-tensor", 2.0, hw))
            print(f"| {op} ({n} x {kk}) | {m} | {b[0] * 1e3:.4f} | {f[0] * 1e3:.4f} | "
                  f"{f[0] / b[0]:.2f} | {q * 1e3:.4f} | {(f[0] - q) / b[0]:.2f} |")


if __name__ == "__main__":
    main()
