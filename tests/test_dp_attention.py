"""Attention data parallel with the experts split their own way (``dp_attn``, ``moe_tp`` x
``moe_ep``): the degrees, what the cost model charges for them, the engines' flags, and
AIConfigurator's best Mixtral plans reproduced (docs/deploy.md, "Attention data parallel")."""

import json

import numpy as np
import pytest
from cost_graphs import fixture_graph

from shardc.cli import main
from shardc.cost import CostModel
from shardc.errors import InputError
from shardc.ir.space import MEGATRON_CHOICE, StrategySpace
from shardc.ir.strategy import Degrees, Mesh, Strategy, Workload


# ------------------------------------------------------------------ degrees
@pytest.mark.parametrize("text, want", [
    ("dp_attn=8,moe_tp=8", {"tp": 1, "ep": 8, "moe_tp": 8, "moe_ep": 1}),
    ("tp=8,moe_tp=2,moe_ep=4", {"tp": 8, "ep": 1, "moe_tp": 2, "moe_ep": 4}),
    ("tp=2,dp_attn=4,moe_ep=8", {"tp": 2, "ep": 4, "moe_tp": 1, "moe_ep": 8}),
    ("dp_attn=8", {"tp": 1, "ep": 8}),  # ep's other name, experts split over it
    ("tp=2,ep=4,moe_tp=2", {"tp": 2, "ep": 4}),  # the default split, spelt out
    ("ep=8,moe_ep=8", {"tp": 1, "ep": 8}),
])
def test_degrees_parse_the_experts_split(text, want):
    d = Degrees.parse(text)
    got = d.as_dict()
    assert {k: got.get(k) for k in want} == want
    assert ("moe_tp" in got) == ("moe_tp" in want)  # the default split is not written
    assert d.expert_tp * d.expert_ep == d.tp * d.ep
    assert Degrees(**got) == d  # plan.json's dict reads back the same degrees


@pytest.mark.parametrize("text, words", [
    ("tp=8,moe_tp=3", "must multiply to tp x dp_attn = 8 x 1 = 8"),
    ("dp_attn=8,moe_tp=4,moe_ep=4", "must multiply to tp x dp_attn = 1 x 8 = 8"),
    ("ep=2,dp_attn=2", "dp_attn and ep name the same degree"),
    ("tp=2,dp_attn=4,moe_tp=8,sp=on", "sequence parallelism needs the experts at the attention tp"),
    ("moe_tp=0", "positive integer"),
    ("etp=2", "unknown degree 'etp'"),
])
def test_degrees_refuse_a_split_that_means_nothing(text, words):
    with pytest.raises(InputError, match=words.replace("(", r"\(").replace(")", r"\)")):
        Degrees.parse(text)


@pytest.mark.parametrize("model, fixed, words", [
    ("llama3_70b", {"moe_tp": 8}, "no routed experts"),
    ("llama3_70b", {"ep": 8}, "use dp=N"),
    ("mixtral_8x7b", {"ep": 8, "moe_ep": 3}, "does not divide the 8 experts"),
    ("mixtral_8x7b", {"ep": 8, "moe_tp": 8, "sp": -1}, "sequence parallelism"),
])
def test_space_refuses_a_split_the_model_cannot_take(model, fixed, words):
    with pytest.raises(InputError, match=words):
        StrategySpace(fixture_graph(model), Mesh(8, 1), Workload(batch=64), fixed=fixed)


@pytest.mark.parametrize("text", ["dp_attn=8,moe_tp=8", "tp=8,moe_tp=2", "tp=2,dp_attn=4,moe_tp=8"])
def test_simulate_accepts_the_split(text, tmp_path, monkeypatch, capsys):
    import shardc.api

    monkeypatch.setattr(shardc.api, "load_model_graph", lambda m, *a, **k: fixture_graph(m))
    out = tmp_path / "sim.json"
    assert main(["simulate", "mixtral_8x7b", "--mesh", "8x1", "--degrees", text,
                 "--batch", "64", "--json", str(out)]) == 0
    d = Degrees.parse(text)
    assert json.loads(out.read_text())["degrees"]["moe_tp"] == d.moe_tp
    assert f"moe_tp={d.moe_tp} moe_ep={d.moe_ep}" in capsys.readouterr().out


