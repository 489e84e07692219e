"""``shardc verify`` can be trusted: NaN / Inf logits fail, ``--tol`` is checked, and an HF
config.json is verified on a tiny variant derived from it (same class, same layer pattern).

The gloo part is one 4-rank launch: ``shardc verify CONFIG --plan plan.json --world 4`` is run
in process with the launch replaced by a recorder (the cases it builds), the recorded cases
of three configs run in ONE launch, and their results are replayed into the CLI.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from shardc.backends import verify as harness
from shardc.cli import main

ROOT = Path(__file__).resolve().parents[1]
LLAMA_PY = str(ROOT / "examples" / "tiny_llama.py")
QWEN3_MOE = str(ROOT / "examples" / "configs" / "qwen3_30b_a3b" / "config.json")
NAN, INF = float("nan"), float("inf")

# Llama-3-8B shapes, 4 layers (the trace of a full-depth model is what costs)
LLAMA3 = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096,
          "intermediate_size": 14336, "num_attention_heads": 32, "num_key_value_heads": 8,
          "num_hidden_layers": 4, "vocab_size": 128256, "max_position_embeddings": 131072,
          "rms_norm_eps": 1e-05, "tie_word_embeddings": False, "bos_token_id": 128000,
          "eos_token_id": 128001, "rope_theta": 500000.0,
          "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                           "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}}
# DeepSeek-V3 (examples/deepseek_v3.py) with 5 layers: 3 dense (first_k_dense_replace) + 2 MoE
DEEPSEEK_V3 = {"architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3",
               "vocab_size": 129280, "hidden_size": 7168, "intermediate_size": 18432,
               "moe_intermediate_size": 2048, "num_hidden_layers": 5, "first_k_dense_replace": 3,
               "num_attention_heads": 128, "num_key_value_heads": 128, "n_routed_experts": 256,
               "n_shared_experts": 1, "num_experts_per_tok": 8, "n_group": 8, "topk_group": 4,
               "q_lora_rank": 1536, "kv_lora_rank": 512, "qk_rope_head_dim": 64,
               "qk_nope_head_dim": 128, "v_head_dim": 128, "tie_word_embeddings": False}


# ----------------------------------------------------------------- NaN / Inf never pass
@pytest.mark.parametrize("a,b", [(0.1, NAN), (NAN, 0.1), (0.0, INF), (INF, 0.0), (None, NAN)])
def test_worst_rel_err_keeps_a_nan_or_inf_from_either_rank(a, b):
    worst = harness.worst_rel_err(a, b)
    assert worst is not None and not math.isfinite(worst)


def test_worst_rel_err_of_numbers_is_the_max():
    worst = harness.worst_rel_err
    assert worst(0.1, 0.3) == 0.3 and worst(None, 0.2) == 0.2
    assert worst(0.2, None) == 0.2 and worst(None, None) is None


@pytest.mark.parametrize("order", [0, 1])
def test_a_rank_with_nan_logits_fails_the_case(order):
    ranks = [{"rel_err": 1e-7}, {"rel_err": NAN}]
    res = harness.merge_rank_results("plan", ranks[::-1] if order else ranks)
    assert res["error"] and "NaN" in res["error"]


@pytest.mark.parametrize("side", ["sharded", "reference"])
@pytest.mark.parametrize("bad", [NAN, INF, -INF])
def test_compare_logits_refuses_non_finite_values_on_either_side(side, bad):
    good = torch.randn(2, 3, 5)
    broken = good.clone()
    broken[1, 2, 3] = bad
    out, expect = (broken, good) if side == "sharded" else (good, broken)
    rel, err = harness.compare_logits(out, expect)
    assert rel is None and err.startswith(side if side == "sharded" else "reference")
    assert "not finite" in err


def test_compare_logits_of_an_all_zero_reference_is_an_error():
    rel, err = harness.compare_logits(torch.ones(2, 4), torch.zeros(2, 4))
    assert rel is None and "all zero" in err


def test_compare_logits_relative_error():
    expect = torch.tensor([[1.0, -4.0]])
    assert harness.compare_logits(expect + 0.4, expect) == (pytest.approx(0.1), None)


@pytest.fixture(scope="module")
def llama_plan(tmp_path_factory) -> str:
    """A tp=2 plan of examples/tiny_llama.py (no trace cost: the tiny graph is cached)."""
    from shardc.frontends import load_graph
    from shardc.ir.strategy import Degrees, Mesh, Strategy, Workload
    from shardc.plan import build_plan

    graph = load_graph(LLAMA_PY, tiny=True)
    ch = {"embedding": 0, "lm_head": 0, "dense_block.qkv": 0, "dense_block.attn_core": 0,
          "dense_block.out_proj": 1, "dense_block.ffn1": 0, "dense_block.ffn2": 0}
    path = tmp_path_factory.mktemp("plan") / "plan.json"
    build_plan(graph, Strategy(Degrees(tp=2), 8, ch), Mesh(2, 1), "h100",
               Workload(batch=8)).save(path)
    return str(path)


def _verify(argv: list[str], results, monkeypatch, capsys) -> tuple[int, str, str]:
    seen = []

    def fake_run_cases(model_ref, cases, world, **kw):
        seen.append((model_ref, cases, world, kw))
        return [dict(r, name=c.name) for c, r in zip(cases, results)]

    monkeypatch.setattr(harness, "run_cases", fake_run_cases)
    rc = main(["verify", *argv])
    cap = capsys.readouterr()
    return rc, cap.out, cap.err


def test_verify_cli_fails_on_a_nan_error(llama_plan, monkeypatch, capsys):
    rc, out, _ = _verify([LLAMA_PY, "--plan", llama_plan, "--world", "2"],
                         [{"rel_err": NAN, "error": None}], monkeypatch, capsys)
    assert rc == 1, out
    assert out.strip().splitlines()[-1].startswith("verify MISMATCH")


@pytest.mark.parametrize("tol", ["nan", "-1", "inf", "0", "-inf"])
def test_verify_tol_must_be_finite_and_positive(llama_plan, monkeypatch, capsys, tol):
    rc, out, err = _verify([LLAMA_PY, "--plan", llama_plan, "--world", "2", f"--tol={tol}"],
                           [{"rel_err": 0.0, "error": None}], monkeypatch, capsys)
    lines = err.strip().splitlines()
    assert rc == 2 and len(lines) == 1 and "verify OK" not in out
    assert lines[0].startswith("shardc: error: --tol") and "finite positive" in lines[0]


def test_verify_seq_must_be_positive(llama_plan, monkeypatch, capsys):
    rc, _, err = _verify([LLAMA_PY, "--plan", llama_plan, "--world", "2", "--seq", "0"],
                         [{"rel_err": 0.0, "error": None}], monkeypatch, capsys)
    assert rc == 2 and err.strip() == ("shardc: error: --seq 0: expected a positive number "
                                       "of tokens per sequence")


def test_verify_maps_config_layers_onto_the_plan_and_refuses_a_mismatch(llama_plan, monkeypatch,
                                                                       capsys):
    """A dense Llama plan against Qwen3-MoE's tiny variant (MoE layers): exit 2, one line."""
    rc, out, err = _verify([QWEN3_MOE, "--plan", llama_plan, "--world", "2"],
                           [{"rel_err": 0.0, "error": None}], monkeypatch, capsys)
    lines = err.strip().splitlines()
    assert rc == 2 and len(lines) == 1, out + err
    assert "its layer 0 (original layer 0) is a moe_block, the plan's layer 0 is dense_block" \
        in lines[0]


