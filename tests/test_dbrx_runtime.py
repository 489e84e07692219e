"""DBRX on the fast runtime (``shardc/runtime/dbrx_local.py``): its block layout
(``norm_attn_norm`` with LayerNorms, the packed ``Wqkv`` clamped to ``clip_qkv``), its router
(``DbrxFFN.route_tokens_to_experts``: softmax, top-k, p-norm) and its experts stored fused
(``mlp.w1`` / ``v1`` / ``w2``, ``[E * f, h]`` each, read as ``[E, f, h]``) on 4 gloo ranks,
ep 2 x tp 2 with the experts col/row (each expert's ``f`` rows cut over tp) and on 1 rank.

The runtime-only cases place the expert weights in the test as the plan's params rows say --
``[E, f, h]`` views, ``Shard(0)`` over ep, ``Shard(1)`` over tp -- and the rest whole; the
plan cases (below) run the plan's own ``parallelize.py`` and ``generate``. The runtime's
greedy tokens must equal the unsharded HF model's (full recompute per token).
"""

from __future__ import annotations

import pytest

CASES = {"rank1": ({"tp": 1}, "rep", "rep"), "ep2 tp2 experts col/row": ({"ep": 2, "tp": 2},
                                                                         "col", "row")}
NEW = 12


def _model(clip: float | None = 0.05):
    import torch
    from family_matrix import config_path, tiny_config

    from shardc.frontends.hf_build import build_causal_lm

    torch.manual_seed(0)
    model = build_causal_lm(tiny_config(config_path("dbrx")), device="cpu", dtype=torch.float32)
    for blk in model.transformer.blocks:  # a clip that bites: the tiny model's q|k|v ~ 0.1
        blk.norm_attn_norm.attn.clip_qkv = clip
    return model.eval()


def _place(model, ep, tp) -> None:
    """This rank's expert shards as the plan's rows say: ``[E, f, h]``, experts over ep,
    each expert's ``f`` rows over tp (``w1`` / ``v1`` col, ``w2`` row)."""
    from torch import nn

    for blk in model.transformer.blocks:
        ex = blk.ffn.experts
        f, h = ex.ffn_hidden_size, ex.hidden_size
        for n in ("w1", "v1", "w2"):
            w = getattr(ex.mlp, n).detach().view(-1, f, h)
            w = w.chunk(ep.size, 0)[ep.rank].chunk(tp.size, 1)[tp.rank].contiguous()
            setattr(ex.mlp, n, nn.Parameter(w, requires_grad=False))


def _walks(degrees: dict, c1: str, c2: str) -> dict:
    from shardc.backends.runtime_walks import plan_walks
    from shardc.ir.strategy import strategy_from_names

    choices = {"embedding": "rep", "lm_head": "rep"}
    ops = {"qkv": "rep", "attn_core": "rep", "out_proj": "rep", "router": "rep",
           "expert_ffn1": c1, "expert_ffn2": c2}
    choices.update({f"moe_block.{op}": c for op, c in ops.items()})
    return plan_walks(choices, strategy_from_names(degrees, choices, 4).degrees)


def _worker(rank, world, port, cases, out_dir):
    from shardc.testing.launch import run_cases

    run_cases(rank, world, port, out_dir, cases, _run_case)


def _run_case(name) -> dict:
    import copy

    import torch
    import torch.distributed as dist
    from test_fast_runtime import PROMPT, prompts, reference_greedy
    from torch.distributed.device_mesh import init_device_mesh

    from shardc.runtime.fast import FastModel
    from shardc.runtime.generate import fast_generate
    from shardc.runtime.local_ops import Group

    degrees, c1, c2 = CASES[name]
    model = _model()
    ids, mask = prompts(model.config.vocab_size)
    want = reference_greedy(copy.deepcopy(model), ids, mask, NEW)
    dims = [d for d in ("ep", "tp") if d in degrees]
    shape = [degrees[d] for d in dims]
    if dist.get_world_size() != 1 and len(dims) == 1 and shape == [1]:
        raise ValueError(name)
    mesh = init_device_mesh("cpu", tuple(shape), mesh_dim_names=tuple(dims))
    ep = Group(mesh["ep"] if "ep" in dims else None)
    tp = Group(mesh["tp"] if degrees.get("tp", 1) > 1 else None)
    _place(model, ep, tp)
    fast = FastModel(model, mesh, _walks(degrees, c1, c2),
                     {"moe_block": list(range(len(model.transformer.blocks)))})
    got = fast_generate(fast, ids, NEW, attention_mask=mask)
    return {"equal": bool(torch.equal(got, want)),
            "got": got[:, PROMPT:].tolist(), "want": want[:, PROMPT:].tolist()}


