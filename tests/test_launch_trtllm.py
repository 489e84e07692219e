"""TensorRT-LLM launch scripts for every pool (issue 21; shardc/backends/launch_trtllm.py,
docs/deploy.md): disaggregated pools as context / generation servers plus the
``trtllm-serve disaggregated`` orchestrator and its config YAML, FP8 (the KV-cache dtype in
the LLM API options; FP8 weights from a pre-quantized checkpoint only) and workers spanning
nodes (``srun ... trtllm-llmapi-launch``). Each script passes ``bash -n``, every flag it
writes is in ``engine_flags.json``, and run against stub commands it passes what TensorRT-LLM
documents. Before: these pools got no TensorRT-LLM script at all."""

import os
import re
import shutil
import subprocess
import sys

import pytest
from test_launch import flags_of, problem

from shardc.backends.launch import (
    LaunchPool,
    engine_flag_table,
    launch_scripts,
    pool_entry,
    render_script,
)
from shardc.backends.launch_trtllm import option_paths
from shardc.search.engine_search import search_engine

BASH = shutil.which("bash")
pytestmark = pytest.mark.skipif(BASH is None, reason="needs bash")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TABLE = engine_flag_table()["trtllm"]
KNOWN = set(TABLE["flags"]) | set(TABLE["multi_node"]["flags"])


def _best(model, mesh, **fixed):
    space, cm = problem(model, mesh, "decode", engine="trtllm", **fixed)
    return space, space.decode(search_engine("exact", space, "trtllm",
                                             cost_model=cm).result.best_action)


def _stub(tmp_path, name: str, body: str) -> dict:
    stub = tmp_path / "bin"
    stub.mkdir(exist_ok=True)
    (stub / name).write_text("#!/usr/bin/env bash\n" + body)
    (stub / name).chmod(0o755)
    return dict(os.environ, PATH=f"{stub}{os.pathsep}{os.environ['PATH']}",
                OUT=str(tmp_path / "out"))


# a stub trtllm-serve that records its argv and the YAML files it is given
RECORD = ('printf "%s\\n" "$@" > "$OUT.argv"\nwhile [ "$#" -gt 0 ]; do\n'
          '  case "$1" in --extra_llm_api_options|--config_file) cat "$2" > "$OUT.yaml";; esac\n'
          '  shift\ndone\n')


def _run(text, tmp_path, env, *args):
    path = tmp_path / "s.sh"
    path.write_text(text)
    assert subprocess.run([BASH, "-n", str(path)]).returncode == 0
    return subprocess.run([BASH, str(path), *args], env=env, capture_output=True, text=True)


def test_disaggregated_pools_get_servers_and_the_orchestrator(tmp_path):
    space, s = _best("llama3_70b", "8x2", tp=4, pp=1)
    assert s.degrees.replica_gpus == 4
    entries = {}
    for role, workers in (("prefill", 2), ("decode", 1)):
        from dataclasses import replace

        pool = LaunchPool.of(role, replace(s, degrees=replace(s.degrees, dp=workers)), space,
                             5000, 0.9)
        entries[role] = pool_entry("trtllm", pool, f"launch/trtllm_{role}.sh")
        assert set(option_paths(entries[role]["llm_api_options"])) <= set(
            TABLE["llm_api_options"])
    env = _stub(tmp_path, "trtllm-serve", RECORD)
    # the context server: port 8100 + w, reachable, its transceiver, no overlap scheduler
    text = render_script("trtllm", entries["prefill"], {}, "org/m", 8)
    assert set(flags_of(text)) <= KNOWN
    r = _run(text, tmp_path, env, "1")
    assert r.returncode == 0, r.stderr
    argv = (tmp_path / "out.argv").read_text().split("\n")
    assert argv[:1] == ["serve"] and argv[argv.index("--port") + 1] == "8101"
    assert argv[argv.index("--host") + 1] == "0.0.0.0" and argv[-3:-1] == ["--", "org/m"]
    assert (tmp_path / "out.yaml").read_text() == (
        "cache_transceiver_config:\n  backend: DEFAULT\n  max_tokens_in_buffer: 5000\n"
        "disable_overlap_scheduler: true\n")
    text = render_script("trtllm", entries["decode"], {}, "org/m", 8)
    assert _run(text, tmp_path, env, "0").returncode == 0
    argv = (tmp_path / "out.argv").read_text().split("\n")
    assert argv[argv.index("--port") + 1] == "8200"
    assert "disable_overlap_scheduler" not in (tmp_path / "out.yaml").read_text()
    # the orchestrator: every server's host:port in TensorRT-LLM's disagg config
    launch = {"trtllm": {"pools": [dict(e, script=f"launch/trtllm_{r}.sh")
                                   for r, e in entries.items()]}}
    files = launch_scripts(launch, "org/m", 8)
    assert sorted(files) == ["launch/trtllm_decode.sh", "launch/trtllm_disagg.sh",
                             "launch/trtllm_prefill.sh"]
    router = files["launch/trtllm_disagg.sh"].text
    assert set(flags_of(router)) <= KNOWN and TABLE["checked_against"] in router
    env["PREFILL_HOSTS"], env["DECODE_HOSTS"] = "node-a node-b", "node-c"
    r = _run(router, tmp_path, env)
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "out.argv").read_text().split("\n")[:2] == ["disaggregated",
                                                                   "--config_file"]
    assert (tmp_path / "out.yaml").read_text() == (
        "hostname: 0.0.0.0\nport: 8000\nbackend: pytorch\n"
        'context_servers:\n  num_instances: 2\n  urls:\n    - "node-a:8100"\n'
        '    - "node-b:8101"\n'
        'generation_servers:\n  num_instances: 1\n  urls:\n    - "node-c:8200"\n')
    for bad in ("node-a", "node-a $(touch PWNED)", "-x node-b", "*"):  # too few, or not hosts
        env["PREFILL_HOSTS"] = bad
        r = _run(router, tmp_path, env)
        assert r.returncode == 2 and r.stderr.strip(), bad
    assert not (tmp_path / "PWNED").exists()