def test_verify_config_whose_pattern_a_tiny_model_cannot_keep(llama_plan, tmp_path, monkeypatch,
                                                              capsys):
    """MoE every 20th layer: no prefix of <= 8 layers holds an MoE layer and the step cannot
    be renumbered, so the derived model would differ in kind: refused, not run as another
    model."""
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps({"model_type": "qwen2_moe", "decoder_sparse_step": 20,
                               "num_hidden_layers": 40, "num_experts": 16}))
    rc, _, err = _verify([str(cfg), "--plan", llama_plan, "--world", "2"],
                         [{"rel_err": 0.0, "error": None}], monkeypatch, capsys)
    lines = err.strip().splitlines()
    assert rc == 2 and len(lines) == 1
    assert "qwen2_moe: cannot derive a tiny variant that keeps the layer pattern" in lines[0]


# ----------------------------------------------------------------- tiny_config
def _gqa(heads: int, kv: int) -> str:
    return "mha" if heads == kv else "mqa" if kv == 1 else "gqa"


def _configs() -> dict:
    from transformers import (
        AutoConfig,
        DeepseekV2Config,
        Gemma2Config,
        GPT2Config,
        GptOssConfig,
        Phi3Config,
        Qwen2MoeConfig,
    )

    longrope = {"rope_type": "longrope", "short_factor": [1.0 + i / 48 for i in range(48)],
                "long_factor": [2.0 + i / 48 for i in range(48)],
                "original_max_position_embeddings": 4096}
    return {
        "llama3": AutoConfig.for_model(**LLAMA3),
        "qwen3_moe": AutoConfig.for_model(**json.loads(Path(QWEN3_MOE).read_text())),
        "deepseek_v3": AutoConfig.for_model(**dict(DEEPSEEK_V3, num_hidden_layers=61)),
        "deepseek_v2_lite": DeepseekV2Config(q_lora_rank=None, n_routed_experts=64,
                                             first_k_dense_replace=1, num_hidden_layers=27,
                                             num_experts_per_tok=6, n_shared_experts=2),
        "gemma2": Gemma2Config(),
        "gpt_oss": GptOssConfig(),
        "qwen2_moe_mlp_only_late": Qwen2MoeConfig(mlp_only_layers=[5, 20]),
        "phi3_longrope": Phi3Config(hidden_size=3072, num_attention_heads=32,
                                    num_key_value_heads=32, max_position_embeddings=131072,
                                    rope_scaling=longrope),
        "phi3_longrope_partial_rotary": Phi3Config(
            hidden_size=3072, num_attention_heads=32, num_key_value_heads=8,
            max_position_embeddings=131072,
            rope_scaling=dict(longrope, partial_rotary_factor=0.5,
                              short_factor=longrope["short_factor"][:24],
                              long_factor=longrope["long_factor"][:24])),
        "gpt2": GPT2Config(),
    }


