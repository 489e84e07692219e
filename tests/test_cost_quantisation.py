"""FP8 linears priced as the activation quantisation + the FP8 GEMM (shardc.cost.quantisation)."""

from __future__ import annotations

import numpy as np
import pytest
from cost_graphs import fixture_graph

from shardc.cost import CostModel, load_hardware
from shardc.cost.quantisation import quant_bytes, quant_time
from shardc.cost.roofline import memory_time
from shardc.ir.space import StrategySpace, megatron_op_choices
from shardc.ir.strategy import Degrees, Mesh, Strategy, Workload

NO_SLO = dict(tpot_slo_ms=1e9, ttft_slo_ms=1e9)


def test_quant_traffic_per_scaling():
    m, k, a = 64.0, 8192.0, 2.0
    assert quant_bytes(m, k, "per-token", a) == m * k * 3 + 4 * m
    assert quant_bytes(m, k, "block", a) == m * k * 3 + 4 * m * 64
    assert quant_bytes(m, k, "per-tensor", a) == 2 * m * k * a + m * k + 4
    hw = load_hardware("h100")
    t = {s: float(quant_time(m, k, s, a, hw)) for s in ("per-tensor", "per-token", "block")}
    assert t["per-tensor"] > t["block"] > t["per-token"] > 0
    assert t["per-token"] == pytest.approx(memory_time(m * k * 3 + 4 * m, hw)
                                           + hw.kernel_overhead_us * 1e-6)
    assert float(quant_time(0.0, k, "block", a, hw)) == 0.0


def _simulate(wl, kernels="roofline", engine="vllm", tp=8, batch=64):
    g, mesh = fixture_graph("llama3_70b"), Mesh(8, 1)
    space = StrategySpace(g, mesh, Workload(**{**wl.__dict__, "batch": batch}))
    ch = dict(zip(space.op_slots, (int(c) for c in megatron_op_choices(
        space, space.values["tp"].index(tp)))))
    cm = CostModel(g, mesh, "h100", wl, kernels=kernels, engine=engine)
    return cm.simulate(Strategy(Degrees(tp=tp), batch, ch))


@pytest.mark.parametrize("scaling", ["per-tensor", "per-token", "block"])
def test_roofline_fp8_linear_is_gemm_plus_quantisation(scaling):
    """Each FP8 linear row carries its quantisation at the closed form (tokens x input
    features per GPU); BF16 rows carry none; the scalings order the step times."""
    wl = Workload(context=2048, weights="fp8", fp8_scaling=scaling, **NO_SLO)
    rows = {(r["layer_kind"], r["op"]): r for r in _simulate(wl).ops}
    hw = load_hardware("h100")
    qkv = rows[("block", "qkv")] if ("block", "qkv") in rows else next(
        r for (kind, op), r in rows.items() if op == "qkv")
    want = float(quant_time(64.0, 8192.0, scaling, 2.0, hw)) * 1e3  # col: whole input
    assert qkv["act_quant_ms"] == pytest.approx(want, rel=1e-9)
    assert qkv["time_ms"] > qkv["act_quant_ms"] > 0
    bf = {(r["layer_kind"], r["op"]): r for r in _simulate(
        Workload(context=2048, **NO_SLO)).ops}
    assert all(r["act_quant_ms"] == 0 for r in bf.values())


def test_fp8_scalings_order_the_step_and_block_reads_its_table():
    base = dict(context=2048, weights="fp8", **NO_SLO)
    tpot = {s: _simulate(Workload(fp8_scaling=s, **base)).predicted["tpot_ms"]
            for s in ("per-tensor", "per-token")}
    assert tpot["per-tensor"] > tpot["per-token"]
    ex = _simulate(Workload(fp8_scaling="block", **base), kernels="silicon", engine="sglang")
    from shardc.cost.silicon import kernels_for

    k, _, _ = kernels_for(load_hardware("h100"), "silicon", "sglang")
    assert "gemm_fp8_block" in k.t and k.gemm_dtype(True, True) == "fp8_block"
    assert k.gemm_dtype(True, False) == "fp8" and k.gemm_dtype(False, True) == "bf16"
    src = {r["op"]: r["kernel_source"] for r in ex.ops}
    assert src["qkv"].startswith("silicon")
    t_blk, _ = k.gemm(np.array([64.0, 4096.0]), 10240.0, 8192.0, True, True)
    t_fp8, _ = k.gemm(np.array([64.0, 4096.0]), 10240.0, 8192.0, True, False)
    assert np.isfinite(t_blk).all() and not np.allclose(t_blk, t_fp8)
