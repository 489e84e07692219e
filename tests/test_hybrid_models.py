"""Hybrid models: linear-attention (Gated DeltaNet) and Mamba layers are modelled.

Their layers get their own op kinds (``causal_conv``, ``recurrent_scan``) and a constant
per-sequence recurrent + conv state instead of a KV cache, split with the heads under tp.
The configs are the public ones under examples/configs (Qwen3-Next-80B-A3B-Instruct,
Jamba-v0.1, the 52B model whose architecture Jamba-1.5-Mini shares, and Nemotron-H-8B-Base-8K,
whose Mamba-2 layers interleave with attention and MLP-only layers).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from shardc.cli import main

CONFIGS = Path(__file__).resolve().parents[1] / "examples" / "configs"
GB = 1e9
BF16 = 2  # bytes: the checkpoints' dtype; vLLM's default state dtype is the model's
FP32 = 4  # SGLang's default SSM state dtype, and vLLM's for Nemotron-H

# ----------------------------------------------------------------- hand computations
# tp = 8, batch 64 sequences, context 4096 tokens, decode, vLLM's layout (attention and the
# recurrent layers split by heads; a KV head held by tp / kv_heads ranks when tp > kv_heads).
TP, BATCH, CONTEXT = 8, 64, 4096

# Qwen3-Next-80B-A3B: num_hidden_layers 48, full_attention_interval 4 -> 12 gated-attention
# layers and 36 Gated DeltaNet layers.
# KV cache: num_key_value_heads 2 x head_dim 256, K and V; 2 KV heads < tp 8, so each GPU
# holds one KV head (replicated on 4 ranks): 2 (K, V) x 1 x 256 elements per token and layer.
QWEN3_NEXT_KV = 12 * (2 * 1 * 256) * BATCH * CONTEXT * BF16  # 3.22 GB
# Recurrent state per Gated DeltaNet layer and sequence: linear_num_value_heads 32 x
# linear_key_head_dim 128 x linear_value_head_dim 128 = 524,288; conv state: the conv runs
# over q, k, v = 2 x 16 key heads x 128 + 32 value heads x 128 = 8,192 channels, keeping
# linear_conv_kernel_dim 4 - 1 = 3 inputs each = 24,576. Split by heads over tp 8.
QWEN3_NEXT_STATE = 36 * (32 * 128 * 128 + 8192 * 3) // TP * BATCH * BF16  # 0.32 GB
# Jamba-v0.1: num_hidden_layers 32, attn_layer_period 8 / offset 4 -> 4 attention layers,
# 28 Mamba layers. KV: num_key_value_heads 8 x head_dim 4096 / 32 = 128, K and V, split 8 ways.
JAMBA_KV = 4 * (2 * 8 * 128 // TP) * BATCH * CONTEXT * BF16  # 0.54 GB
# Mamba state per layer and sequence: d_inner = mamba_expand 2 x hidden 4096 = 8,192
# channels x mamba_d_state 16 = 131,072; conv state 8,192 x (mamba_d_conv 4 - 1) = 24,576;
# split by channels over tp 8.
JAMBA_STATE = 28 * (8192 * 16 + 8192 * 3) // TP * BATCH * BF16  # 0.07 GB
# Nemotron-H-8B: hybrid_override_pattern "M-M-M-M*-..." of 52 layers -> 24 Mamba-2 layers,
# 4 attention layers, 24 MLP-only layers. KV: num_key_value_heads 8 x head_dim 128, K and V,
# split 8 ways.
NEMOTRON_H_KV = 4 * (2 * 8 * 128 // TP) * BATCH * CONTEXT * BF16  # 0.54 GB
# Mamba-2 state per layer and sequence: mamba_num_heads 128 x mamba_head_dim 64 x
# ssm_state_size 128 = 1,048,576; conv state over x, B, C = 128 x 64 + 2 x n_groups 8 x 128
# = 10,240 channels x (conv_kernel 4 - 1) = 30,720; split by heads (and the 8 groups) over tp 8.
# vLLM holds Nemotron-H's SSM state in float32 (its per-model hook reads the config's
# mamba_ssm_cache_dtype, float32 by default), the conv state in the model's bf16.
NEMOTRON_H_STATE = 24 * (128 * 64 * 128 * FP32 + 10240 * 3 * BF16) // TP * BATCH  # 0.81 GB
HAND = {"qwen3_next_80b_a3b": (QWEN3_NEXT_KV, QWEN3_NEXT_STATE),
        "jamba_v0_1": (JAMBA_KV, JAMBA_STATE),
        "nemotron_h_8b": (NEMOTRON_H_KV, NEMOTRON_H_STATE)}


def _simulate(tmp_path, name: str, context: int = CONTEXT, runtime: str = "vllm") -> dict:
    out = tmp_path / f"{name}-{context}-{runtime}.json"
    rc = main(["simulate", str(CONFIGS / name / "config.json"), "--mesh", "8x1", "--degrees",
               f"tp={TP}", "--batch", str(BATCH), "--context", str(context), "--runtime",
               runtime, "--json", str(out)])
    assert rc == 0
    return json.loads(out.read_text())["predicted"]["breakdown"]["memory"]


@pytest.mark.parametrize("name", sorted(HAND))
def test_kv_cache_and_recurrent_state_per_gpu_match_a_hand_computation(tmp_path, name):
    kv, state = HAND[name]
    mem = _simulate(tmp_path, name)
    predicted = (mem["kv_cache_gb"] + mem["recurrent_state_gb"]) * GB
    assert abs(predicted - (kv + state)) <= 0.25 * (kv + state), (predicted, kv + state)
    # each part on its own: the formulas are exact, so the parts agree far closer
    assert mem["kv_cache_gb"] * GB == pytest.approx(kv, rel=1e-3)
    assert mem["recurrent_state_gb"] * GB == pytest.approx(state, rel=1e-3)


def test_sglang_holds_the_ssm_state_in_float32(tmp_path):
    """SGLang's --mamba-ssm-dtype defaults to float32 for every model: Qwen3-Next's Gated
    DeltaNet state doubles against vLLM's (the model's bf16); its conv state does not."""
    recurrent, conv = 36 * 32 * 128 * 128 // TP * BATCH, 36 * 8192 * 3 // TP * BATCH
    mem = _simulate(tmp_path, "qwen3_next_80b_a3b", runtime="sglang")
    assert mem["recurrent_state_gb"] * GB == pytest.approx(recurrent * FP32 + conv * BF16,
                                                           rel=1e-3)


def test_the_ssm_state_dtype_rule_per_engine():
    from shardc.ir.recurrent import ssm_state_bytes

    nemotron, qwen = {"model_type": "nemotron_h"}, {"model_type": "qwen3_next"}
    assert ssm_state_bytes("vllm", nemotron, 2) == 4  # its hook: float32 when unnamed
    assert ssm_state_bytes("vllm", {**nemotron, "mamba_ssm_cache_dtype": "bfloat16"}, 2) == 2
    assert ssm_state_bytes("vllm", {**qwen, "mamba_ssm_cache_dtype": "float32"}, 2) == 2
    assert ssm_state_bytes("sglang", qwen, 2) == 4
    assert ssm_state_bytes("trtllm", qwen, 2) == 2  # auto: the config's, else the model's
    assert ssm_state_bytes("trtllm", {**qwen, "mamba_ssm_cache_dtype": "float32"}, 2) == 4
    assert ssm_state_bytes("dtensor", nemotron, 2) == ssm_state_bytes("vllm", nemotron, 2)


def test_the_recurrent_state_does_not_grow_with_context(tmp_path):
    short, long = (_simulate(tmp_path, "jamba_v0_1", c) for c in (1024, 8192))
    assert short["recurrent_state_gb"] == pytest.approx(long["recurrent_state_gb"])
    assert long["kv_cache_gb"] == pytest.approx(8 * short["kv_cache_gb"])


def test_recurrent_layers_are_kinds_of_their_own_without_a_kv_cache():
    from shardc.frontends import load_graph

    g = load_graph(CONFIGS / "qwen3_next_80b_a3b" / "config.json")
    kinds = {k.name: k for k in g.layer_kinds}
    assert {n: k.count for n, k in kinds.items()} == {"linear_attn_moe_block": 36,
                                                       "moe_block": 12}
    core = kinds["linear_attn_moe_block"].op("attn_core")
    a = core.attrs
    assert a["recurrent"] == "gated_deltanet" and a["kv_cache_elems_per_token"] == 0
    assert (a["heads"], a["kv_heads"]) == (32, 16)
    assert a["state_elems_per_sequence"] == 32 * 128 * 128 + 8192 * 3
    # the model's attention (plan.json model.heads / kv_heads) is the gated attention's
    assert (g.config["heads"], g.config["kv_heads"]) == (16, 2)
    attn = kinds["moe_block"].op("attn_core").attrs
    assert attn["kv_cache_elems_per_token"] == 2 * 2 * 256
    ops = {n.op for n in g.nodes if n.layer_kind == "linear_attn_moe_block"}
    assert {"causal_conv", "recurrent_scan"} <= ops and "attention" not in ops
    # a longer context costs only the 12 attention layers more FLOPs per decoded token
    from shardc.passes.layers import decode_flops_per_token

    grow = decode_flops_per_token(g, 8192) - decode_flops_per_token(g, 1024)
    assert grow == 12 * (8192 - 1024) * attn["decode_flops_per_token_per_context"]
    # one Gated DeltaNet step: 7 Dk Dv FLOPs per value head + the conv (2 x 8192 x 4)
    assert a["decode_flops_per_token"] == 32 * 7 * 128 * 128 + 2 * 8192 * 4


def test_compile_plans_a_hybrid_model_with_engine_scripts_and_no_parallelize(tmp_path):
    out = tmp_path / "out"
    rc = main(["compile", str(CONFIGS / "qwen3_next_80b_a3b" / "config.json"), "--mesh", "8x1",
               "--search", "megatron", "--budget", "1", "--context", "4096", "--quiet",
               "--out", str(out)])
    assert rc == 0
    plan = json.loads((out / "plan.json").read_text())
    rows = {k["name"]: k for k in plan["layer_kinds"]}
    assert rows["linear_attn_moe_block"]["attention"] == "gated_deltanet"
    assert rows["linear_attn_moe_block"]["recurrent_state"]["elems_per_sequence"] == 548864
    assert rows["moe_block"]["attention"] == "full"
    assert plan["predicted"]["breakdown"]["memory"]["recurrent_state_gb"] > 0
    assert plan["backend"]["runs"] is False
    assert "linear-attention / state-space (recurrent) layers" in plan["backend"]["reason"]
    assert "(Qwen3NextGatedDeltaNet; of such layers it runs Nemotron-H's Mamba-2 mixers only)" \
        in plan["backend"]["reason"]
    assert not (out / "parallelize.py").exists()
    assert "linear_attn_moe_block x 36 (layers 0, 1, 2, 4," in (out / "graph.txt").read_text()
    assert "Gated DeltaNet linear attention: a constant state of 548,864 elements per " \
        "sequence, no KV cache" in (out / "graph.txt").read_text()
    for script in ("launch/vllm_mixed.sh", "launch/sglang_mixed.sh"):
        assert (out / script).is_file()


@pytest.mark.parametrize("name", ["qwen3_next_80b_a3b", "jamba_v0_1", "nemotron_h_8b"])
def test_the_traced_kernels_compute_what_transformers_computes(name):
    """The trace's leaves (shardc.frontends.recurrent_kernels) are transformers' own torch
    kernels: a tiny model's logits are the same with and without them swapped in."""
    from family_matrix import tiny_config

    from shardc.frontends.hf_build import build_causal_lm, token_ids
    from shardc.frontends.recurrent_kernels import recurrent_kernels

    model = build_causal_lm(tiny_config(CONFIGS / name / "config.json"), device="cpu",
                            dtype=torch.float32)
    ids = token_ids(int(model.config.vocab_size), seq=12)[0]
    module = sys.modules[type(model).__module__]
    with torch.no_grad():
        plain = model(ids, use_cache=False).logits
        with recurrent_kernels(model):
            assert module.causal_conv1d_fn.__module__ == "shardc.frontends.recurrent_kernels"
            leaves = model(ids, use_cache=False).logits
    torch.testing.assert_close(leaves, plain, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name, layer_class", [("qwen3_next_80b_a3b", "Qwen3NextGatedDeltaNet"),
                                               ("jamba_v0_1", "JambaMambaMixer")])
