"""--phase serve end to end on the tiny model: plan.json schema 2 (serving section) validates
and round-trips, schema 1 plans still load, the Pareto fronts are monotone, disaggregated
plans emit one parallelize file per pool, and a bad serving section is refused."""

from __future__ import annotations

import copy
import json
import subprocess
from pathlib import Path

import pytest

import shardc
from shardc.cli import main
from shardc.errors import InputError
from shardc.ir.strategy import Workload
from shardc.plan import load_plan, validate_plan_dict

ROOT = Path(__file__).resolve().parents[1]
TINY = str(ROOT / "examples" / "tiny_llama.py")
SCHEMA1 = ROOT / "tests" / "data" / "serving" / "schema1_tiny_llama.plan.json"  # pre-schema 2


def _serve(mode: str, **kw) -> Workload:
    return Workload(phase="serve", isl=256, osl=64, mode=mode, **kw)


@pytest.fixture(scope="module")
def plans():
    return {mode: shardc.compile(TINY, mesh="4x1", workload=_serve(mode), search=search)
            for mode, search in (("agg", "megatron"), ("disagg", "best_practice"))}


def test_schema2_plan_validates_and_round_trips(plans, tmp_path):
    for mode, plan in plans.items():
        d = plan.to_dict()
        assert d["schema_version"] == 2 and d["workload"]["phase"] == "serve"
        assert (d["workload"]["isl"], d["workload"]["osl"]) == (256, 64)
        sv = d["serving"]
        assert sv["mode"] == mode
        assert d["predicted"]["tok_s_per_gpu"] == sv["predicted"]["tok_s_per_gpu"]
        validate_plan_dict(json.loads(json.dumps(d)))
        back = load_plan(plan.save(tmp_path / f"{mode}.json"))
        assert back.to_dict() == json.loads(json.dumps(d))
        gpus = sum(p["workers"] * p["gpus_per_worker"] for p in sv["pools"])
        assert gpus <= 4
        assert [p["role"] for p in sv["pools"]] == (["mixed"] if mode == "agg"
                                                    else ["prefill", "decode"])
        for name in ("megatron", "best_practice"):  # both baselines, same serving model
            base = d["baseline"][name]["tok_s_per_gpu"]
            assert 0 < base <= sv["predicted"]["tok_s_per_gpu"]


def test_pareto_fronts_are_monotone(plans):
    for plan in plans.values():
        for mode in ("agg", "disagg"):
            pts = [p for p in plan.serving["pareto"] if p["mode"] == mode]
            users = [p["tok_s_per_user"] for p in pts]
            gpu = [p["tok_s_per_gpu"] for p in pts]
            assert users == sorted(users) and len(set(users)) == len(users)
            assert all(a > b for a, b in zip(gpu, gpu[1:]))


def test_schema1_plan_still_loads():
    plan = load_plan(SCHEMA1)
    assert plan.schema_version == 1 and not plan.serving
    assert "serving" not in plan.to_dict()


@pytest.mark.parametrize("edit,match", [
    (lambda d: d["serving"]["pools"][0].update(workers=99), "pool"),
    (lambda d: d["serving"].update(mode="both"), "mode"),
    (lambda d: d["workload"].update(osl=0), "osl"),
])
def test_bad_serving_section_is_refused(plans, edit, match):
    d = copy.deepcopy(plans["disagg"].to_dict())
    edit(d)
    with pytest.raises(InputError, match=match):
        validate_plan_dict(d)


def test_compile_serve_writes_pool_files(tmp_path, capsys):
    out = tmp_path / "o"
    rc = main(["compile", TINY, "--mesh", "4x1", "--phase", "serve", "--isl", "256", "--osl",
               "64", "--mode", "disagg", "--search", "megatron", "--quiet", "--out", str(out)])
    assert rc == 0
    names = {p.name for p in out.iterdir()}
    assert {"plan.json", "pareto.png", "parallelize_prefill.py", "parallelize_decode.py"} <= names
    assert "parallelize.py" not in names
    for role in ("prefill", "decode"):
        compile((out / f"parallelize_{role}.py").read_text(), role, "exec")
    plan = json.loads((out / "plan.json").read_text())
    for engine in ("vllm", "sglang"):  # one launch script per pool of each engine's best
        entry = plan["launch"][engine]
        assert [p["role"] for p in entry["pools"]] == ["prefill", "decode"]
        for pool in entry["pools"]:
            script = out / pool["script"]
            assert subprocess.run(["bash", "-n", str(script)]).returncode == 0
            assert f"WORKERS={pool['workers']}" in script.read_text()
    text = capsys.readouterr().out
    assert "binding constraint" in text and "SLOs -20%" in text and "SLOs +20%" in text


