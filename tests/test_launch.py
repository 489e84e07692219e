"""Engines' spaces and launch scripts (shardc/ir/engines.py, shardc/search/engine_search.py,
shardc/launch_plan.py, shardc/backends/launch.py, docs/deploy.md): every configuration an
engine's space holds is one its flags express, the engine's exact search finds its optimum,
the scripts parse, their parallel sizes multiply to the pool's GPUs, every flag is in the
engine's checked flag list, and input never becomes code or a flag."""

import json
import os
import re
import shutil
import subprocess
import sys

import numpy as np
import pytest
from cost_graphs import fixture_graph

from shardc.backends.launch import (
    LaunchPool,
    check_model_id,
    config_model_id,
    engine_flag_table,
    engine_flags,
    gpus_per_instance,
    no_script_reason,
    pool_entry,
    render_script,
    role_for_phase,
)
from shardc.cost import CostModel
from shardc.errors import InputError
from shardc.ir.engines import ENGINES, mode_spaces, strategy_mode
from shardc.ir.space import StrategySpace
from shardc.ir.strategy import Mesh, Workload
from shardc.search.engine_search import search_engine
from shardc.search.legal import LegalSampler
from shardc.search.objective import cost_model_objective

BASH = shutil.which("bash")
needs_bash = pytest.mark.skipif(BASH is None, reason="needs bash")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def problem(name, mesh, phase, engine="vllm", **fixed):
    g = fixture_graph(name)
    m = Mesh.parse(mesh)
    wl = Workload(phase=phase)
    space = StrategySpace(g, m, wl, fixed=fixed, tp_domain=m.gpus_per_node)
    return space, CostModel(g, m, "h100", wl, kernels="silicon", engine=engine)


def script_for(engine, pool, model_id="org/model", gpus_per_node=8, launch=None):
    entry = pool_entry(engine, pool, f"launch/{engine}_{pool.role}.sh")
    return render_script(engine, entry, launch or {}, model_id, gpus_per_node)


def flags_of(text: str) -> list[str]:
    cmd = text.split("exec ", 1)[1]
    return re.findall(r"(?<![\w-])(--[a-z0-9][a-z0-9_-]*)", cmd)


def script_gpus(engine: str, text: str) -> int:
    """GPUs of a script's pool by the engine's own arithmetic of its flags."""
    cmd = text.split("exec ", 1)[1]
    f = dict(re.findall(r"(--[a-z_-]+) (\d+)", cmd))
    workers = int(re.search(r"^WORKERS=(\d+)$", text, re.M).group(1))
    if engine == "vllm":
        return (workers * int(f["--tensor-parallel-size"]) * int(f["--pipeline-parallel-size"])
                * int(f.get("--data-parallel-size", 1)))
    if engine == "trtllm":
        return workers * int(f["--tp_size"]) * int(f["--pp_size"])
    return workers * int(f["--tp-size"]) * int(f["--pp-size"])


CASES = [  # (model, mesh, phase)
    ("llama3_70b", "8x2", "decode"),
    ("mixtral_8x7b", "8x2", "prefill"),
    ("deepseek_v3", "8x4", "decode"),
    ("qwen3_30b_a3b", "8x1", "decode"),
]


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("case", CASES, ids=[f"{c[0]}-{c[1]}-{c[2]}" for c in CASES])
def test_every_point_of_an_engines_space_is_one_its_flags_express(case, engine):
    space, _ = problem(*case)
    modes = mode_spaces(space, engine)
    assert modes
    rng = np.random.default_rng(0)
    for mode, ms in modes:
        sampler = LegalSampler(ms)
        acts = sampler.sample(300, rng)
        assert sampler.legal(acts).all() and space.actions_legal(acts).all()
        for a in acts[:60]:
            s = space.decode(a)
            d = s.degrees
            assert strategy_mode(engine, space, s) is not None
            if engine == "vllm" or (engine == "trtllm" and mode.attention == "heads"):
                assert d.tp == 1 or d.ep == 1  # expert parallelism spans tp x dp ranks
            if engine != "vllm":
                assert d.sp == 1
            if engine == "sglang" and any(o.endswith(("ffn1", "shared_ffn1"))
                                          and "expert" not in o for o in space.op_slots):
                assert d.tp == 1 or d.ep == 1  # dense layers run at the whole tp
            pool = LaunchPool.of("mixed", s, space, 4096, 0.9)
            assert gpus_per_instance(engine, pool) * d.dp == space.mesh.gpus


