"""GPT-OSS on the fast runtime: attention sinks (a learned logit per head joining each
softmax; a heads split holds its heads' sinks), q/k/v and o_proj biases, alternating sliding
window / full layers, YaRN rotary tables (the model's own ``rotary_emb``, d / 2 frequencies
rotating the halves), the router's bias then top-k then a softmax over the k, and experts
stored ``[E, h, 2f]`` / ``[E, f, h]`` with gate / up alternating, per-expert biases and the
clamped activation (``GptOssExperts._apply_gate``).

The tiny variant of examples/configs/gpt_oss_20b/config.json (``tests/family_matrix.py``,
random fp32 weights, sinks and biases drawn away from HF's zero init so that each one
matters) on 4 gloo ranks: the plan's own ``parallelize.py`` places it and its ``generate``
(greedy, 32 new tokens from left-padded prompts) must equal the unsharded HF model's tokens,
and the runtime's logits agree within 1e-4 (``test_fast_runtime_moe``'s worker) -- for the
plan shardc's search picks for the tiny model on 4 GPUs and for plans forced to cover a
tp=2 heads split x ep=2 with the experts col/row (the down projection's bias added once to
the partial sums), tp=4 (KV heads replicated, sinks cut per rank, the router row: its bias
added once after the all-reduce), experts rep/rep under a col router, ep=4, sequence
parallelism, batch-split attention (whole sinks) and 2 pipeline stages. One decode step of
each forced plan without pipeline stages on 4 fake ranks issues exactly the cost model's
collectives, through the fast runtime and through the model's own forward (as ``shardc
verify`` runs the placed model).
"""

from __future__ import annotations

from pathlib import Path

import pytest

MODEL = '''"""tiny GPT-OSS, sinks and biases drawn (tests/test_gpt_oss_runtime.py)."""
import sys

sys.path.insert(0, {tests!r})
import torch  # noqa: E402
from family_matrix import config_path, tiny_config  # noqa: E402

from shardc.frontends.hf_build import build_causal_lm, token_ids  # noqa: E402


def build_model():
    model = build_causal_lm(tiny_config(config_path("gpt_oss_20b")), device="cpu",
                            dtype=torch.float32)
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():  # HF zero-initialises the biases: draw them, and the sinks
        for name, p in model.named_parameters():
            if name.endswith(("sinks", "bias")):
                p.copy_(torch.randn(p.shape, generator=g) * (1.0 if "sinks" in name else 0.3))
    return model.eval()


def example_inputs():
    return token_ids(256)


tiny_model = build_model
tiny_inputs = example_inputs
'''
# name -> (degrees, choices other than Megatron's)
PLAN_CASES = {
    "tp2 ep2 megatron: heads split, experts col/row": ({"ep": 2, "tp": 2}, {}),
    "tp4, KV heads replicated, router row": ({"tp": 4}, {"router": "row"}),
    "tp2 ep2 experts rep/rep, router col": ({"ep": 2, "tp": 2}, {
        "expert_ffn1": "rep", "expert_ffn2": "rep", "router": "col"}),
    "ep4": ({"ep": 4}, {}),
    "tp2 ep2 sp2: each tp rank's rows, expert partial sums reduce-scattered": (
        {"ep": 2, "tp": 2, "sp": 2}, {}),
    "tp2 ep2 batch-split attention (whole sinks)": (
        {"ep": 2, "tp": 2}, {"qkv": "rep", "attn_core": "batch", "out_proj": "col"}),
    "pp2 tp2": ({"pp": 2, "tp": 2}, {}),
}


