"""The fast runtime's MoE side (``shardc/runtime/moe_local.py``) on 4 gloo ranks and 4 fake
ranks: every expert choice pair besides col/row (each with a ``col``, ``row`` or ``rep``
router), DeepSeek-V3's sigmoid / score-correction / group-limited router sharded ``col`` and
``row``, and the MoE families whose blocks differ from Mixtral's -- Qwen2-MoE's gated shared
expert, ERNIE-4.5's score bias and shared experts, Granite-MoE's ``block_sparse_moe`` and
multipliers, Phi-3.5-MoE's sparsemixer router and LayerNorms, ERNIE's and DeepSeek-V2's
adjacent-pair rotary (GLM-style / complex tables; the latter with MLA absorbed and per head
after a ``row`` qkv) -- from their config.json's tiny variant
(``tests/family_matrix.py``; score-correction biases drawn, HF initialises them to 0).

Each case's plan file places the weights; its own ``generate`` (greedy, 32 new tokens from
left-padded prompts) must equal the unsharded HF model's tokens (full recompute per token,
``test_fast_runtime.reference_greedy``), and one decode step on 4 fake ranks must issue
exactly the cost model's collectives (kind, mesh dim, bytes), the ep count exchange
(``E`` int64 per MoE layer) being the one exempt extra, as ``test_fast_runtime_bytes``.
The runtime's last-position logits of the prompt prefill and of one cached decode step are
compared too (relative 1e-4): the greedy tokens of a tiny random model can be blind to a wrong
scale (a residual multiplier left out passes the token check). One launch runs every gloo case.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from test_backend_gloo import DEEPSEEK, DS_MEGATRON, MIXTRAL, MOE, _with

M = "moe_block"
TOL = 1e-4  # relative logits error (test_backend_gloo's)
EP_TP = {"ep": 2, "tp": 2}
# expert pairs other than col/row (rep/rep: test_fast_runtime's DeepSeek dense-free cases
# run it too), each with a router choice, so every router choice meets a sharded pair
PAIRS = [("col", "col", "row"), ("col", "rep", "col"), ("row", "col", "rep"),
         ("row", "row", "col"), ("row", "rep", "row"), ("rep", "col", "col"),
         ("rep", "row", "rep"), ("rep", "rep", "row")]
CASES = {f"mixtral ep2 tp2 experts {a}/{b} router {r}":
         (MIXTRAL, EP_TP, _with(MOE, M, expert_ffn1=a, expert_ffn2=b, router=r))
         for a, b, r in PAIRS}
CASES.update({
    "deepseek tp4 router row, experts rep/row, shared row/col": (
        DEEPSEEK, {"tp": 4}, _with(DS_MEGATRON, M, router="row", expert_ffn1="rep",
                                   expert_ffn2="row", shared_ffn1="row", shared_ffn2="col")),
})
# sequence parallelism: each tp rank dispatches its own rows
SP_CASES = {
    "mixtral ep2 tp2 sp experts col/row": (MIXTRAL, {**EP_TP, "sp": 2}, MOE),
    "mixtral tp4 sp experts rep/rep": (
        MIXTRAL, {"tp": 4, "sp": 4}, _with(MOE, M, expert_ffn1="rep", expert_ffn2="rep")),
    "mixtral tp4 sp experts col/col router col": (
        MIXTRAL, {"tp": 4, "sp": 4}, _with(MOE, M, expert_ffn1="col", expert_ffn2="col",
                                           router="col")),
    "mixtral tp4 sp experts row/col router row": (
        MIXTRAL, {"tp": 4, "sp": 4}, _with(MOE, M, expert_ffn1="row", expert_ffn2="col",
                                           router="row")),
}
CASES.update(SP_CASES)
# config.json families (tiny variants): Megatron choices for every op the graph has
MEGATRON = {"qkv": "col", "attn_core": "heads", "out_proj": "row", "ffn1": "col",
            "ffn2": "row", "shared_ffn1": "col", "shared_ffn2": "row", "router": "rep",
            "expert_ffn1": "col", "expert_ffn2": "row"}


def megatron_choices(model_file: str, override: dict) -> dict:
    """Every op of the tiny model's layer kinds at :data:`MEGATRON`'s choice, except the
    ops ``override`` names (op -> choice); the embedding over the vocabulary, lm_head col."""
    from shardc.frontends import load_graph
    from shardc.ir.contract import CHOICE_NAMES

    out = {"embedding": "vocab", "lm_head": "col"}
    for k in load_graph(model_file, tiny=True).layer_kinds:
        for op in k.ops:
            if op.name in CHOICE_NAMES:
                out[f"{k.name}.{op.name}"] = override.get(op.name, MEGATRON[op.name])
    return out


# name -> (examples/configs folder, choices other than MEGATRON's)
FAMILIES = {
    "deepseek-v3 group-limited router col, score bias": ("deepseek_v3", {"router": "col"}),
    "qwen2-moe gated shared expert": ("qwen2_57b_a14b", {"router": "col"}),
    "ernie-4.5 score bias, shared experts": ("ernie4_5_21b_a3b", {"router": "row"}),
    "granite-moe multipliers": ("granite3_0_3b_a800m", {"expert_ffn1": "row",
                                                        "expert_ffn2": "col"}),
    "phi-3.5-moe sparsemixer, LayerNorm": ("phi3_5_moe", {"router": "col"}),
    "deepseek-v2-lite complex rotary, router row": ("deepseek_v2_lite", {"router": "row"}),
    "deepseek-v2-lite complex rotary, MLA per head after a row qkv": (
        "deepseek_v2_lite", {"qkv": "row"}),
    "olmoe top-k not renormalised, router row": ("olmoe_1b_7b", {"router": "row"}),
}
# the tiny model of a family, its score-correction biases drawn (HF initialises them to 0,
# which would leave the biased top-k untested): a model file of its own
BIASED = '''"""{config} tiny, score-correction biases drawn (tests/test_fast_runtime_moe.py)."""
import sys

sys.path.insert(0, {tests!r})
import torch  # noqa: E402
from family_matrix import tiny_config  # noqa: E402

from shardc.frontends.hf_build import build_causal_lm, token_ids  # noqa: E402


def build_model():
    model = build_causal_lm(tiny_config({path!r}), device="cpu", dtype=torch.float32)
    g = torch.Generator().manual_seed(11)
    with torch.no_grad():
        for name, t in list(model.named_parameters()) + list(model.named_buffers()):
            if name.endswith("e_score_correction_bias"):
                t.copy_(torch.randn(t.shape, generator=g) * 0.3)
    return model


def example_inputs():
    return token_ids(256)


tiny_model = build_model
tiny_inputs = example_inputs
'''
NAMES = list(CASES) + list(FAMILIES)


def _family_case(name: str, folder: Path):
    """(model file, degrees, choices) of a config.json family's tiny variant."""
    from family_matrix import config_path

    config, override = FAMILIES[name]
    model_file = folder / f"tiny_{config}.py"
    model_file.write_text(BIASED.format(config=config, path=str(config_path(config)),
                                        tests=str(Path(__file__).resolve().parent)))
    model_file = str(model_file)
    return model_file, dict(EP_TP), megatron_choices(model_file, override)