CONFIGS = list(_configs())


@pytest.mark.parametrize("name", CONFIGS)
@pytest.mark.parametrize("degrees", [{"tp": 4, "ep": 4, "pp": 2}, {"tp": 2, "ep": 8}])
def test_tiny_config_divides_degrees_and_keeps_the_pattern(name, degrees):
    from transformers import AutoModelForCausalLM

    from shardc.frontends.tiny_config import LAYER_SOURCE_KEY, tiny_config

    big = _configs()[name]
    tiny = tiny_config(big, degrees)
    tp, ep = degrees.get("tp", 1), degrees.get("ep", 1)
    assert type(tiny) is type(big) and tiny.model_type == big.model_type
    assert tiny.architectures == big.architectures
    # shrunk, and divisible by the degrees
    assert tiny.hidden_size < big.hidden_size and tiny.vocab_size <= 256 * tp * ep
    assert tiny.num_attention_heads % tp == 0 and tiny.hidden_size % tp == 0
    kv = getattr(big, "num_key_value_heads", None)
    if kv is not None:
        assert _gqa(tiny.num_attention_heads, tiny.num_key_value_heads) == \
            _gqa(big.num_attention_heads, kv)
        if kv > 1:
            assert tiny.num_key_value_heads % tp == 0
    for f in ("n_routed_experts", "num_experts", "num_local_experts"):
        if getattr(big, f, None):
            assert getattr(tiny, f) % ep == 0 and getattr(tiny, f) <= 8 * ep
            assert tiny.num_experts_per_tok <= getattr(tiny, f)
    for f in ("intermediate_size", "moe_intermediate_size"):
        if getattr(big, f, None):
            assert getattr(tiny, f) % tp == 0 and getattr(tiny, f) < getattr(big, f)
    assert tiny.num_hidden_layers >= degrees.get("pp", 1)
    # MLA ranks present or None exactly as in the original
    for f in ("q_lora_rank", "kv_lora_rank"):
        if hasattr(big, f):
            assert (getattr(tiny, f) is None) == (getattr(big, f) is None)
    # the layer pattern: tiny layer i plays original layer source[i]
    source = getattr(tiny, LAYER_SOURCE_KEY)
    assert len(source) == tiny.num_hidden_layers and source == sorted(set(source))
    if getattr(big, "layer_types", None):
        assert tiny.layer_types == [big.layer_types[j] for j in source]
        assert set(tiny.layer_types) == set(big.layer_types)
    if getattr(big, "first_k_dense_replace", None) is not None:
        assert tiny.first_k_dense_replace == sum(1 for j in source if j < big.first_k_dense_replace)
        assert 0 < tiny.first_k_dense_replace < tiny.num_hidden_layers
    if getattr(big, "mlp_only_layers", None):
        assert [source[t] for t in tiny.mlp_only_layers] == \
            [j for j in big.mlp_only_layers if j in source]
        assert tiny.mlp_only_layers and len(tiny.mlp_only_layers) < tiny.num_hidden_layers
    rope = getattr(tiny, "rope_parameters", None) or {}
    if "short_factor" in rope:
        head_dim = tiny.head_dim if getattr(tiny, "head_dim", None) else \
            tiny.hidden_size // tiny.num_attention_heads
        rotary = int(head_dim * rope.get("partial_rotary_factor", 1.0))
        assert len(rope["short_factor"]) == len(rope["long_factor"]) == rotary // 2
    assert rope.get("rope_type") == (getattr(big, "rope_parameters", None) or {}).get("rope_type")
    # HF builds it (meta: shapes only)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(tiny, attn_implementation="eager")
    assert sum(p.numel() for p in model.parameters()) < 5_000_000