def test_clip_qkv_changes_the_tiny_models_tokens():
    """The clip the runtime cases set bites (a wrong clamp would change the tokens)."""
    import torch
    from test_fast_runtime import prompts, reference_greedy

    clipped, plain = _model(), _model(1e9)
    ids, mask = prompts(clipped.config.vocab_size)
    assert not torch.equal(reference_greedy(clipped, ids, mask, NEW),
                           reference_greedy(plain, ids, mask, NEW))


@pytest.mark.parametrize("name", list(CASES))
def test_dbrx_greedy_generate_equals_unsharded(name):
    from shardc.testing.launch import launch

    world = 1
    for d in CASES[name][0].values():
        world *= d
    per_rank = launch(_worker, world, ([name],), 600, ("torch", "transformers"))
    for r, res in enumerate(per_rank):
        res = res[0]
        assert "error" not in res, f"rank {r}: {res.get('error')}"
        assert res["equal"], f"rank {r}: got {res['got']}\nwant {res['want']}"


# parallelize.py cases: the plan's own file places DBRX (ep over whole experts, Shard(0) of
# the [E, f, h] view; col/row: each expert's f rows over tp; Wqkv col with its heads) and its
# ``generate`` runs the fast runtime; tokens and logits against the unsharded model
# (test_fast_runtime_moe's worker). name -> (degrees, choices other than Megatron's)
PLAN_CASES = {
    "plan ep2 tp2 megatron": ({"ep": 2, "tp": 2}, {}),
    "plan ep4 experts": ({"ep": 4}, {}),
    "plan ep2 tp2 sp megatron": ({"ep": 2, "tp": 2, "sp": 2}, {}),
    # the experts re-split (the all-gather dispatch): all-EP, all-TP, mixed
    "plan tp2 dp_attn2 moe_ep4": ({"tp": 2, "ep": 2, "moe_ep": 4}, {}),
    "plan tp2 dp_attn2 moe_tp4": ({"tp": 2, "ep": 2, "moe_tp": 4}, {}),
    "plan dp_attn4 moe_tp2 moe_ep2": ({"ep": 4, "moe_tp": 2}, {}),
    "plan ep2 tp2 experts rep/rep, qkv row": ({"ep": 2, "tp": 2}, {
        "expert_ffn1": "rep", "expert_ffn2": "rep", "qkv": "row", "router": "col"}),
}
MODEL = '''"""tiny DBRX, clip_qkv set to bite (tests/test_dbrx_runtime.py)."""
import sys

sys.path.insert(0, {tests!r})
from test_dbrx_runtime import _model  # noqa: E402
from shardc.frontends.hf_build import token_ids  # noqa: E402


def build_model():
    return _model()


def example_inputs():
    return token_ids(256)


tiny_model = build_model
tiny_inputs = example_inputs
'''


@pytest.fixture(scope="module")
def model_file(tmp_path_factory) -> str:
    from pathlib import Path

    path = tmp_path_factory.mktemp("dbrx") / "tiny_dbrx.py"
    path.write_text(MODEL.format(tests=str(Path(__file__).resolve().parent)))
    return str(path)


def _choices(model_file: str, override: dict) -> dict:
    from test_fast_runtime_moe import megatron_choices

    return megatron_choices(model_file, override)


@pytest.fixture(scope="module")
def launched(model_file) -> dict:
    from test_fast_runtime import launch_plans
    from test_fast_runtime_moe import _worker as plan_worker

    return launch_plans(plan_worker, {n: (model_file, deg, _choices(model_file, over))
                                      for n, (deg, over) in PLAN_CASES.items()})


@pytest.mark.parametrize("name", list(PLAN_CASES))
def test_dbrx_plan_generate_equals_unsharded(launched, name):
    from test_fast_runtime import assert_unsharded_tokens
    from test_fast_runtime_moe import TOL

    assert_unsharded_tokens(launched[name], TOL)


RESPLIT = {"tp": 2, "ep": 2, "moe_ep": 4}


@pytest.mark.parametrize("pair, degrees, runs", [
    (("col", "row"), None, True), (("rep", "rep"), None, True), (("col", "row"), RESPLIT, True),
    (("col", "col"), None, False), (("row", "col"), None, False), (("rep", "rep"), RESPLIT, False)])
def test_fused_experts_verdict_per_plan(model_file, pair, degrees, runs):
    """Plans whose experts pair parallelize.py does not place for fused experts (other than
    col/row, rep/rep over tp; a re-split other than col/row) get backend runs False naming
    the pair, not an emission error; the others run."""
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
        assert "experts stored fused" in got["reason"] and "/".join(pair) in got["reason"]
    else:
        assert "fused=('mlp', " in plan.code()
        assert ("GatheredExperts(" in plan.code()) == bool(degrees)
