"""The fast runtime (``shardc/runtime/fast.py``, ``generate.py``, ``kv_cache.py``) on 4 gloo
ranks: weights placed by the plan's torch-style ``parallelize.py``, then ``generate`` runs
on the local shards with explicit functional collectives and the runtime's own KV cache.

The emitted file's own ``generate`` runs (its ``WALKS`` data = the contract's walk). For tiny
Llama (tp=4; tp=2 x dp=2 with batch-split attention), tiny Mixtral (ep=2 x tp=2; attention
data parallel with the experts tensor-parallel over every rank, tp=1 x dp_attn=4 and tp=2 x
dp_attn=2, or expert-parallel over every rank, tp=2 x dp_attn=2 and tp=4, or mixed:
moe_tp=2 x moe_ep=2 at tp=1 x dp_attn=4 and at tp=4; tiny DeepSeek-V3's shared expert beside
all-TP and all-EP experts),
tiny DeepSeek-V3 MLA (tp=4) and tiny Llama pp=2 x tp=2, the greedy tokens of 32 new tokens
from left-padded prompts equal the unsharded HF model's, computed by its own forward with
full recompute each step (a 2-D padding mask and the positions HF's generate would use):
no dependence on any transformers cache API. One launch runs every case (process start-up
dominates). A sampled run is checked for agreement across ranks and determinism.
"""

from __future__ import annotations

import copy
import time

import pytest
import torch
from test_backend_gloo import DEEPSEEK, DENSE, DS_MEGATRON, LLAMA, MIXTRAL, MOE, D, _with

WORLD, BATCH, PROMPT, NEW = 4, 4, 6, 32
BATCH_ATTN = {"qkv": "rep", "attn_core": "batch", "out_proj": "col"}
CASES = {
    "llama tp4": (LLAMA, {"tp": 4}, DENSE),
    "llama dp2 tp2 batch-split attention": (
        LLAMA, {"tp": 2, "dp": 2}, _with(DENSE, D, **BATCH_ATTN)),
    "mixtral ep2 tp2": (MIXTRAL, {"ep": 2, "tp": 2}, MOE),
    "deepseek MLA tp4": (DEEPSEEK, {"tp": 4}, DS_MEGATRON),
    "llama pp2 tp2": (LLAMA, {"pp": 2, "tp": 2}, DENSE),
    # attention data parallel, the experts split their own way (the all-gather dispatch)
    "mixtral dp_attn4 moe_tp4": (MIXTRAL, {"ep": 4, "moe_tp": 4}, MOE),
    "mixtral tp2 dp_attn2 moe_tp4": (MIXTRAL, {"tp": 2, "ep": 2, "moe_tp": 4}, MOE),
    "mixtral tp2 dp_attn2 moe_ep4": (MIXTRAL, {"tp": 2, "ep": 2, "moe_ep": 4}, MOE),
    "mixtral tp4 moe_ep4": (MIXTRAL, {"tp": 4, "moe_ep": 4}, MOE),  # no ep: all-reduce only
    # mixed: 2 expert groups x 2 width slices on the experts mesh (moe_ep, moe_tp)
    "mixtral dp_attn4 moe_tp2 moe_ep2": (MIXTRAL, {"ep": 4, "moe_tp": 2}, MOE),
    "mixtral tp4 moe_tp2 moe_ep2": (MIXTRAL, {"tp": 4, "moe_tp": 2}, MOE),
    # a shared expert beside the re-split experts, on the rank's own rows
    "deepseek dp_attn4 moe_tp4, shared expert": (DEEPSEEK, {"ep": 4, "moe_tp": 4}, DS_MEGATRON),
    "deepseek tp2 dp_attn2 moe_ep4, shared expert": (
        DEEPSEEK, {"tp": 2, "ep": 2, "moe_ep": 4}, DS_MEGATRON),
}


def plan_payload(model_file: str, degrees: dict, choices: dict, batch: int = BATCH) -> dict:
    """The plan's torch-style ``parallelize.py`` source and its ``WALKS`` data."""
    from shardc.backends.runtime_walks import plan_walks
    from shardc.frontends import load_graph
    from shardc.ir.strategy import Mesh, Workload, strategy_from_names
    from shardc.plan import build_plan

    graph = load_graph(model_file, tiny=True)
    strategy = strategy_from_names(degrees, choices, batch)
    plan = build_plan(graph, strategy, Mesh(strategy.degrees.world, 1), "h100",
                      Workload(batch=batch, context=512))
    return {"code": plan.code(standalone=True), "model": model_file,
            "walks": plan_walks({str(o["name"]): str(o["choice"]) for o in plan.ops},
                                strategy.degrees)}