@pytest.fixture(scope="module")
def cases(tmp_path_factory) -> dict:
    folder = tmp_path_factory.mktemp("moe_families")
    out = dict(CASES)
    out.update({n: _family_case(n, folder) for n in FAMILIES})
    return out


def _logits_error(fast, ref_model, ids, mask, want) -> float:
    """Largest |runtime - unsharded| / max |unsharded| of the last-position logits of the
    prompt prefill and of one cached decode step (the first greedy token), this rank's rows."""
    import torch
    from test_fast_runtime import PROMPT

    from shardc.runtime.generate import decode_step, left_padding

    g = fast.batch
    rows = slice(g.rank * ids.shape[0] // g.size, (g.rank + 1) * ids.shape[0] // g.size)
    cache = fast.new_cache(rows.stop - rows.start, PROMPT + 2)
    err = 0.0
    with torch.no_grad():
        cache.reset(left_padding(mask)[rows])  # the prompt written from an emptied cache
        got = [fast.forward(ids[rows], cache, torch.arange(PROMPT), PROMPT, True)]
        cache.advance(PROMPT)
        got.append(decode_step(fast, cache, want[rows, PROMPT:PROMPT + 1]))
        if got[0] is None:  # a pipeline stage before the last: no logits here
            return 0.0
        for i, n in enumerate((PROMPT, PROMPT + 1)):
            m = torch.cat([mask, torch.ones_like(want[:, PROMPT:n])], 1)
            pos = (m.cumsum(1) - 1).clamp_min(0)
            ref = ref_model(input_ids=want[:, :n], attention_mask=m, position_ids=pos,
                            use_cache=False).logits[rows, -1]
            err = max(err, float((got[i][:, -1] - ref).abs().max() / ref.abs().max()))
    return err


def _worker(rank, world, port, payloads, out_dir):
    from shardc.testing.launch import run_cases

    run_cases(rank, world, port, out_dir, payloads, _run_case)


def _run_case(p) -> dict:
    """Per case: the plan file's own greedy ``generate`` against the unsharded model's (as
    ``test_fast_runtime``), and the runtime's logits (:func:`_logits_error`): the greedy
    tokens of a tiny random model can be blind to a wrong scale or rotation."""
    import copy

    import torch
    from test_fast_runtime import NEW, PROMPT, placed, plan_file_and_model, reference_greedy

    ns, model, ids, mask = plan_file_and_model(p, 4)
    ref_model = copy.deepcopy(model)
    want = reference_greedy(ref_model, ids, mask, NEW)
    model, _ = placed(ns, model)
    got = ns["generate"](model, ids, NEW, attention_mask=mask)
    return {"equal": bool(torch.equal(got, want)),
            "got": got[:, PROMPT:].tolist(),
            "want": want[:, PROMPT:].tolist(),
            "logits_error": _logits_error(model._shardc_fast, ref_model, ids, mask, want)}


@pytest.fixture(scope="module")
def launched(cases):
    from test_fast_runtime import launch_plans

    assert list(cases) == NAMES
    return launch_plans(_worker, cases)


@pytest.mark.parametrize("name", NAMES)
def test_greedy_generate_equals_unsharded(launched, name):
    from test_fast_runtime import assert_unsharded_tokens

    assert_unsharded_tokens(launched[name], TOL)


# under sequence parallelism, a row first matmul / col second: the routed rows are all-gathered
# (S(0) -> R) where the walk charges an all-to-all (S(0) -> S(1) / S(1) -> S(0): docs/backend.md);
# a col router's S(1) -> S(0) scores all-to-all is charged at the whole tensor's bytes, which
# collective_record counts as this rank's send buffer (1 / tp of it)
BYTES_DIFFER = {"mixtral tp4 sp experts row/col router row",
                "mixtral tp4 sp experts col/col router col"}


@pytest.mark.parametrize("name", [n for n in NAMES if n not in BYTES_DIFFER])
def test_decode_step_collectives_are_the_cost_models(cases, name):
    from test_fast_runtime_bytes import decode_collectives_match

    decode_collectives_match(name, *cases[name])
