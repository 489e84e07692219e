"""Pipeline parallelism on the torch-style path: a pp > 1 plan's ``parallelize.py`` keeps on
each rank its stage's decoder layers (embedding on the first stage, final norm + lm_head on
the last), applies the per-kind ``parallelize_module`` plans on the stage's submesh and runs
the stages under ``torch.distributed.pipelining`` (``ScheduleGPipe``, forward only).

* numerics (gloo): the emitted files of tiny Llama pp=2 (2 ranks; standalone and the default
  file importing ``shardc.runtime``, with a padding mask), pp=2 x tp=2 (with and without
  sequence parallelism), pp=2 x dp=2, tiny Mixtral pp=2 x ep=2 and tiny DeepSeek-V3
  pp=2 x tp=2 (4 ranks) and a tiny Gemma-2 pp=2 (2 ranks) reproduce the unsharded logits;
* deployed stage membership (the parameters each rank keeps after the emitted
  ``parallelize``) == the cost model's (trace.json lanes, ``CostModel.stage_counts``) for
  pp 2/3/4 on Llama-3-70B and DeepSeek-V3;
* ``Plan.apply`` of a pp plan returns the pipeline runner around this rank's stage.
"""

from __future__ import annotations

import re
from collections import defaultdict
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from test_backend_gloo import (
    DEEPSEEK,
    DENSE,
    DS_MEGATRON,
    GPT_MOE,
    LLAMA,
    MIXTRAL,
    MOE,
    TOL,
    D,
    _with,
    ruff_clean,
)
from test_runtime_styles import TORCH_ONLY, _imported_modules, build, config_file

from shardc.backends.verify import Case, _load_code, run_suites

ROOT = Path(__file__).resolve().parents[1]
_LAYER_PARAM = re.compile(r"(?:^|\.)layers\.(\d+)\.")

# name -> (model file, degrees, choices, standalone, Case options); world from the degrees
CASES = {
    "llama pp2": (LLAMA, {"pp": 2}, DENSE, True, {}),
    "llama pp2, default file, right padding": (LLAMA, {"pp": 2}, DENSE, False,
                                               {"padded": "right"}),
    "llama pp2 tp2": (LLAMA, {"pp": 2, "tp": 2}, DENSE, True, {}),
    "llama pp2 tp2, KV cache (refused)": (LLAMA, {"pp": 2, "tp": 2}, DENSE, True,
                                          {"kv_cache": 2}),
    "llama pp2 tp2 sp, batch-split attention": (
        LLAMA, {"pp": 2, "tp": 2, "sp": 2},
        _with(DENSE, D, qkv="rep", attn_core="batch", out_proj="row"), True, {}),
    "llama pp2 dp2, left padding": (LLAMA, {"pp": 2, "dp": 2}, DENSE, True, {"padded": "left"}),
    "mixtral pp2 ep2": (MIXTRAL, {"pp": 2, "ep": 2}, MOE, True, {}),
    "deepseek-v3 pp2 tp2 (MLA, shared experts; stages: 2 layers | 1)": (
        DEEPSEEK, {"pp": 2, "tp": 2}, DS_MEGATRON, True, {}),
    # scales its embeddings (a later stage must not rescale what it receives), alternates
    # sliding-window / global layers by layer index, softcaps the logits; Megatron choices
    "gemma-2 pp2 (config.json)": (config_file("gemma2_9b"), {"pp": 2}, None, True, {}),
}


def _world(degrees: dict) -> int:
    n = 1
    for d in ("tp", "pp", "ep", "dp"):
        n *= degrees.get(d, 1)
    return n


