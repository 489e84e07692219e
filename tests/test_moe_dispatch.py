"""The MoE exchange as served (shardc/cost/moe_dispatch.py) and the experts' tp all-reduce on
``T`` tokens after the weighted top-k sum, in the cost model and in both backends."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist
from cost_graphs import fixture_graph

from shardc.cost import CostModel, load_hardware
from shardc.cost.moe_dispatch import exchange_rows, exchange_time, fp8_dispatch_row_bytes
from shardc.cost.topology import comm_group
from shardc.ir.space import StrategySpace, megatron_op_choices
from shardc.ir.strategy import Degrees, Mesh, Strategy, Workload

ROOT = Path(__file__).resolve().parents[1]
MIXTRAL = str(ROOT / "examples" / "tiny_mixtral.py")
H800 = str(ROOT / "benchmarks" / "hardware" / "h800.toml")


def _megatron(graph, mesh, wl, deg: Degrees, batch: int, **opts):
    cm = CostModel(graph, mesh, "h100", wl, expert_imbalance=1.0, **opts)
    space = StrategySpace(graph, mesh, Workload(**{**wl.__dict__, "batch": batch}))
    ch = dict(zip(space.op_slots, (int(c) for c in
                                   megatron_op_choices(space, space.values["tp"].index(deg.tp)))))
    return cm, Strategy(deg, batch, ch)


def _experts_rows(ex, coll_name: str, dim: str):
    return [r for r in ex.collectives if r[1] == "experts" and r[3] == coll_name and r[4] == dim]


@pytest.mark.parametrize("name", ["mixtral_8x7b", "deepseek_v3"])
def test_experts_tp_all_reduce_is_charged_on_tokens_not_routed_rows(name):
    """Megatron col/row experts at tp 8: one all-reduce per MoE layer, of T x hidden x 2
    bytes (the combined tokens), not T x top_k x hidden x 2 (Mixtral 2x, DeepSeek 8x)."""
    graph = fixture_graph(name)
    hidden, top_k = graph.config["hidden"], graph.config["top_k"]
    batch = 64
    wl = Workload(phase="decode", batch=batch, context=1024, tpot_slo_ms=1e9)
    for ep in (1, 8):
        cm, st = _megatron(graph, Mesh(8, 8), wl, Degrees(tp=8, ep=ep, dp=8 // ep), batch)
        ex = cm.simulate(st)
        ars = _experts_rows(ex, "all_reduce", "tp")
        tokens = batch / ep  # T: sequences per attention group x 1 token
        assert [r[5] for r in ars] == [tokens * hidden * 2], (ep, ars, top_k)


def test_dispatch_and_combine_bytes_follow_the_tp_layout():
    """A token-split residual (sp) dispatches 1/tp of the routed bytes; FP8 dispatch sends 1
    byte per channel + one fp32 scale per 128; the combine stays bf16."""
    graph = fixture_graph("mixtral_8x7b")
    hidden, top_k = graph.config["hidden"], graph.config["top_k"]
    wl = Workload(phase="prefill", batch=8, prompt=512, ttft_slo_ms=1e9)
    tokens = 512  # one sequence per attention group (ep 8, batch 8)
    sent = {}
    for sp in (1, 4):
        for fp8 in (False, True):
            cm, st = _megatron(graph, Mesh(8, 4), wl, Degrees(tp=4, ep=8, sp=sp), 8,
                               fp8_dispatch=fp8)
            ex = cm.simulate(st)
            rows = {r[2]: r[5] for r in ex.collectives if r[1] == "experts" and r[4] == "ep"}
            sent[sp, fp8] = rows
    assert sent[1, False]["dispatch"] == tokens * top_k * hidden * 2
    assert sent[4, False]["dispatch"] == tokens / 4 * top_k * hidden * 2
    assert sent[1, True]["dispatch"] == pytest.approx(tokens * top_k * hidden * (1 + 4 / 128))
    assert sent[1, True]["combine"] == sent[1, False]["combine"] == tokens * top_k * hidden * 2


def test_normal_mode_deduplicates_by_node_and_low_latency_does_not():
    """Per token, normal mode sends at most one NIC copy per other node (fewer than the
    top-k copies that cross nodes); low-latency mode sends every copy."""
    hw = load_hardware(H800)
    g = comm_group(np.array([64]), np.array([1]), 8)  # 8 nodes x 8 ranks
    nv_n, nic_n, _ = exchange_rows("normal", g, 256, 8)
    nv_l, nic_l, all_l = exchange_rows("low_latency", g, 256, 8)
    assert nic_l[0] == pytest.approx(8 * 56 / 64) and all_l[0] == 8
    p_node = 1 - np.prod([(256 - 32 - i) / (256 - i) for i in range(8)])  # >= 1 of 8 of 32
    assert nic_n[0] == pytest.approx(7 * p_node) and nic_n[0] < nic_l[0]
    assert nv_n[0] > 0 and nv_l[0] == pytest.approx(8 * 7 / 64)
    t_n, _ = exchange_time("normal", 4096, 7168 * 2, g, 256, 8, 1.0, hw)
    t_l, _ = exchange_time("low_latency", 4096, 7168 * 2, g, 256, 8, 1.0, hw)
    assert t_n[0] < t_l[0]  # at prefill sizes the deduplicated mode moves fewer bytes


def test_receiving_rank_scales_with_imbalance_and_single_rank_is_free():
    hw = load_hardware(H800)
    g = comm_group(np.array([1, 16]), np.array([1, 1]), 8)
    row = fp8_dispatch_row_bytes(7168)
    t1, _ = exchange_time("low_latency", 128, row, g, 256, 8, 1.0, hw)
    t2, _ = exchange_time("low_latency", 128, row, g, 256, 8, 1.5, hw)
    assert t1[0] == t2[0] == 0.0
    lat = (hw.collective_base_us + hw.net_hop_us) * 1e-6
    wire = 128 * 8 * 8 / 16 * row / hw.nic_bytes_s
    assert t1[1] > lat + wire and t2[1] - lat > 1.45 * (t1[1] - lat)


def test_deepep_low_latency_within_20_percent_at_ep_16_to_128():
    """The must-show of docs/validation.md: per-call times vs DeepEP's measured numbers."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import deepep_validation

    for r in deepep_validation.rows():
        if r["ep"] in deepep_validation.MUST_SHOW:
            assert 0.8 <= r["dispatch_ratio"] <= 1.2, r
            assert 0.8 <= r["combine_ratio"] <= 1.2, r


