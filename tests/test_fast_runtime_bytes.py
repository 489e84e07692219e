"""The fast runtime's decode step issues exactly the collectives the cost model charges, as
(collective, mesh dim, bytes), on 4 fake ranks (rank 0 of a ``fake`` process group, the
plan's torch-style ``parallelize.py`` placing the weights of the tiny model).

One decode step (``[rows, 1]`` token ids, float32) of :class:`shardc.runtime.fast.FastModel`
runs under :class:`collective_record.CollectiveRecorder`; the expected multiset is
:meth:`CostModel.simulate`'s ``collectives`` for the plan (decode, ``batch`` = 8 sequences
per dp replica: each rank's layers see ``8 / ep`` rows), as in
``tests/test_runtime_styles_bytes.py``. The one exempt extra, issued and not charged: with
ep > 1 the per-expert counts exchange before the uneven dispatch, one ``all_to_all`` of
``E`` int64 per MoE layer (not with the experts split their own way: the all-gather dispatch
of ``moe_tp`` / ``moe_ep`` issues exactly the charged all-gather, reduce-scatter and
all-reduce). Unlike the model-level forward, a decode step gathers no logits
over dp x ep (``generate`` gathers the new tokens once, at the end).
"""

from __future__ import annotations

import importlib.util

import pytest
import torch
import torch.distributed as dist
from collective_record import CollectiveRecorder, group_names
from test_backend_fake import assert_records_match
from test_fast_runtime import CASES as GLOO_CASES
from test_runtime_styles_bytes import charged

BATCH = 8
CHECKED = ["llama tp4", "llama dp2 tp2 batch-split attention", "mixtral ep2 tp2",
           "deepseek MLA tp4", "mixtral dp_attn4 moe_tp4", "mixtral tp2 dp_attn2 moe_tp4",
           "mixtral tp2 dp_attn2 moe_ep4", "mixtral tp4 moe_ep4",
           "mixtral dp_attn4 moe_tp2 moe_ep2", "mixtral tp4 moe_tp2 moe_ep2",
           "deepseek dp_attn4 moe_tp4, shared expert", "deepseek tp2 dp_attn2 moe_ep4, shared expert"]


def _decode_records(plan, walks, model_file, strategy, label, rank=0):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from shardc.backends.verify import _build
    from shardc.runtime.fast import FastModel
    from shardc.runtime.generate import decode_step

    spec = importlib.util.spec_from_loader(f"fast_bytes_{abs(hash(label))}", loader=None)
    code = importlib.util.module_from_spec(spec)
    exec(compile(plan.code(standalone=True), f"<{label} parallelize.py>", "exec"), code.__dict__)
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=4)
    try:
        world = init_device_mesh("cpu", tuple(code.MESH_SHAPE),
                                 mesh_dim_names=tuple(code.MESH_DIM_NAMES))
        deg = strategy.degrees
        rows = BATCH // deg.ep
        model, ids = _build(model_file, rows, 1)
        model = code.parallelize(model, world_mesh=world)
        fast = FastModel(model, world, walks, code.LAYER_KINDS)
        cache = fast.new_cache(rows, 16)
        cache.reset(torch.zeros(rows, dtype=torch.long))
        with torch.no_grad(), CollectiveRecorder(group_names([world])) as rec:
            decode_step(fast, cache, ids)
    finally:
        dist.destroy_process_group()
    return list(rec.records)