def test_serve_flags_are_checked(capsys):
    assert main(["compile", TINY, "--mesh", "4x1", "--phase", "serve", "--osl", "0"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("shardc: error: --osl 0") and len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("argv,code,match", [
    (["--mesh", "1x1", "--mode", "disagg"], 2, "--mode disagg: mesh 1x1 has one GPU"),
    (["--mode", "disagg", "--degrees", "dp=2"], 2, "--degrees dp: a disaggregated pool"),
    (["--tpot-slo", "0.001", "--ttft-slo", "0.001"], 3, "no serving plan on 4x1 meets"),
    (["--mode", "disagg", "--degrees", "tp=4"], 2, "a pool's worker has at most 2 of the 4 GPUs"),
])
def test_serve_errors_are_one_line(argv, code, match, capsys, tmp_path):
    base = ["compile", TINY, "--mesh", "4x1", "--phase", "serve", "--search", "megatron",
            "--quiet", "--out", str(tmp_path / "o")]
    assert main(base + argv) == code
    err = capsys.readouterr().err
    assert match in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "o").exists()


def test_simulate_serve_prices_the_aggregated_pool_only(capsys):
    args = ["simulate", TINY, "--mesh", "4x1", "--phase", "serve", "--degrees", "tp=2"]
    assert main(args + ["--mode", "disagg"]) == 2
    assert "prices one aggregated pool" in capsys.readouterr().err
    assert main(args + ["--mode", "agg"]) == 0
    assert "TTFT (ms)" in capsys.readouterr().out


def test_simulate_serve_prices_the_batch_asked(capsys):
    """``--batch N`` is priced at N on a mesh with ep x pp work units (an infeasible N says
    what binds, not a divisibility failure of another batch); ``auto`` with nothing feasible
    prices a batch that splits, so the reason is the SLO."""
    args = ["simulate", str(ROOT / "examples" / "tiny_mixtral.py"), "--mesh", "4x1",
            "--phase", "serve", "--isl", "256", "--osl", "64", "--degrees", "ep=4"]
    assert main(args + ["--batch", "12"]) == 0
    assert "batch 12\n" in capsys.readouterr().out
    for batch, shown in (("12", "batch=12"), ("auto", "batch=4")):
        assert main(args + ["--batch", batch, "--tpot-slo", "0.001"]) == 3
        err = capsys.readouterr().err
        assert "TPOT" in err and shown in err, err
    assert main(args + ["--batch", "6"]) == 3
    assert "batch 6 does not divide over 4" in capsys.readouterr().err


def test_serve_longer_than_the_model_positions_is_refused():
    from shardc.serving.search import check_serve_positions
    from tests.cost_graphs import fixture_graph

    g = fixture_graph("tiny_llama")
    g.config["max_position_embeddings"] = 512
    check_serve_positions(g, _serve("agg"))  # 256 + 64 fits
    with pytest.raises(InputError, match=r"--isl 500 \+ --osl 64 = 564 tokens is longer"):
        check_serve_positions(g, Workload(phase="serve", isl=500, osl=64))


def test_serve_batch_is_a_cap():
    plan = shardc.compile(TINY, mesh="4x1", workload=_serve("agg", batch=48), search="megatron")
    pool = plan.serving["pools"][0]
    assert pool["batch"] <= 48
    assert plan.serving["binding"] in ("--batch cap", "memory", "TPOT", "TTFT")
    if pool["batch"] == 48:
        assert plan.serving["binding"] == "--batch cap"


def test_optimum_fraction_and_inspect_of_a_serve_plan(plans, tmp_path, capsys):
    for plan in plans.values():  # exact finishes on the tiny model: the certificate is there
        frac = plan.search["optimum_fraction"]
        assert 0 < frac <= 1 + 1e-12
        assert plan.search["exact_tok_s_per_gpu"] >= plan.serving["predicted"]["tok_s_per_gpu"] * (1 - 1e-12)
    path = plans["disagg"].save(tmp_path / "plan.json")
    assert main(["inspect", str(path)]) == 0
    assert "one decode step" in capsys.readouterr().out


def test_serve_pools_record_the_scheduler_and_kv_reservation(plans):
    """plan.json pools name what the launch scripts write: the aggregated pool's token
    budget (a candidate of the scheduler or the steady-state need) and every mixed / decode
    pool's KV reservation rule; the budget leaves room for the decode tokens and the chunk."""
    from shardc.cost.scheduler import TOKEN_BUDGETS

    agg = plans["agg"].serving["pools"][0]
    sched = agg["scheduler"]
    d = agg["degrees"]
    seqs = agg["batch"] / d["pp"] / d["ep"]
    assert sched["max_batched_tokens"] in TOKEN_BUDGETS or \
        sched["max_batched_tokens"] >= TOKEN_BUDGETS[-1]
    assert seqs + sched["prefill_chunk_tokens"] <= sched["max_batched_tokens"] + 1e-9
    assert sched["prefill_budget_tokens"] == sched["max_batched_tokens"] - int(seqs)
    assert sched["prefill_chunk_tokens"] <= sched["prefill_budget_tokens"]
    assert 0 < sched["mixed_step_fraction"] <= 1
    for plan in plans.values():
        for pool in plan.serving["pools"]:
            if pool["role"] == "prefill":
                assert "kv_reservation" not in pool and "scheduler" not in pool
            else:
                kv = pool["kv_reservation"]
                assert kv["rule"] == "paged" and 256 < kv["tokens_per_sequence"] <= 256 + 64


def test_launch_flags_carry_the_priced_token_budget(plans):
    """The aggregated pool's scripts run the token budget the plan priced: vLLM
    --max-num-batched-tokens (per data-parallel rank), SGLang --chunked-prefill-size (its
    prompt part); the engine's own best pool carries the budget its own pricing chose."""
    plan = plans["agg"].to_dict()
    checked = 0
    for engine, flag in (("vllm", "--max-num-batched-tokens"), ("sglang", "--chunked-prefill-size")):
        entry = plan["launch"][engine]
        for pool in entry["pools"]:
            if pool["role"] != "mixed":
                continue
            flags = pool["flags"]
            assert flag in flags, (engine, flags)
            value = int(flags[flags.index(flag) + 1])
            if entry["same_as_plan"]:
                sched = plan["serving"]["pools"][0]["scheduler"]
                want = (max(sched["max_batched_tokens"] // pool["degrees"]["ep"],
                            pool["batch"] // pool["degrees"]["ep"])
                        if engine == "vllm" else sched["prefill_budget_tokens"])
                assert value == want
            checked += 1
    assert checked >= 2