@pytest.mark.parametrize("engine", ENGINES)
def test_the_engines_exact_search_is_the_best_of_its_space(engine):
    space, cm = problem("mixtral_8x7b", "8x1", "decode", engine=engine)
    found = search_engine("exact", space, engine, cost_model=cm)
    assert found.complete and found.result.best_action is not None
    # every point of every mode, evaluated: nothing beats the exact answer
    best = -np.inf
    for _mode, ms in mode_spaces(space, engine):
        sampler = LegalSampler(ms)
        acts = np.unique(sampler.sample(4000, np.random.default_rng(1)), axis=0)
        v, ok = cost_model_objective(cm, ms)(acts)
        best = max(best, float(np.max(np.where(ok, v, -np.inf))))
    assert found.result.best_value >= best - 1e-9
    # the RL agent in the engine's space stays in it (budget split over the modes)
    rl = search_engine("rl", space, engine, budget=300, seed=0, cost_model=cm)
    assert rl.result.best_value <= found.result.best_value + 1e-9
    assert strategy_mode(engine, space, space.decode(rl.result.best_action)) is not None


@needs_bash
@pytest.mark.parametrize("case", CASES, ids=[f"{c[0]}-{c[1]}-{c[2]}" for c in CASES])
def test_scripts_of_the_engines_best_parse_and_use_only_their_flags(case, tmp_path):
    for engine in ENGINES:
        space, cm = problem(*case, engine=engine)
        found = search_engine("exact", space, engine, cost_model=cm)
        s = space.decode(found.result.best_action)
        role = role_for_phase(case[2]) if case[2] != "decode" else "decode"
        pool = LaunchPool.of(role, s, space, 4096, 0.9)
        assert no_script_reason(engine, pool, space.mesh.gpus_per_node) is None
        text = script_for(engine, pool)
        path = tmp_path / f"{engine}.sh"
        path.write_text(text)
        assert subprocess.run([BASH, "-n", str(path)]).returncode == 0
        assert script_gpus(engine, text) == space.mesh.gpus
        table = engine_flag_table()[engine]
        known = set(table["flags"]) | set(table.get("multi_node", {}).get("flags", ()))
        assert set(flags_of(text)) <= known, set(flags_of(text)) - known
        assert table["checked_against"] in text
        if engine != "trtllm":
            assert (f"--disaggregation-mode {role}" in text if engine == "sglang"
                    else "--kv-transfer-config" in text)
        else:  # a context / generation server: its cache transceiver in the options YAML
            assert "cache_transceiver_config:" in text and "--extra_llm_api_options" in text
            if pool.strategy.degrees.replica_gpus > 8:  # TensorRT-LLM's multi-node launch
                assert "exec srun -N" in text and "trtllm-llmapi-launch trtllm-serve" in text
                assert f"--ntasks {pool.strategy.degrees.replica_gpus} " in text


def test_every_flag_engine_flags_can_write_is_in_the_checked_lists():
    space, _ = problem("deepseek_v3", "8x4", "decode")
    seen = {"vllm": set(), "sglang": set(), "trtllm": set()}
    rng = np.random.default_rng(2)
    for engine in seen:
        for _mode, ms in mode_spaces(space, engine):
            for a in LegalSampler(ms).sample(200, rng):
                s = space.decode(a)
                for role in ("mixed", "prefill", "decode"):
                    for fmt in ("bf16", "fp8"):
                        sched = {"max_batched_tokens": 4096, "prefill_budget_tokens": 4000}
                        pool = LaunchPool.of(role, s, space, 4096, 0.9, fmt, fmt,
                                             sched if role == "mixed" else None)
                        seen[engine] |= {f for f in engine_flags(engine, pool)
                                         if f.startswith("--")}
        assert seen[engine] <= set(engine_flag_table()[engine]["flags"])
    assert {"--data-parallel-size", "--enable-expert-parallel"} <= seen["vllm"]
    assert {"--enable-dp-attention", "--ep-size", "--moe-dense-tp-size"} <= seen["sglang"]
    assert "--max-num-batched-tokens" in seen["vllm"] and "--max_num_tokens" in seen["trtllm"]
    assert "--chunked-prefill-size" in seen["sglang"]