# ------------------------------------------------------------------ the priced exchange
def _breakdown(degrees: Degrees, batch: int = 64, graph="mixtral_8x7b", mesh=Mesh(8, 1)):
    g = fixture_graph(graph)
    cm = CostModel(g, mesh, "h100", Workload(batch=batch, context=2048))
    space = cm.space_for(Strategy(degrees, batch, {}))
    choices = {s: MEGATRON_CHOICE[s.split(".")[-1]] if degrees.tp > 1 else 0
               for s in space.op_slots}
    choices.update({s: MEGATRON_CHOICE[s.split(".")[-1]] for s in space.op_slots
                    if "expert_ffn" in s})
    return cm, cm.simulate(Strategy(degrees, batch, choices))


@pytest.mark.parametrize("deg, want", [
    # tp1 dp8 etp8: gather the 8 groups' tokens, reduce-scatter back; nothing over tp
    (Degrees(tp=1, ep=8, moe_tp=8), [("dispatch", "all_gather", "ep"),
                                     ("combine", "reduce_scatter", "ep")]),
    # tp2 x dp_attn4 with experts tp8: also the sum over the attention tp pair
    (Degrees(tp=2, ep=4, moe_tp=8), [("dispatch", "all_gather", "ep"),
                                     ("combine", "reduce_scatter", "ep"),
                                     ("after combine", "all_reduce", "tp")]),
    # tp8 with experts tp2 x ep4 inside the tp group: every rank holds every token already
    (Degrees(tp=8, moe_tp=2, moe_ep=4), [("after combine", "all_reduce", "tp")]),
])
def test_resplit_experts_charge_the_gather_path(deg, want):
    """The experts exchange of a re-split is the all-gather / reduce-scatter of the routed
    tokens over the attention groups (no all-to-all), on the replica's T x ep tokens."""
    cm, ex = _breakdown(deg)
    rows = [(at, kind, dim) for _k, br, at, kind, dim, _S, _ms in ex.collectives
            if br == "experts"]
    assert rows == want
    T = 64 / deg.ep  # decode: one token per sequence of an attention group
    for _k, br, at, kind, dim, S, _ms in ex.collectives:
        if br == "experts" and dim == "ep":  # the replica's tokens, full hidden vectors
            assert S == pytest.approx(T * deg.ep * cm.hidden * cm.act_bytes)
        if br == "experts" and dim == "tp":
            assert S == pytest.approx(T * cm.hidden * cm.act_bytes)


def test_expert_weights_per_gpu_depend_on_the_split_size_only():
    """moe_tp x moe_ep = 8 holds 1/8 of every expert's bytes per GPU, however split; the
    busiest rank's routed rows grow with moe_ep's imbalance, never with moe_tp."""
    mem = {}
    for split in ((8, 1), (4, 2), (2, 4), (1, 8)):
        _, ex = _breakdown(Degrees(tp=1, ep=8, moe_tp=split[0], moe_ep=split[1]))
        mem[split] = sum(r["weight_bytes"] * r["count"] for r in ex.ops
                         if r["op"].startswith("expert_ffn"))
    assert max(mem.values()) == pytest.approx(min(mem.values()), rel=1e-9)


def test_default_split_spelt_out_is_the_same_strategy():
    _, a = _breakdown(Degrees(ep=8))
    _, b = _breakdown(Degrees(ep=8, moe_ep=8))
    assert a.strategy.degrees == b.strategy.degrees
    assert a.predicted["tok_s_per_gpu"] == b.predicted["tok_s_per_gpu"]
    assert [c[3] for c in a.collectives if c[1] == "experts"] == ["all_to_all", "all_to_all"]