def test_the_backend_refuses_recurrent_layers_other_than_nemotron_h_mamba2(name, layer_class):
    """Gated DeltaNet and Mamba-1 keep the backend gate, naming the layer class; Nemotron-H's
    Mamba-2 mixers pass it (the fast runtime runs them)."""
    from family_matrix import tiny_config

    from shardc.backends.support import backend_problem
    from shardc.frontends.hf_build import build_causal_lm

    def tiny(folder):
        return build_causal_lm(tiny_config(CONFIGS / folder / "config.json"), device="meta",
                               dtype=torch.float32)

    problem = backend_problem(tiny(name))
    assert problem.startswith("it does not run linear-attention / state-space (recurrent) "
                              f"layers yet ({layer_class};"), problem
    nemotron = backend_problem(tiny("nemotron_h_8b"))
    assert nemotron is None or "recurrent" not in nemotron, nemotron


def test_a_heads_split_needs_tp_to_divide_the_recurrent_layers_own_heads():
    """Legal choices of a Gated DeltaNet core follow its own value and key heads (the state
    shards with them), not the model's attention heads; no key head is replicated."""
    import copy

    from shardc.frontends import load_graph
    from shardc.ir.space import StrategySpace
    from shardc.ir.strategy import Mesh, Workload

    g = copy.deepcopy(load_graph(CONFIGS / "qwen3_next_80b_a3b" / "config.json"))
    space = StrategySpace(g, Mesh(8, 1), Workload(context=4096))
    tp8 = space.values["tp"].index(8)
    slot = space.op_slots.index
    heads = 0  # choice index of the heads split (ir.contract)
    assert space.op_mask_by_tp[tp8, slot("linear_attn_moe_block.attn_core"), heads]
    assert space.op_mask_by_tp[tp8, slot("moe_block.attn_core"), heads]  # 2 KV heads replicated
    # the same model with 4 key heads in its linear layers: tp 8 cannot split them
    core = g.layer_kind("linear_attn_moe_block").op("attn_core")
    core.attrs["kv_heads"] = 4
    space = StrategySpace(g, Mesh(8, 1), Workload(context=4096))
    assert not space.op_mask_by_tp[tp8, slot("linear_attn_moe_block.attn_core"), heads]
    assert not space.op_mask_by_tp[tp8, slot("linear_attn_moe_block.qkv"), heads]
    assert space.op_mask_by_tp[tp8, slot("moe_block.attn_core"), heads]
    assert space.op_mask_by_tp[space.values["tp"].index(4),
                               slot("linear_attn_moe_block.attn_core"), heads]