@pytest.fixture(scope="module")
def model_file(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("gpt_oss") / "tiny_gpt_oss.py"
    path.write_text(MODEL.format(tests=str(Path(__file__).resolve().parent)))
    return str(path)


def _choices(model_file: str, override: dict) -> dict:
    from test_fast_runtime_moe import megatron_choices

    return megatron_choices(model_file, override)


@pytest.fixture(scope="module")
def searched(model_file):
    """The plan shardc's search picks for the tiny model on 4 GPUs (decode, batch 4)."""
    import shardc
    from shardc.ir.strategy import Workload

    return shardc.compile(model_file, mesh="4x1", workload=Workload(batch=4, context=64),
                          budget=200, seed=0, launch=False)


@pytest.fixture(scope="module")
def launched(model_file, searched) -> dict:
    from test_fast_runtime import launch_plans
    from test_fast_runtime_moe import _worker as plan_worker

    cases = {n: (model_file, deg, _choices(model_file, over))
             for n, (deg, over) in PLAN_CASES.items()}
    deg = {k: v for k, v in searched.to_dict()["degrees"].items() if v > 1}
    cases["the searched plan"] = (model_file, deg, {str(o["name"]): str(o["choice"])
                                                     for o in searched.ops})
    return launch_plans(plan_worker, cases)


def test_the_tiny_models_sinks_and_biases_matter(model_file):
    """Each GPT-OSS part the runtime adds changes the unsharded model's logits (a runtime
    leaving one out could not pass the token and logits checks)."""
    import torch
    from test_fast_runtime import prompts

    from shardc.frontends.model_file import load_model_file

    model, _ = load_model_file(model_file).build(tiny=True)
    ids, mask = prompts(model.config.vocab_size)

    def logits():
        with torch.no_grad():
            return model(input_ids=ids, attention_mask=mask, use_cache=False).logits

    base = logits()
    for suffix in ("sinks", "gate_up_proj_bias", "down_proj_bias", "router.bias", "o_proj.bias"):
        p = next(p for n, p in model.named_parameters() if n.endswith(suffix))
        saved = p.detach().clone()
        with torch.no_grad():
            p.zero_()
        assert (logits() - base).abs().max() > 1e-3, suffix
        with torch.no_grad():
            p.copy_(saved)


def test_the_search_picks_a_plan_that_runs(searched):
    assert searched.to_dict()["backend"] == {"runs": True, "reason": None}


@pytest.mark.parametrize("name", list(PLAN_CASES) + ["the searched plan"])
def test_gpt_oss_plan_generate_equals_unsharded(launched, name):
    from test_fast_runtime import assert_unsharded_tokens
    from test_fast_runtime_moe import TOL

    assert_unsharded_tokens(launched[name], TOL)


# the collective checks: pp > 1 plans are not (test_fast_runtime_bytes' and
# test_runtime_styles_bytes' cases have none either); the model's own forward under sequence
# parallelism exchanges the tp ranks' expert counts and row totals, which only the fast
# runtime's check lists as exempt
FAST_BYTES = [n for n in PLAN_CASES if "pp" not in PLAN_CASES[n][0]]
FORWARD_BYTES = [n for n in FAST_BYTES if "sp" not in PLAN_CASES[n][0]]


@pytest.mark.parametrize("name", FAST_BYTES)
def test_decode_step_collectives_are_the_cost_models(model_file, name):
    """As test_fast_runtime_moe's: the ep count exchange (``E`` int64 per MoE layer) and,
    under sequence parallelism, the tp ranks' per-expert counts (``E / ep`` int64 each,
    all-gathered) are the exempt extras; the biases and sinks add no collective."""
    from test_fast_runtime_bytes import decode_collectives_match

    degrees, override = PLAN_CASES[name]
    decode_collectives_match(name, model_file, degrees, _choices(model_file, override))


@pytest.mark.parametrize("pair, degrees, runs", [
    (("col", "row"), None, True), (("rep", "rep"), None, True),
    (("col", "col"), None, False), (("row", "rep"), None, False),
    (("col", "row"), {"tp": 2, "ep": 2, "moe_ep": 4}, False)])
def test_biased_experts_verdict_per_plan(model_file, pair, degrees, runs):
    """Plans whose experts pair (or re-split) parallelize.py does not place for experts with
    biases get backend runs False naming it, not an emission error; the others run, the
    down-projection bias Partial under a row split."""
    from shardc.backends.support import fused_experts_verdict
    from shardc.frontends import load_graph
    from shardc.ir.strategy import Mesh, Workload, strategy_from_names
    from shardc.plan import build_plan

    graph = load_graph(model_file, tiny=True)
    choices = _choices(model_file, {"expert_ffn1": pair[0], "expert_ffn2": pair[1]})
    strategy = strategy_from_names(degrees or {"ep": 2, "tp": 2}, choices, 4)
    plan = build_plan(graph, strategy, Mesh(4, 1), "h100", Workload(batch=4, context=512))
    got = fused_experts_verdict({"runs": True, "reason": None}, [plan])
    assert got["runs"] is runs, got
    if not runs:
        assert "experts with biases" in got["reason"]
    else:
        code = plan.code()
        assert ("partial=('down_proj_bias',)" in code) == (pair == ("col", "row"))
        assert "HeadSlices(('sinks',)" in code


@pytest.mark.parametrize("name", FORWARD_BYTES)
def test_model_forward_collectives_are_the_cost_models(model_file, name):
    """The plan's ``--standalone`` file run through the model's own forward (its styles on
    DTensor placements, as ``shardc verify`` runs it) on 4 fake ranks issues the cost model's
    collectives plus test_runtime_styles_bytes' exempt extras, nothing for the sinks and
    biases (a row router's bias and the Partial expert bias add no collective)."""
    from test_runtime_styles_bytes import forward_collectives_match

    degrees, override = PLAN_CASES[name]
    forward_collectives_match(name, model_file, degrees, _choices(model_file, override))
