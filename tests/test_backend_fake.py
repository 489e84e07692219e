"""Full-size models on the ``fake`` process group with their real meshes (meta device),
sharded by the plan's emitted ``parallelize.py`` (torch's styles, :func:`shard_by_plan`).

* every parameter's local shape and placements are what plan.json's ``params`` says (same
  function :func:`shardc.backends.layout.param_plan` that :func:`shardc.plan.build_plan`
  uses; a plain tensor is whole on every rank, ``R``);
* the collectives DTensor executes for one layer of each kind, recorded as (collective,
  mesh dim, bytes) by :class:`collective_record.CollectiveRecorder`, are those the cost model
  charges (:meth:`CostModel.simulate` ``collectives``, at the token count the forward runs:
  :func:`_expected_records`), mapped to where the runtime issues them: a repair of an op's
  output happens once per module of that op (HF keeps q/k/v and gate/up as separate linears:
  3 and 2 collectives whose bytes sum to the charged bytes; GPT-MoE packs qkv: 1).
"""

from __future__ import annotations

import functools
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.testing._internal.distributed.fake_pg import FakeStore

from shardc.backends.layout import param_plan, spmd_dims
from shardc.backends.models import adapter_for, default_layer_kinds
from shardc.ir.contract import BRANCHES
from shardc.ir.strategy import Mesh, Workload, strategy_from_names

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
sys.path.insert(0, str(EXAMPLES))

_COMM = {"all_reduce": "all_reduce", "all_gather_into_tensor": "all_gather",
         "reduce_scatter_tensor": "reduce_scatter", "all_to_all_single": "all_to_all"}

MEGATRON = {"embedding": "vocab", "qkv": "col", "attn_core": "heads", "out_proj": "row",
            "ffn1": "col", "ffn2": "row", "router": "rep", "expert_ffn1": "col",
            "expert_ffn2": "row", "lm_head": "col"}


def choices_for(kind: str, overrides: dict) -> dict:
    ops = [o for o, _ in MEGATRON.items() if o not in ("embedding", "lm_head")]
    if kind == "dense_block":
        ops = [o for o in ops if o in ("qkv", "attn_core", "out_proj", "ffn1", "ffn2")]
    else:
        ops = [o for o in ops if o not in ("ffn1", "ffn2")]
    ch = {f"{kind}.{o}": overrides.get(o, MEGATRON[o]) for o in ops}
    ch["embedding"] = overrides.get("embedding", "vocab")
    ch["lm_head"] = overrides.get("lm_head", "col")
    return ch


@pytest.fixture
def fake_world():
    def init(world: int):
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)

    yield init
    if dist.is_initialized():
        dist.destroy_process_group()


def _disk_cached(module_name: str, variant: str, trace):
    """``trace()`` served from shardc's on-disk graph cache, keyed by the example file's
    cache key (file, siblings, versions, frontend and passes code) plus ``variant``."""
    import hashlib

    from shardc.frontends import graph_cache

    if not graph_cache.cache_enabled():
        return trace()
    base = graph_cache.cache_key(EXAMPLES / f"{module_name}.py", tiny=False)
    key = hashlib.sha256(f"{base} short {variant}".encode()).hexdigest()
    graph = graph_cache.load_entry(key)
    if graph is None:
        graph = trace()
        graph_cache.store_entry(key, graph)
    return graph


@functools.lru_cache(maxsize=None)
def _short_graph(module_name: str, layers: int):
    """IR of the same architecture at full width with ``layers`` layers (the cost model's
    per-layer collectives do not depend on the layer count; tracing 80 layers takes ~1 min)."""
    return _disk_cached(module_name, f"layers={layers}",
                        lambda: _trace_short(module_name, layers))


def _trace_short(module_name: str, layers: int):
    import importlib

    from shardc.frontends import graph_from_module

    mod = importlib.import_module(module_name)
    if hasattr(mod, "config"):
        cfg = mod.config()
        cfg.num_hidden_layers = layers
        from shardc.frontends.hf_build import build_causal_lm

        model = build_causal_lm(cfg)
        vocab = cfg.vocab_size
    else:
        import dataclasses

        import gpt_moe

        cfg = dataclasses.replace(mod.CONFIG, num_layers=layers)
        model = gpt_moe.build(cfg)
        vocab = cfg.vocab_size
    ids = (torch.zeros(1, 16, dtype=torch.long) % vocab,)
    return graph_from_module(model, ids, name=module_name)