def test_tiny_config_keeps_first_k_dense_replace_with_one_moe_layer():
    """DeepSeek-V3's 3 dense layers stay 3 (the prefix 0..3): 3 dense + 1 MoE."""
    from shardc.frontends.tiny_config import LAYER_SOURCE_KEY, tiny_config

    tiny = tiny_config(_configs()["deepseek_v3"], {"ep": 4})
    assert tiny.first_k_dense_replace == 3 and tiny.num_hidden_layers == 4
    assert getattr(tiny, LAYER_SOURCE_KEY) == [0, 1, 2, 3]


def test_tiny_config_of_a_multimodal_config_shrinks_its_text_model(tmp_path):
    """Llama-4 (Llama4Config with a text_config): MoE every 2nd layer and NoPE every 4th
    survive in the text config; the outer config stays a Llama4Config; as a config.json its
    tiny inputs are below the text model's vocab."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from shardc.frontends.model_file import load_model_file
    from shardc.frontends.tiny_config import LAYER_SOURCE_KEY, tiny_config

    big = AutoConfig.for_model("llama4", text_config={"interleave_moe_layer_step": 2,
                                                      "num_hidden_layers": 48})
    tiny = tiny_config(big, {"tp": 2, "ep": 4})
    text = tiny.get_text_config()
    assert type(tiny) is type(big) and text.hidden_size <= 128
    assert text.num_hidden_layers == 4 and getattr(tiny, LAYER_SOURCE_KEY) == [0, 1, 2, 3]
    assert text.moe_layers == [1, 3] and text.no_rope_layers == big.text_config.no_rope_layers[:4]
    assert text.num_local_experts % 4 == 0 and text.num_attention_heads % 2 == 0
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(text, attn_implementation="eager")
    assert sum(p.numel() for p in model.parameters()) < 5_000_000
    (tmp_path / "config.json").write_text(big.to_json_string())
    model, (ids,) = load_model_file(tmp_path / "config.json", {"tp": 2}).build(tiny=True)
    assert int(ids.max()) < text.vocab_size
    with torch.no_grad():
        assert torch.isfinite(model(ids).logits).all()


def test_config_json_has_a_small_cpu_tiny_model():
    from shardc.frontends.model_file import load_model_file

    src = load_model_file(QWEN3_MOE, tiny_degrees={"ep": 4})
    model, (ids,) = src.build(tiny=True)
    params = list(model.parameters())
    assert all(p.device.type == "cpu" and p.dtype == torch.float32 for p in params)
    assert sum(p.numel() for p in params) < 2_000_000
    assert type(model).__name__ == "Qwen3MoeForCausalLM"
    assert int(ids.max()) < model.config.vocab_size
    with torch.no_grad():
        assert torch.isfinite(model(ids).logits).all()


# ----------------------------------------------------------------- verify a config.json
CASES = {"llama3": LLAMA3, "deepseek_v3": DEEPSEEK_V3}


@pytest.fixture(scope="module")
def config_runs(tmp_path_factory):
    """name -> (config path, plan path, recorded (model_ref, cases, world, kw))."""
    tmp = tmp_path_factory.mktemp("configs")
    paths = {"qwen3_moe": QWEN3_MOE}
    for name, cfg in CASES.items():
        (tmp / name).mkdir()
        (tmp / name / "config.json").write_text(json.dumps(cfg))
        paths[name] = str(tmp / name / "config.json")
    runs = {}
    for name, cfg in paths.items():
        out = tmp / f"{name}_out"
        assert main(["compile", cfg, "--mesh", "8x1", "--search", "megatron",
                     "--out", str(out)]) == 0
        seen = []
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(harness, "run_cases", lambda m, cs, w, **kw: seen.append((m, cs, w, kw))
                       or [{"name": c.name, "rel_err": 0.0, "error": None} for c in cs])
            assert main(["verify", cfg, "--plan", str(out / "plan.json"), "--world", "4"]) == 0
        runs[name] = (cfg, str(out / "plan.json"), seen[0])
    return runs


def test_verify_maps_deepseek_layers_onto_the_plans_kinds(config_runs):
    """The tiny DeepSeek-V3 keeps 3 dense + 1 MoE layer: they run the plan's dense_block and
    moe_block choices."""
    _, _, (_, (case,), world, kw) = config_runs["deepseek_v3"]
    assert case.layer_kinds == {"dense_block": [0, 1, 2], "moe_block": [3]}
    assert world == 4 and set(kw["tiny_degrees"]) == {"tp", "ep", "pp", "dp"}


@pytest.fixture(scope="module")
def gloo(config_runs):
    suites = [(m, cases, kw["tiny_degrees"]) for _, _, (m, cases, _, kw) in config_runs.values()]
    results = harness.run_suites(suites, world=4)
    return dict(zip(config_runs, results))


@pytest.mark.parametrize("name", ["llama3", "deepseek_v3", "qwen3_moe"])
def test_verify_a_config_json_plan(config_runs, gloo, name, monkeypatch, capsys):
    """``shardc verify CONFIG --plan plan.json --world 4`` passes: the launch's result for
    the case the CLI built is replayed into the CLI."""
    cfg, plan, (_, (case,), _, _) = config_runs[name]
    res = gloo[name]
    assert res["error"] is None, res["error"]
    rc, out, err = _verify([cfg, "--plan", plan, "--world", "4"], [res], monkeypatch, capsys)
    assert rc == 0 and "verify OK" in out, out + err
    assert out.startswith(f"tiny variant of {cfg}: ")
    assert res["rel_err"] <= 1e-4

