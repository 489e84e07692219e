"""Quantisation as workload inputs: ``--weights bf16|fp8`` and ``--kv-cache bf16|fp8``
(Workload fields; compile, simulate, bench and the API; plan.json workload keys)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from cost_graphs import fixture_graph

import shardc
from shardc.cli import main
from shardc.cost import CostModel
from shardc.cost.capacity import weight_and_kv_bytes
from shardc.errors import InputError
from shardc.ir.space import StrategySpace, megatron_op_choices
from shardc.ir.strategy import Degrees, Mesh, Strategy, Workload

ROOT = Path(__file__).resolve().parents[1]
LLAMA = str(ROOT / "examples" / "tiny_llama.py")


def _simulate(phase: str, **formats):
    graph = fixture_graph("llama3_70b")
    mesh = Mesh(8, 1)
    wl = Workload(phase=phase, batch=8, context=2048, prompt=2048, tpot_slo_ms=1e9,
                  ttft_slo_ms=1e9, **formats)
    space = StrategySpace(graph, mesh, wl)
    tp_idx = space.values["tp"].index(8)
    ch = dict(zip(space.op_slots, (int(c) for c in megatron_op_choices(space, tp_idx))))
    cm = CostModel(graph, mesh, "h100", wl)
    return cm, cm.simulate(Strategy(Degrees(tp=8), 8, ch))


def _op(ex, op: str) -> dict:
    return next(r for r in ex.ops if r["op"] == op)


def test_defaults_stay_bf16():
    wl = Workload()
    assert (wl.weights, wl.kv_cache) == ("bf16", "bf16")
    cm, _ = _simulate("decode")
    assert (cm.weight_bytes, cm.kv_bytes, cm.fp8_gemm) == (2.0, 2.0, False)


def test_fp8_weights_halve_weight_bytes_and_double_the_gemm_peak():
    bf, ex_bf = _simulate("prefill")
    f8, ex_f8 = _simulate("prefill", weights="fp8")
    assert (f8.weight_bytes, f8.fp8_gemm, f8.kv_bytes) == (1.0, True, 2.0)
    peaks = f8.hw.peak_flops(True) / f8.hw.peak_flops(False)  # H100: 1978.9 / 989.4
    assert peaks == pytest.approx(2.0, rel=1e-3)
    for op in ("qkv", "out_proj", "ffn1", "ffn2"):
        assert _op(ex_f8, op)["weight_bytes"] == pytest.approx(_op(ex_bf, op)["weight_bytes"] / 2)
        # the same GEMM FLOPs at the FP8 peak
        assert _op(ex_f8, op)["compute_ms"] == pytest.approx(_op(ex_bf, op)["compute_ms"] / peaks)
    assert ex_f8.predicted["ttft_ms"] < ex_bf.predicted["ttft_ms"]
    graph = fixture_graph("llama3_70b")
    w_bf, kv_bf = weight_and_kv_bytes(graph, Workload())
    w_f8, kv_f8 = weight_and_kv_bytes(graph, Workload(weights="fp8"))
    assert (w_f8, kv_f8) == (w_bf / 2, kv_bf)


def test_fp8_kv_cache_halves_the_cache_not_the_weights():
    _, ex_bf = _simulate("decode")
    cm, ex_f8 = _simulate("decode", kv_cache="fp8")
    assert (cm.kv_bytes, cm.weight_bytes, cm.fp8_gemm) == (1.0, 2.0, False)
    core_bf, core_f8 = _op(ex_bf, "attn_core"), _op(ex_f8, "attn_core")
    assert core_f8["kv_bytes"] == pytest.approx(core_bf["kv_bytes"] / 2)
    assert core_f8["memory_ms"] < core_bf["memory_ms"]
    assert _op(ex_f8, "qkv")["weight_bytes"] == _op(ex_bf, "qkv")["weight_bytes"]


def test_plan_json_records_the_formats_and_loads_them(tmp_path):
    out = tmp_path / "sim.json"
    assert main(["simulate", LLAMA, "--mesh", "4x1", "--degrees", "tp=4", "--batch", "4",
                 "--weights", "fp8", "--kv-cache", "fp8", "--json", str(out)]) == 0
    wl = json.loads(out.read_text())["workload"]
    assert (wl["weights"], wl["kv_cache"]) == ("fp8", "fp8")

    from shardc.frontends import load_graph
    from shardc.ir.strategy import strategy_from_names
    from shardc.plan import build_plan

    graph = load_graph(LLAMA, tiny=True)
    strategy = strategy_from_names({"tp": 4}, {}, 4)
    plan = build_plan(graph, strategy, Mesh(4, 1), "h100",
                      Workload(batch=4, weights="fp8", kv_cache="bf16"))
    path = tmp_path / "plan.json"
    plan.save(str(path))
    doc = json.loads(path.read_text())
    assert (doc["workload"]["weights"], doc["workload"]["kv_cache"]) == ("fp8", "bf16")
    assert shardc.load_plan(str(path)).workload["weights"] == "fp8"
    doc["workload"]["weights"] = "int4"
    path.write_text(json.dumps(doc))
    with pytest.raises(InputError, match="int4"):
        shardc.load_plan(str(path))


def test_compile_records_weights_in_plan_json(tmp_path):
    out = tmp_path / "o"
    assert main(["compile", LLAMA, "--mesh", "2x1", "--weights", "fp8", "--search", "megatron",
                 "--budget", "50", "--quiet", "--out", str(out)]) == 0
    wl = json.loads((out / "plan.json").read_text())["workload"]
    assert (wl["weights"], wl["kv_cache"]) == ("fp8", "bf16")


@pytest.mark.parametrize("argv", [
    ["compile", LLAMA, "--mesh", "2x1", "--weights", "int4"],
    ["simulate", LLAMA, "--mesh", "2x1", "--degrees", "tp=2", "--kv-cache", "fp16"],
    ["bench", "--suite", "paper", "--weights", "fp4"],
])
def test_bad_format_is_exit_2_in_one_line(argv, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as stop:  # argparse's own refusal (shardc.cli._Parser)
        main(argv)
    assert stop.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("shardc: error: argument --")
    assert "invalid choice" in err[0] and "bf16" in err[0] and "fp8" in err[0]
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize("field,flag", [("weights", "--weights"), ("kv_cache", "--kv-cache")])
def test_api_workload_refuses_bad_formats(field, flag):
    with pytest.raises(InputError, match=f"^{flag} 'int8': expected bf16 or fp8$"):
        Workload(**{field: "int8"})
