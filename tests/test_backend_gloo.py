"""Numerics under gloo: sharded logits equal the unsharded model's within 1e-4 relative.

One multi-process launch (4 ranks) runs every case of the four tiny models (process
start-up is the cost): the Megatron plan and non-Megatron strategies per model (DeepSeek-V3:
MLA split by heads / batch / replicated, shared experts, EP), incremental decoding with the
model's KV cache (prompt prefill + cached one-token steps == one whole forward), left- and
right-padded batches with a padding mask (real tokens' logits compared), the emitted
``parallelize.py`` imported and run by the workers, and a deliberately corrupted shard that
must be caught. The 8-rank launch is marked slow.
"""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest

from shardc.backends.verify import Case, run_suites
from shardc.plan import strategy_code

ROOT = Path(__file__).resolve().parents[1]
LLAMA = str(ROOT / "examples" / "tiny_llama.py")
MIXTRAL = str(ROOT / "examples" / "tiny_mixtral.py")
GPT_MOE = str(ROOT / "examples" / "gpt_moe_1p6t.py")
DEEPSEEK = str(ROOT / "examples" / "deepseek_v3.py")  # tiny_model(): 1 dense + 2 MoE layers
TOL = 1e-4

DENSE = {"embedding": "vocab", "dense_block.qkv": "col", "dense_block.attn_core": "heads",
         "dense_block.out_proj": "row", "dense_block.ffn1": "col", "dense_block.ffn2": "row",
         "lm_head": "col"}
MOE = {"embedding": "vocab", "moe_block.qkv": "col", "moe_block.attn_core": "heads",
       "moe_block.out_proj": "row", "moe_block.router": "rep", "moe_block.expert_ffn1": "col",
       "moe_block.expert_ffn2": "row", "lm_head": "col"}
D, M = "dense_block", "moe_block"
REP_ATTN = {"qkv": "rep", "attn_core": "rep", "out_proj": "rep"}


def _with(base: dict, kind: str, **ops) -> dict:
    out = dict(base)
    for op, c in ops.items():
        out[op if op in ("embedding", "lm_head") else f"{kind}.{op}"] = c
    return out


def llama_cases(code: str | None) -> list[Case]:
    L = {D: [0, 1]}
    cases = [
        Case("llama megatron tp4", {"tp": 4}, DENSE, L),
        Case("llama ffn2 hidden tp4", {"tp": 4}, _with(DENSE, D, ffn2="col"), L),
        Case("llama replicated attention tp4", {"tp": 4}, _with(DENSE, D, **REP_ATTN), L),
        Case("llama batch attention, hidden embedding, row lm_head tp4", {"tp": 4},
             _with(DENSE, D, qkv="row", attn_core="batch", out_proj="col", embedding="hidden",
                   lm_head="row"), L),
        Case("llama megatron+sp tp4", {"tp": 4, "sp": 4}, DENSE, L),
        Case("llama pp2 tp2", {"tp": 2, "pp": 2}, DENSE, L),
        Case("llama pp2 tp2, left padding", {"tp": 2, "pp": 2}, DENSE, L, padded="left"),
        Case("llama pp2 tp2 with a KV cache (refused)", {"tp": 2, "pp": 2}, DENSE, L,
             kv_cache=2),
        Case("llama dp2 tp2 ffn1 row", {"tp": 2, "dp": 2}, _with(DENSE, D, ffn1="row"), L),
        Case("llama corrupted shard (must mismatch)", {"tp": 4}, DENSE, L, corrupt=True),
        Case("llama megatron tp4, KV cache: prefill + 2 cached steps", {"tp": 4}, DENSE, L,
             kv_cache=2),
        Case("llama batch attention dp2 tp2, KV cache", {"tp": 2, "dp": 2},
             _with(DENSE, D, qkv="row", attn_core="batch", out_proj="col"), L, kv_cache=2),
        Case("llama batch attention dp2 tp2, padding mask", {"tp": 2, "dp": 2},
             _with(DENSE, D, qkv="row", attn_core="batch", out_proj="col"), L, padded="right"),
        Case("llama megatron+sp tp4, padding mask", {"tp": 4, "sp": 4}, DENSE, L, padded="right"),
        Case("llama batch attention dp2 tp2, left padding", {"tp": 2, "dp": 2},
             _with(DENSE, D, qkv="row", attn_core="batch", out_proj="col"), L, padded="left"),
    ]
    if code:
        cases.append(Case("llama emitted parallelize.py", {}, {}, None, code=code))
    return cases


