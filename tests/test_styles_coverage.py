"""The torch-style backend reads parameter roles from the IR, and covers the remaining
pp = 1 families (GPT-2, GPT-MoE, Phi-3.5-MoE, OLMoE heads split, router and expert choices,
sequence-parallel combinations).

* plan.json ``params`` rows carry the fused op, the decoder layer and the tensor dims each
  choice cuts, derived from the graph (:mod:`shardc.ir.param_roles`): Conv1D weights
  ``[in, out]``, experts stored ``[E, out, in]`` (HF, transposed before the matmul) or
  ``[E, in, out]`` (GPT-MoE), square weights told apart by the frontend's transpose record,
  packed q|k|v and gate|up, a tied lm_head, learned positions replicated;
* a plan written before those fields (schema 1 without ``op``) still emits the same file.
"""

from __future__ import annotations

from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
GPT2 = str(ROOT / "examples" / "configs" / "gpt2" / "config.json")
OLMOE = str(ROOT / "examples" / "configs" / "olmoe_1b_7b" / "config.json")
MIXTRAL = str(ROOT / "examples" / "tiny_mixtral.py")
LLAMA = str(ROOT / "examples" / "tiny_llama.py")
GPT_MOE = str(ROOT / "examples" / "gpt_moe_1p6t.py")
MEGATRON = {"qkv": "col", "attn_core": "heads", "out_proj": "row", "ffn1": "col", "ffn2": "row",
            "router": "rep", "expert_ffn1": "col", "expert_ffn2": "row", "shared_ffn1": "col",
            "shared_ffn2": "row"}


def build(model_file: str, degrees: dict, overrides: dict | None = None, batch: int = 8):
    """Plan of the tiny graph of ``model_file``: Megatron choices with ``overrides`` (op ->
    choice name, every layer kind)."""
    from shardc.frontends import load_graph
    from shardc.ir.strategy import Mesh, Workload, strategy_from_names
    from shardc.plan import build_plan

    graph = load_graph(model_file, tiny=True)
    ch = dict(MEGATRON, **(overrides or {}))
    choices = {"embedding": ch.get("embedding", "vocab"), "lm_head": ch.get("lm_head", "col")}
    choices.update({f"{k.name}.{o.name}": ch[o.name] for k in graph.layer_kinds
                    for o in k.ops if o.name in ch})
    st = strategy_from_names(degrees, choices, batch)
    return build_plan(graph, st, Mesh(st.degrees.world, 1), "h100",
                      Workload(batch=batch, context=64))


def rows(plan) -> dict:
    return {r["fqn"]: r for r in plan.params}


def test_param_rows_carry_ops_and_dims_from_the_graph():
    g = rows(build(GPT2, {"tp": 2}))
    assert g["transformer.h.0.attn.c_attn.weight"]["op"] == "qkv"
    assert g["transformer.h.0.attn.c_attn.weight"]["split_dims"] == [1, 0]  # Conv1D [in, out]
    assert g["transformer.h.0.attn.c_attn.weight"]["parts"] == [64, 64, 64]
    assert g["transformer.h.0.attn.c_attn.weight"]["placements"] == ["S(1)"]
    assert g["transformer.h.0.attn.c_attn.bias"]["parts"] == [64, 64, 64]
    assert g["transformer.h.1.mlp.c_proj.weight"] == {**g["transformer.h.1.mlp.c_proj.weight"],
                                                      "op": "ffn2", "layer": 1,
                                                      "placements": ["S(0)"]}
    assert g["transformer.wte.weight"]["op"] == "embedding"
    assert g["transformer.wte.weight"]["tied"] == [{"op": "lm_head", "module": "lm_head"}]
    assert g["transformer.wpe.weight"]["op"] is None and g["transformer.wpe.weight"]["stage"] == 0
    m = rows(build(MIXTRAL, {"tp": 2, "ep": 2}))
    gu = m["model.layers.0.mlp.experts.gate_up_proj"]
    assert (gu["op"], gu["split_dims"], gu["expert_dim"], gu["parts"]) == \
        ("expert_ffn1", [1, 2], 0, [128, 128])
    assert m["model.layers.0.input_layernorm.weight"]["op"] is None
    e = rows(build(GPT_MOE, {"tp": 2, "ep": 2}))
    assert e["layers.1.moe.experts.w_in"]["split_dims"] == [2, 1]  # [E, in, out]
    assert e["layers.1.moe.experts.w_in"]["placements"] == ["S(0)", "S(2)"]
    assert e["layers.0.attn.qkv.weight"]["parts"] == [64, 64, 64]
    # OLMoE's tiny gate_up_proj is square [8, 64, 64]: only the transpose record tells
    o = rows(build(OLMOE, {"tp": 2, "ep": 2}))
    assert o["model.layers.0.mlp.experts.gate_up_proj"]["shape"][1:] == [64, 64]
    assert o["model.layers.0.mlp.experts.gate_up_proj"]["split_dims"] == [1, 2]