def _placement_name(pl) -> str:
    if pl.is_replicate():
        return "R"
    if pl.is_shard():
        return f"S({pl.dim})"
    return "P"


def shard_by_plan(model, graph, strategy, mesh: str):
    """Shard ``model`` by running the ``parallelize.py`` of ``strategy``'s plan on ``graph``
    (what ``shardc compile`` writes and ``Plan.apply`` runs); returns (the model to call,
    the plan)."""
    import types

    from shardc.plan import build_plan

    plan = build_plan(graph, strategy, Mesh.parse(mesh), "h100",
                      Workload(batch=strategy.batch))
    code = types.ModuleType("fake_parallelize")
    exec(compile(plan.code(), "<parallelize.py>", "exec"), code.__dict__)  # noqa: S102
    return code.parallelize(model), plan


def check_placed_params(model, expected: dict, degrees) -> int:
    """Every parameter of stage 0 has the local shape and the placements per SPMD mesh dim
    ``param_plan`` gives it (``expected``: fqn -> row; a DTensor's mesh dims, ``R`` on a dim
    its mesh lacks; a plain tensor is whole, ``R`` everywhere); returns how many DTensors
    were checked."""
    dims = spmd_dims(degrees)
    checked = 0
    for name, p in model.named_parameters():
        row = expected[name]
        if row["stage"] != 0:
            continue
        if isinstance(p, DTensor):
            on = dict(zip(p.device_mesh.mesh_dim_names, p.placements))
            got = [_placement_name(on[d]) if d in on else "R" for d in dims]
            assert list(p.to_local().shape) == row["local_shape"], name
            checked += 1
        else:
            got = ["R"] * len(dims)
            assert list(p.shape) == row["local_shape"], name
        assert got == row["placements"], (name, got, row["placements"])
    return checked


def _expected_records(graph, strategy, mesh: str, kind: str, modules_per_op: dict,
                      seqs: int) -> list[tuple[str, str, float, int]]:
    """The cost model's collectives of one ``kind`` layer: ``[(collective, mesh dim, bytes,
    n)]`` from :meth:`CostModel.simulate`, ``n`` = how many modules issue that repair (a repair
    of an op's output happens once per module of that op; ``bytes`` is their total).

    Workload: ``strategy.batch = seqs x pp x ep`` sequences per dp replica, so the cost model's
    per-micro-batch tokens per attention group are ``T = seqs`` sequences x 1 token: decode
    (``T = batch / pp / ep``); with sequence parallelism, which the cost model has in prefill
    only, a 1-token prefill (pp = 1: ``T = batch / ep x prompt``). That is what
    :func:`_run_layer` feeds one rank: ``[seqs, 1, hidden]``, or its ``seqs / tp`` rows of the
    token-split residual under sp. Bytes are bf16 full-tensor bytes (``T x width x 2``; ep
    all-to-alls per rank ``T / sp x top_k x hidden x 2``). ``expert_imbalance=1``: on ``meta``
    the routing is the balanced load (the backend's capacity is ``ceil(T x top_k / E)``, the
    charged volume when ``E`` divides ``T x top_k``)."""
    from shardc.cost import CostModel

    deg = strategy.degrees
    assert strategy.batch == seqs * deg.pp * deg.ep
    if deg.sp > 1:
        assert deg.pp == 1
        wl = Workload(phase="prefill", batch=strategy.batch, prompt=1)
    else:
        wl = Workload(phase="decode", batch=strategy.batch, context=4096)
    ex = CostModel(graph, Mesh.parse(mesh), "h100", wl, expert_imbalance=1.0).simulate(strategy)
    ops = [o for b in BRANCHES.values() for o in b]
    out = []
    for lk, branch, before, coll, dim, nbytes, _ms in ex.collectives:
        if lk != kind:
            continue
        n = 1
        seq = BRANCHES.get(branch, ())
        if before in seq and seq.index(before) > 0:  # issued at the previous op's output
            n = modules_per_op.get(seq[seq.index(before) - 1], 1)
        elif before == "<end>" and seq:
            n = modules_per_op.get(seq[-1], 1)
        assert before in ops or before in ("<end>", "dispatch", "combine", "before dispatch",
                                           "after combine")
        out.append((coll, dim, nbytes, n))
    return out