@needs_bash
def test_workers_sharing_a_node_each_get_their_gpus(tmp_path):
    space, cm = problem("mixtral_8x7b", "8x1", "decode", tp=2, pp=1, dp=4)
    s = space.decode(search_engine("exact", space, "vllm", cost_model=cm).result.best_action)
    assert s.degrees.replica_gpus == 2 and s.degrees.dp == 4
    text = script_for("vllm", LaunchPool.of("mixed", s, space, 4096, 0.9))
    stub = tmp_path / "bin"
    stub.mkdir()
    (stub / "vllm").write_text('#!/usr/bin/env bash\necho "$CUDA_VISIBLE_DEVICES" > "$OUT"\n')
    (stub / "vllm").chmod(0o755)
    path = tmp_path / "v.sh"
    path.write_text(text)
    got = []
    for w in range(4):
        env = dict(os.environ, PATH=f"{stub}{os.pathsep}{os.environ['PATH']}",
                   OUT=str(tmp_path / "dev"), SHARDC_MODEL="org/m")
        assert subprocess.run([BASH, str(path), str(w)], env=env).returncode == 0
        got.append((tmp_path / "dev").read_text().strip())
    assert got == ["0,1", "2,3", "4,5", "6,7"]


def test_model_ids_are_hub_ids_or_paths_never_flags(tmp_path):
    for ok in ("zai-org/GLM-4.5-Air", "gpt2", "/models/llama 3", "./local", "~/m"):
        assert check_model_id(ok) == ok
    for bad in ("--trust-remote-code", "-rf", "", "a\nb", "x\u202e", "a b", "org/a/b/c",
                "\ud800", 5, None):
        with pytest.raises(InputError):
            check_model_id(bad)
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps({"_name_or_path": "--trust-remote-code"}))
    assert config_model_id(str(cfg)) is None
    cfg.write_text(json.dumps({"_name_or_path": "org/name"}))
    assert config_model_id(str(cfg)) == "org/name"


