"""The architecture families of docs/support.md: their config.json and tiny variants.

``tiny_config(path)`` shrinks a family's public config.json (hidden 64, 4 heads / 2 KV
heads, 4 layers or fewer, 4 experts, vocab 256) keeping everything that decides the
structure (layer pattern, norms, biases, routing, rope type). Once
``shardc.frontends.tiny_config`` is merged, :data:`USE_SHARDC_TINY_CONFIG` switches to it.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = ROOT / "examples" / "configs"

# (row of the table, directory under examples/configs)
FAMILIES = [
    ("Llama-3.1-8B", "llama3_1_8b"),
    ("Qwen2.5-7B", "qwen2_5_7b"),
    ("Qwen3-8B (dense)", "qwen3_8b"),
    ("Qwen3-30B-A3B (MoE)", "qwen3_30b_a3b"),
    ("Mixtral-8x7B", "mixtral_8x7b"),
    ("OLMoE-1B-7B", "olmoe_1b_7b"),
    ("DeepSeek-V2-Lite", "deepseek_v2_lite"),
    ("DeepSeek-V3", "deepseek_v3"),
    ("Phi-3.5-MoE (longrope)", "phi3_5_moe"),
    ("Gemma-2-9B", "gemma2_9b"),
    ("Llama-4-Scout", "llama4_scout"),
    ("GPT-OSS-20B", "gpt_oss_20b"),
    ("GPT-2", "gpt2"),
]

USE_SHARDC_TINY_CONFIG = False  # the one line to flip once shardc.frontends.tiny_config exists

_SMALL = dict(hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
              num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=256,
              max_position_embeddings=4096, num_local_experts=4, num_experts=4,
              n_routed_experts=4, num_experts_per_tok=2, kv_lora_rank=16, qk_nope_head_dim=8,
              qk_rope_head_dim=8, v_head_dim=8, intermediate_size_mlp=128, n_embd=64, n_head=4,
              n_positions=4096, n_group=1, topk_group=1, attention_chunk_size=4,
              sliding_window=4, query_pre_attn_scalar=16)


def config_path(name: str) -> Path:
    return CONFIGS / name / "config.json"


def tiny_dict(data: dict) -> dict:
    """A config.json dict shrunk to the tiny variant (see module docstring)."""
    d = copy.deepcopy(data)
    cfg = d.get("text_config", d)
    for k, v in _SMALL.items():
        if cfg.get(k) is not None:
            cfg[k] = v
    if cfg.get("kv_lora_rank"):  # MLA: one latent shared by all heads
        cfg["num_key_value_heads"] = cfg["num_attention_heads"]
    if cfg.get("q_lora_rank"):
        cfg["q_lora_rank"] = 32
    for k in ("pad_token_id", "bos_token_id", "eos_token_id"):
        if k in cfg:
            cfg[k] = 0
    for k in ("num_hidden_layers", "n_layer"):
        if k in cfg:
            cfg[k] = min(int(cfg[k]), 4)
    if "layer_types" in cfg:
        cfg["layer_types"] = cfg["layer_types"][:4]
    rope = cfg.get("rope_scaling") or {}
    for k in ("long_factor", "short_factor"):
        if k in rope:
            rope[k] = rope[k][:cfg["head_dim"] // 2 if "head_dim" in cfg else 8]
    if "original_max_position_embeddings" in rope:
        rope["original_max_position_embeddings"] = 8
    if "original_max_position_embeddings" in cfg:
        cfg["original_max_position_embeddings"] = 8
    return d


def tiny_config(path: str | Path):
    """The tiny variant's ``PretrainedConfig`` of a config.json."""
    if USE_SHARDC_TINY_CONFIG:  # pragma: no cover - after the verify helper's merge
        from transformers import AutoConfig

        from shardc.frontends.tiny_config import tiny_config as shrink

        return shrink(AutoConfig.for_model(**json.loads(Path(path).read_text())), None)
    from transformers import AutoConfig

    return AutoConfig.for_model(**tiny_dict(json.loads(Path(path).read_text())))


MODEL_FILE = '''"""Tiny {name}: {config} shrunk by tests/family_matrix.py (generated)."""
import sys

sys.path.insert(0, {tests!r})
import torch  # noqa: E402
from family_matrix import tiny_config  # noqa: E402

from shardc.frontends.hf_build import build_causal_lm, token_ids  # noqa: E402


def build_model():
    return build_causal_lm(tiny_config({config!r}), device="cpu", dtype=torch.float32)


def example_inputs():
    return token_ids(256)


tiny_model = build_model
tiny_inputs = example_inputs
'''


def write_tiny_model_file(name: str, folder: Path) -> Path:
    """A .py model file whose build_model() / tiny_model() is the family's tiny variant."""
    out = folder / f"tiny_{name}.py"
    out.write_text(MODEL_FILE.format(name=name, config=str(config_path(name)),
                                     tests=str(Path(__file__).resolve().parent)))
    return out
