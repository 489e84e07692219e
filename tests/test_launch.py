"""Launch scripts for vLLM and SGLang (shardc/backends/launch.py, docs/deploy.md): they parse,
their parallel sizes multiply to the pool's GPUs, input never becomes code, and a plan an
engine cannot run gets the nearest configuration it can, with that one's predicted
throughput beside the plan's."""

import os
import re
import shutil
import subprocess
import sys

import pytest
from cost_graphs import fixture_graph

from shardc.backends.launch import (
    LaunchPool,
    launch_scripts,
    nearest_expressible,
    not_expressible,
    role_for_phase,
)
from shardc.cost import CostModel
from shardc.errors import InputError
from shardc.ir.space import StrategySpace, megatron_op_choices
from shardc.ir.strategy import Degrees, Mesh, Strategy, Workload
from shardc.search.objective import cost_model_objective

BASH = shutil.which("bash")
needs_bash = pytest.mark.skipif(BASH is None, reason="needs bash")


def problem(name, mesh, phase):
    g = fixture_graph(name)
    m = Mesh.parse(mesh)
    wl = Workload(phase=phase)
    space = StrategySpace(g, m, wl)
    return space, cost_model_objective(CostModel(g, m, "h100", wl), space)


def strategy(space, batch, overrides=None, **deg):
    d = Degrees(**deg)
    ops = megatron_op_choices(space, space.values["tp"].index(d.tp))
    choices = {s: int(c) for s, c in zip(space.op_slots, ops)}
    for slot, c in (overrides or {}).items():
        choices[slot] = c
    return Strategy(degrees=d, batch=batch, choices=choices)


def scripts(space, obj, strat, role="mixed", model="org/model", plan_value=None):
    pool = LaunchPool(role=role, strategy=strat, model=model, max_model_len=4096,
                      mem_fraction=0.9)
    files = launch_scripts(pool, space, obj, plan_value=plan_value)
    return {name: w.text for name, w in files.items()}


def flags(text: str) -> dict[str, str | None]:
    out = {}
    for m in re.finditer(r"(--[a-z0-9-]+)(?: ([^-\s\\][^\s\\]*))?", text.split("exec ", 1)[1]):
        out[m.group(1)] = m.group(2)
    return out


def engine_gpus(name: str, text: str) -> int:
    f = flags(text)
    workers = int(re.search(r"^WORKERS=(\d+)$", text, re.M).group(1))
    if "vllm" in name:
        return (workers * int(f["--tensor-parallel-size"]) * int(f["--pipeline-parallel-size"])
                * int(f.get("--data-parallel-size") or 1))
    return workers * int(f["--tp-size"]) * int(f["--pp-size"])


CASES = [  # (model, mesh, phase, batch, degrees, role)
    ("llama3_70b", "8x2", "decode", 64, dict(tp=8, dp=2), "mixed"),
    ("llama3_70b", "8x4", "decode", 64, dict(tp=4, pp=2, dp=4), "decode"),
    ("mixtral_8x7b", "8x2", "decode", 256, dict(tp=1, ep=8, dp=2), "mixed"),
    ("mixtral_8x7b", "8x2", "prefill", 16, dict(tp=2, ep=4, pp=2, sp=2), "prefill"),
    ("deepseek_v3", "8x4", "decode", 256, dict(tp=1, ep=32), "mixed"),  # 4 nodes a worker
]


@needs_bash
@pytest.mark.parametrize("case", CASES, ids=[f"{c[0]}-{c[1]}-{c[2]}" for c in CASES])
def test_scripts_parse_and_their_sizes_multiply_to_the_pools_gpus(case, tmp_path):
    name, mesh, phase, batch, deg, role = case
    space, obj = problem(name, mesh, phase)
    st = strategy(space, batch, **deg)
    out = scripts(space, obj, st, role=role)
    assert set(out) == {f"launch/vllm_{role}.sh", f"launch/sglang_{role}.sh"}
    for fname, text in out.items():
        path = tmp_path / fname.replace("/", "_")
        path.write_text(text)
        r = subprocess.run([BASH, "-n", str(path)], capture_output=True, text=True)
        assert r.returncode == 0, r.stderr
        assert engine_gpus(fname, text) == Mesh.parse(mesh).gpus
        if role in ("prefill", "decode"):
            assert (f"--disaggregation-mode {role}" in text if "sglang" in fname
                    else "--kv-transfer-config" in text)


