"""`--kernels silicon`: measured kernel tables, interpolation, fallbacks, physics floors."""

import dataclasses
import json

import numpy as np
import pytest
from cost_graphs import fixture_graph

import shardc.api
from shardc.cli import main
from shardc.cost import CostModel, load_hardware, silicon_tables
from shardc.cost.collectives import ALL_REDUCE
from shardc.cost.roofline import compute_time, gemm_flop_efficiency
from shardc.cost.silicon import EXTRAPOLATED, MEASURED, kernels_for
from shardc.cost.topology import comm_group
from shardc.ir.space import StrategySpace, megatron_op_choices
from shardc.ir.strategy import Degrees, Mesh, Strategy, Workload

NO_SLO = dict(tpot_slo_ms=1e9, ttft_slo_ms=1e9)


@pytest.fixture(scope="module")
def h100():
    k, source, reason = kernels_for(load_hardware("h100"), "silicon", "vllm")
    assert k is not None, reason
    assert source == "silicon:vllm-0.24.0:h100_sxm"
    return k


def _random_actions(space, n, seed):
    rng = np.random.default_rng(seed)
    return np.stack([rng.integers(0, k, size=n) for k in space.nvec], axis=1)


def test_gemm_exact_on_grid_points_and_monotone_between(h100):
    t = h100.t
    ms, ns, ks = t["gemm_m"], t["gemm_n"], t["gemm_k"]
    for i, j, q in [(0, 5, 7), (30, 16, 16), (len(ms) - 1, 10, 3), (50, 21, 21)]:
        got, status = h100.gemm(np.array([ms[i]]), ns[j], ks[q], fp8=False)
        assert got[0] == pytest.approx(t["gemm_bf16"][i, j, q], rel=1e-12)
        assert status[0] == MEASURED
    # between two grid m values the time lies between the neighbours' and moves one way
    j, q = 16, 16
    for i in (10, 40, 60):
        m = np.exp(np.linspace(np.log(ms[i]), np.log(ms[i + 1]), 9))
        got, _ = h100.gemm(m, ns[j], ks[q], fp8=False)
        lo, hi = sorted((t["gemm_bf16"][i, j, q], t["gemm_bf16"][i + 1, j, q]))
        assert (got >= lo - 1e-15).all() and (got <= hi + 1e-15).all()
        d = np.diff(got)
        assert (d >= -1e-15).all() or (d <= 1e-15).all()
    # and along n (log-space bilinear): monotone between two grid n at a grid m
    n = np.exp(np.linspace(np.log(ns[12]), np.log(ns[13]), 7))
    got, _ = h100.gemm(np.full(7, ms[40]), n, np.full(7, ks[q]), fp8=False)
    assert (np.diff(got) >= -1e-15).all()


def test_moe_and_collective_exact_on_grid_points(h100):
    t = h100.t
    key = t["moe_bf16_keys"][0]
    hidden, inter, topk, experts, mtp, mep = (int(x) for x in key)
    tok = t["moe_tokens"]
    got, status = h100.moe(tok, hidden, inter, topk, experts, np.full(len(tok), mtp),
                           np.full(len(tok), mep), fp8=False)
    assert np.allclose(got, t["moe_bf16"][0], rtol=1e-12) and (status == MEASURED).all()
    row = int(np.flatnonzero((t["nccl_keys"][:, 0] == 0) & (t["nccl_keys"][:, 1] == 8))[0])
    sizes = t["nccl_bytes"]
    group = comm_group(np.full(len(sizes), 8), 1, 8)
    got, status = h100.collective(np.full(len(sizes), 1), sizes, group, cuda_graph=True)
    assert np.allclose(got, t["nccl"][row], rtol=1e-12) and (status == MEASURED).all()


def test_tables_are_monotone_in_size(h100):
    """The cleaned grids never get faster with more work along their size axis."""
    t = h100.t
    assert (np.diff(t["gemm_bf16"], axis=0) >= 0).all()
    assert (np.diff(t["moe_bf16"], axis=1) >= 0).all()
    assert (np.diff(t["gen_attn"], axis=1) >= 0).all() and (np.diff(t["gen_attn"], axis=2) >= 0).all()


