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


def test_compile_refuses_what_it_cannot_plan(tmp_path, capsys):
    """One line, exit 2, nothing written: Llama-4 would be traced as a different model."""
    cfg = _tiny_config_json("llama4_scout", tmp_path)
    out = tmp_path / "out"
    rc = main(["compile", str(cfg), "--mesh", "2x1", "--search", "megatron", "--budget", "1",
               "--context", "64", "--out", str(out), "--quiet"])
    lines = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("shardc:")]
    assert rc == 2 and len(lines) == 1 and "experts computed densely" in lines[0], lines
    assert not out.exists()


def test_a_model_the_backend_cannot_run_is_planned_without_parallelize_py(tmp_path, capsys):
    """Qwen3-Next (Gated DeltaNet layers): the DTensor backend cannot run it, which
    the engines do not need -- plan.json, the reports and both launch scripts are written, no
    parallelize.py (a stale one from an earlier compile is removed), exit 0, and plan.json
    ``backend`` and the summary say why; ``Plan.code`` and ``shardc verify`` refuse it."""
    from shardc.plan import load_plan

    cfg = _tiny_config_json("qwen3_next_80b_a3b", tmp_path)
    out = tmp_path / "out"
    out.mkdir()
    (out / "parallelize.py").write_text("# an earlier model's\n")
    rc = main(["compile", str(cfg), "--mesh", "2x1", "--search", "megatron", "--budget", "1",
               "--context", "64", "--out", str(out), "--quiet"])
    text = capsys.readouterr().out
    assert rc == 0
    assert "no parallelize.py: qwen3_next: the DTensor backend cannot run this model" in text
    for name in ("plan.json", "graph.txt", "launch/vllm_mixed.sh", "launch/sglang_mixed.sh"):
        assert (out / name).exists(), name
    assert not (out / "parallelize.py").exists()
    plan = load_plan(out / "plan.json")
    assert plan.backend["runs"] is False and "recurrent" in plan.backend["reason"]
    with pytest.raises(InputError, match="has no parallelize.py"):
        plan.code()
    rc = main(["verify", str(cfg), "--plan", str(out / "plan.json"), "--world", "2"])
    err = capsys.readouterr().err
    assert rc == 2 and err.startswith("shardc: error:") and len(err.splitlines()) == 1, err
    assert "the DTensor backend cannot run this model" in err, err  # not a layer-kind mismatch


def test_a_runnable_model_records_that_its_backend_runs(tmp_path):
    import shardc

    plan = shardc.compile(_tiny_config_json("llama3_1_8b", tmp_path), mesh="2x1",
                          search="megatron", budget=1)
    assert plan.to_dict()["backend"] == {"runs": True, "reason": None}


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
                 "gemma2_9b", "phi3_5_moe", "gpt2", "gpt_oss_20b"):
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


def _cut(name: str, folder: Path, layers: int, **override) -> Path:
    """The family's public config.json at full width with ``layers`` decoder layers."""
    data = json.loads(config_path(name).read_text())
    data.update(num_hidden_layers=layers, **override)
    out = folder / name / "config.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(data))
    return out


def test_remote_code_model_type_is_built_from_the_class_its_architectures_name(tmp_path,
                                                                               capsys):
    """Kimi-K2 says model_type kimi_k2 (remote code, never run) and architectures
    DeepseekV3ForCausalLM: read as DeepSeek-V3 (MLA, 384 experts, top-8), with a note; a type
    whose architectures name no transformers class is one line, exit 2."""
    from shardc.frontends.model_file import load_model_file

    src = load_model_file(_cut("kimi_k2", tmp_path, 2))
    assert len(src.notes) == 1 and "model_type 'kimi_k2' is not a transformers model type" \
        in src.notes[0] and "DeepseekV3ForCausalLM (model_type 'deepseek_v3')" in src.notes[0]
    from shardc.frontends.hf_types import known_model_type

    data, _ = known_model_type(json.loads(config_path("kimi_k2").read_text()), "kimi")
    assert data["model_type"] == "deepseek_v3" and data["n_routed_experts"] == 384
    bad = _cut("kimi_k2", tmp_path / "bad", 2, architectures=["KimiForCausalLM"])
    rc = main(["inspect", str(bad)])
    lines = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("shardc:")]
    assert rc == 2 and len(lines) == 1, lines
    assert "'kimi_k2' is not a transformers model type" in lines[0]
    assert "never runs a config's remote code" in lines[0]


FALCON_H1 = {  # Falcon-H1's layout (Mamba-2 mixer beside attention in every layer), small
    "model_type": "falcon_h1", "architectures": ["FalconH1ForCausalLM"], "vocab_size": 256,
    "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 4,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64, "mamba_d_ssm": 512,
    "mamba_n_heads": 8, "mamba_d_head": 64, "mamba_d_state": 16, "mamba_chunk_size": 16}