def decode_collectives_match(name: str, model_file: str, degrees: dict, choices: dict):
    """Assert one decode step of the plan issues the cost model's collectives."""
    from shardc.backends.runtime_walks import plan_walks
    from shardc.frontends import load_graph
    from shardc.ir.strategy import Mesh, Workload, strategy_from_names
    from shardc.plan import build_plan

    graph = load_graph(model_file, tiny=True)
    strategy = strategy_from_names(degrees, choices, BATCH)
    plan = build_plan(graph, strategy, Mesh(strategy.degrees.world, 1), "h100",
                      Workload(batch=BATCH, context=512))
    walks = plan_walks({str(o["name"]): str(o["choice"]) for o in plan.ops}, strategy.degrees)
    got = _decode_records(plan, walks, model_file, strategy, name)
    experts = int(graph.config.get("num_experts", 0) or 0)
    deg = strategy.degrees
    extras = []
    for k in graph.layer_kinds:
        if k.op("expert_ffn1") is None:
            continue
        if deg.ep > 1 and not deg.experts_resplit:  # (the all-gather dispatch: no counts)
            extras += [("all_to_all", "ep", experts * 8)] * k.count
        if deg.sp > 1 and walks["kinds"][k.name]["experts"]["steps"][0][1] != "rep":
            # the tp ranks' per-expert counts, all-gathered before their rows (E / ep int64)
            extras += [("all_gather", "tp", experts // deg.ep * 8 * deg.tp)] * k.count
    for extra in extras:
        assert extra in got, (f"count exchange {extra} not issued", sorted(got))
        got.remove(extra)
    assert got, name
    # the cost model names a tp all-to-all (S(0) <-> S(1)) by its full tensor's bytes, the
    # recorder by this rank's send buffer (1 / tp of it): compare in the cost model's unit
    tp = strategy.degrees.tp
    got = [(c, d, b * tp if (c, d) == ("all_to_all", "tp") else b) for c, d, b in got]
    assert_records_match(got, charged(graph, strategy), name)


@pytest.mark.parametrize("name", CHECKED)
def test_decode_step_collectives_are_the_cost_models(name):
    decode_collectives_match(name, *GLOO_CASES[name])


def test_pipelined_decode_step_sends_the_cost_models_bytes():
    """pp = 2 x tp = 2: the first stage's rank issues the embedding's and its layers'
    collectives and one send of the step's activations to the next stage; the last stage's
    rank one receive and its layers' and lm_head's collectives. The cost model prices a
    decode step as ``micro_batches`` (= pp) micro-batches of ``rows / pp`` rotating through
    the stages (its rows and ``Breakdown.pp_send_bytes``: one micro-batch's); the runtime
    runs the step's rows as one micro-batch through the stages in turn (as
    ``predicted.runtime`` prices it, :mod:`shardc.cost.runtime_step`): every collective and
    the send carry ``micro_batches`` x the charged bytes, issued once."""
    from shardc.backends.runtime_walks import plan_walks
    from shardc.cost import CostModel
    from shardc.frontends import load_graph
    from shardc.ir.strategy import Mesh, Workload, strategy_from_names
    from shardc.plan import build_plan

    model_file, degrees, choices = GLOO_CASES["llama pp2 tp2"]
    graph = load_graph(model_file, tiny=True)
    strategy = strategy_from_names(degrees, choices, BATCH)
    plan = build_plan(graph, strategy, Mesh(4, 1), "h100", Workload(batch=BATCH, context=512))
    walks = plan_walks({str(o["name"]): str(o["choice"]) for o in plan.ops}, strategy.degrees)
    ex = CostModel(graph, Mesh(4, 1), "h100", Workload(phase="decode", batch=BATCH, context=512),
                   expert_imbalance=1.0).simulate(strategy)
    micro = int(ex.totals["micro_batches"])
    assert micro == 2 and ex.pp_send_bytes > 0
    send = int(round(micro * ex.pp_send_bytes))
    (kind,) = graph.layer_kinds
    per_stage = kind.count // 2
    rows: dict = {}
    for k, branch, _before, coll, dim, nbytes, _ms in ex.collectives:
        n = 1 if k == "global" else per_stage
        rows.setdefault(branch if k == "global" else "layer", []).extend(
            [(coll, dim, micro * nbytes, 1)] * n)
    for rank, end, p2p in ((0, "embedding", ("send", "pp", send)),
                           (2, "lm_head", ("recv", "pp", send))):
        got = _decode_records(plan, walks, model_file, strategy, f"pp stage rank {rank}", rank)
        assert got.count(p2p) == 1, (p2p, sorted(got))
        got.remove(p2p)
        assert rows.get(end), end
        assert_records_match(got, rows["layer"] + rows[end], f"rank {rank}")


def test_a_row_qkv_into_replicated_kv_heads_is_charged_the_repeated_reduce_scatter():
    """GQA with tp > KV heads (8 query / 2 KV heads at tp 4) after a row qkv: each KV head is
    repeated over its 2 ranks before the reduce-scatter into the heads split, so that
    collective moves qkv's output grown by the repeat ((8 + 2 x 2 x 2) / (8 + 2 x 2) heads of
    width: 8192 bytes on this model, not 6144) -- charged as run."""
    from pathlib import Path

    gqa = str(Path(__file__).parent / "data" / "tiny_gqa_for_every_plan.py")
    choices = {"embedding": "vocab", "dense_block.qkv": "row", "dense_block.attn_core": "heads",
               "dense_block.out_proj": "row", "dense_block.ffn1": "col",
               "dense_block.ffn2": "row", "lm_head": "col"}
    decode_collectives_match("gqa tp4 row qkv", gqa, {"tp": 4}, choices)