def test_transpose_record_decides_a_square_weight():
    """Without the frontend's record a square ``[E, 64, 64]`` grouped-matmul weight reads as
    ``[E, in, out]`` (x @ W); HF transposes it first, so it is ``[E, out, in]``."""
    from shardc.frontends import load_graph
    from shardc.ir.param_roles import param_uses

    g = load_graph(OLMOE, tiny=True)
    fqn = "model.layers.0.mlp.experts.gate_up_proj"
    node = next(n for n in g.nodes if any(p.fqn == fqn for p in n.params))
    assert node.attrs["param_dims"][[p.fqn for p in node.params].index(fqn)] == [0, 2, 1]
    assert param_uses(g)[fqn].split_dims == (1, 2)
    del node.attrs["param_dims"]
    assert param_uses(g)[fqn].split_dims == (2, 1)


@pytest.mark.parametrize("model_file, degrees", [(MIXTRAL, {"tp": 2, "ep": 2}),
                                                 (str(ROOT / "examples" / "tiny_deepseek_v3.py"),
                                                  {"tp": 4})])
def test_plan_without_ir_fields_emits_the_same_file(model_file, degrees):
    plan = build(model_file, degrees)
    new = plan.code(standalone=True)
    for r in plan.params:
        for key in ("op", "layer", "split_dims", "expert_dim", "parts", "tied"):
            r.pop(key, None)
    assert plan.code(standalone=True) == new


# ------------------------------------------------------------------ numerics (one launch)
PHI = str(ROOT / "examples" / "configs" / "phi3_5_moe" / "config.json")
DEEPSEEK = str(ROOT / "examples" / "tiny_deepseek_v3.py")
# name -> (model file, degrees, choice overrides); every plan's standalone parallelize.py
GLOO = {
    "gpt2 megatron tp2 dp2 (Conv1D, packed qkv, tied lm_head)": (GPT2, {"tp": 2, "dp": 2}, {}),
    "gpt2 tp2 dp2 sp (learned positions broadcast over the rows)": (
        GPT2, {"tp": 2, "dp": 2, "sp": 2}, {}),
    "gpt2 tp2 dp2 batch attention, hidden embedding": (
        GPT2, {"tp": 2, "dp": 2},
        {"qkv": "rep", "attn_core": "batch", "out_proj": "col", "embedding": "hidden"}),
    "gpt-moe tp2 ep2 router col": (GPT_MOE, {"tp": 2, "ep": 2}, {"router": "col"}),
    "gpt-moe tp2 ep2 sp, experts col/row": (GPT_MOE, {"tp": 2, "ep": 2, "sp": 2}, {}),
    "phi-3.5-moe tp2 ep2 (lm_head bias, sparsemixer)": (PHI, {"tp": 2, "ep": 2}, {}),
    "olmoe tp2 ep2 heads split (q/k norms over all heads)": (OLMOE, {"tp": 2, "ep": 2}, {}),
    "mixtral tp2 ep2 router row": (MIXTRAL, {"tp": 2, "ep": 2}, {"router": "row"}),
    "mixtral tp4 sp, experts col/row": (MIXTRAL, {"tp": 4, "sp": 4}, {}),
    "mixtral tp2 ep2 sp, router col": (MIXTRAL, {"tp": 2, "ep": 2, "sp": 2}, {"router": "col"}),
    "gpt-moe tp4 sp, router row": (GPT_MOE, {"tp": 4, "sp": 4}, {"router": "row"}),
    "deepseek tp4 sp, MLA row": (DEEPSEEK, {"tp": 4, "sp": 4}, {"qkv": "row"}),
    "mixtral tp2 ep2 experts col/rep": (
        MIXTRAL, {"tp": 2, "ep": 2}, {"expert_ffn1": "col", "expert_ffn2": "rep"}),
    "mixtral tp4 experts row/row": (MIXTRAL, {"tp": 4}, {"expert_ffn1": "row",
                                                          "expert_ffn2": "row"}),
    "mixtral tp2 dp2 experts rep/col": (
        MIXTRAL, {"tp": 2, "dp": 2}, {"expert_ffn1": "rep", "expert_ffn2": "col"}),
    "mixtral tp2 ep2 experts row/col": (
        MIXTRAL, {"tp": 2, "ep": 2}, {"expert_ffn1": "row", "expert_ffn2": "col"}),
    # formerly the first runtime's (issue 20): the core on other rows than q/k/v read
    "llama tp2 dp2 batch attention after qkv col": (
        LLAMA, {"tp": 2, "dp": 2}, {"qkv": "col", "attn_core": "batch", "out_proj": "row"}),
    "llama tp4 sp batch attention after qkv col": (
        LLAMA, {"tp": 4, "sp": 4}, {"qkv": "col", "attn_core": "batch", "out_proj": "col"}),
    "llama tp4 sp qkv rep before a heads split": (LLAMA, {"tp": 4, "sp": 4}, {"qkv": "rep"}),
    "gpt2 tp2 dp2 batch attention after packed qkv col": (
        GPT2, {"tp": 2, "dp": 2}, {"qkv": "col", "attn_core": "batch", "out_proj": "row"}),
    "gpt2 tp2 dp2 packed qkv rep / row before a heads split": (
        GPT2, {"tp": 2, "dp": 2}, {"qkv": "row"}),
    "gpt-moe tp2 ep2 sp packed qkv rep before a heads split": (
        GPT_MOE, {"tp": 2, "ep": 2, "sp": 2}, {"qkv": "rep"}),
    "deepseek tp4 MLA batch attention after qkv row": (
        DEEPSEEK, {"tp": 4}, {"qkv": "row", "attn_core": "batch", "out_proj": "col"}),
    "deepseek tp4 sp MLA rep before a heads split": (DEEPSEEK, {"tp": 4, "sp": 4}, {"qkv": "rep"}),
    # expert pairs of GPT-MoE's plain [E, in, out] experts, and under sequence parallelism
    "gpt-moe tp2 ep2 experts col/rep": (
        GPT_MOE, {"tp": 2, "ep": 2}, {"expert_ffn1": "col", "expert_ffn2": "rep"}),
    "gpt-moe tp4 experts row/row": (
        GPT_MOE, {"tp": 4}, {"expert_ffn1": "row", "expert_ffn2": "row"}),
    "gpt-moe tp2 ep2 sp experts row/col": (
        GPT_MOE, {"tp": 2, "ep": 2, "sp": 2}, {"expert_ffn1": "row", "expert_ffn2": "col"}),
    "mixtral tp2 ep2 sp experts col/rep": (
        MIXTRAL, {"tp": 2, "ep": 2, "sp": 2}, {"expert_ffn1": "col", "expert_ffn2": "rep"}),
    "mixtral tp4 sp experts rep/row": (
        MIXTRAL, {"tp": 4, "sp": 4}, {"expert_ffn1": "rep", "expert_ffn2": "row"}),
}
# (case, base case, Case options): the same file with a padding mask / a KV cache
VARIANTS = {
    "llama tp4 sp qkv rep before a heads split, left padding": (
        "llama tp4 sp qkv rep before a heads split", {"padded": "left"}),
    "llama tp4 sp batch attention after qkv col, right padding": (
        "llama tp4 sp batch attention after qkv col", {"padded": "right"}),
    "llama tp2 dp2 batch attention after qkv col, KV cache": (
        "llama tp2 dp2 batch attention after qkv col", {"kv_cache": 2}),
    "deepseek tp4 sp MLA rep before a heads split, left padding": (
        "deepseek tp4 sp MLA rep before a heads split", {"padded": "left"}),
}