def test_large_gemm_agrees_with_roofline_within_a_sane_factor(h100):
    hw = h100.hw
    m, n, k = 8192.0, 8192.0, 8192.0
    got, status = h100.gemm(np.array([m]), n, k, fp8=False)
    roof = compute_time(2 * m * n * k, gemm_flop_efficiency(m, n * k, hw), hw.peak_flops())
    assert status[0] == MEASURED
    assert 0.67 < got[0] / roof < 1.5
    # and never faster than the datasheet peak
    assert got[0] >= 2 * m * n * k / hw.peak_flops()


def test_shape_outside_the_tables_uses_roofline_and_is_logged():
    """GPT-MoE's experts (hidden 12288) have no measured MoE row: the roofline prices them,
    the op row says so and plan-level fallbacks name the op, its shape and why."""
    g, mesh = fixture_graph("gpt_moe_1p2t"), Mesh(8, 16)
    wl = Workload(context=4096, **NO_SLO)
    space = StrategySpace(g, mesh, Workload(**{**wl.__dict__, "batch": 64}))
    ch = dict(zip(space.op_slots, (int(c) for c in megatron_op_choices(space, 3))))
    st = Strategy(Degrees(tp=8, ep=16, pp=1, dp=1), 64, ch)
    sil = CostModel(g, mesh, "h100", wl, kernels="silicon").simulate(st)
    roof = CostModel(g, mesh, "h100", wl, kernels="roofline").simulate(st)
    rows = {(r["layer_kind"], r["op"]): r for r in sil.ops}
    rrows = {(r["layer_kind"], r["op"]): r for r in roof.ops}
    e1 = rows[("moe_block", "expert_ffn1")]
    assert e1["kernel_source"] == "roofline"
    assert e1["time_ms"] == pytest.approx(rrows[("moe_block", "expert_ffn1")]["time_ms"])
    assert rows[("moe_block", "qkv")]["kernel_source"].startswith("silicon")
    fb = [f for f in sil.predicted["kernel_fallbacks"] if f["op"] == "expert_ffn1"]
    assert fb and "hidden=12288" in fb[0]["shape"] and "no measured" in fb[0]["reason"]
    assert sil.predicted["kernel_source"] == "silicon:vllm-0.24.0:h100_sxm"
    assert roof.predicted["kernel_source"] == "roofline"
    assert roof.predicted["kernel_fallbacks"] == []


def test_beyond_the_grid_is_extrapolated_and_logged(h100):
    t = h100.t
    big = t["gemm_m"][-1] * 4
    got, status = h100.gemm(np.array([big]), 8192.0, 8192.0, fp8=False)
    edge, _ = h100.gemm(np.array([t["gemm_m"][-1]]), 8192.0, 8192.0, fp8=False)
    assert status[0] == EXTRAPOLATED and got[0] == pytest.approx(4 * edge[0])
    # a collective across nodes has no measured row
    group = comm_group(np.array([16]), 1, 8)
    _, status = h100.collective(np.array([ALL_REDUCE]), np.array([1e6]), group, True)
    assert status[0] == 2


def test_user_hardware_is_priced_by_the_roofline(tmp_path):
    f = tmp_path / "my.toml"
    f.write_text('base = "h100"\nhbm_tb_s = 4.0\n')
    g, mesh = fixture_graph("llama3_70b"), Mesh(8, 1)
    cm = CostModel(g, mesh, str(f), Workload(), kernels="silicon")
    assert cm.kernels is None and cm.kernel_source == "roofline"
    assert "differs from the h100 preset" in cm.kernel_reason
    # a preset changed in memory is not the measured GPU either
    k, source, _ = kernels_for(dataclasses.replace(load_hardware("h100"), hbm_tb_s=9.0))
    assert k is None and source == "roofline"
    k, source, reason = kernels_for(dataclasses.replace(load_hardware("h100"), name="mi300"))
    assert k is None and source == "roofline" and "not a measured preset" in reason