def test_expressible_plans_map_to_the_engines_flags_exactly():
    space, obj = problem("mixtral_8x7b", "8x2", "decode")
    st = strategy(space, 256, tp=1, ep=8, dp=2)
    assert not not_expressible("vllm", space, st) and not not_expressible("sglang", space, st)
    out = scripts(space, obj, st, plan_value=123.4)
    v, s = flags(out["launch/vllm_mixed.sh"]), flags(out["launch/sglang_mixed.sh"])
    assert v["--tensor-parallel-size"] == "1" and v["--data-parallel-size"] == "8"
    assert "--enable-expert-parallel" in v and v["--max-num-seqs"] == "32"  # per DP rank
    assert (s["--tp-size"], s["--dp-size"], s["--ep-size"]) == ("8", "8", "8")
    assert "--enable-dp-attention" in s and s["--max-running-requests"] == "256"
    for text in out.values():
        assert "not expressible" not in text and "123.4 tok/s/GPU" in text


def test_a_plan_an_engine_cannot_run_gets_the_nearest_configuration_and_its_throughput():
    # Mixtral prefill, tp 8 with ep 2 and the experts unsplit over tp, sequence parallel:
    # vLLM cannot split experts apart from tp x dp; SGLang has no SP, nor unsplit experts
    space, obj = problem("mixtral_8x7b", "8x2", "prefill")
    rep = {"moe_block.expert_ffn1": 2, "moe_block.expert_ffn2": 2}
    st = strategy(space, 32, rep, tp=8, ep=2, sp=8)
    plan_value = float(obj(space.encode(st)[None])[0][0])
    out = scripts(space, obj, st, plan_value=plan_value)
    for engine in ("vllm", "sglang"):
        text = out[f"launch/{engine}_mixed.sh"]
        near = nearest_expressible(engine, space, st, obj)
        assert near.reasons and not not_expressible(engine, space, near.strategy)
        value, feasible = obj(space.encode(near.strategy)[None])
        assert feasible[0] and near.predicted == pytest.approx(float(value[0]))
        assert "is not expressible in" in text
        assert f"predicted {near.predicted:.1f} tok/s/GPU vs the plan's {plan_value:.1f}" in text
        d = near.strategy.degrees
        assert f"tp={d.tp} ep={d.ep} pp={d.pp} dp={d.dp} sp={d.sp}" in text
        assert engine_gpus(engine, text) == 16
    # SGLang keeps the degrees it can run (tp 8, ep 2) and drops only SP and the expert split
    sg = nearest_expressible("sglang", space, st, obj).strategy
    assert (sg.degrees.tp, sg.degrees.ep, sg.degrees.sp) == (8, 2, 1)
    assert "sequence parallelism" in out["launch/sglang_mixed.sh"]


@needs_bash
def test_a_hostile_model_name_stays_one_quoted_argument(tmp_path):
    hostile = "x'; touch PWNED; echo \"$(touch PWNED2)\" `touch PWNED3` \\ #"
    space, obj = problem("llama3_70b", "8x1", "decode")
    out = scripts(space, obj, strategy(space, 64, tp=8), model=hostile)
    stub = tmp_path / "bin"
    stub.mkdir()
    for exe in ("vllm", "python"):  # record the argv instead of starting an engine
        (stub / exe).write_text('#!/usr/bin/env bash\nprintf "%s\\n" "$@" > "$ARGV_OUT"\n')
        (stub / exe).chmod(0o755)
    for fname, text in out.items():
        path = tmp_path / fname.replace("/", "_")
        path.write_text(text)
        argv_out = tmp_path / (path.name + ".argv")
        env = dict(os.environ, PATH=f"{stub}{os.pathsep}{os.environ['PATH']}",
                   ARGV_OUT=str(argv_out))
        env.pop("SHARDC_MODEL", None)
        r = subprocess.run([BASH, str(path), "0"], cwd=tmp_path, env=env, capture_output=True,
                           text=True)
        assert r.returncode == 0, r.stderr
        args = argv_out.read_text().split("\n")
        assert hostile in args  # the model arrives verbatim, as one argument
        assert not list(tmp_path.glob("PWNED*"))
        bad = subprocess.run([BASH, str(path), "1; touch PWNED"], cwd=tmp_path, env=env,
                             capture_output=True, text=True)
        assert bad.returncode == 2 and "worker index" in bad.stderr
        assert not list(tmp_path.glob("PWNED*"))