def test_resplit_rows_price_alongside_default_rows():
    """One evaluate() batch mixing re-split and default rows prices each as alone (the
    vectorised evaluator picks the re-split branch per row)."""
    g = fixture_graph("mixtral_8x7b")
    cm = CostModel(g, Mesh(8, 1), "h100", Workload(context=2048))
    space = StrategySpace(g, Mesh(8, 1), Workload(context=2048), fixed={"moe_tp": 8})
    rng = np.random.default_rng(0)
    acts = np.stack([rng.integers(0, n, size=64) for n in space.nvec], axis=1)
    ev = cm.evaluate(acts, space)
    for i in range(0, 64, 9):
        one = cm.evaluate(acts[i:i + 1], space)
        assert one.tok_s_per_gpu[0] == pytest.approx(ev.tok_s_per_gpu[i], rel=1e-12)
        assert one.reason[0] == ev.reason[i]
    deg = space.degree_arrays(acts)
    ok = deg["dp"] > 0
    assert ((deg["moe_tp"] == 8) | ~ok).all()  # every valid row splits the experts tp8


# ------------------------------------------------------------------ engines
def _pool(engine, deg, dense=False):
    from shardc.backends.launch import LaunchPool, engine_flags

    pool = LaunchPool("mixed", Strategy(deg, 512, {}), 4096, 0.9, dense_mlp=dense)
    return engine_flags(engine, pool)


@pytest.mark.parametrize("engine, deg, has, lacks", [
    ("vllm", Degrees(ep=8, moe_tp=8), ["--data-parallel-size", "8"], ["--enable-expert-parallel"]),
    ("vllm", Degrees(tp=2, ep=4, moe_ep=8), ["--data-parallel-size", "--enable-expert-parallel"],
     []),
    ("sglang", Degrees(ep=8, moe_tp=8), ["--tp-size", "8", "--dp-size", "--enable-dp-attention"],
     ["--ep-size"]),
    ("sglang", Degrees(ep=8, moe_tp=2, moe_ep=4), ["--enable-dp-attention", "--ep-size", "4"], []),
    ("sglang", Degrees(tp=8, moe_tp=2, moe_ep=4), ["--tp-size", "8", "--ep-size", "4"],
     ["--enable-dp-attention"]),
    ("trtllm", Degrees(ep=8, moe_tp=8), ["--tp_size", "8"], ["--ep_size"]),
    ("trtllm", Degrees(tp=8, moe_tp=2, moe_ep=4), ["--tp_size", "8", "--ep_size", "4"], []),
])
def test_engine_flags_spell_the_split(engine, deg, has, lacks):
    from shardc.backends.launch import engine_flag_table

    flags = _pool(engine, deg)
    for f in has:
        assert f in flags
    for f in lacks:
        assert f not in flags
    known = engine_flag_table()[engine]["flags"]
    assert all(f in known for f in flags if f.startswith("--"))


@pytest.mark.parametrize("engine, tp, ep, mt, me, dense, ok", [
    ("vllm", 1, 8, 8, 1, False, True), ("vllm", 2, 4, 1, 8, False, True),
    ("vllm", 1, 8, 2, 4, False, False), ("sglang", 1, 8, 2, 4, False, True),
    ("sglang", 2, 4, 8, 1, True, False), ("trtllm", 2, 4, 8, 1, False, False),
    ("trtllm", 8, 1, 2, 4, False, True),
])
def test_which_engine_expresses_which_split(engine, tp, ep, mt, me, dense, ok):
    from shardc.ir.engines import experts_split_ok

    assert experts_split_ok(engine, tp, ep, mt, me, dense) is ok


