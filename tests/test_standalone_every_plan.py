"""Every plan gets a ``parallelize.py`` on torch's styles: ``Plan.code(standalone=True)``
never raises and the file imports only torch (issue 20: the first runtime is retired, no
plan falls back to it).

Sample: for each family layout (HF Llama with GQA at tp > kv_heads, GPT-2's Conv1D and
packed q|k|v, GPT-MoE's plain ``[E, in, out]`` experts, Mixtral, DeepSeek-V3's MLA) and
degrees with and without sequence parallelism and, for the non-HF layouts, with pipeline
stages, every pair of
choices of two ops of one branch (attention: qkv x attn_core x out_proj in pairs; experts:
expert_ffn1 x expert_ffn2; mlp; router against experts), the other ops Megatron's. Legal or
not for the cost model, each such plan must be deployable. Emitting only (no process group):
cheap; the numerics of the formerly uncovered pairs are :mod:`test_styles_coverage`'s.
"""

from __future__ import annotations

import itertools
from functools import lru_cache
from pathlib import Path

import pytest
from test_runtime_styles import TORCH_ONLY, _imported_modules

ROOT = Path(__file__).resolve().parents[1]
NAMES = {"qkv": ("col", "row", "rep"), "attn_core": ("heads", "batch", "rep"),
         "out_proj": ("col", "row", "rep"), "ffn1": ("col", "row", "rep"),
         "ffn2": ("col", "row", "rep"), "router": ("col", "row", "rep"),
         "expert_ffn1": ("col", "row", "rep"), "expert_ffn2": ("col", "row", "rep"),
         "shared_ffn1": ("col", "row", "rep"), "shared_ffn2": ("col", "row", "rep")}
MEGATRON = {"qkv": "col", "attn_core": "heads", "out_proj": "row", "ffn1": "col",
            "ffn2": "row", "router": "rep", "expert_ffn1": "col", "expert_ffn2": "row",
            "shared_ffn1": "col", "shared_ffn2": "row"}
PAIRS = [("qkv", "attn_core"), ("attn_core", "out_proj"), ("qkv", "out_proj"),
         ("expert_ffn1", "expert_ffn2"), ("ffn1", "ffn2"), ("router", "expert_ffn1"),
         ("shared_ffn1", "shared_ffn2")]
GQA = ROOT / "tests" / "data" / "tiny_gqa_for_every_plan.py"
MODELS = {
    "llama gqa (8 heads / 2 kv)": str(GQA),
    "gpt2": str(ROOT / "examples" / "configs" / "gpt2" / "config.json"),
    "gpt-moe": str(ROOT / "examples" / "gpt_moe_1p6t.py"),
    "mixtral": str(ROOT / "examples" / "tiny_mixtral.py"),
    "deepseek-v3": str(ROOT / "examples" / "tiny_deepseek_v3.py"),
}
SP = {"tp": 2, "dp": 2, "sp": 2}  # experts: dp -> ep
CASES = [("llama gqa (8 heads / 2 kv)", {"tp": 4}),  # KV heads replicated
         ("llama gqa (8 heads / 2 kv)", SP), ("gpt2", SP), ("gpt2", {"tp": 2, "pp": 2}),
         ("gpt-moe", SP), ("gpt-moe", {"tp": 2, "pp": 2}), ("mixtral", {"tp": 4}),
         ("mixtral", SP), ("deepseek-v3", {"tp": 4}), ("deepseek-v3", SP)]


@lru_cache(maxsize=None)
def _graph(path: str):
    from shardc.frontends import load_graph

    return load_graph(path, tiny=True)


def _plans(model: str, degrees: dict):
    """(label, plan) for every choice pair of :data:`PAIRS` the model has."""
    from shardc.ir.strategy import Mesh, Workload, strategy_from_names
    from shardc.plan import build_plan

    graph = _graph(MODELS[model])
    ops = {o.name for k in graph.layer_kinds for o in k.ops}
    degrees = dict(degrees)
    if "expert_ffn1" in ops and "dp" in degrees:  # experts: split the batch over ep instead
        degrees["ep"] = degrees.pop("dp")
    for a, b in PAIRS:
        if a not in ops or b not in ops:
            continue
        for ca, cb in itertools.product(NAMES[a], NAMES[b]):
            ch = dict(MEGATRON, **{a: ca, b: cb})
            choices = {"embedding": "vocab", "lm_head": "col"}
            choices.update({f"{k.name}.{o.name}": ch[o.name] for k in graph.layer_kinds
                            for o in k.ops if o.name in ch})
            st = strategy_from_names(degrees, choices, 8)
            yield f"{a}={ca} {b}={cb}", build_plan(graph, st, Mesh(st.degrees.world, 1),
                                                   "h100", Workload(batch=8, context=64))


@pytest.mark.parametrize("model, degrees", CASES,
                         ids=[f"{m}-{'-'.join(f'{k}{v}' for k, v in d.items())}" for m, d in CASES])
def test_every_choice_pair_emits_a_torch_only_file(model, degrees):
    seen = 0
    for label, plan in _plans(model, degrees):
        code = plan.code(standalone=True)  # raises InputError if a plan is not deployable
        mods = {m.split(".")[0] for m in _imported_modules(code)}
        assert mods <= TORCH_ONLY, (label, mods)
        default = _imported_modules(plan.code())
        assert {m for m in default if m.startswith("shardc")} <= {"shardc.runtime",
                                                                  "shardc.fingerprint"}, label
        seen += 1
    assert seen >= 27, seen  # the attention pairs at least