@needs_bash
def test_names_from_the_model_in_comments_cannot_end_the_comment(tmp_path):
    g = fixture_graph("mixtral_8x7b")
    g.layer_kinds[0].name = "moe\ntouch PWNED\n#"
    m, wl = Mesh.parse("8x1"), Workload(phase="decode")
    space = StrategySpace(g, m, wl)
    obj = cost_model_objective(CostModel(g, m, "h100", wl), space)
    slot = next(s for s in space.op_slots if s.endswith(".expert_ffn1"))
    st = strategy(space, 64, {slot: 2}, tp=8)  # not expressible: its name is in a comment
    for fname, text in scripts(space, obj, st).items():
        assert "touch PWNED" in text and "\ntouch PWNED" not in text.replace("\\x0a", "")
        assert all(line.startswith("#") for line in text.splitlines() if "PWNED" in line)
        path = tmp_path / fname.replace("/", "_")
        path.write_text(text)
        assert subprocess.run([BASH, "-n", str(path)]).returncode == 0


def test_pool_values_are_validated_before_any_script():
    space, _ = problem("llama3_70b", "8x1", "decode")
    st = strategy(space, 64, tp=8)
    ok = dict(role="mixed", strategy=st, model="m", max_model_len=4096, mem_fraction=0.9)
    for bad in (dict(role="both"), dict(mem_fraction=float("nan")), dict(mem_fraction=1.5),
                dict(max_model_len=0), dict(kv_cache="int4"), dict(model="")):
        with pytest.raises(InputError):
            LaunchPool(**{**ok, **bad})
    assert role_for_phase("decode") == "mixed" and role_for_phase("prefill") == "prefill"


@needs_bash
def test_compile_writes_launch_scripts_and_both_baselines(tmp_path):
    import json

    out = tmp_path / "o"
    r = subprocess.run([sys.executable, "-m", "shardc.cli", "compile", "examples/tiny_mixtral.py",
                        "--mesh", "4x1", "--search", "megatron", "--quiet", "--out", str(out)],
                       capture_output=True, text=True,
                       cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert r.returncode == 0, r.stderr
    assert "launch/vllm_mixed.sh" in r.stdout and "vs best practice" in r.stdout
    plan = json.loads((out / "plan.json").read_text())
    assert set(plan["baseline"]) == {"megatron", "best_practice"}
    assert plan["baseline"]["best_practice"]["tok_s_per_gpu"] >= \
        plan["baseline"]["megatron"]["tok_s_per_gpu"]
    for engine in ("vllm", "sglang"):
        path = out / "launch" / f"{engine}_mixed.sh"
        assert os.access(path, os.X_OK)
        assert subprocess.run([BASH, "-n", str(path)]).returncode == 0
        assert engine_gpus(engine, path.read_text()) == 4


def test_sglang_runs_dp_attention_in_the_tp_group_vllm_gets_the_nearest():
    space, obj = problem("llama3_70b", "8x1", "prefill")
    dp_attn = {"dense_block.qkv": 2, "dense_block.attn_core": 1, "dense_block.out_proj": 2}
    st = strategy(space, 8, dp_attn, tp=4, dp=2, sp=4)
    plan_value = float(obj(space.encode(st)[None])[0][0])
    out = scripts(space, obj, st, role="prefill", plan_value=plan_value)
    vllm = nearest_expressible("vllm", space, st, obj)
    assert vllm.reasons and vllm.strategy.choice_names()["dense_block.attn_core"] == "heads"
    assert "is not expressible in vLLM" in out["launch/vllm_prefill.sh"]
    sg = nearest_expressible("sglang", space, st, obj)  # only SP is beyond SGLang
    assert [r for r in sg.reasons if "per-op" in r] == []
    assert sg.strategy.choice_names()["dense_block.attn_core"] == "batch"
    f = flags(out["launch/sglang_prefill.sh"])
    assert (f["--tp-size"], f["--dp-size"]) == ("4", "4") and "--enable-dp-attention" in f