def moe_cases(tag: str, code: str | None, kv_cache: bool = False) -> list[Case]:
    L = {M: [0, 1]}
    cases = [
        Case(f"{tag} megatron tp4", {"tp": 4}, MOE, L),
        Case(f"{tag} ep4", {"ep": 4}, MOE, L),
        Case(f"{tag} ep2 tp2 expert ffn2 hidden, router col", {"ep": 2, "tp": 2},
             _with(MOE, M, expert_ffn2="col", router="col"), L),
        Case(f"{tag} replicated attention ep2 dp2", {"ep": 2, "dp": 2}, _with(MOE, M, **REP_ATTN), L),
        Case(f"{tag} sp tp4 expert ffn1 row, router row", {"tp": 4, "sp": 4},
             _with(MOE, M, expert_ffn1="row", router="row"), L),
        Case(f"{tag} pp2 ep2", {"pp": 2, "ep": 2}, MOE, L),
    ]
    if kv_cache:  # HF models only (the GPT-MoE example model keeps no cache, takes no mask)
        cases += [Case(f"{tag} ep2 tp2, KV cache", {"ep": 2, "tp": 2}, MOE, L, kv_cache=2),
                  Case(f"{tag} ep2 tp2, padding mask", {"ep": 2, "tp": 2}, MOE, L, padded="right")]
    if code:
        cases.append(Case(f"{tag} emitted parallelize.py", {}, {}, None, code=code))
    return cases


DS_MEGATRON = {**DENSE, **MOE, "moe_block.shared_ffn1": "col", "moe_block.shared_ffn2": "row"}
DS_LAYERS = {D: [0], M: [1, 2]}


def deepseek_cases(code: str | None) -> list[Case]:
    other = _with(_with(DS_MEGATRON, D, qkv="row", attn_core="batch", out_proj="col",
                        ffn1="row", ffn2="col"),
                  M, qkv="rep", attn_core="batch", out_proj="col", shared_ffn1="rep",
                  shared_ffn2="rep", router="col", expert_ffn2="col", embedding="hidden")
    cases = [Case("deepseek megatron tp4", {"tp": 4}, DS_MEGATRON, DS_LAYERS),
             Case("deepseek ep2 tp2: batch attention (row / rep MLA), shared rep, expert "
                  "ffn2 hidden", {"ep": 2, "tp": 2}, other, DS_LAYERS),
             Case("deepseek megatron tp4, KV cache (MLA)", {"tp": 4}, DS_MEGATRON, DS_LAYERS,
                  kv_cache=2),
             Case("deepseek ep2 tp2 batch attention, padding mask", {"ep": 2, "tp": 2}, other,
                  DS_LAYERS, padded="right")]
    if code:
        cases.append(Case("deepseek emitted parallelize.py", {}, {}, None, code=code))
    return cases


def emit_code(model_file: str, degrees: dict, choices: dict, out: Path) -> str:
    """plan (tiny graph) -> parallelize.py on disk (ruff-checked by :func:`ruff_clean`)."""
    from shardc.frontends import load_graph
    from shardc.ir.strategy import Mesh, Workload, strategy_from_names
    from shardc.plan import build_plan

    graph = load_graph(model_file, tiny=True)
    st = strategy_from_names(degrees, choices, 8)
    world = st.degrees.world
    plan = build_plan(graph, st, Mesh(world, 1), "h100", Workload(batch=8))
    out.write_text(plan.code())
    return str(out)


def ruff_clean(paths: list[str]) -> None:
    r = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", *paths],
                       capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 0, r.stdout + r.stderr


def big_mesh_llama_plan(tmp: Path) -> str:
    """A Llama plan for a 64-GPU mesh (tp 8, dp 8): ``shardc verify --world 4`` scales it
    (tp to 2: the tiny model has 2 KV heads; dp fills the other ranks)."""
    from shardc.frontends import load_graph
    from shardc.ir.strategy import Degrees, Mesh, Strategy, Workload
    from shardc.plan import build_plan

    graph = load_graph(LLAMA, tiny=True)
    ch = {"embedding": 0, "lm_head": 0, "dense_block.qkv": 0, "dense_block.attn_core": 0,
          "dense_block.out_proj": 1, "dense_block.ffn1": 0, "dense_block.ffn2": 0}
    st = Strategy(Degrees(tp=8, dp=8), 8, ch)
    build_plan(graph, st, Mesh(8, 8), "h100", Workload(batch=8)).save(tmp / "plan.json")
    return str(tmp / "plan.json")


VERIFY_CASE = "llama 64-GPU plan scaled by shardc verify --world 4"


def verify_cli(plan: str, run_cases, capsys=None) -> tuple[int, str]:
    """``shardc verify LLAMA --plan plan --world 4`` in process with ``run_cases`` replaced."""
    from shardc.backends import verify as harness
    from shardc.cli import main

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(harness, "run_cases", run_cases)
        rc = main(["verify", LLAMA, "--plan", plan, "--world", "4"])
    return rc, capsys.readouterr().out if capsys else ""