def assert_records_match(got: list[tuple[str, str, int]], want: list[tuple], what=""):
    """``got`` (the recorder's ``(collective, mesh dim, bytes)``) equals ``want`` (the cost
    model's ``(collective, mesh dim, bytes, n)``): every ``n = 1`` row is one recorded
    collective of exactly those bytes; the rows issued per module (``n > 1``) are, per
    (collective, mesh dim), that many recorded collectives whose bytes sum to the charged
    bytes; nothing else is recorded."""
    rest = Counter(got)
    missing = []
    for coll, dim, nbytes, n in want:
        if n == 1:
            key = (coll, dim, int(round(nbytes)))
            if rest[key] > 0:
                rest[key] -= 1
            else:
                missing.append(key)
    split_want: dict = {}
    for coll, dim, nbytes, n in want:
        if n > 1:
            c, b = split_want.get((coll, dim), (0, 0))
            split_want[(coll, dim)] = (c + n, b + int(round(nbytes)))
    split_got: dict = {}
    for (coll, dim, nbytes), k in rest.items():
        if k > 0:
            c, b = split_got.get((coll, dim), (0, 0))
            split_got[(coll, dim)] = (c + k, b + k * nbytes)
    detail = f"{what}\nrecorded: {sorted(got)}\ncharged: {sorted(want)}"
    assert not missing, f"charged but not issued with these bytes: {missing}{detail}"
    assert split_got == split_want, f"(count, total bytes) per repair split over modules: " \
        f"issued {split_got}, charged {split_want}{detail}"


def _run_layer(model, adapter, i: int, seqs: int) -> list[tuple[str, str, int]]:
    """One decode step of layer ``i`` on this rank: ``[seqs, 1, hidden]`` bf16 on meta, no
    cache; returns the collectives it issued as ``(collective, mesh dim, bytes)``."""
    from collective_record import CollectiveRecorder, group_names, model_meshes

    hidden = adapter.config.hidden_size
    h = torch.zeros(seqs, 1, hidden, device="meta", dtype=torch.bfloat16)
    if adapter.family == "hf":
        layer = adapter.inner.layers[i]
        pos = torch.arange(1, device="meta")[None]
        pe = adapter.inner.rotary_emb(h, position_ids=pos)
        kw = dict(attention_mask=None, position_embeddings=pe, position_ids=pos)
    else:
        layer, kw = adapter.model.layers[i], {}
    with CollectiveRecorder(group_names(model_meshes(layer))) as rec:  # the layer's meshes
        out = layer(h, **kw)
    assert out.shape == h.shape
    return rec.records


CASES = [
    # (example module, mesh, degrees, overrides of the Megatron choices, sequences per
    # attention group = one rank's decode tokens T; T x top_k divisible by the experts E)
    ("llama3_70b", "8x1", {"tp": 8}, {}, 8),
    ("llama3_70b", "8x1", {"tp": 8}, {"ffn2": "col"}, 8),
    ("llama3_70b", "8x1", {"tp": 8}, {"qkv": "rep", "attn_core": "rep", "out_proj": "rep"}, 8),
    ("llama3_70b", "8x1", {"tp": 8}, {"qkv": "row", "attn_core": "batch", "out_proj": "col"}, 8),
    ("mixtral_8x7b", "8x128", {"tp": 8, "ep": 8, "dp": 16}, {}, 16),
    ("mixtral_8x7b", "8x128", {"tp": 8, "ep": 8, "dp": 16},
     {"router": "col", "expert_ffn2": "col", "attn_core": "rep"}, 16),
    ("gpt_moe_1p6t", "8x128", {"tp": 8, "ep": 16, "pp": 2, "dp": 4}, {}, 16),
    ("gpt_moe_1p6t", "8x128", {"tp": 8, "ep": 16, "pp": 2, "dp": 4},
     {"qkv": "row", "expert_ffn1": "row", "expert_ffn2": "rep"}, 16),
]