def test_mamba2_layers_are_kinds_of_their_own_with_the_ssd_scan(tmp_path):
    """Nemotron-H's Mamba-2 layers: one ssd recurrent_scan per layer, heads 128 in 8 groups
    (the groups are the key heads a heads split keeps whole), state H x P x N + conv; the
    MLP-only layers have no core; the 4 attention layers alone hold a KV cache. Its
    parameters add up to the model card's 8,100,852,736."""
    from shardc.frontends import load_graph

    g = load_graph(CONFIGS / "nemotron_h_8b" / "config.json")
    kinds = {k.name: k for k in g.layer_kinds}
    assert {n: k.count for n, k in kinds.items()} == {"mamba2_dense_block": 24,
                                                       "dense_block": 24, "dense_block_2": 4}
    a = kinds["mamba2_dense_block"].op("attn_core").attrs
    assert a["recurrent"] == "mamba2" and a["kv_cache_elems_per_token"] == 0
    assert (a["heads"], a["kv_heads"], a["head_dim"], a["v_head_dim"]) == (128, 8, 128, 64)
    assert a["state_elems_per_sequence"] == 128 * 64 * 128 + 10240 * 3
    # one decode step: 5 P N FLOPs per head + the conv (2 x 10,240 x 4)
    assert a["decode_flops_per_token"] == 128 * 5 * 64 * 128 + 2 * 10240 * 4
    assert kinds["dense_block"].op("attn_core") is None
    assert kinds["dense_block_2"].op("attn_core").attrs["kv_cache_elems_per_token"] == 2 * 8 * 128
    assert sum(p.numel for p in g.params) == 8_100_852_736
    out = tmp_path / "out"
    assert main(["compile", str(CONFIGS / "nemotron_h_8b" / "config.json"), "--mesh", "8x1",
                 "--search", "megatron", "--budget", "1", "--context", "4096", "--quiet",
                 "--out", str(out)]) == 0
    plan = json.loads((out / "plan.json").read_text())
    rows = {k["name"]: k for k in plan["layer_kinds"]}
    assert rows["mamba2_dense_block"]["attention"] == "mamba2"
    # the fast runtime runs its Mamba-2 mixers (tests/test_nemotron_h_runtime.py)
    assert plan["backend"] == {"runs": True, "reason": None}
    assert "Mamba2HeadsParallel(" in (out / "parallelize.py").read_text() or \
        plan["degrees"]["tp"] == 1
    for script in ("launch/vllm_mixed.sh", "launch/sglang_mixed.sh"):
        assert (out / script).is_file()