def test_backend_gate_runs_every_split():
    """parallelize.py / the runtime run every experts split that tiles the tp x ep ranks:
    all-TP, all-EP and mixed (moe_tp and moe_ep both > 1, e.g. DeepSeek-V3's tp8 with expert
    TP2 x EP4; :mod:`shardc.runtime.gathered_experts`)."""
    from shardc.backends.support import experts_split_problem, plan_verdict

    for deg in (Degrees(ep=8), Degrees(ep=8, moe_tp=8), Degrees(tp=2, ep=4, moe_tp=8),
                Degrees(tp=2, ep=4, moe_ep=8), Degrees(tp=8, moe_tp=2, moe_ep=4),
                Degrees(ep=8, moe_tp=4, moe_ep=2)):
        assert experts_split_problem(deg) is None, deg
    deg = Degrees(tp=8, moe_tp=2, moe_ep=4)
    v = plan_verdict({"runs": True, "reason": None}, [Strategy(deg, 8, {})])
    assert v == {"runs": True, "reason": None}


# ------------------------------------------------------------------ published numbers
MIXTRAL = "examples/configs/mixtral_8x7b/config.json"
QWEN3_235B = "examples/configs/qwen3_235b_a22b/config.json"


def _simulate_json(tmp_path, args) -> dict:
    out = tmp_path / "sim.json"
    assert main(["simulate", *args, "--json", str(out)]) == 0
    return json.loads(out.read_text())["predicted"]


# AIConfigurator 0.12.0's best aggregated Mixtral-8x7B workers on H100 (SILICON database,
# benchmarks/serve_aiconfigurator.md, "Each tool's own best"): tp1pp1dp8etp8ep1, 64
# sequences per attention-DP rank; output tok/s/GPU of the whole mesh.
AIC_MIXTRAL = [  # (mesh, isl, osl, ttft, tpot, AIC backend, AIC tok/s/GPU)
    ("8x1", 2048, 512, 2000, 30, "trtllm", 2063.90),
    ("8x2", 1024, 1024, 1000, 20, "trtllm", 3391.70),
    ("8x2", 1024, 1024, 1000, 20, "vllm", 3412.85),
]


@pytest.mark.parametrize("mesh, isl, osl, ttft, tpot, engine, aic", AIC_MIXTRAL)
def test_aiconfigurator_best_mixtral_within_30_percent(tmp_path, mesh, isl, osl, ttft, tpot,
                                                       engine, aic):
    """``tp1 dp8 etp8`` = dp_attn=8, moe_tp=8 (one worker of 8 GPUs per 8 GPUs), priced with
    the same engine's kernel tables, lands within 30% of AIConfigurator's estimate."""
    p = _simulate_json(tmp_path, [
        MIXTRAL, "--mesh", mesh, "--hardware", "h100", "--phase", "serve", "--mode", "agg",
        "--isl", str(isl), "--osl", str(osl), "--ttft-slo", str(ttft), "--tpot-slo", str(tpot),
        "--degrees", "dp_attn=8,moe_tp=8", "--batch", "512", "--engine", engine])
    assert abs(p["tok_s_per_gpu"] / aic - 1.0) < 0.30, p["tok_s_per_gpu"]
    assert p["tpot_ms"] <= tpot and p["ttft_ms"] <= ttft


def test_qwen3_235b_attention_dp_8x4_communication_share(tmp_path):
    """Qwen3-235B-A22B on 8x4 H200, attention data-parallel over each node's 8 GPUs with the
    experts tensor-parallel over them (SGLang's ``--enable-dp-attention --tp-size 8``): the
    gather / reduce-scatter of the routed tokens is < 20% of the step (aggregated serving's
    mixed step and pure decode)."""
    for phase in (["--phase", "serve", "--mode", "agg"], ["--phase", "decode"]):
        p = _simulate_json(tmp_path, [QWEN3_235B, "--mesh", "8x4", "--hardware", "h200",
                                      *phase, "--degrees", "dp_attn=8,moe_tp=8"])
        bd = p["breakdown"]
        comm = bd["tp_comm_ms"] + bd["ep_comm_ms"]
        assert bd["ep_comm_ms"] > 0
        assert comm / max(bd["stage_ms"]) < 0.20, (phase, comm, bd["stage_ms"])


