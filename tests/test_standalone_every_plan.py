"""Every plan gets a ``parallelize.py`` on torch's styles: ``Plan.code(standalone=True)``
never raises and the file imports only torch (issue 20: the first runtime is retired, no
plan falls back to it).

Sample: for each family layout (HF Llama with GQA at tp > kv_heads, GPT-2's Conv1D and
packed q|k|v, GPT-MoE's plain ``[E, in, out]`` experts, Mixtral, DeepSeek-V3's MLA) and
degrees with and without sequence parallelism and, for the non-HF layouts, with pipeline
stages, Nemotron-H's Mamba-2 / MLP-only / attention blocks, every pair of
choices of two ops of one branch (attention: qkv x attn_core x out_proj in pairs; experts:
expert_ffn1 x expert_ffn2; mlp; router against experts), the other ops Megatron's. Legal or
not for the cost model, each such plan must be deployable, and runs on the one fast runtime:
its file's ``parallelize`` places the tiny model on rank 0 of a 4-rank ``fake`` process group
and :class:`shardc.runtime.fast.FastModel` builds on it (a plan the runtime does not run
raises NotImplementedError naming what: none may). Building only, no step (cheap); the
numerics of the formerly uncovered pairs are :mod:`test_styles_coverage`'s and the
``test_fast_runtime*`` files'.
"""

from __future__ import annotations

import copy
import itertools
from functools import lru_cache
from pathlib import Path

import pytest
import torch.distributed as dist
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
    "gpt-oss": str(ROOT / "examples" / "configs" / "gpt_oss_20b" / "config.json"),
    "nemotron-h": str(ROOT / "tests" / "data" / "tiny_nemotron_h.py"),
}
SP = {"tp": 2, "dp": 2, "sp": 2}  # experts: dp -> ep
CASES = [("llama gqa (8 heads / 2 kv)", {"tp": 4}),  # KV heads replicated
         ("llama gqa (8 heads / 2 kv)", SP), ("gpt2", SP), ("gpt2", {"tp": 2, "pp": 2}),
         ("gpt-moe", SP), ("gpt-moe", {"tp": 2, "pp": 2}), ("mixtral", {"tp": 4}),
         ("mixtral", SP), ("deepseek-v3", {"tp": 4}), ("deepseek-v3", SP),
         ("nemotron-h", {"tp": 4}), ("nemotron-h", SP)]  # Mamba-2, MLP-only and attention


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


@pytest.fixture
def fake_ranks():
    """Rank 0 of a 4-rank ``fake`` process group (every case's world is 4)."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=4)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _runtime_builds(code: str, model) -> None:
    """The plan file ``code`` places ``model`` and the fast runtime builds on it."""
    from torch.distributed.device_mesh import init_device_mesh

    from shardc.runtime.fast import FastModel

    ns: dict = {}
    exec(compile(code, "<parallelize.py>", "exec"), ns)
    mesh = init_device_mesh("cpu", tuple(ns["MESH_SHAPE"]),
                            mesh_dim_names=tuple(ns["MESH_DIM_NAMES"]))
    placed = ns["parallelize"](model, world_mesh=mesh)
    FastModel(placed, mesh, ns["WALKS"], ns["LAYER_KINDS"])


@pytest.mark.parametrize("model, degrees", CASES,
                         ids=[f"{m}-{'-'.join(f'{k}{v}' for k, v in d.items())}" for m, d in CASES])
def test_every_choice_pair_emits_a_torch_only_file(model, degrees, fake_ranks):
    from shardc.backends.verify import _build

    tiny, _ = _build(MODELS[model], 8, 4)
    seen, refused = 0, []
    for label, plan in _plans(model, degrees):
        code = plan.code(standalone=True)  # raises InputError if a plan is not deployable
        mods = {m.split(".")[0] for m in _imported_modules(code)}
        assert mods <= TORCH_ONLY, (label, mods)
        default = plan.code()
        assert {m for m in _imported_modules(default) if m.startswith("shardc")} <= {
            "shardc.runtime", "shardc.fingerprint"}, label
        try:
            _runtime_builds(default, copy.deepcopy(tiny))
        except NotImplementedError as e:
            refused.append(f"{label}: {e}")
        seen += 1
    assert seen >= 27, seen  # the attention pairs at least
    assert not refused, refused  # every plan runs on the fast runtime


# GPT-OSS (sinks, expert biases, gate / up alternating): its experts run col/row and rep/rep
# over tp on the tp x ep mesh; another pair is refused per plan (backend runs False, naming
# it: ``fused_experts_verdict``), every other plan is deployable and runs
BIASED_PAIRS = {("col", "row"), ("rep", "rep")}


@pytest.mark.parametrize("degrees", [{"tp": 4}, SP], ids=["tp4", "tp2-ep2-sp2"])
def test_gpt_oss_every_choice_pair_runs_or_is_refused_per_plan(degrees, fake_ranks):
    from shardc.backends.support import fused_experts_verdict
    from shardc.backends.verify import _build

    tiny, _ = _build(MODELS["gpt-oss"], 8, 4)
    seen, refused, wrong = 0, 0, []
    for label, plan in _plans("gpt-oss", degrees):
        pair = {o["kind"]: o["choice"] for o in plan.ops if o["layer_kind"] == "moe_block"}
        verdict = fused_experts_verdict({"runs": True, "reason": None}, [plan])
        if (pair["expert_ffn1"], pair["expert_ffn2"]) not in BIASED_PAIRS:
            assert not verdict["runs"] and "experts with biases" in verdict["reason"], label
            refused += 1
            continue
        assert verdict["runs"], (label, verdict)
        code = plan.code(standalone=True)
        assert {m.split(".")[0] for m in _imported_modules(code)} <= TORCH_ONLY, label
        try:
            _runtime_builds(plan.code(), copy.deepcopy(tiny))
        except NotImplementedError as e:
            wrong.append(f"{label}: {e}")
        seen += 1
    assert seen >= 27 and refused >= 7, (seen, refused)
    assert not wrong, wrong