@pytest.mark.parametrize("name", ["llama3_70b", "mixtral_8x7b"])
def test_physics_floors_hold_on_10k_sampled_strategies(name):
    """Decode: TPOT >= (weights + KV cache read per GPU) / HBM peak; prefill: TTFT >= the
    linear-layer FLOPs per GPU / bf16 peak -- on 10k random strategies each."""
    g, mesh = fixture_graph(name), Mesh(8, 2)
    dense = name == "llama3_70b"
    for phase in ("decode", "prefill") if dense else ("prefill",):
        wl = Workload(phase=phase, context=4096, prompt=1024, **NO_SLO)
        space = StrategySpace(g, mesh, wl)
        cm = CostModel(g, mesh, "h100", wl, kernels="silicon")
        acts = _random_actions(space, 10_000, seed=1)
        r = cm._simulate(acts, space)
        ok = r["ev"].reason <= 4  # priced (legal degrees, choices and batch)
        assert ok.sum() > 1000
        deg = r["deg"]
        if phase == "decode":
            # every stage reads its weights and its sequences' KV cache once per step; the
            # embedding table is resident but only gathered from
            emb = r["glob"]["embedding"][4].weight_bytes
            stage_m = r["stage_m"].copy()
            stage_m[:, 0] -= emb
            floor_s = stage_m.max(axis=1) / cm.hw.hbm_bytes_s
            t = r["ev"].tpot_ms / 1e3
        else:
            per_token = sum(k.count * sum(float(o.flops_per_token or 0) for o in k.ops
                                          if o.name != "attn_core") for k in g.layer_kinds)
            gpus = deg["tp"] * deg["ep"] * deg["pp"]
            floor_s = deg["batch"] * wl.prompt * per_token / gpus / cm.hw.peak_flops()
            t = r["ev"].ttft_ms / 1e3
        assert (t[ok] >= floor_s[ok] * (1 - 1e-9)).all(), (phase, (t / floor_s)[ok].min())


def test_npz_cache_is_used_on_the_second_load(tmp_path, monkeypatch):
    monkeypatch.setenv("SHARDC_CACHE_DIR", str(tmp_path))
    first = silicon_tables.load_tables("h200", "sglang")
    assert list((tmp_path / "kernels").glob("h200_sxm-sglang-*.npz"))

    def no_parquet(*a, **k):
        raise AssertionError("parquet read although the npz cache holds the tables")

    monkeypatch.setattr(silicon_tables, "build_tables", no_parquet)
    again = silicon_tables.load_tables("h200", "sglang")
    assert set(again) == set(first)
    assert all(np.array_equal(again[k], first[k]) for k in first)