@pytest.fixture(scope="module")
def verify_plan(tmp_path_factory):
    """(plan path, the Case ``shardc verify`` builds for it): the case runs in the launch."""
    plan = big_mesh_llama_plan(tmp_path_factory.mktemp("verify"))
    seen = []

    def record(model_ref, cases, world, **kw):
        seen.append((model_ref, cases, world, kw))
        return [{"name": c.name, "rel_err": 0.0, "error": None} for c in cases]

    verify_cli(plan, record)
    (model_ref, cases, world, kw), = seen
    assert model_ref == LLAMA and world == 4 and kw == {"seq": 8} and len(cases) == 1
    return plan, cases[0]


@pytest.fixture(scope="module")
def gloo_results(tmp_path_factory, verify_plan):
    tmp = tmp_path_factory.mktemp("parallelize")
    llama_code = emit_code(LLAMA, {"tp": 2, "dp": 2, "sp": 2}, _with(DENSE, D, ffn2="col"),
                           tmp / "llama_parallelize.py")
    mixtral_code = emit_code(MIXTRAL, {"tp": 2, "ep": 2}, MOE, tmp / "mixtral_parallelize.py")
    gpt_code = emit_code(GPT_MOE, {"tp": 2, "pp": 2}, _with(MOE, M, attn_core="batch", qkv="rep"),
                         tmp / "gpt_parallelize.py")
    # DeepSeek's emitted code: EP over 4 with replicated MLA in the dense layer, sp off
    ds_code = emit_code(DEEPSEEK, {"ep": 4}, _with(DS_MEGATRON, D, **REP_ATTN),
                        tmp / "deepseek_parallelize.py")
    ruff_clean([llama_code, mixtral_code, gpt_code, ds_code])
    scaled = dataclasses.replace(verify_plan[1], name=VERIFY_CASE)
    suites = [(LLAMA, llama_cases(llama_code) + [scaled]),
              (MIXTRAL, moe_cases("mixtral", mixtral_code, kv_cache=True)),
              (GPT_MOE, moe_cases("gpt_moe", gpt_code)), (DEEPSEEK, deepseek_cases(ds_code))]
    results = run_suites(suites, world=4, plan_code=strategy_code)
    return {r["name"]: r for r in results}


ALL_NAMES = ([c.name for c in llama_cases("x")] + [c.name for c in moe_cases("mixtral", "x", kv_cache=True)]
             + [c.name for c in moe_cases("gpt_moe", "x")] + [c.name for c in deepseek_cases("x")]
             + [VERIFY_CASE])


@pytest.mark.parametrize("name", ALL_NAMES)
def test_logits_match_unsharded(gloo_results, name):
    r = gloo_results[name]
    if "must mismatch" in name:
        assert r["error"] is None and r["rel_err"] > 10 * TOL, r
        return
    if "(refused)" in name:
        assert "runs whole sequences: it takes no" in r["error"] and "use_cache" in r["error"]
        return
    assert r["error"] is None, r["error"]
    assert r["rel_err"] <= TOL, r


def test_verify_runs_a_big_mesh_plan_scaled_down(gloo_results, verify_plan, capsys):
    """``shardc verify`` scales a 64-GPU plan to 4 ranks; the case it builds is the one the
    launch above ran (same degrees, choices, layer kinds), whose result it reports."""
    plan, case = verify_plan

    def replay(model_ref, cases, world, **kw):
        assert (model_ref, world, kw) == (LLAMA, 4, {"seq": 8}) and cases == [case]
        return [dict(gloo_results[VERIFY_CASE], name=case.name)]

    capsys.readouterr()
    rc, out = verify_cli(plan, replay, capsys)
    assert case.degrees == {"tp": 2, "pp": 1, "ep": 1, "dp": 2, "sp": 1}
    assert rc == 0, out
    assert "tp 8->2" in out and "dp 8->2" in out
    assert "verify OK" in out


@pytest.mark.slow
def test_eight_ranks():
    L = {M: [0, 1]}
    cases = [Case("mixtral tp2 ep2 dp2", {"tp": 2, "ep": 2, "dp": 2}, MOE, L),
             Case("mixtral tp4 ep2 sp", {"tp": 4, "ep": 2, "sp": 4},
                  _with(MOE, M, expert_ffn2="col"), L)]
    for r in run_suites([(MIXTRAL, cases)], world=8, plan_code=strategy_code):
        assert r["error"] is None, r
        assert r["rel_err"] <= TOL, r