def test_best_layouts_never_cost_more_than_the_backends():
    """``moe_layouts="best"`` (every reachable crossing placement) <= the backend's rule."""
    graph = fixture_graph("deepseek_v3")
    wl = Workload(phase="prefill", batch=32, prompt=1024, ttft_slo_ms=1e9)
    mesh = Mesh(8, 4)
    space = StrategySpace(graph, mesh, wl)
    rng = np.random.default_rng(0)
    acts = np.stack([rng.integers(0, n, 500) for n in space.nvec]).T  # random actions
    a = CostModel(graph, mesh, "h100", wl).evaluate(acts, space)
    b = CostModel(graph, mesh, "h100", wl, moe_layouts="best").evaluate(acts, space)
    ok = np.isfinite(a.ttft_ms) & space.degrees_valid(acts)
    assert ok.sum() > 50
    assert (b.ttft_ms[ok] <= a.ttft_ms[ok] * (1 + 1e-12)).all()


# ---------------------------------------------------------------- backend = cost model
def _fake(world: int):
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)


def _moe_block(model):
    layer = model.model.layers[0]
    return layer.mlp if hasattr(layer, "mlp") else layer.block_sparse_moe


def _charged(strategy, tokens: int) -> list[tuple]:
    """The cost model's experts-branch tp/ep collectives of one MoE layer (decode, T tokens
    per attention group; fp32 tiny graph)."""
    from shardc.frontends import load_graph

    graph = load_graph(MIXTRAL, tiny=True)
    deg = strategy.degrees
    cm = CostModel(graph, Mesh(deg.world, 1), "h100",
                   Workload(phase="decode", batch=strategy.batch, context=512),
                   expert_imbalance=1.0)
    ex = cm.simulate(strategy)
    assert tokens == strategy.batch // deg.ep
    return sorted((r[3], r[4], int(round(r[5]))) for r in ex.collectives
                  if r[1] in ("router", "experts"))


MOE_CHOICES = {"embedding": "vocab", "moe_block.qkv": "col", "moe_block.attn_core": "heads",
               "moe_block.out_proj": "row", "moe_block.router": "rep",
               "moe_block.expert_ffn1": "col", "moe_block.expert_ffn2": "row", "lm_head": "col"}


@pytest.mark.parametrize("degrees", [{"tp": 4}, {"tp": 2, "ep": 2}])
def test_backend_moe_collectives_are_the_cost_models(degrees):
    """The MoE block of the tiny Mixtral (col/row experts, replicated router) on fake ranks
    issues exactly the cost model's experts-branch collectives: the tp all-reduce of the
    combined ``[T, hidden]`` output (not of the ``T x top_k`` routed rows) and, with ep,
    the dispatch / combine of the routed rows (plus the exempt count exchange)."""
    from collective_record import CollectiveRecorder, group_names
    from torch.distributed.device_mesh import init_device_mesh

    from shardc.backends.verify import _build
    from shardc.frontends import load_graph
    from shardc.ir.strategy import strategy_from_names
    from shardc.plan import build_plan

    tokens = 8
    ep = degrees.get("ep", 1)
    strategy = strategy_from_names(degrees, MOE_CHOICES, tokens * ep)
    want = _charged(strategy, tokens)
    world = strategy.degrees.world
    _fake(world)
    try:
        model, _ = _build(MIXTRAL, 1, 1)
        graph = load_graph(MIXTRAL, tiny=True)
        plan = build_plan(graph, strategy, Mesh(world, 1), "h100",
                          Workload(batch=strategy.batch, context=512))
        spec = importlib.util.spec_from_loader("moe_dispatch_parallelize", loader=None)
        code = importlib.util.module_from_spec(spec)
        exec(compile(plan.code(standalone=True), "<parallelize.py>", "exec"), code.__dict__)
        mesh = init_device_mesh("cpu", tuple(code.MESH_SHAPE),
                                mesh_dim_names=tuple(code.MESH_DIM_NAMES))
        code.parallelize(model, world_mesh=mesh)
        groups = group_names([mesh])
        hidden = model.config.hidden_size
        x = torch.randn(tokens, 1, hidden)
        with torch.no_grad(), CollectiveRecorder(groups) as rec:
            out = _moe_block(model)(x)
        out = out[0] if isinstance(out, tuple) else out
        assert out.shape[-1] == hidden
    finally:
        dist.destroy_process_group()
    got = sorted(rec.records)
    if ep > 1:  # exempt: the per-expert counts exchanged first
        got.remove(("all_to_all", "ep", model.config.num_local_experts * 8))
    assert got == want
    assert ("all_reduce", "tp", tokens * hidden * 4) in got
    assert want.count(("all_reduce", "tp", tokens * hidden * 4)) == 1
