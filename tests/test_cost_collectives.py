"""Collectives equal their closed forms; topology; one TP-sharded matmul by hand."""

import dataclasses

import numpy as np
import pytest

from shardc.cost import collectives as coll
from shardc.cost import load_hardware
from shardc.cost.layer_costs import _pick_collective
from shardc.cost.topology import mesh_groups

HW = load_hardware("h100")
A0, ANV, ANET = 6.6e-6, 0.6e-6, 2.7e-6
BNV, BNIC = 450e9 * 0.81, 50e9 * 0.94
S = 64e6


def g(n, per_node, nodes):
    return coll.CommGroup(np.array([n]), np.array([per_node]), np.array([nodes]))


def test_all_reduce_ring_in_node():
    t = coll.all_reduce(S, g(8, 8, 1), HW)[0]
    assert t == pytest.approx(A0 + 2 * 7 * ANV + 2 * 7 / 8 * S / BNV, rel=1e-12)


def test_all_reduce_across_nodes_one_rank_per_node():
    t = coll.all_reduce(S, g(16, 1, 16), HW)[0]
    assert t == pytest.approx(A0 + 2 * 15 * ANET + 2 * 15 / 16 * S / BNIC, rel=1e-12)


def test_all_reduce_hierarchical():
    t = coll.all_reduce(S, g(32, 8, 4), HW)[0]
    want = A0 + 2 * 7 * ANV + 2 * 3 * ANET + 2 * 7 / 8 * S / BNV + 2 * 3 / 4 * (S / 8) / BNIC
    assert t == pytest.approx(want, rel=1e-12)


def test_all_gather_reduce_scatter_and_all_to_all_and_send():
    assert coll.all_gather(S, g(8, 8, 1), HW)[0] == pytest.approx(A0 + 7 * ANV + 7 / 8 * S / BNV)
    assert coll.reduce_scatter(S, g(4, 1, 4), HW)[0] == pytest.approx(
        A0 + 3 * ANET + 3 / 4 * S / BNIC)
    # all-to-all: per-rank volume S, one rank per node -> (n-1)/n S / B_nic
    assert coll.all_to_all(S, g(16, 1, 16), HW)[0] == pytest.approx(
        A0 + 15 * 0.5e-6 + ANET + 15 / 16 * S / BNIC)
    assert coll.all_to_all(S, g(8, 8, 1), HW)[0] == pytest.approx(
        A0 + 7 * 0.5e-6 + ANV + 7 / 8 * S / BNV)
    assert coll.send_recv(S, g(2, 1, 2), HW)[0] == pytest.approx(A0 + ANET + S / BNIC)
    for f in (coll.all_reduce, coll.all_gather, coll.all_to_all, coll.send_recv):
        assert f(S, g(1, 1, 1), HW)[0] == 0.0


def test_redistribution_codes_match_closed_forms():
    grp = g(16, 8, 2)
    codes = np.array([0, 1, 2, 3, 4])
    t = _pick_collective(codes, np.full(5, S), coll.CommGroup(*(np.repeat(x, 5) for x in (
        grp.size, grp.per_node, grp.nodes))), HW)
    assert t[0] == 0
    assert t[1] == pytest.approx(coll.all_gather(S, grp, HW)[0])
    assert t[2] == pytest.approx(coll.reduce_scatter(S, grp, HW)[0])
    assert t[3] == pytest.approx(coll.all_reduce(S, grp, HW)[0], rel=1e-12)
    assert t[4] == pytest.approx(coll.redistribution_time("all_to_all", S, grp, HW)[0])


def test_topology_tp_inner_ep_outer():
    grp = mesh_groups(np.array([8, 16, 4]), np.array([16, 4, 2]), np.array([1, 1, 1]),
                      np.array([1, 2, 8]), 8)
    # tp=8 fills a node; ep over 16 nodes one rank each
    assert (grp["tp"].per_node[0], grp["tp"].nodes[0]) == (8, 1)
    assert (grp["ep"].per_node[0], grp["ep"].nodes[0]) == (1, 16)
    # tp=16 spans 2 nodes with 8 ranks each (hierarchical)
    assert (grp["tp"].per_node[1], grp["tp"].nodes[1]) == (8, 2)
    # tp=4, ep=2: the ep group (stride 4, size 2) fits one node
    assert (grp["ep"].per_node[2], grp["ep"].nodes[2]) == (2, 1)
    # pp stride tp*ep*dp = 8 -> one rank per node
    assert (grp["pp"].per_node[2], grp["pp"].nodes[2]) == (1, 8)


def test_tp_sharded_matmul_hand_computed():
    """Llama-70B qkv (8192 -> 10240), column-parallel at TP 8, 4096 tokens, bf16, with the
    small-kernel curve switched off: compute 2*4096*8192*1280 FLOPs at 0.8 x 989.4 TFLOP/s;
    memory (8192*1280 weights + 4096*(8192+1280) activations) x 2 B at 0.9 x 3.35 TB/s;
    + 2 us launch overhead."""
    from shardc.cost.layer_costs import Batch, linear_cost
    from shardc.ir.graph import FusedOp

    hw = dataclasses.replace(HW, gemm_m_half=1e-12, gemm_nk_half=1e-12, hbm_bytes_half=1e-12)
    fop = FusedOp("qkv", 8192, 10240, params=8192 * 10240, shardable_params=8192 * 10240,
                  flops_per_token=2 * 8192 * 10240)
    one = np.ones(1)
    b = Batch(hw=hw, phase="prefill", tp=8 * one, ep=one, sp=one, seqs=one, seqs_resident=one,
              tokens=4096 * one, expert_tokens=one, lm_tokens=one, context=1, kv_context=1,
              prompt=4096, residual=np.zeros(1, int), groups={}, hidden=8192, top_k=1,
              num_experts=0, weight_bytes=2, act_bytes=2, kv_bytes=2, ssm_bytes=2,
              gemm_peak=989.4e12)
    div = np.array([[1.0, 8.0, 8.0, 1.0, 8.0]])  # column parallel
    oc = linear_cost(fop, div, 4096 * one, b)
    compute = 2 * 4096 * 8192 * 1280 / (989.4e12 * 0.8)  # 108.52 us
    memory = (8192 * 1280 * 2 + 4096 * (8192 + 1280) * 2) / (3.35e12 * 0.9)  # 32.69 us
    assert oc.compute_s[0] == pytest.approx(compute, rel=1e-9)
    assert oc.memory_s[0] == pytest.approx(memory, rel=1e-9)
    assert oc.time_s[0] == pytest.approx(108.522e-6 + 2e-6, rel=1e-4)