def prompts(vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded prompts: row b has b pad tokens (id 0) then real tokens."""
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(1, vocab, (BATCH, PROMPT), generator=g)
    mask = torch.ones_like(ids)
    for b in range(BATCH):
        ids[b, :b % PROMPT] = 0
        mask[b, :b % PROMPT] = 0
    return ids, mask


def reference_greedy(model, ids: torch.Tensor, mask: torch.Tensor, new: int) -> torch.Tensor:
    """The unsharded model's greedy continuation, full recompute per token."""
    with torch.no_grad():
        for _ in range(new):
            pos = (mask.cumsum(1) - 1).clamp_min(0)
            logits = model(input_ids=ids, attention_mask=mask, position_ids=pos,
                           use_cache=False).logits
            nxt = logits[:, -1].argmax(-1, keepdim=True)
            ids = torch.cat([ids, nxt], 1)
            mask = torch.cat([mask, torch.ones_like(nxt)], 1)
    return ids


def launch_plans(worker, cases: dict) -> dict:
    """Every case's plan (``cases``: name -> :func:`plan_payload` arguments) run by ``worker``
    on :data:`WORLD` gloo ranks in one launch; name -> the per-rank result dicts."""
    from shardc.testing.launch import launch

    names = list(cases)
    payloads = [plan_payload(*cases[n]) for n in names]
    per_rank = launch(worker, WORLD, (payloads,), 900,
                      ("torch", "transformers", "shardc.runtime.fast"))
    return {n: [r[i] for r in per_rank] for i, n in enumerate(names)}


def assert_unsharded_tokens(per_rank: list, logits_tol: float | None = None) -> None:
    """Every rank ran without error, its greedy tokens equal the unsharded model's (and,
    with ``logits_tol``, its logits within that relative error), and every rank picked the
    same tokens (the all-gathered batch)."""
    for r, res in enumerate(per_rank):
        assert "error" not in res, f"rank {r}: {res.get('error')}"
        assert res["equal"], f"rank {r}: got {res['got']}\nwant {res['want']}"
        if logits_tol is not None:
            err = res["logits_error"]
            assert err <= logits_tol, f"rank {r}: logits off by {err:.2e}"
    assert all(res["got"] == per_rank[0]["got"] for res in per_rank)


def plan_file_and_model(p: dict, batch: int = BATCH):
    """A payload's plan file (``p["code"]`` executed: its namespace), the tiny model built
    from seed 0 for ``batch`` x :data:`PROMPT` tokens, and its left-padded prompts."""
    from shardc.backends.verify import _build, _vocab

    ns: dict = {}
    exec(compile(p["code"], "<parallelize.py>", "exec"), ns)
    torch.manual_seed(0)
    model, _ = _build(p["model"], batch, PROMPT)
    ids, mask = prompts(_vocab(model))
    return ns, model, ids, mask


def placed(ns: dict, model):
    """``model`` placed by the plan file's own ``parallelize`` on the file's mesh, and the
    mesh."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", tuple(ns["MESH_SHAPE"]),
                            mesh_dim_names=tuple(ns["MESH_DIM_NAMES"]))
    return ns["parallelize"](model, world_mesh=mesh), mesh


def _worker(rank, world, port, payloads, out_dir):
    from shardc.testing.launch import run_cases

    run_cases(rank, world, port, out_dir, payloads, _run_case)


def _run_case(p: dict) -> dict:
    """One plan on this rank: the file's own greedy ``generate`` against the unsharded
    model's, and a sampled run twice (same seed, same tokens)."""
    from shardc.runtime.fast import FastModel
    from shardc.runtime.generate import fast_generate as generate

    t0 = time.perf_counter()
    ns, model, ids, mask = plan_file_and_model(p)
    want = reference_greedy(copy.deepcopy(model), ids, mask, NEW)
    t1 = time.perf_counter()
    model, mesh = placed(ns, model)
    assert ns["WALKS"] == p["walks"]  # the file's data is the contract's walk
    t2 = time.perf_counter()
    got = ns["generate"](model, ids, NEW, attention_mask=mask)  # the file's own
    t3 = time.perf_counter()
    assert type(model._shardc_fast).__name__ == "FastModel"  # inlined class
    fast = FastModel(model, mesh, p["walks"], ns["LAYER_KINDS"])
    s1 = generate(fast, ids, 8, attention_mask=mask, temperature=0.8, top_k=20, seed=5)
    s2 = ns["generate"](model, ids, 8, attention_mask=mask, temperature=0.8, top_k=20, seed=5)
    return {"equal": bool(torch.equal(got, want)), "got": got[:, PROMPT:].tolist(),
            "want": want[:, PROMPT:].tolist(), "sampled": s1[:, PROMPT:].tolist(),
            "sampled_repeat": bool(torch.equal(s1, s2)), "seconds": [t1 - t0, t2 - t1, t3 - t2]}


@pytest.fixture(scope="module")
def launched():
    return launch_plans(_worker, CASES)


@pytest.mark.parametrize("name", list(CASES))
def test_greedy_generate_equals_unsharded(launched, name):
    per_rank = launched[name]
    assert_unsharded_tokens(per_rank)
    # sampling: deterministic for a seed, the same on every rank, and not the greedy run
    assert all(res["sampled_repeat"] for res in per_rank)
    assert all(res["sampled"] == per_rank[0]["sampled"] for res in per_rank)
    assert [row[:8] for row in per_rank[0]["got"]] != per_rank[0]["sampled"]