@pytest.mark.parametrize("model, args, words", [
    ("llama3_70b", ["--degrees", "dp_attn=8"], "use dp=N"),
    ("llama3_70b", ["--degrees", "moe_tp=8"], "must multiply to"),
    ("mixtral_8x7b", ["--degrees", "dp_attn=8,moe_tp=3"], "must multiply to"),
    ("mixtral_8x7b", ["--degrees", "dp_attn=8,moe_tp=2", "--runtime", "vllm"],
     "its flags do not split the experts moe_tp=2 x moe_ep=4"),
])
def test_simulate_refuses_a_split_in_one_line(model, args, words, monkeypatch, capsys):
    import shardc.api

    monkeypatch.setattr(shardc.api, "load_model_graph", lambda m, *a, **k: fixture_graph(m))
    assert main(["simulate", model, "--mesh", "8x1", "--batch", "64", *args]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and words in err


def test_compile_writes_the_split_into_plan_json(tmp_path, capsys):
    """The tiny Mixtral at dp_attn=4, moe_tp=4: plan.json's degrees carry the split, the
    expert weights are cut over ep and tp by their column / row dims (1/4 of each expert per
    rank), the backend runs it and parallelize.py applies the gathered experts style."""
    out = tmp_path / "o"
    assert main(["compile", "examples/tiny_mixtral.py", "--mesh", "4x1", "--budget", "50",
                 "--degrees", "dp_attn=4,moe_tp=4", "--out", str(out)]) == 0
    plan = json.loads((out / "plan.json").read_text())
    assert plan["degrees"]["moe_tp"] == 4 and plan["degrees"]["moe_ep"] == 1
    assert plan["backend"] == {"runs": True, "reason": None}
    code = (out / "parallelize.py").read_text()
    assert "GatheredExperts(experts='experts'" in code and "split='tp'" in code
    assert "ExpertParallel(" not in code
    rows = [r for r in plan["params"] if r.get("expert_dim") is not None]
    assert rows
    for r in rows:
        cut = r["split_dims"][0 if r["op"] == "expert_ffn1" else 1]
        assert r["placements"] == [f"S({cut})"]
        assert r["local_shape"][cut] * 4 == r["shape"][cut]
        assert r["local_shape"][r["expert_dim"]] == r["shape"][r["expert_dim"]]
    flags = plan["launch"]["vllm"]["pools"][0]["flags"]
    assert "--enable-expert-parallel" not in flags


def test_compile_places_a_mixed_split_on_the_experts_mesh(tmp_path):
    """The tiny Mixtral at tp=4, moe_tp=2 x moe_ep=2 (a mixed split: no placement per mesh
    dim says it): the expert rows live on the experts mesh ``(moe_ep, moe_tp)`` -- the
    expert dim over moe_ep, each expert's column / row dim over moe_tp, 1/4 of every expert
    layer per rank -- the backend runs it and parallelize.py applies the gathered experts
    style with the int split; the router is replicated (every rank routes the gathered
    tokens)."""
    out = tmp_path / "o"
    assert main(["compile", "examples/tiny_mixtral.py", "--mesh", "4x1", "--budget", "20",
                 "--degrees", "tp=4,moe_tp=2,moe_ep=2", "--out", str(out)]) == 0
    plan = json.loads((out / "plan.json").read_text())
    assert (plan["degrees"]["moe_tp"], plan["degrees"]["moe_ep"]) == (2, 2)
    assert plan["backend"] == {"runs": True, "reason": None}
    assert "split=2)" in (out / "parallelize.py").read_text()
    assert all(o["choice"] == "rep" for o in plan["ops"] if o["kind"] == "router")
    rows = [r for r in plan["params"] if r.get("expert_dim") is not None]
    assert rows
    for r in rows:
        cut = r["split_dims"][0 if r["op"] == "expert_ffn1" else 1]
        assert r["mesh_dims"] == ["moe_ep", "moe_tp"]
        assert r["placements"] == [f"S({r['expert_dim']})", f"S({cut})"]
        assert r["local_shape"][cut] * 2 == r["shape"][cut]
        assert r["local_shape"][r["expert_dim"]] * 2 == r["shape"][r["expert_dim"]]
    assert all("mesh_dims" not in r for r in plan["params"] if r.get("expert_dim") is None)
    # SGLang and TensorRT-LLM spell tp4 with the experts 2 x 2 (MoE tp = tp-size / ep-size);
    # their searches sweep it and the scripts carry it; vLLM has no flag for it
    for engine, tp_flag, ep_flag in (("sglang", "--tp-size", "--ep-size"),
                                     ("trtllm", "--tp_size", "--ep_size")):
        (pool,) = plan["launch"][engine]["pools"]
        assert (pool["degrees"]["tp"], pool["degrees"]["moe_tp"], pool["degrees"]["moe_ep"]) \
            == (4, 2, 2)
        flags = pool["flags"]
        assert flags[flags.index(tp_flag) + 1] == "4" and flags[flags.index(ep_flag) + 1] == "2"
    assert plan["launch"]["vllm"]["pools"] == []


def test_verify_runs_a_resplit_plan_scaled_down(tmp_path, capsys):
    """verify scales an 8-rank tp=2, dp_attn=4, moe_tp=8 plan to 4 gloo ranks keeping the
    split's kind (dp_attn 4->2, moe_tp 8->4: still every expert tensor-parallel over every
    rank) and runs the scaled plan's parallelize.py against the unsharded model."""
    out = tmp_path / "o"
    assert main(["compile", "examples/tiny_mixtral.py", "--mesh", "8x1", "--budget", "20",
                 "--degrees", "tp=2,dp_attn=4,moe_tp=8", "--out", str(out)]) == 0
    capsys.readouterr()
    assert main(["verify", "examples/tiny_mixtral.py", "--plan", str(out / "plan.json"),
                 "--world", "4"]) == 0
    text = capsys.readouterr().out
    assert "ep 4->2" in text and "moe_tp 8->4" in text and "verify OK" in text


def test_verify_runs_a_mixed_split_scaled_down(tmp_path, capsys):
    """DeepSeek-V3's ``tp8`` with expert TP2 x EP4 on the tiny Mixtral: verify scales it to 4
    gloo ranks keeping it mixed (tp 8->4, moe_ep 4->2: moe_tp=2 x moe_ep=2) and the scaled
    parallelize.py's logits equal the unsharded model's."""
    out = tmp_path / "o"
    assert main(["compile", "examples/tiny_mixtral.py", "--mesh", "8x1", "--budget", "20",
                 "--degrees", "tp=8,moe_tp=2,moe_ep=4", "--out", str(out)]) == 0
    capsys.readouterr()
    assert main(["verify", "examples/tiny_mixtral.py", "--plan", str(out / "plan.json"),
                 "--world", "4"]) == 0
    text = capsys.readouterr().out
    assert "tp 8->4" in text and "moe_ep 4->2" in text and "verify OK" in text


# ------------------------------------------------------------------ the router of a re-split
def test_resplit_router_is_priced_on_the_gathered_tokens():
    """After the all-gather every rank routes the replica's tokens (T x dp_attn), not its
    attention group's T: the router of ``tp1 dp8 etp8`` at 64 sequences costs what the
    replicated router of tp=8 costs on the same 64 tokens, 8x the FLOPs of the default
    split's (each rank routing its own 8)."""
    def router(deg):
        _, ex = _breakdown(deg)
        return next(r for r in ex.ops if r["op"] == "router")

    gathered, same_tokens = router(Degrees(ep=8, moe_tp=8)), router(Degrees(tp=8))
    assert gathered["compute_ms"] == pytest.approx(same_tokens["compute_ms"])
    assert gathered["time_ms"] == pytest.approx(same_tokens["time_ms"])
    assert router(Degrees(tp=8, moe_tp=2, moe_ep=4))["compute_ms"] == \
        pytest.approx(same_tokens["compute_ms"])  # tp8: every rank holds the 64 tokens already
    assert gathered["compute_ms"] > 2 * router(Degrees(ep=8))["compute_ms"]


def test_resplit_router_runs_on_the_gathered_tokens():
    """What runs (parallelize.py's GatheredExperts on 4 fake ranks, tiny Mixtral at dp_attn=4,
    moe_tp=4): the router's matmul FLOPs are those of the 4 attention groups' tokens, ``2 x
    hidden x E`` per token -- the tokens the cost model prices it on."""
    import torch
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore
    from torch.utils.flop_counter import FlopCounterMode

    from shardc.backends.verify import _build, _load_code
    from shardc.frontends import load_graph
    from shardc.ir.strategy import strategy_from_names
    from shardc.plan import build_plan

    model_file = "examples/tiny_mixtral.py"
    rows, seq = 2, 4  # per attention group
    from test_backend_gloo import MOE  # Megatron's choices: col / row experts, rep router

    strategy = strategy_from_names({"ep": 4, "moe_tp": 4}, MOE, rows * 4)
    plan = build_plan(load_graph(model_file, tiny=True), strategy, Mesh(4, 1), "h100",
                      Workload(batch=rows * 4, context=64))
    code = _load_code(None, plan.code(standalone=True))
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=4)
    try:
        model, ids = _build(model_file, rows, seq)
        model = code.parallelize(model)
        cfg = model.config
        block = model.model.layers[0].mlp
        x = torch.randn(rows, seq, cfg.hidden_size)
        with torch.no_grad(), FlopCounterMode(display=False) as counter:
            block(x)
        got = counter.get_flop_counts()
    finally:
        dist.destroy_process_group()
    router_flops = sum(sum(v.values()) for k, v in got.items() if k.endswith(".gate"))
    assert router_flops == 2 * cfg.hidden_size * cfg.num_local_experts * rows * seq * 4