def test_bamba_mamba2_layers_trace_to_the_same_kinds(tmp_path):
    """Bamba (Mamba-2 layers of their own beside attention layers) calls the same SSD scan:
    its Mamba-2 layers are modelled; state 8 heads x 64 x 16 + conv (512 + 2 x 2 x 16) x 3."""
    from transformers import BambaConfig

    from shardc.frontends import load_graph

    data = BambaConfig(vocab_size=256, hidden_size=256, intermediate_size=512,
                       num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                       attn_layer_indices=[2], mamba_n_heads=8, mamba_d_head=64,
                       mamba_d_state=16, mamba_n_groups=2, mamba_chunk_size=16).to_dict()
    data = {k: v for k, v in data.items() if k != "time_step_limit"}  # inf: not JSON
    cfg = tmp_path / "bamba" / "config.json"
    cfg.parent.mkdir()
    cfg.write_text(json.dumps(dict(data, architectures=["BambaForCausalLM"])))
    kinds = {k.name: k for k in load_graph(cfg).layer_kinds}
    assert {n: k.count for n, k in kinds.items()} == {"mamba2_dense_block": 3, "dense_block": 1}
    a = kinds["mamba2_dense_block"].op("attn_core").attrs
    assert (a["heads"], a["kv_heads"], a["scan_chunk"]) == (8, 2, 16)
    assert a["state_elems_per_sequence"] == 8 * 64 * 16 + (512 + 2 * 2 * 16) * 3
    assert kinds["dense_block"].op("attn_core").attrs["kv_cache_elems_per_token"] == 2 * 2 * 64