@needs_bash
def test_a_hostile_model_id_stays_one_argument_and_a_flag_like_one_is_refused(tmp_path):
    hostile = "/m/x'; touch PWNED; echo \"$(touch PWNED2)\" `touch PWNED3` \\ #"
    assert check_model_id(hostile) == hostile  # a path: any printable text, quoted
    space, cm = problem("llama3_70b", "8x1", "decode")
    s = space.decode(search_engine("exact", space, "vllm", cost_model=cm).result.best_action)
    stub = tmp_path / "bin"
    stub.mkdir()
    for exe in ("vllm", "python", "trtllm-serve"):  # record the argv, start no engine
        (stub / exe).write_text('#!/usr/bin/env bash\nprintf "%s\\n" "$@" > "$ARGV_OUT"\n')
        (stub / exe).chmod(0o755)
    for engine, flag in (("vllm", "--model="), ("sglang", "--model-path="), ("trtllm", "")):
        text = script_for(engine, LaunchPool.of("mixed", s, space, 4096, 0.9), hostile)
        path = tmp_path / f"{engine}.sh"
        path.write_text(text)
        env = dict(os.environ, PATH=f"{stub}{os.pathsep}{os.environ['PATH']}",
                   ARGV_OUT=str(tmp_path / "argv"))
        env.pop("SHARDC_MODEL", None)
        r = subprocess.run([BASH, str(path), "0"], cwd=tmp_path, env=env, capture_output=True,
                           text=True)
        assert r.returncode == 0, r.stderr
        argv = (tmp_path / "argv").read_text().split("\n")
        assert flag + hostile in argv
        if engine == "trtllm":  # a positional after "--": never read as an option
            assert argv[argv.index(hostile) - 1] == "--"
        assert not list(tmp_path.glob("PWNED*"))
        for bad_env in ({"SHARDC_MODEL": "--trust-remote-code"}, ):
            r = subprocess.run([BASH, str(path), "0"], cwd=tmp_path, env={**env, **bad_env},
                               capture_output=True, text=True)
            assert r.returncode == 2 and "must not start with -" in r.stderr
        bad = subprocess.run([BASH, str(path), "1; touch PWNED"], cwd=tmp_path, env=env,
                             capture_output=True, text=True)
        assert bad.returncode == 2 and "worker index" in bad.stderr
        assert not list(tmp_path.glob("PWNED*"))
    # no id recorded: the script refuses to start until SHARDC_MODEL is set
    text = script_for("vllm", LaunchPool.of("mixed", s, space, 4096, 0.9), None)
    path = tmp_path / "none.sh"
    path.write_text(text)
    r = subprocess.run([BASH, str(path)], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert r.returncode == 2 and "no model id" in r.stderr


def test_pool_values_are_validated_before_any_script():
    space, cm = problem("llama3_70b", "8x1", "decode")
    s = space.decode(search_engine("exact", space, "vllm", cost_model=cm).result.best_action)
    ok = dict(role="mixed", strategy=s, max_model_len=4096, mem_fraction=0.9)
    for bad in (dict(role="both"), dict(mem_fraction=float("nan")), dict(mem_fraction=1.5),
                dict(max_model_len=0), dict(kv_cache="int4")):
        with pytest.raises(InputError):
            LaunchPool(**{**ok, **bad})
    assert role_for_phase("decode") == "mixed" and role_for_phase("prefill") == "prefill"


def test_an_engine_space_keeps_fixed_degrees_and_says_when_it_has_none():
    # sp fixed on: SGLang and TensorRT-LLM have no sequence parallelism
    space, _ = problem("llama3_70b", "8x1", "decode", tp=8, sp=8)
    assert mode_spaces(space, "vllm") and not mode_spaces(space, "sglang")
    assert not mode_spaces(space, "trtllm")
    # vLLM has no tp x ep split of the experts
    space, _ = problem("mixtral_8x7b", "8x1", "decode", tp=2, ep=4)
    assert not mode_spaces(space, "vllm") and mode_spaces(space, "sglang")


def test_the_refresh_tool_reads_flags_from_argument_definitions(tmp_path):
    sys.path.insert(0, os.path.join(ROOT, "tools"))
    try:
        import refresh_engine_flags as tool
    finally:
        sys.path.pop(0)
    src = ('def f(parser, g):\n    parser.add_argument("--tp-size", "--tensor-parallel-size", '
           'type=int)\n    g.add_argument("-x", "--only", action="store_true")\n'
           'class FrontendArgs:\n    port: int = 8000\n    ssl_keyfile: str = ""\n')
    assert tool.add_argument_flags(src) == {"--tp-size", "--tensor-parallel-size", "--only"}
    assert tool.dataclass_field_flags(src, "FrontendArgs") == {"--port", "--ssl-keyfile"}
    click_src = ('@click.command("serve")\n@click.argument("model")\n'
                 '@click.option("--tp_size", type=int)\ndef serve(model, tp_size): pass\n')
    assert tool.click_option_flags(click_src) == {"--tp_size"}


def run_cli(*args):
    return subprocess.run([sys.executable, "-m", "shardc.cli", *args], capture_output=True,
                          text=True, cwd=ROOT)


@needs_bash
def test_compile_writes_each_engines_best_and_no_script_where_it_has_none(tmp_path):
    from shardc.plan import load_plan

    out = tmp_path / "o"
    r = run_cli("compile", "examples/tiny_llama.py", "--mesh", "4x1", "--degrees", "tp=4,sp=on",
                "--search", "exact", "--quiet", "--out", str(out), "--hf-id", "org/tiny")
    assert r.returncode == 0, r.stderr
    plan = load_plan(out / "plan.json")  # schema-checked
    assert plan.model["hf_id"] == "org/tiny"
    v, sg = plan.launch["vllm"], plan.launch["sglang"]
    assert v["pools"] and v["pools"][0]["degrees"]["sp"] == 4 and v["reason"] is None
    assert not sg["pools"] and "no configuration" in sg["reason"]
    assert not plan.launch["trtllm"]["pools"]
    assert sorted(p.name for p in (out / "launch").iterdir()) == ["vllm_mixed.sh"]
    assert "vLLM can run:" in r.stdout and "SGLang: no launch configuration" in r.stdout
    text = (out / "launch" / "vllm_mixed.sh").read_text()
    assert "DEFAULT_MODEL=org/tiny" in text and "--compilation-config" in text
    assert subprocess.run([BASH, "-n", str(out / "launch" / "vllm_mixed.sh")]).returncode == 0


def test_runtime_flags_are_checked():
    r = run_cli("compile", "examples/tiny_llama.py", "--mesh", "4x1", "--runtime", "vllm",
                "--engine", "sglang")
    assert r.returncode == 2 and "--runtime vllm" in r.stderr
    r = run_cli("compile", "examples/tiny_llama.py", "--mesh", "4x1", "--hf-id=-rf")
    assert r.returncode == 2 and "must not start with '-'" in r.stderr
    r = run_cli("simulate", "examples/tiny_mixtral.py", "--mesh", "8x1", "--degrees",
                "tp=2,ep=4", "--runtime", "vllm")
    assert r.returncode == 2 and "vLLM cannot run tp=2 ep=4" in r.stderr


def test_compile_with_an_engine_runtime_plans_in_its_space(tmp_path):
    from shardc.plan import load_plan

    out = tmp_path / "o"
    r = run_cli("compile", "examples/tiny_mixtral.py", "--mesh", "8x1", "--runtime", "vllm",
                "--search", "exact", "--quiet", "--out", str(out))
    assert r.returncode == 0, r.stderr
    plan = load_plan(out / "plan.json")
    assert plan.search["runtime"] == "vllm" and "exact_tok_s_per_gpu" in plan.search
    assert plan.predicted["kernel_source"].startswith(("silicon:vllm", "roofline"))
    d = plan.degrees
    assert d["tp"] == 1 or d["ep"] == 1
    v = plan.launch["vllm"]
    assert v["same_as_plan"] and v["gap_vs_plan"] == 0.0
    assert v["pools"][0]["degrees"] == {k: d[k] for k in v["pools"][0]["degrees"]}
    assert "vLLM can run:" in r.stdout and "the plan itself" in r.stdout
    # simulate with the runtime prices the engine's own layout at the given degrees
    r = run_cli("simulate", "examples/tiny_mixtral.py", "--mesh", "8x1", "--degrees",
                f"tp={d['tp']},ep={d['ep']},pp={d['pp']}", "--batch", str(plan.workload["batch"]),
                "--runtime", "vllm", "--json", str(tmp_path / "s.json"))
    assert r.returncode == 0, r.stderr
    sim = json.loads((tmp_path / "s.json").read_text())
    assert sim["predicted"]["tok_s_per_gpu"] == pytest.approx(plan.predicted["tok_s_per_gpu"])


def test_the_api_checks_the_runtime():
    import shardc

    for bad in ("tgi", ["vllm"], None):
        with pytest.raises(InputError):
            shardc.compile("examples/tiny_llama.py", mesh="4x1", runtime=bad)



@needs_bash
def test_tensorrt_llm_attention_dp_goes_through_its_llm_api_options(tmp_path):
    space, cm = problem("mixtral_8x7b", "8x1", "decode", tp=1, ep=8)
    s = space.decode(search_engine("exact", space, "trtllm", cost_model=cm).result.best_action)
    pool = LaunchPool.of("mixed", s, space, 4096, 0.9)
    entry = pool_entry("trtllm", pool, "launch/trtllm_mixed.sh")
    assert entry["llm_api_options"] == {"enable_attention_dp": True}
    f = entry["flags"]
    assert f[f.index("--tp_size") + 1] == "8" and f[f.index("--ep_size") + 1] == "8"
    assert f[f.index("--max_batch_size") + 1] == str(s.batch // 8)  # per attention-DP rank
    text = render_script("trtllm", entry, {}, "org/m", 8)
    stub = tmp_path / "bin"
    stub.mkdir()
    (stub / "trtllm-serve").write_text(
        '#!/usr/bin/env bash\nwhile [ "$#" -gt 0 ]; do if [ "$1" = --extra_llm_api_options ]; '
        'then cat "$2" > "$OUT"; fi; shift; done\n')
    (stub / "trtllm-serve").chmod(0o755)
    path = tmp_path / "t.sh"
    path.write_text(text)
    env = dict(os.environ, PATH=f"{stub}{os.pathsep}{os.environ['PATH']}",
               OUT=str(tmp_path / "yaml"))
    assert subprocess.run([BASH, str(path), "0"], env=env).returncode == 0
    assert (tmp_path / "yaml").read_text() == "enable_attention_dp: true\n"