@pytest.fixture(scope="module")
def gloo_results(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("pipeline")
    paths, by_world = [], defaultdict(lambda: defaultdict(list))  # world -> suite -> cases
    for i, (name, (model, degrees, choices, standalone, opts)) in enumerate(CASES.items()):
        path = tmp / f"case{i}_parallelize.py"
        src = build(model, degrees, choices).code(standalone=standalone)
        path.write_text(src)
        paths.append(str(path))
        suite = (model, tuple(degrees.items()) if model.endswith(".json") else ())
        by_world[_world(degrees)][suite].append(Case(name, {}, {}, None, code=str(path),
                                                     **opts))
    ruff_clean(paths)
    out = {}
    for world, suites in sorted(by_world.items()):
        for r in run_suites([(m, cases, dict(degs) or None)
                             for (m, degs), cases in suites.items()], world=world):
            out[r["name"]] = r
    return out


@pytest.mark.parametrize("name", list(CASES))
def test_pipelined_logits_match_unsharded(gloo_results, name):
    r = gloo_results[name]
    if "(refused)" in name:
        assert "a pipelined model (pp=2) runs whole sequences" in (r["error"] or ""), r
        return
    assert r["error"] is None, r["error"]
    assert r["rel_err"] <= TOL, r


def test_pp_file_imports_only_torch_and_reads_as_stages():
    plan = build(LLAMA, {"pp": 2, "tp": 2}, DENSE)
    src = plan.code(standalone=True)
    assert {m.split(".")[0] for m in _imported_modules(src)} <= TORCH_ONLY
    assert "STAGE_LAYERS = [range(0, 1), range(1, 2)]" in src
    assert "keep_stage(model, STAGE_LAYERS[stage], first=stage == 0, last=stage == 1)" in src
    assert "for i in [i for i in LAYER_KINDS['dense_block'] if i in STAGE_LAYERS[stage]]:" in src
    assert "model = pipeline(model, world_mesh, microbatches=2)" in src
    assert "ModelSharder" not in plan.code()  # the default file is the torch-style one too


def _simulated_lanes(cm, strategy) -> dict[int, set[int]]:
    """trace.json: stage lane -> decoder layers the cost model charges to it."""
    lanes = defaultdict(set)
    for ev in cm.chrome_trace(strategy)["traceEvents"]:
        m = re.match(r"^L(\d+) ", ev.get("name", ""))
        if m and ev.get("ph") == "X":
            lanes[ev["tid"]].add(int(m.group(1)))
    return dict(lanes)


def _stand_in(example: str, num_layers: int):
    """A small HF model of the example's family with its layer count (and DeepSeek-V3's
    dense-then-MoE pattern), on meta: only which modules a stage keeps is looked at."""
    from transformers import AutoModelForCausalLM, DeepseekV3Config, LlamaConfig

    small = dict(hidden_size=16, intermediate_size=32, num_attention_heads=2,
                 num_key_value_heads=2, vocab_size=64, num_hidden_layers=num_layers)
    if example == "deepseek_v3.py":
        cfg = DeepseekV3Config(**small, first_k_dense_replace=3, n_routed_experts=4,
                               num_experts_per_tok=2, moe_intermediate_size=8, n_group=1,
                               topk_group=1, q_lora_rank=8, kv_lora_rank=8,
                               qk_rope_head_dim=4, qk_nope_head_dim=4, v_head_dim=4)
    else:
        cfg = LlamaConfig(**small)
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(cfg)


@pytest.mark.parametrize("example", ["deepseek_v3.py", "llama3_70b.py"])
def test_deployed_stages_hold_the_layers_the_cost_model_charges(example):
    """Run the emitted parallelize.py of a pp = 2/3/4 plan of the full-size graph as every
    stage's rank (fake process group) on a stand-in with the same layers: the decoder layers
    whose parameters the rank keeps are trace.json's lane of that stage."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from shardc.cost import CostModel
    from shardc.fingerprint import fingerprint
    from shardc.frontends import load_graph
    from shardc.ir.contract import CHOICE_NAMES
    from shardc.ir.strategy import Degrees, Mesh, Strategy, Workload
    from shardc.plan import build_plan
    from shardc.runtime import make_mesh

    graph = load_graph(str(ROOT / "examples" / example))
    rep = {f"{k.name}.{o.name}": 2 for k in graph.layer_kinds for o in k.ops
           if o.name in CHOICE_NAMES}
    rep.update({o.name: 2 for o in graph.global_ops})
    num_layers = sum(len(k.layers) for k in graph.layer_kinds)
    for pp in (2, 3, 4):
        mesh = Mesh.parse(f"{pp}x1")
        workload = Workload(phase="decode", batch=pp, context=4096, tpot_slo_ms=1e6)
        strategy = Strategy(Degrees(tp=1, pp=pp, ep=1, dp=1, sp=1), pp, rep)
        cm = CostModel(graph, mesh, "h100", workload)
        simulated = _simulated_lanes(cm, strategy)
        assert [len(simulated[s]) for s in range(pp)] == list(cm.stage_counts(pp).sum(axis=1))
        plan = build_plan(graph=graph, strategy=strategy, mesh=mesh, hardware="h100",
                          workload=workload)
        # the stand-in has the model's layers, not its sizes: the plan's parameter table
        # (which parallelize.py checks the model against) is set to the stand-in's
        stand_in = _stand_in(example, num_layers)
        plan = replace(plan, model={**plan.model, "fingerprint": fingerprint(
            [{"fqn": n, "shape": list(p.shape)} for n, p in stand_in.named_parameters()])})
        code = plan.code()
        assert "keep_stage(" in code
        deployed = {}
        for rank in range(pp):
            dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=pp)
            try:
                mod = _load_code_text(code, f"{example}_{pp}")
                shape, names = plan.strategy().degrees.logical_mesh()
                runner = mod.parallelize(_stand_in(example, num_layers), make_mesh(shape, names))
                held = [n for n, _ in runner.named_parameters()]
            finally:
                dist.destroy_process_group()
            deployed[rank] = {int(m.group(1)) for n in held if (m := _LAYER_PARAM.search(n))}
            assert any("embed_tokens" in n for n in held) == (rank == 0)
            assert any("lm_head" in n for n in held) == (rank == pp - 1)
            assert any(n.endswith("model.norm.weight") for n in held) == (rank == pp - 1)
        assert deployed == simulated, (example, pp)


def _load_code_text(code: str, tag: str):
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / f"parallelize_{re.sub(r'[^0-9a-z_]', '_', tag)}.py"
        path.write_text(code)
        return _load_code(str(path))


@pytest.mark.parametrize("rank", [0, 3])
def test_plan_apply_returns_the_pipeline_of_this_ranks_stage(rank):
    """``Plan.apply`` runs the pp plan's own parallelize.py: rank 0 (stage 0 of pp=2 x tp=2)
    keeps the embedding and layer 0, rank 3 (stage 1) layer 1, the final norm and lm_head;
    their projections are torch's tp styles on the stage's tp submesh."""
    from torch.distributed.tensor import DTensor
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from shardc.backends.verify import _build
    from shardc.runtime import make_mesh
    from shardc.runtime.pipeline import OtherStageLayer, PipelinedModel

    plan = build(LLAMA, {"pp": 2, "tp": 2}, DENSE)
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=4)
    try:
        model = _build(LLAMA, 8, 8)[0]
        shape, names = plan.strategy().degrees.logical_mesh()
        runner = plan.apply(model, make_mesh(shape, names))
        assert isinstance(runner, PipelinedModel)
        stage = 0 if rank == 0 else 1
        assert runner.stage_index == stage and runner.num_stages == 2
        layers = model.model.layers
        kept, other = layers[stage], layers[1 - stage]
        assert isinstance(other, OtherStageLayer) and not list(other.parameters())
        q = kept.self_attn.q_proj.weight
        assert isinstance(q, DTensor) and q.device_mesh.mesh_dim_names == ("tp",)
        assert q.to_local().shape[0] == q.shape[0] // 2
        assert (model.model.embed_tokens is not None) == (stage == 0)
        assert (model.lm_head is not None) == (stage == 1)
    finally:
        dist.destroy_process_group()


def test_a_stage_map_the_runtime_cannot_deploy_is_refused_naming_it():
    """A plan.json whose ``params[].stage`` splits a layer over two stages (hand-edited):
    ``--standalone`` refuses it (exit 2) naming the layer, rather than deploying another map."""
    from shardc.errors import InputError

    plan = build(LLAMA, {"pp": 2}, DENSE)
    for p in plan.params:
        if p["fqn"] == "model.layers.1.mlp.down_proj.weight":
            p["stage"] = 0
    with pytest.raises(InputError, match=r"pp=2: layer 1's parameters are on stages \[0, 1\]"):
        plan.code(standalone=True)


def test_pipeline_stages_of_another_layout_name_its_modules():
    """GPT-MoE keeps ``layers.<i>`` / ``embed`` / ``ln_f`` / ``lm_head`` (a plain model whose
    forward takes token ids only): the stage map and the model-level modules of each stage
    come from plan.json's params rows and reach ``keep_stage`` as literals."""
    from shardc.backends.pipeline_styles import stage_layout

    plan = build(GPT_MOE, {"pp": 2, "tp": 2}, None)
    stages, layout = stage_layout(plan, "layers")
    assert stages == [[0], [1]]
    assert layout == {"layers_path": "layers", "embedding": "embed", "positions": (),
                      "final": ("ln_f",), "lm_head": "lm_head"}
    code = plan.code(standalone=True)
    assert "layers_path='layers'," in code and "embedding='embed'," in code
    assert "final=('ln_f',)," in code and "ModelSharder" not in plan.code()