@pytest.mark.parametrize("module_name,mesh,degrees,overrides,seqs", CASES,
                         ids=[f"{c[0]}-{'-'.join(f'{k}{v}' for k, v in c[3].items()) or 'megatron'}"
                              for c in CASES])
def test_full_size_on_fake_pg(fake_world, module_name, mesh, degrees, overrides, seqs):
    import importlib

    mod = importlib.import_module(module_name)
    fake_world(Mesh.parse(mesh).gpus)
    model = mod.build_model()
    kinds = default_layer_kinds(model)
    kind = sorted(set(kinds.values()))[0]
    batch = seqs * degrees.get("pp", 1) * degrees.get("ep", 1)  # per dp replica
    strategy = strategy_from_names(degrees, choices_for(kind, overrides), batch)
    from shardc.frontends import load_graph

    graph = load_graph(mod.__file__)
    expected = {r["fqn"]: r for r in param_plan(graph, strategy, kinds)}
    sharded, plan = shard_by_plan(model, graph, strategy, mesh)
    assert {r["fqn"]: r["local_shape"] for r in plan.params} == \
        {k: r["local_shape"] for k, r in expected.items()}
    adapter = adapter_for(model)

    # every parameter of this rank's stage has the planned local shape and placements
    assert check_placed_params(model, expected, strategy.degrees) > 0
    if degrees.get("pp", 1) > 1:
        assert type(sharded).__name__ == "PipelinedModel"

    # the collectives of one layer equal the cost model's: (collective, mesh dim, bytes)
    fused = adapter.family == "gpt_moe"
    per_op = {"qkv": 1 if fused else 3, "ffn1": 2}
    graph = _short_graph(module_name, 2)
    want = _expected_records(graph, strategy, mesh, kind, per_op, seqs)
    got = _run_layer(model, adapter, 0, seqs)
    assert got
    if kind == "moe_block" and degrees.get("ep", 1) > 1:  # exempt: the counts exchange
        got.remove(("all_to_all", "ep", adapter.layer(0).moe.num_experts * 8))
    assert_records_match(got, want)