def test_cli_kernels_and_engine_flags(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(shardc.api, "load_model_graph", lambda model, *a, **k: fixture_graph(model))
    out = tmp_path / "sim.json"
    base = ["simulate", "llama3_70b", "--mesh", "8x1", "--degrees", "tp=8", "--batch", "8",
            "--json", str(out)]
    assert main(base + ["--engine", "trtllm"]) == 0
    p = json.loads(out.read_text())["predicted"]
    assert p["kernel_source"].startswith("silicon:trtllm-") and p["kernel_source"].endswith("h100_sxm")
    by_op = {r["op"]: r["kernel_source"] for r in p["breakdown"]["ops"]}
    assert by_op["dense_block.qkv"] == "silicon" and by_op["embedding"] == "roofline"
    assert main(base + ["--kernels", "roofline"]) == 0
    assert json.loads(out.read_text())["predicted"]["kernel_source"] == "roofline"
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        main(base + ["--engine", "tgi"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("shardc: error:") and "--engine" in err and "\n" == err[-1]


def test_api_refuses_unknown_kernels_or_engine_before_tracing():
    from shardc.errors import InputError

    with pytest.raises(InputError, match=r"--kernels 'gpu': expected one of silicon, roofline"):
        shardc.api.compile("does_not_exist.py", mesh="8x1", kernels="gpu")
    with pytest.raises(InputError, match=r"--engine 'tgi'"):
        shardc.api.compile("does_not_exist.py", mesh="8x1", engine="tgi")


def test_mla_attention_uses_the_mla_tables_where_the_engine_has_them():
    """DeepSeek-V3's MLA core: TRT-LLM ships MLA core tables (priced from them), vLLM ships
    only whole-module MLA tables (roofline, logged with the reason)."""
    g, mesh = fixture_graph("deepseek_v3"), Mesh(8, 16)
    wl = Workload(context=4096, **NO_SLO)
    space = StrategySpace(g, mesh, Workload(**{**wl.__dict__, "batch": 256}))
    ch = dict(zip(space.op_slots, (int(c) for c in megatron_op_choices(space, 3))))
    st = Strategy(Degrees(tp=8, ep=16, pp=1, dp=1), 256, ch)
    trt = CostModel(g, mesh, "h100", wl, kernels="silicon", engine="trtllm").simulate(st)
    vll = CostModel(g, mesh, "h100", wl, kernels="silicon", engine="vllm").simulate(st)
    src = {(r["layer_kind"], r["op"]): r["kernel_source"] for r in trt.ops}
    assert src[("moe_block", "attn_core")] == "silicon"
    src = {(r["layer_kind"], r["op"]): r["kernel_source"] for r in vll.ops}
    assert src[("moe_block", "attn_core")] == "roofline"
    fb = [f for f in vll.predicted["kernel_fallbacks"] if f["op"] == "attn_core"]
    assert fb and "MLA" in fb[0]["reason"]


def test_published_points_with_measured_kernels(monkeypatch):
    """docs/validation.md's silicon column on the fixture graphs: every TRT-LLM figure within
    +-30% with the TRT-LLM kernel tables, and the DeepSeek rows (H800 TOML: roofline) too
    (tests/test_cost_validation.py)."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import validate_cost

    monkeypatch.setattr(validate_cost, "model_graph", lambda n: (fixture_graph(n), "fixture"))
    bands = {}  # the DeepSeek rows: roofline (H800 TOML), as test_cost_validation
    rows = validate_cost.validation_rows("silicon")
    assert len(rows) == len(validate_cost.CASES)
    for r in rows:
        lo, hi = bands.get(r["case"], (0.7, 1.3))
        assert lo <= r["ratio"] <= hi, f"{r['case']}: ratio {r['ratio']:.2f} outside [{lo}, {hi}]"


def test_exact_search_stays_exact_with_measured_kernels():
    """Measured times depend only on a branch's own choices and are non-decreasing in batch,
    so the decomposed exact search still equals brute force over the whole legal space."""
    from shardc.search import cost_model_objective, run_search
    from shardc.search.synthetic import toy_graph

    g = toy_graph(layers=8, hidden=8192, heads=64, experts=8, ffn=28672, vocab=32000)
    wl = Workload(phase="decode", batch=None, context=4096, prompt=2048, tpot_slo_ms=30)
    space = StrategySpace(g, Mesh.parse("8x1"), wl)
    obj = cost_model_objective(CostModel(g, space.mesh, "h100", wl, kernels="silicon"), space)
    fast = run_search("exact", space, obj)
    brute = run_search("exact", space, obj, decompose=False, monotone_batch=False)
    assert np.isfinite(fast.best_value) and fast.evaluations < brute.evaluations
    assert fast.best_value == pytest.approx(brute.best_value, rel=1e-12)


def test_tables_match_the_raw_parquet_rows(h100):
    """The cached grids are the wheel's measured rows (ms -> s; n and k not swapped; the
    attention key order as named), checked on shapes where the cleaning changes nothing."""
    import pandas as pd

    root = silicon_tables.data_root() / "h100_sxm"
    g = pd.read_parquet(root / "gemm" / "vllm" / "0.24.0" / "gemm_perf.parquet")
    g = g[g.gemm_dtype == "bfloat16"]
    for m, n, k in [(4096, 1024, 8192), (4096, 8192, 1024), (16384, 3584, 8192)]:
        raw = g[(g.m == m) & (g.n == n) & (g.k == k)].latency.min() * 1e-3
        got, _ = h100.gemm(np.array([float(m)]), float(n), float(k), fp8=False)
        assert got[0] == pytest.approx(raw, rel=1e-9)
    a = pd.read_parquet(root / "attention" / "vllm" / "0.24.0" / "generation_attention_perf.parquet")
    row = a[(a.num_heads == 8) & (a.num_key_value_heads == 1) & (a.head_dim == 128)
            & (a.kv_cache_dtype == "bfloat16") & (a.window_size == 0) & (a.batch_size == 64)
            & (a.step == 4095)]
    got, status = h100.attention("decode", np.array([64.0]), 4096.0, 8, 1, 128, False)
    assert status[0] == MEASURED
    assert got[0] == pytest.approx(row.latency.min() * 1e-3, rel=1e-9)


def test_deepseek_fp8_experts_are_priced_from_the_fp8_block_moe_table():
    """SGLang's tables hold DeepSeek-V3's expert shape in FP8 only as ``fp8_block``: with
    --weights fp8 its experts are measured (from that table), not the roofline; a shape with
    per-tensor ``fp8`` rows keeps them."""
    k, _, reason = kernels_for(load_hardware("h200"), "silicon", "sglang")
    assert k is not None, reason
    assert k.moe_source("fp8", 7168, 2048, 8, 256) == "fp8_block"
    t, status = k.moe(np.array([64.0, 4096.0]), 7168, 2048, 8, 256, np.array([8.0, 8.0]),
                      np.array([1.0, 1.0]), fp8=True)
    assert (status != 2).all() and np.isfinite(t).all()
    tb, _ = k.moe(np.array([64.0, 4096.0]), 7168, 2048, 8, 256, np.array([8.0, 8.0]),
                  np.array([1.0, 1.0]), fp8=False)
    assert (t < tb).all()  # fp8 reads half the expert weights
    vk, _, _ = kernels_for(load_hardware("h200"), "silicon", "vllm")
    per_tensor = [tuple(r[:4]) for r, s in zip(vk.t["moe_fp8_keys"], vk.t["moe_fp8_source"])
                  if s == 0]
    assert per_tensor and vk.moe_source("fp8", *map(int, per_tensor[0])) == "fp8"
    g, mesh = fixture_graph("deepseek_v3"), Mesh(8, 4)
    wl = Workload(context=1280, weights="fp8", **NO_SLO)
    space = StrategySpace(g, mesh, Workload(**{**wl.__dict__, "batch": 64}))
    ch = dict(zip(space.op_slots, (int(c) for c in megatron_op_choices(space, 3))))
    bd = CostModel(g, mesh, "h200", wl, kernels="silicon", engine="sglang").simulate(
        Strategy(Degrees(tp=8, pp=1, dp=4), 64, ch))
    src = {(r["layer_kind"], r["op"]): r["kernel_source"] for r in bd.ops}
    assert src[("moe_block", "expert_ffn1")].startswith("silicon")


def test_a_single_glitch_is_not_carried_to_every_larger_size():
    """The running max keeps a table non-decreasing; an isolated spike (3x both neighbours)
    is a measurement glitch and is lowered first, while a slow small-size regime (several
    cells) is the engine's kernel choice and is kept."""
    spiky = np.array([[1.0, 1.0, 1.0], [1.0, 100.0, 1.2], [2.0, 2.0, 2.0]])
    got = silicon_tables._monotone(silicon_tables._monotone(spiky, 0), 1)
    assert got.max() == 2.0 and (np.diff(got, axis=0) >= 0).all()
    regime = np.array([9.0, 9.0, 9.0, 2.0, 2.5, 3.0])
    assert silicon_tables._monotone(regime, 0).tolist() == [9.0] * 6


def test_the_h200_trtllm_mla_table_glitch_stays_one_cell():
    """NVIDIA's H200 TensorRT-LLM MLA generation table holds 1.47 ms at batch 2 / KV 32 (its
    neighbours 0.013-0.016 ms): DeepSeek-V3 decode attention at 128 heads per GPU, batch 16,
    KV 4096 is priced at the table's own row (0.057 ms), not at the glitch."""
    k, _, reason = kernels_for(load_hardware("h200"), "silicon", "trtllm")
    assert k is not None, reason
    t, status = k.attention("decode", np.array([16.0, 256.0]), 4096.0, np.array([128.0] * 2),
                            np.zeros(2), 0, False, mla=True)
    assert t[0] * 1e3 == pytest.approx(0.0571, rel=0.02) and status[0] == MEASURED
    assert t[1] * 1e3 == pytest.approx(0.503, rel=0.02)