@pytest.fixture(scope="module")
def gloo_results(tmp_path_factory):
    from shardc.backends.verify import Case, run_suites

    tmp = tmp_path_factory.mktemp("coverage")
    suites, paths = {}, {}
    for i, (name, (model, degrees, overrides)) in enumerate(GLOO.items()):
        path = paths[name] = tmp / f"case{i}_parallelize.py"
        path.write_text(build(model, degrees, overrides).code(standalone=True))
        key = (model, tuple(sorted(degrees.items())) if model.endswith(".json") else ())
        suites.setdefault(key, []).append(Case(name, {}, {}, None, code=str(path)))
        suites[key] += [Case(v, {}, {}, None, code=str(path), **opts)
                        for v, (base, opts) in VARIANTS.items() if base == name]
    runs = [(model, cases, dict(degs) if degs else None) for (model, degs), cases in suites.items()]
    return {r["name"]: r for r in run_suites(runs, world=4)}


@pytest.mark.parametrize("name", [*GLOO, *VARIANTS])
def test_covered_families_match_unsharded(gloo_results, name):
    r = gloo_results[name]
    assert r["error"] is None, r["error"]
    assert r["rel_err"] <= 1e-4, r


def test_verify_runs_the_scaled_plans_emitted_file(tmp_path, monkeypatch):
    """``shardc verify`` shards with the ``parallelize.py`` of the plan scaled to its ranks
    (the file Plan.apply runs): a GPT-MoE plan for 8 ranks on 4 keeps its choices and runs
    the torch-style file."""
    import argparse

    import shardc.backends.verify as harness
    from shardc.commands import verify

    plan = build(GPT_MOE, {"tp": 2, "ep": 4}, {"router": "row"})
    plan.save(tmp_path / "plan.json")
    seen = {}

    def fake_run_cases(model, cases, world, **kw):
        seen["code"] = cases[0].code_text
        seen["world"] = world
        return [{"name": "plan", "rel_err": 0.0, "error": None}]

    monkeypatch.setattr(harness, "run_cases", fake_run_cases)
    args = argparse.Namespace(model=GPT_MOE, plan=str(tmp_path / "plan.json"), world=4,
                              tol=1e-4, seq=8)
    assert verify.run(args) == 0
    code = seen["code"]
    assert seen["world"] == 4 and "ModelSharder" not in code
    assert "MESH_SHAPE = (2, 2)" in code and "'moe.router': RouterParallel(RowwiseParallel(" in code
