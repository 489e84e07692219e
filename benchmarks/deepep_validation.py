"""Per-call MoE dispatch / combine times of the cost model against DeepEP's measured
low-latency kernels (shared/REFERENCE.md: H800, 128 tokens per rank, hidden 7168, top-8,
256 experts, FP8 dispatch, BF16 combine, EP 8-256).

    .venv/bin/python benchmarks/deepep_validation.py [--markdown]

The times come from :func:`shardc.cost.moe_dispatch.exchange_time` in low-latency mode (the
mode the cost model uses in decode) on the H800 preset (benchmarks/hardware/h800.toml), one
ep rank per GPU, 8 GPUs per node. The benchmark routes uniformly at random, so the load
imbalance of the busiest receiving rank is that of uniform routing: estimated here by
sampling that routing (fixed seed), not the cost model's default for real traffic.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from shardc.cost import load_hardware  # noqa: E402
from shardc.cost.moe_dispatch import exchange_time, fp8_dispatch_row_bytes  # noqa: E402
from shardc.cost.topology import comm_group  # noqa: E402

H800 = str(ROOT / "benchmarks" / "hardware" / "h800.toml")
TOKENS, HIDDEN, TOP_K, EXPERTS, GPUS_PER_NODE = 128, 7168, 8, 256, 8
COMBINE_BYTES = 2  # BF16
# measured (us), REFERENCE.md: EP -> (dispatch, combine)
MEASURED = {8: (77, 114), 16: (118, 195), 32: (155, 273), 64: (173, 314), 128: (192, 369),
            256: (194, 360)}
MUST_SHOW = (16, 32, 64, 128)  # the band: within 20% at EP 16-128


def uniform_imbalance(ep: int, trials: int = 10, seed: int = 0) -> float:
    """Mean over ``trials`` of (rows the busiest rank receives / mean) when every one of
    ``ep`` ranks routes ``TOKENS`` tokens to ``TOP_K`` distinct experts drawn uniformly."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(trials):
        scores = rng.random((ep * TOKENS, EXPERTS))
        experts = np.argpartition(scores, -TOP_K, axis=1)[:, -TOP_K:]
        per_rank = np.bincount((experts // (EXPERTS // ep)).ravel(), minlength=ep)
        out.append(per_rank.max() / per_rank.mean())
    return float(np.mean(out))


def rows() -> list[dict]:
    hw = load_hardware(H800)
    result = []
    for ep, (m_disp, m_comb) in MEASURED.items():
        group = comm_group(np.array([ep]), np.array([1]), GPUS_PER_NODE)
        imb = uniform_imbalance(ep)
        disp, _ = exchange_time("low_latency", TOKENS, fp8_dispatch_row_bytes(HIDDEN), group,
                                EXPERTS, TOP_K, imb, hw)
        comb, _ = exchange_time("low_latency", TOKENS, HIDDEN * COMBINE_BYTES, group,
                                EXPERTS, TOP_K, imb, hw)
        d_us, c_us = float(disp[0]) * 1e6, float(comb[0]) * 1e6
        result.append(dict(ep=ep, nodes=int(group.nodes[0]), imbalance=imb,
                           dispatch_us=d_us, dispatch_measured=m_disp, dispatch_ratio=d_us / m_disp,
                           combine_us=c_us, combine_measured=m_comb, combine_ratio=c_us / m_comb))
    return result


def markdown(rs: list[dict]) -> str:
    lines = ["| EP | nodes | imbalance | dispatch predicted (us) | measured | ratio | "
             "combine predicted (us) | measured | ratio |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rs:
        lines.append(f"| {r['ep']} | {r['nodes']} | {r['imbalance']:.3f} | "
                     f"{r['dispatch_us']:.0f} | {r['dispatch_measured']} | "
                     f"{r['dispatch_ratio']:.2f} | {r['combine_us']:.0f} | "
                     f"{r['combine_measured']} | {r['combine_ratio']:.2f} |")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--markdown", action="store_true")
    args = ap.parse_args()
    rs = rows()
    if args.markdown:
        print(markdown(rs))
    else:
        for r in rs:
            print(f"EP {r['ep']:>3}: dispatch {r['dispatch_us']:6.1f} us vs "
                  f"{r['dispatch_measured']} ({r['dispatch_ratio']:.2f}), combine "
                  f"{r['combine_us']:6.1f} us vs {r['combine_measured']} "
                  f"({r['combine_ratio']:.2f}), imbalance {r['imbalance']:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