def test_fp8_kv_cache_and_weights(tmp_path):
    space, s = _best("llama3_70b", "8x1", tp=8, pp=1)
    pool = LaunchPool.of("mixed", s, space, 4096, 0.9, "fp8", "fp8")
    entry = pool_entry("trtllm", pool, "launch/trtllm_mixed.sh")
    assert entry["llm_api_options"] == {"kv_cache_config": {"dtype": "fp8"}}
    assert entry["checkpoint"].startswith("fp8 (pre-quantized")
    text = render_script("trtllm", entry, {}, None, 8)
    assert set(flags_of(text)) <= KNOWN
    env = _stub(tmp_path, "trtllm-serve", RECORD)
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "config.json").write_text("{}")
    env["SHARDC_MODEL"] = str(ckpt)  # a BF16 folder: refused before the engine starts
    r = _run(text, tmp_path, env, "0")
    assert r.returncode == 2 and "not a pre-quantized FP8 checkpoint" in r.stderr
    assert not (tmp_path / "out.argv").exists()
    (ckpt / "hf_quant_config.json").write_text('{"quantization": {"quant_algo": "FP8"}}')
    r = _run(text, tmp_path, env, "0")
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "out.yaml").read_text() == "kv_cache_config:\n  dtype: fp8\n"
    env["SHARDC_MODEL"] = "nvidia/Llama-3.1-70B-Instruct-FP8"  # a hub id: passed as given
    assert _run(text, tmp_path, env, "0").returncode == 0


def test_a_worker_spanning_nodes_runs_under_srun_and_trtllm_llmapi_launch(tmp_path):
    space, s = _best("llama3_70b", "8x2", tp=8, pp=2)
    assert s.degrees.replica_gpus == 16
    entry = pool_entry("trtllm", LaunchPool.of("mixed", s, space, 4096, 0.9),
                       "launch/trtllm_mixed.sh")
    text = render_script("trtllm", entry, {}, "org/m", 8)
    assert set(flags_of(text)) <= KNOWN
    env = _stub(tmp_path, "srun", 'printf "%s\\n" "$@" > "$OUT.argv"\n')
    r = _run(text, tmp_path, env, "0")
    assert r.returncode == 0, r.stderr
    argv = (tmp_path / "out.argv").read_text().split("\n")
    assert argv[:9] == ["-N", "2", "--ntasks", "16", "--ntasks-per-node=8", "--mpi=pmix",
                        "trtllm-llmapi-launch", "trtllm-serve", "serve"]
    assert argv[argv.index("--tp_size") + 1] == "8" and argv[argv.index("--pp_size") + 1] == "2"
    assert argv[argv.index("--host") + 1] == "0.0.0.0"
    assert "CUDA_VISIBLE_DEVICES" not in text


def test_compile_writes_tensorrt_llm_scripts_for_a_disaggregated_fp8_plan(tmp_path):
    from shardc.plan import load_plan

    out = tmp_path / "o"
    r = subprocess.run([sys.executable, "-m", "shardc.cli", "compile", "examples/tiny_llama.py",
                        "--mesh", "4x1", "--phase", "serve", "--mode", "disagg", "--degrees",
                        "tp=2", "--kv-cache", "fp8", "--weights", "fp8", "--search", "megatron",
                        "--budget", "20", "--quiet", "--out", str(out), "--hf-id", "org/tiny"],
                       capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    trt = load_plan(out / "plan.json").launch["trtllm"]
    assert [p["role"] for p in trt["pools"]] == ["prefill", "decode"] and "note" not in trt
    names = sorted(p.name for p in (out / "launch").iterdir() if p.name.startswith("trtllm"))
    assert names == ["trtllm_decode.sh", "trtllm_disagg.sh", "trtllm_prefill.sh"]
    for name in names:
        text = (out / "launch" / name).read_text()
        assert subprocess.run([BASH, "-n", str(out / "launch" / name)]).returncode == 0
        assert set(flags_of(text)) <= KNOWN
        assert name == "trtllm_disagg.sh" or re.search(r"dtype: fp8", text)
