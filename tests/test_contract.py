"""The sharding contract (shardc.ir.contract) against independent oracles: DTensor's own
sharding propagation for what each linear/embedding choice produces, and walk invariants
over every branch and choice combination."""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.testing._internal.distributed.fake_pg import FakeStore

from shardc.ir.contract import (
    BRANCHES,
    CHOICE_NAMES,
    MODES,
    NUM_CHOICES,
    PLACEMENTS,
    TOKEN_SPLIT,
    branch_ends,
    legal,
    op_choice,
    redistribution,
    walk,
)

TP = 4


@pytest.fixture(scope="module")
def tp_mesh():
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=TP)
    yield init_device_mesh("cpu", (TP,), mesh_dim_names=("tp",))
    dist.destroy_process_group()


def _torch_placement(p: str):
    return {"R": Replicate(), "S(0)": Shard(0), "S(1)": Shard(1), "P": Partial()}[p]


def _spelled(pl) -> str:
    if pl.is_replicate():
        return "R"
    if pl.is_shard():
        return f"S({pl.dim})"
    return "P"


LINEAR_OPS = [op for op, names in CHOICE_NAMES.items() if names == ("col", "row", "rep")]


@pytest.mark.parametrize("op", LINEAR_OPS)
@pytest.mark.parametrize("index", [0, 1])
def test_linear_choice_produces_what_dtensor_propagates(tp_mesh, op, index):
    """A [tokens, in] activation at the choice's ``need``, times a [out, in] weight cut as
    ``weight_split`` says, gives DTensor's output placement == the choice's ``produces``."""
    c = op_choice(op, index)
    x = DTensor.from_local(torch.randn(8, 16 // (TP if c.need == "S(1)" else 1)), tp_mesh,
                           [_torch_placement(c.need)])
    w_full = torch.randn(32, 16)
    w = DTensor.from_local(w_full.chunk(TP, dim={"out": 0, "in": 1}[c.weight_split])[0],
                           tp_mesh, [Shard({"out": 0, "in": 1}[c.weight_split])])
    y = F.linear(x, w)
    assert _spelled(y.placements[0]) == c.produces
    assert c.parallel_style in ("ColwiseParallel", "RowwiseParallel")


@pytest.mark.parametrize("index", [0, 1])
def test_embedding_choice_produces_what_dtensor_propagates(tp_mesh, index):
    c = op_choice("embedding", index)
    ids = DTensor.from_local(torch.randint(0, 64, (8,)), tp_mesh, [Replicate()])
    dim = {"vocab": 0, "hidden": 1}[c.weight_split]
    table = torch.randn(64, 32)
    w = DTensor.from_local(table.chunk(TP, dim=dim)[0], tp_mesh, [Shard(dim)])
    y = F.embedding(ids, w)
    assert _spelled(y.placements[0]) == c.produces


@pytest.mark.parametrize("branch", list(BRANCHES) + ["embedding", "lm_head"])
@pytest.mark.parametrize("residual", ["R", "S(0)"])
def test_walk_invariants_for_every_choice_combination(branch, residual):
    """Replaying a walk's repairs reaches every op at its need and ends at the branch end;
    a repair is issued exactly where the placements differ and a collective is needed."""
    ops = BRANCHES.get(branch, (branch,))
    start, end = branch_ends(branch, residual)
    for choices in itertools.product(range(NUM_CHOICES), repeat=len(ops)):
        w = walk(ops, choices, start, end)
        cur = start
        for step, c in zip(w.steps, choices):
            assert step.choice == op_choice(step.op, c)
            if step.repair:
                src, dst, coll = step.repair
                assert (src, dst) == (cur, step.need) and coll == redistribution(src, dst)
            else:
                assert redistribution(cur, step.need) is None
            cur = step.produced
            assert cur in PLACEMENTS
            assert MODES[step.mode]
            if step.choice.name == "rep":
                assert (step.mode == TOKEN_SPLIT) == (step.need == "S(0)")
        if w.end_repair:
            assert w.end_repair[:2] == (cur, end)
        else:
            assert redistribution(cur, end) is None


def test_legality_rules():
    qkv_col, out_row = op_choice("qkv", 0), op_choice("out_proj", 1)
    assert legal(qkv_col, 8, 8192, 10240, 64, 8) and legal(qkv_col, 16, 8192, 10240, 64, 8)
    assert not legal(qkv_col, 16, 8192, 10240, 64, 8, replicate_kv_heads=False)
    assert not legal(qkv_col, 12, 8192, 10240, 96, 8)  # 8 KV heads do not divide 12
    assert legal(out_row, 8, 8192, 8192, 64, 8) and not legal(out_row, 3, 8192, 8192, 64, 8)
    assert legal(op_choice("ffn1", 0), 8, 8192, 28672, 64, 8)
    assert not legal(op_choice("ffn1", 1), 3, 8192, 28672, 64, 8)
    assert all(legal(op_choice(op, 2), 7, 5, 5, 1, 1) for op in CHOICE_NAMES)
