"""torch.export frontend and model-file loader on real HF and plain PyTorch models."""

from __future__ import annotations

import json

import pytest
import torch
from traced_examples import EXAMPLES, TINY, full_graph, tiny_graph

from shardc.errors import InputError
from shardc.frontends import graph_from_module, load_graph
from shardc.frontends.model_file import load_model_file
from shardc.frontends.torch_export import layer_of

# Full-size parameter counts of the examples, built on meta (no tracing): REFERENCE.md.
FULL_PARAMS = {"llama3_70b": (70.55e9, 0.001), "mixtral_8x7b": (46.70e9, 0.001),
               "deepseek_v3": (671.0e9, 0.001), "gpt_moe_1p2t": (1.197e12, 0.0005),
               "gpt_moe_1p6t": (1.596e12, 0.0005)}


@pytest.mark.parametrize("name", sorted(FULL_PARAMS))
def test_full_size_examples_build_on_meta_with_reference_sizes(name):
    model, inputs = load_model_file(EXAMPLES / f"{name}.py").build()
    n = sum(p.numel() for p in model.parameters())
    want, tol = FULL_PARAMS[name]
    assert abs(n - want) / want < tol
    assert all(p.device.type == "meta" for p in model.parameters())
    assert inputs[0].dtype == torch.int64 and inputs[0].shape == (1, 16)


@pytest.mark.parametrize("name", ["tiny_llama", "tiny_mixtral"])
def test_tiny_examples_have_real_deterministic_weights(name):
    src = load_model_file(EXAMPLES / f"{name}.py")
    (m1, x), (m2, _) = src.build(), src.build()
    assert next(m1.parameters()).device.type == "cpu"
    with torch.no_grad():
        assert torch.equal(m1(*x).logits, m2(*x).logits)


def test_nodes_carry_shapes_modules_and_layers():
    g = tiny_graph("tiny_llama")
    kinds = [n.op for n in g.nodes]
    assert kinds[0] == "input" and kinds[-1] == "output"
    q = next(n for n in g.nodes if n.module_path == "model.layers.1.self_attn.q_proj")
    assert q.op == "linear" and q.layer == 1 and q.target == "aten.linear.default"
    assert q.output_shape == [1, 16, 64] and q.input_shapes == [[1, 16, 64]]
    assert [p.fqn for p in q.params] == ["model.layers.1.self_attn.q_proj.weight"]
    assert q.params[0].shape == [64, 64] and q.params[0].dtype == "float32"
    assert g.tokens == 16


def test_expert_weights_seen_through_views():
    """The transposed expert weight is folded: the grouped matmul carries the [E,..] param."""
    g = tiny_graph("tiny_mixtral")
    gm = [n for n in g.nodes if n.op == "grouped_matmul"]
    assert len(gm) == 4
    assert gm[0].params[0].shape == [4, 256, 64]  # gate_up [E, 2*ffn, hidden]
    assert gm[0].input_shapes[0] == [32, 64]  # 16 tokens x top-2 rows


def test_layer_index_from_module_path():
    assert layer_of("model.layers.12.mlp.experts") == 12
    assert layer_of("layers.0.attn") == 0
    assert layer_of("lm_head") is None


class _Bessel(torch.nn.Module):
    """A model with an op the frontend's table does not know (special_bessel_j0)."""

    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(32, 8)
        self.head = torch.nn.Linear(8, 32)

    def forward(self, ids):
        return self.head(torch.special.bessel_j0(self.emb(ids)))


def test_unknown_op_becomes_other_with_a_warning():
    g = graph_from_module(_Bessel(), (torch.zeros(1, 4, dtype=torch.int64),), name="bessel")
    other = [n for n in g.nodes if n.op == "other"]
    assert len(other) == 1 and "bessel" in other[0].target
    assert other[0].flops == 0
    assert any("bessel" in w for w in g.warnings)
    assert g.num_params == 32 * 8 + 8 * 32 + 32
    assert g.global_op("lm_head").out_features == 32


def test_hf_config_json_builds_on_meta(tmp_path):
    from transformers import LlamaConfig

    cfg = LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2)
    d = cfg.to_dict()
    path = tmp_path / "config.json"
    path.write_text(json.dumps(d))
    g = load_graph(path)
    assert g.num_layers == 2 and g.config["kv_heads"] == 2
    assert {p.dtype for p in g.params} == {"bfloat16"}


def test_loader_errors_are_one_line(tmp_path):
    with pytest.raises(InputError, match="no such file"):
        load_model_file(tmp_path / "nope.py")
    (tmp_path / "empty.py").write_text("x = 1\n")
    with pytest.raises(InputError, match="defines no build_model"):
        load_model_file(tmp_path / "empty.py")
    (tmp_path / "boom.py").write_text(
        "def build_model():\n    raise ValueError('bad hidden size 7')\n"
        "def example_inputs():\n    return ()\n")
    with pytest.raises(InputError) as e:
        load_model_file(tmp_path / "boom.py").build()
    msg = str(e.value)
    assert "bad hidden size 7" in msg and "boom.py:2" in msg and "\n" not in msg
    (tmp_path / "syntax.py").write_text("def build_model(:\n")
    with pytest.raises(InputError, match="syntax error"):
        load_model_file(tmp_path / "syntax.py")
    (tmp_path / "a.txt").write_text("")
    with pytest.raises(InputError, match="unsupported"):
        load_model_file(tmp_path / "a.txt")


@pytest.mark.slow
def test_full_size_mixtral_traces_with_exact_param_count():
    g = full_graph("mixtral_8x7b")
    model, _ = load_model_file(EXAMPLES / "mixtral_8x7b.py").build()
    assert g.num_params == sum(p.numel() for p in model.parameters())
    assert {p.dtype for p in g.params} == {"bfloat16"} and g.config["dtype_bytes"] == 2


def test_tiny_list_is_traceable():
    assert all((EXAMPLES / f"{n}.py").exists() for n in TINY)


def test_qwen3_moe_with_a_dense_first_layer():
    from transformers import Qwen3MoeConfig

    from shardc.frontends.hf_build import build_causal_lm, token_ids

    cfg = Qwen3MoeConfig(vocab_size=256, hidden_size=64, intermediate_size=128,
                         moe_intermediate_size=32, num_hidden_layers=2, num_attention_heads=8,
                         num_key_value_heads=4, num_experts=8, num_experts_per_tok=2, head_dim=8,
                         mlp_only_layers=[0])
    model = build_causal_lm(cfg, device="cpu", dtype=torch.float32)
    g = graph_from_module(model, token_ids(256), name="qwen3_moe")
    assert [(k.name, k.count) for k in g.layer_kinds] == [("dense_block", 1), ("moe_block", 1)]
    assert g.num_params == sum(p.numel() for p in model.parameters())
    assert g.config["num_experts"] == 8 and g.config["top_k"] == 2 and g.config["kv_heads"] == 4
    assert g.nodes[0].name == "input_ids" and not g.warnings


def test_tied_embedding_counted_once():
    from transformers import LlamaConfig

    from shardc.frontends.hf_build import build_causal_lm, token_ids

    cfg = LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)
    model = build_causal_lm(cfg, device="cpu", dtype=torch.float32)
    g = graph_from_module(model, token_ids(128), name="tied")
    assert g.num_params == sum(p.numel() for p in model.parameters())
    head = g.global_op("lm_head")
    assert head.params == 0 and head.attrs["tied_to"] == "embedding"
    assert head.flops_per_token == 2 * 32 * 128
    assert g.config["other_global_params"] == 32
