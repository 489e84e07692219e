"""The torch-style ``parallelize.py`` (``compile --standalone``) on 4 fake ranks issues the
collectives the cost model charges, as (collective, mesh dim, bytes).

One decode step of the whole tiny model (float32, ``[batch, 1]`` token ids) runs under
:class:`collective_record.CollectiveRecorder`; the expected multiset is
:meth:`CostModel.simulate`'s ``collectives`` of the plan's strategy on the tiny graph: each
layer kind's rows times its layer count, plus the embedding's and lm_head's rows.

Token counts (the cost model's ``T`` per attention group and micro-batch, see
:mod:`shardc.cost.layer_costs`): the plans have pp = 1 and ``strategy.batch`` = 8 sequences
per dp replica; decode gives ``T = batch / ep`` sequences x 1 token, which is what each
rank's layers see (the runtime slices the global batch over dp x ep). Sequence parallelism
exists in the cost model in prefill only: there a 1-token prompt gives the same ``T``
(``batch / ep x prompt``; lm_head sees ``batch / ep`` last tokens = ``T`` too). Bytes: the
traced graph's activation dtype, float32 for the tiny models (4 bytes per element), full
tensor (all-gather: output; reduce-scatter, all-reduce: input; ep all-to-all: this rank's
send bytes, ``T x top_k x hidden x 4``; routing is exact here --
the torch-style dispatch sends exactly the routed rows -- so ``expert_imbalance = 1``).

Exempt extras, issued by the runtime and not charged by the cost model, each listed and
bounded exactly (:func:`exempt_extras`):

* ``ExpertParallel`` with ep > 1 exchanges the per-expert row counts before the uneven
  dispatch: one ``all_to_all`` over ``ep`` of ``E`` int64 per MoE layer (``E x 8`` bytes,
  latency only; ``GatheredExperts``, the experts split their own way, exchanges none);
* with dp x ep > 1 the logits are all-gathered over the batch-split mesh (the model maps the
  global batch to global logits): one ``all_gather`` of ``global batch x vocab x 4`` bytes.

On the fake process group an all-to-all returns its input, so every rank "receives" what it
sends: the combine carries exactly the dispatched rows, as under a balanced routing.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch
import torch.distributed as dist
from collective_record import CollectiveRecorder, group_names
from test_backend_fake import assert_records_match
from test_runtime_styles import CASES

CHECKED = ["llama megatron tp4", "llama megatron + sequence parallel tp4",
           "llama batch attention, hidden embedding, row lm_head tp4",
           "mixtral ep2 tp2 megatron", "mixtral ep4", "deepseek MLA megatron tp4",
           "mixtral dp_attn4 moe_tp4", "mixtral tp2 dp_attn2 moe_tp4", "mixtral tp2 dp_attn2 moe_ep4",
           "mixtral tp4 moe_ep4", "mixtral dp_attn4 moe_tp2 moe_ep2", "mixtral tp4 moe_tp2 moe_ep2",
           "deepseek dp_attn4 moe_tp4, shared expert", "deepseek tp2 dp_attn2 moe_ep4, shared expert"]
BATCH = 8  # sequences per dp replica (plan and forward)


def charged(graph, strategy) -> list[tuple]:
    """Cost model rows ``(collective, mesh dim, bytes, 1)`` of one whole-model forward."""
    from shardc.cost import CostModel
    from shardc.ir.strategy import Mesh, Workload

    deg = strategy.degrees
    wl = (Workload(phase="prefill", batch=strategy.batch, prompt=1) if deg.sp > 1
          else Workload(phase="decode", batch=strategy.batch, context=512))
    cm = CostModel(graph, Mesh(deg.world, 1), "h100", wl, expert_imbalance=1.0)
    ex = cm.simulate(strategy)
    out = []
    for kind, _branch, _before, coll, dim, nbytes, _ms in ex.collectives:
        n = 1 if kind == "global" else graph.layer_kind(kind).count
        out += [(coll, dim, nbytes, 1)] * n
    return out


def exempt_extras(graph, strategy, vocab: int) -> list[tuple[str, str, int]]:
    """What the runtime issues beyond the cost model (module docstring), exactly."""
    deg = strategy.degrees
    extra = []
    experts = int(graph.config.get("num_experts", 0) or 0)
    moe_layers = sum(k.count for k in graph.layer_kinds if k.op("expert_ffn1") is not None)
    if deg.ep > 1 and not deg.experts_resplit:  # the all-gather dispatch exchanges no counts
        extra += [("all_to_all", "ep", experts * 8)] * moe_layers
    if deg.dp * deg.ep > 1:
        dim = "dp_ep" if deg.dp > 1 and deg.ep > 1 else ("dp" if deg.dp > 1 else "ep")
        extra.append(("all_gather", dim, BATCH * deg.dp * vocab * 4))  # float32 logits
    return extra


@pytest.mark.parametrize("name", CHECKED)
def test_torch_style_collective_bytes_are_the_cost_models(name):
    forward_collectives_match(name, *CASES[name])


def forward_collectives_match(name: str, model_file: str, degrees: dict, choices: dict):
    """Assert one forward of the plan's standalone file issues the cost model's collectives
    plus :func:`exempt_extras`."""

    from shardc.frontends import load_graph
    from shardc.ir.strategy import Mesh, Workload, strategy_from_names
    from shardc.plan import build_plan

    graph = load_graph(model_file, tiny=True)
    strategy = strategy_from_names(degrees, choices, BATCH)
    plan = build_plan(graph, strategy, Mesh(strategy.degrees.world, 1), "h100",
                      Workload(batch=BATCH, context=512))
    records, vocab = run_standalone_file(plan, model_file, strategy, name)
    got = list(records)
    for extra in exempt_extras(graph, strategy, vocab):
        assert extra in got, (f"exempt extra {extra} not issued", sorted(got))
        got.remove(extra)
    assert got, name
    assert_records_match(got, charged(graph, strategy), name)


def run_standalone_file(plan, model_file, strategy, label: str):
    """Run the plan's ``--standalone`` parallelize.py as rank 0 of a 4-rank fake process
    group on the tiny model: one forward of [batch, 1] ids. Returns (the collectives it
    issued, as CollectiveRecorder records, and the model's vocab size)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from shardc.backends.verify import _build, _vocab

    spec = importlib.util.spec_from_loader(f"bytes_{abs(hash(label))}", loader=None)
    code = importlib.util.module_from_spec(spec)
    exec(compile(plan.code(standalone=True), f"<{label} parallelize.py>", "exec"), code.__dict__)
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=4)
    try:
        world = init_device_mesh("cpu", tuple(code.MESH_SHAPE),
                                 mesh_dim_names=tuple(code.MESH_DIM_NAMES))
        model, ids = _build(model_file, BATCH * strategy.degrees.dp, 1)
        model = code.parallelize(model, world_mesh=world)
        groups = group_names([world])
        if "dp" in world.mesh_dim_names and "ep" in world.mesh_dim_names:
            groups[world["dp", "ep"]._flatten("dp_ep").get_group().group_name] = "dp_ep"
        with torch.no_grad(), CollectiveRecorder(groups) as rec:
            model(ids)
        vocab = _vocab(model)
    finally:
        dist.destroy_process_group()
    return list(rec.records), vocab