def test_every_command_refuses_recurrent_layers_it_does_not_model_by_name(tmp_path, capsys):
    """Falcon-H1 runs its Mamba-2 mixer in parallel with attention in every layer (two cores
    in one layer, which the cost model has no kind for): simulate, inspect and compile refuse
    them by name (one line, exit 2) instead of pricing them as attention; Gated DeltaNet,
    Mamba-1 and Mamba-2 in layers of their own (Nemotron-H) are modelled
    (tests/test_hybrid_models.py)."""
    cfg = tmp_path / "falcon_h1" / "config.json"
    cfg.parent.mkdir()
    cfg.write_text(json.dumps(FALCON_H1))
    out = tmp_path / "out"
    part = ("falcon_h1: 4 of 4 layers (0, 1, 2, 3) are linear attention / state-space layers "
            "(FalconH1Mixer)")
    for argv in (["inspect", str(cfg)],
                 ["simulate", str(cfg), "--mesh", "8x1", "--degrees", "tp=8"],
                 ["compile", str(cfg), "--mesh", "8x1", "--search", "megatron", "--budget",
                  "1", "--out", str(out), "--quiet"]):
        rc = main(argv)
        lines = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("shardc:")]
        assert rc == 2 and len(lines) == 1 and part in lines[0], (argv[0], lines)
        assert "not supported" in lines[0] and "beside attention in the same layer" in lines[0]
    assert not out.exists()


FP8_BLOCKS = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
              "weight_block_size": [128, 128]}


@pytest.mark.parametrize("quant, flags, weights, line", [
    (FP8_BLOCKS, [], "fp8", "weights fp8: the checkpoint's quantization_config (fp8 e4m3, "
                            "128x128 blocks)"),
    ({"quant_method": "fp8", "activation_scheme": "static"}, [], "fp8",
     "weights fp8: the checkpoint's quantization_config (fp8 e4m3, per tensor)"),
    (FP8_BLOCKS, ["--weights", "bf16"], "bf16",
     "weights bf16: --weights (the checkpoint stores fp8 e4m3, 128x128 blocks)"),
    ({"quant_method": "awq", "bits": 4, "group_size": 128}, [], "bf16",
     "warning: the checkpoint's quantization_config (awq, 4-bit) is not modelled; weights "
     "priced as bf16")])
def test_quantization_config_sets_the_default_weight_format(tmp_path, capsys, quant, flags,
                                                             weights, line):
    """An FP8 checkpoint (blocks or per tensor) is planned in fp8 unless --weights says
    otherwise; a scheme shardc does not model is priced as bf16 and says so; the summary and
    plan.json model.checkpoint / workload.weights record it."""
    cfg = _tiny_config_json("llama3_1_8b", tmp_path, quantization_config=quant)
    out = tmp_path / "out"
    rc = main(["compile", str(cfg), "--mesh", "2x1", "--search", "megatron", "--budget", "1",
               "--context", "64", "--out", str(out), "--quiet", *flags])
    text = capsys.readouterr().out
    assert rc == 0 and line in text, text
    plan = json.loads((out / "plan.json").read_text())
    assert plan["workload"]["weights"] == weights
    assert plan["model"]["checkpoint"]["weights"] == (None if quant["quant_method"] == "awq"
                                                      else "fp8")


def test_sliding_window_shows_in_plan_graph_and_parallelize(tmp_path):
    """Gemma-2 alternates sliding-window and full layers: each kind's attention is in
    plan.json layer_kinds, the graph.txt header and the parallelize.py comment of its kind."""
    cfg = _tiny_config_json("gemma2_9b", tmp_path)
    window = json.loads(cfg.read_text())["sliding_window"]
    out = tmp_path / "out"
    assert main(["compile", str(cfg), "--mesh", "2x1", "--search", "megatron", "--budget", "1",
                 "--context", "64", "--out", str(out), "--quiet"]) == 0
    kinds = json.loads((out / "plan.json").read_text())["layer_kinds"]
    by_attention = {k.get("attention"): k for k in kinds}
    assert set(by_attention) == {"sliding_window", "full"}
    sliding = by_attention["sliding_window"]
    assert sliding["window"] == window and sliding["layers"][0] == 0  # Gemma-2: even layers
    text = (out / "graph.txt").read_text()
    assert f"# layer kind {sliding['name']} x {sliding['count']} (layers 0" in text
    assert f"sliding-window attention, window {window:,} tokens" in text
    code = (out / "parallelize.py").read_text()
    assert f"# {sliding['name']} x {sliding['count']}: sliding-window attention" in code
    assert f"# {by_attention['full']['name']} x" in code and "full causal attention" in code