# ------------------------------------------------------------------ dp_attn and the expert count
def test_dp_attn_need_not_divide_the_experts_beside_expert_tp(tmp_path, capsys):
    """vLLM / SGLang attention data parallel with the experts tensor-parallel over the same
    ranks (``--data-parallel-size 16`` on Mixtral's 8 experts) needs only the split's moe_ep
    to divide the experts: ``dp_attn=16, moe_tp=16`` (moe_ep 1) and ``dp_attn=16, moe_tp=2``
    (moe_ep 8) are priced; the default split at dp_attn=16 (16 expert groups of 8 experts)
    stays refused, and the searched space (no split fixed) keeps ep | experts."""
    mesh = ["--mesh", "8x2", "--batch", "512"]
    for degrees in ("dp_attn=16,moe_tp=16", "dp_attn=16,moe_tp=2"):
        p = _simulate_json(tmp_path, [MIXTRAL, *mesh, "--degrees", degrees])
        assert p["tok_s_per_gpu"] > 0, degrees
    capsys.readouterr()
    assert main(["simulate", MIXTRAL, *mesh, "--degrees", "dp_attn=16"]) == 2
    assert "ep=16" in capsys.readouterr().err
    g = fixture_graph("mixtral_8x7b")
    wl = Workload(batch=64, context=2048)
    assert StrategySpace(g, Mesh(8, 2), wl).values["ep"] == [1, 2, 4, 8]
    assert 16 in StrategySpace(g, Mesh(8, 2), wl, fixed={"ep": 16, "moe_tp": 16}).values["ep"]