def _torch_style_extras(tp: int, ep: int, experts: int) -> list[tuple[str, str, int]]:
    """Collectives the torch-style ``ExpertParallel`` issues beyond the walk's, per MoE layer:
    the per-expert counts exchanged over ep (``E`` int64) and, under sequence parallelism
    with tp-split experts, the local experts' counts all-gathered over tp (``E / ep`` int64
    per rank; output bytes)."""
    return [("all_to_all", "ep", experts * 8), ("all_gather", "tp", tp * experts // ep * 8)]


@functools.lru_cache(maxsize=None)
def _deepseek_short_graph():
    """Full-width DeepSeek-V3 IR with one dense and one MoE layer (the cost model's
    per-layer collectives do not depend on the layer count)."""
    return _disk_cached("deepseek_v3", "1 dense + 1 moe layer", _trace_deepseek_short)


def _trace_deepseek_short():
    import deepseek_v3

    from shardc.frontends import graph_from_module
    from shardc.frontends.hf_build import build_causal_lm

    cfg = deepseek_v3.config()
    cfg.num_hidden_layers, cfg.first_k_dense_replace = 2, 1
    ids = (torch.zeros(1, 16, dtype=torch.long),)
    return graph_from_module(build_causal_lm(cfg), ids, name="deepseek_v3")


DEEPSEEK_CASES = [
    # (degrees on 8x32, overrides of the Megatron choices, applied to both layer kinds)
    ({"tp": 8, "ep": 32}, {}),
    ({"tp": 8, "ep": 16, "pp": 2},
     {"qkv": "row", "attn_core": "batch", "out_proj": "col", "ffn1": "row", "ffn2": "col",
      "shared_ffn1": "rep", "shared_ffn2": "rep", "router": "col", "expert_ffn2": "col"}),
]


@functools.lru_cache(maxsize=None)
def _deepseek_graph_4():
    """Full-width DeepSeek-V3 IR with one dense and three MoE layers (so that pipeline stage
    0 of two holds a layer of each kind)."""
    return _disk_cached("deepseek_v3", "1 dense + 3 moe layers", lambda: _trace_deepseek(4))


def _trace_deepseek(layers: int):
    import deepseek_v3

    from shardc.frontends import graph_from_module
    from shardc.frontends.hf_build import build_causal_lm

    cfg = deepseek_v3.config()
    cfg.num_hidden_layers, cfg.first_k_dense_replace = layers, 1
    ids = (torch.zeros(1, 16, dtype=torch.long),)
    return graph_from_module(build_causal_lm(cfg), ids, name="deepseek_v3")


@pytest.mark.parametrize("degrees,overrides", DEEPSEEK_CASES,
                         ids=["megatron-tp8-ep32", "batch-attention-row-qkv-tp8-ep16-pp2"])
def test_deepseek_v3_full_size_on_fake_pg(fake_world, degrees, overrides):
    """MLA (heads / batch split), shared experts and EP experts at full width on 8x32 (one
    dense + three MoE layers): local shapes and placements = plan.json, collectives of one
    dense and one MoE layer = explain."""
    import deepseek_v3

    from shardc.frontends.hf_build import build_causal_lm

    fake_world(256)
    cfg = deepseek_v3.config()
    cfg.num_hidden_layers, cfg.first_k_dense_replace = 4, 1
    model = build_causal_lm(cfg)
    kinds = default_layer_kinds(model)
    assert kinds[0] == "dense_block" and kinds[1] == "moe_block"
    ops = {"dense_block": ("qkv", "attn_core", "out_proj", "ffn1", "ffn2"),
           "moe_block": ("qkv", "attn_core", "out_proj", "shared_ffn1", "shared_ffn2",
                         "router", "expert_ffn1", "expert_ffn2")}
    megatron = dict(MEGATRON, shared_ffn1="col", shared_ffn2="row")
    choices = {"embedding": "vocab", "lm_head": "col"}
    ops_of = {kind: {o: overrides.get(o, megatron[o]) for o in names}
              for kind, names in ops.items()}
    for kind, names in ops_of.items():
        choices.update({f"{kind}.{o}": c for o, c in names.items()})
    seqs = 32  # one rank's decode tokens T: T x top_k (8) = E (256), the balanced capacity 1
    strategy = strategy_from_names(degrees, choices, seqs * degrees.get("pp", 1) * degrees["ep"])
    graph = _deepseek_graph_4()
    assert {k.name: sorted(o.name for o in k.ops) for k in graph.layer_kinds} == \
        {k: sorted(v) for k, v in ops.items()}  # the IR's slots are the backend's
    _, plan = shard_by_plan(model, graph, strategy, "8x32")
    expected = {r["fqn"]: r for r in plan.params}

    assert check_placed_params(model, expected, strategy.degrees) > 10  # stage 0's DTensors
    qb = expected["model.layers.1.self_attn.q_b_proj.weight"]
    assert qb["local_shape"] == ([128 * 192 // 8, 1536] if overrides.get("qkv") != "row"
                                 else [128 * 192, 1536 // 8])
    assert expected["model.layers.1.self_attn.q_a_proj.weight"]["placements"] == ["R", "R"]
    ex = expected["model.layers.1.mlp.experts.gate_up_proj"]
    assert ex["local_shape"][0] == 256 // degrees["ep"]

    adapter = adapter_for(model)
    per_op = {"qkv": 2, "ffn1": 2, "shared_ffn1": 2}  # q_b|kv_b, gate|up: one repair each
    for layer, kind in ((0, "dense_block"), (1, "moe_block")):
        want = _expected_records(_deepseek_short_graph(), strategy, "8x32", kind, per_op, seqs)
        got = _run_layer(model, adapter, layer, seqs)
        if kind == "moe_block":  # exempt: the per-expert counts exchanged over ep
            got.remove(("all_to_all", "ep", 256 * 8))
        if kind == "moe_block" and ops_of[kind]["router"] == "col":
            # DeepSeek-V3's router computes its scores in fp32: gathered at twice the
            # charged bf16 bytes (docs/backend.md, "Known differences")
            got.remove(("all_gather", "tp", seqs * 256 * 4))
            got.append(("all_gather", "tp", seqs * 256 * 2))
        mla = ops_of.get(kind, {})
        if mla.get("attn_core") == "batch" and mla.get("qkv") in ("col", "row"):
            # exempt (docs/backend.md): the up projections of a batch-split MLA read the
            # q / kv latents of the rank's rows, all-gathered (q_lora 1536, kv_lora 512)
            for rank_dim in (1536, 512):
                got.remove(("all_gather", "tp", seqs * rank_dim * 2))
        assert_records_match(got, want, kind)


def test_deepseek_v3_emitted_parallelize_on_8x16(fake_world, tmp_path):
    """What ``shardc compile examples/deepseek_v3.py --mesh 8x16`` hands over: plan.json and
    parallelize.py. The emitted file, imported and run on a full-width model (one dense +
    one MoE layer, as the plan's graph) on 128 fake ranks, gives every parameter the local
    shape plan.json lists, and both layer kinds issue the cost model's collectives (kind,
    mesh dim, bytes; sequence parallelism: each rank's layer input is its ``T / sp`` token
    rows, and the cost model's workload a 1-token prefill, see :func:`_expected_records`)."""
    import importlib.util

    import deepseek_v3

    from shardc.frontends.hf_build import build_causal_lm
    from shardc.plan import build_plan

    fake_world(128)
    megatron = dict(MEGATRON, shared_ffn1="col", shared_ffn2="row")
    graph = _deepseek_short_graph()
    choices = {"embedding": "vocab", "lm_head": "col"}
    for k in graph.layer_kinds:
        choices.update({f"{k.name}.{o.name}": megatron[o.name] for o in k.ops})
    seqs = 64  # tokens per attention group; a rank's T / sp = 32 tokens x top_k (8) = E (256)
    strategy = strategy_from_names({"tp": 2, "ep": 32, "dp": 2, "sp": 2}, choices, seqs * 32)
    plan = build_plan(graph, strategy, Mesh(8, 16), "h100", Workload(batch=seqs * 32))
    (tmp_path / "parallelize.py").write_text(plan.code())
    spec = importlib.util.spec_from_file_location("ds_parallelize", tmp_path / "parallelize.py")
    code = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(code)

    cfg = deepseek_v3.config()
    cfg.num_hidden_layers, cfg.first_k_dense_replace = 2, 1
    model = build_causal_lm(cfg)
    code.parallelize(model)
    rows = {r["fqn"]: r for r in plan.params}
    assert set(rows) == {n for n, _ in model.named_parameters()}
    for name, p in model.named_parameters():  # a plain tensor: whole on every rank (R)
        local = p.to_local() if isinstance(p, DTensor) else p
        assert list(local.shape) == rows[name]["local_shape"], name
        if not isinstance(p, DTensor):
            assert set(rows[name]["placements"]) == {"R"}, name
    assert rows["model.layers.1.mlp.experts.down_proj"]["local_shape"] == [8, 7168, 1024]
    assert rows["model.layers.1.self_attn.kv_b_proj.weight"]["local_shape"] == [128 * 256 // 2, 512]
    adapter = adapter_for(model)
    for layer, kind in ((0, "dense_block"), (1, "moe_block")):
        got = _run_layer(model, adapter, layer, seqs // 2)  # sp=2: this rank's token rows
        want = _expected_records(graph, strategy, "8x16", kind, {}, seqs)
        if kind == "moe_block":  # the torch-style file's exempt extras (docs/backend.md)
            for extra in _torch_style_extras(tp=2, ep=32, experts=256):
                assert extra in got, (extra, sorted(got))
                got.remove(extra)
        assert_records_match(got, want, kind)
