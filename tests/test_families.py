"""Model families: faithful traces or clear refusals (exit 2), never a different model.

Tiny variants of the public configs (tests/family_matrix.py) keep each family's structure.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from family_matrix import config_path, tiny_dict

from shardc.cli import main
from shardc.errors import InputError


def _tiny_config_json(name: str, folder: Path, **override) -> Path:
    data = tiny_dict(config_path(name))
    data.get("text_config", data).update(override)
    out = folder / name / "config.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(data))
    return out


def _graph(path: Path):
    from shardc.frontends import load_graph

    return load_graph(path)


@pytest.fixture(autouse=True)
def _no_cache(monkeypatch):
    monkeypatch.setenv("SHARDC_NO_CACHE", "1")


def test_context_longer_than_max_positions_is_exit_2(tmp_path, capsys):
    cfg = _tiny_config_json("llama3_1_8b", tmp_path, max_position_embeddings=512)
    out = tmp_path / "out"
    rc = main(["compile", str(cfg), "--mesh", "2x1", "--search", "megatron", "--budget", "1",
               "--context", "1024", "--out", str(out), "--quiet"])
    err = capsys.readouterr().err
    assert rc == 2 and "--context 1024" in err and "max_position_embeddings 512" in err, err
    assert not out.exists()
    rc = main(["simulate", str(cfg), "--mesh", "2x1", "--degrees", "tp=2", "--phase",
               "prefill", "--prompt", "600"])
    err = capsys.readouterr().err
    assert rc == 2 and "--prompt 600" in err and "512" in err, err


def test_context_within_max_positions_compiles(tmp_path, capsys):
    cfg = _tiny_config_json("llama3_1_8b", tmp_path, max_position_embeddings=512)
    out = tmp_path / "out"
    rc = main(["compile", str(cfg), "--mesh", "2x1", "--search", "megatron", "--budget", "1",
               "--context", "512", "--out", str(out), "--quiet"])
    assert rc == 0, capsys.readouterr().err
    assert (out / "parallelize.py").exists()


def test_llama4_experts_are_not_traced_as_a_dense_ffn(tmp_path):
    """transformers' Llama-4 MoE multiplies every token by every expert: refused, not planned
    as dense FFN layers."""
    with pytest.raises(InputError, match="experts computed densely"):
        _graph(_tiny_config_json("llama4_scout", tmp_path))


@pytest.mark.parametrize("name, part", [
    ("gpt_oss_20b", "gpt_oss: the DTensor backend cannot run this model"),
    ("llama4_scout", "experts computed densely")])
def test_compile_refuses_what_it_cannot_plan_or_run(tmp_path, capsys, name, part):
    """One line, exit 2, nothing written: GPT-OSS (sinks, router and expert biases) cannot be
    run by the backend; Llama-4 would be traced as a different model."""
    cfg = _tiny_config_json(name, tmp_path)
    out = tmp_path / "out"
    rc = main(["compile", str(cfg), "--mesh", "2x1", "--search", "megatron", "--budget", "1",
               "--context", "64", "--out", str(out), "--quiet"])
    lines = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("shardc:")]
    assert rc == 2 and len(lines) == 1 and part in lines[0], lines
    assert not out.exists()


def test_phi_moe_longrope_traces_with_its_router_and_top_k(tmp_path):
    """longrope picks its factors from the positions' values (not exportable on meta):
    traced with the positions of a fresh forward; sparsemixer routing has no top-k node, yet
    the router is found and top_k = 2 (not 0: experts would cost nothing)."""
    path = _tiny_config_json("phi3_5_moe", tmp_path)
    g = _graph(path)
    cfg = json.loads(path.read_text())
    kind = g.layer_kinds[0]
    assert kind.op("router") is not None
    assert cfg["num_experts_per_tok"] == 2 and cfg["num_local_experts"] > 2
    assert g.config["top_k"] == 2 and g.config["num_experts"] == cfg["num_local_experts"]
    assert kind.op("expert_ffn1").flops_per_token > 0


def test_phi_moe_full_size_traces_on_meta(tmp_path):
    data = json.loads(config_path("phi3_5_moe").read_text())
    data["num_hidden_layers"] = 1
    cfg = tmp_path / "phi" / "config.json"
    cfg.parent.mkdir()
    cfg.write_text(json.dumps(data))
    g = _graph(cfg)
    assert g.config["hidden"] == 4096 and g.config["top_k"] == 2
    assert g.config["max_position_embeddings"] == 131072


@pytest.mark.parametrize("name", ["gemma2_9b", "gpt_oss_20b"])
def test_models_refusing_sdpa_trace_with_eager_attention(tmp_path, name):
    path = _tiny_config_json(name, tmp_path)
    g = _graph(path)
    assert all(k.op("attn_core") is not None for k in g.layer_kinds)
    assert g.config["heads"] == json.loads(path.read_text())["num_attention_heads"]


def test_backend_places_every_parameter_of_the_runnable_families():
    from family_matrix import tiny_config

    from shardc.backends.support import backend_problem
    from shardc.frontends.hf_build import build_causal_lm

    for name in ("qwen3_8b", "qwen3_30b_a3b", "olmoe_1b_7b", "qwen2_5_7b", "deepseek_v2_lite",
                 "gemma2_9b", "phi3_5_moe", "gpt2"):
        model = build_causal_lm(tiny_config(config_path(name)))
        assert backend_problem(model) is None, name


def test_gpt2_plan_places_its_conv1d_weights_by_layer_kind(tmp_path):
    """GPT-2's Conv1D weights are [in, out] and its layers are ``transformer.h.<i>``: a
    Megatron plan splits c_attn / c_fc by output (dim 1), c_proj by input (dim 0)."""
    from shardc.ir.strategy import Mesh, Workload, strategy_from_names
    from shardc.plan import build_plan

    g = _graph(_tiny_config_json("gpt2", tmp_path))
    kind = g.layer_kinds[0].name
    ops = {"qkv": "col", "attn_core": "heads", "out_proj": "row", "ffn1": "col", "ffn2": "row"}
    choices = {"embedding": "vocab", "lm_head": "col", **{f"{kind}.{o}": c for o, c in ops.items()}}
    plan = build_plan(g, strategy_from_names({"tp": 2}, choices, 1), Mesh(2, 1), "h100",
                      Workload(batch=1, context=64))
    place = {p["fqn"]: p["placements"][0] for p in plan.params}
    assert place["transformer.h.0.attn.c_attn.weight"] == "S(1)"
    assert place["transformer.h.0.attn.c_attn.bias"] == "S(0)"
    assert place["transformer.h.0.attn.c_proj.weight"] == "S(0)"
    assert place["transformer.h.0.mlp.c_fc.weight"] == "S(1)"
    assert place["transformer.h.0.mlp.c_proj.weight"] == "S(0)"
