"""The architecture families of docs/support.md: their config.json and tiny variants.

``tiny_config(path)`` is the tiny variant of a family's public config.json that ``shardc
verify`` derives (``shardc.frontends.tiny_config``: small widths, the layer pattern, norms,
biases, routing and rope type kept).
"""

from __future__ import annotations

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
    ("Qwen2-57B-A14B (MoE)", "qwen2_57b_a14b"),
    ("ERNIE-4.5-21B-A3B", "ernie4_5_21b_a3b"),
    ("Phi-4", "phi4"),
    ("Granite-3.0-3B-A800M", "granite3_0_3b_a800m"),
    ("DBRX", "dbrx"),
    ("Kimi-K2", "kimi_k2"),
    ("Qwen3-Next-80B-A3B (Gated DeltaNet hybrid)", "qwen3_next_80b_a3b"),
    ("Jamba-v0.1 (Mamba hybrid)", "jamba_v0_1"),
    ("Nemotron-H-8B (Mamba-2 hybrid)", "nemotron_h_8b"),
]

def config_path(name: str) -> Path:
    return CONFIGS / name / "config.json"


def tiny_config(path: str | Path):
    """The tiny variant's ``PretrainedConfig`` of a config.json: the one ``shardc verify``
    derives (:func:`shardc.frontends.tiny_config.tiny_config`)."""
    from transformers import AutoConfig

    from shardc.frontends.hf_types import known_model_type
    from shardc.frontends.tiny_config import tiny_config as shrink

    data = {k: v for k, v in json.loads(Path(path).read_text()).items() if k != "auto_map"}
    data, _ = known_model_type(data, str(path))  # Kimi-K2: built as DeepSeek-V3
    return shrink(AutoConfig.for_model(**data), None)


def tiny_dict(path: str | Path) -> dict:
    """The tiny variant as config.json data."""
    return json.loads(tiny_config(path).to_json_string())


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
