"""The experts split (``moe_tp x moe_ep``, docs/deploy.md "Attention data parallel with the
experts split their own way") as a searched choice: each engine's search sweeps the splits it
spells as an outer loop over fixed-split spaces, the best-practice baseline picks one, and
the dtensor search only the splits the DTensor backend runs (one place:
``shardc.ir.engines.dtensor_runs_split``)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import shardc.ir.engines as engines
from shardc.cost import CostModel, load_hardware
from shardc.driver import best_practice_over_splits, cost_model_objective, search_pass
from shardc.frontends import load_graph
from shardc.ir.engines import experts_split_ok, has_dense_mlp, searched_splits, split_spaces
from shardc.ir.space import StrategySpace, nvlink_tp_domain
from shardc.ir.strategy import Mesh, Workload
from shardc.search import run_search
from shardc.search.engine_search import engine_mode_spaces, search_engine
from shardc.serving.search import serve_search

ROOT = Path(__file__).resolve().parents[1]
MIXTRAL = str(ROOT / "examples" / "configs" / "mixtral_8x7b" / "config.json")
TINY_MIXTRAL = str(ROOT / "examples" / "tiny_mixtral.py")
LLAMA = str(ROOT / "examples" / "configs" / "llama3_1_8b" / "config.json")


def _setup(model, mesh="8x1", engine="vllm", fixed=None, **wl):
    g = load_graph(model)
    m, hw = Mesh.parse(mesh), load_hardware("h100")
    w = Workload(**wl)
    space = StrategySpace(g, m, w, fixed=dict(fixed or {}),
                          tp_domain=nvlink_tp_domain(m, hw.nvlink_domain))
    return g, m, hw, w, space, CostModel(g, m, hw, w, engine=engine)


def _split(found, space):
    s = (found.result.space or space).decode(found.result.best_action)
    return s, (s.degrees.expert_tp, s.degrees.expert_ep)


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
def test_engine_search_finds_a_split_where_only_a_resplit_is_expressible(engine):
    """tiny_mixtral at --degrees tp=2,ep=4: vLLM has no flag for experts over ep beside
    tp = 2 at the default split, so only a re-split (all-TP or all-EP over the 8 ranks) is
    expressible and the search finds it, decoded with that split in the result's own space;
    SGLang runs the default there, and a re-split only if strictly better."""
    _, _, _, _, space, cm = _setup(TINY_MIXTRAL, fixed={"tp": 2, "ep": 4}, phase="decode")
    alone = search_engine("exact", space, engine, cost_model=cm, resplit=False)
    found = search_engine("exact", space, engine, cost_model=cm)
    assert found is not None and found.result.best_action is not None
    s, (mt, me) = _split(found, space)
    assert mt * me == s.degrees.tp * s.degrees.ep == 8
    if engine == "vllm":
        assert alone is None  # nothing at the default split
        assert (mt, me) in ((8, 1), (1, 8)) and found.result.space is not None
        assert experts_split_ok("vllm", 2, 4, mt, me, has_dense_mlp(space))
        assert found.result.space.fixed["moe_tp"] == mt
    else:  # the default split is expressible: the re-split only when strictly better
        assert found.result.best_value >= alone.result.best_value
    # the value is the cost model's own number for the decoded plan
    assert found.result.best_value == pytest.approx(
        cm.simulate(s).predicted["tok_s_per_gpu"], rel=1e-9)


def test_engine_search_keeps_the_default_split_where_it_wins():
    """Mixtral 8x1 decode: tp=1 ep=8 (DeepEP's all-to-all) beats every re-split vLLM spells;
    the sweep saw them (more evaluations) and returned the default, in the caller's space."""
    _, _, _, _, space, cm = _setup(MIXTRAL, phase="decode")
    alone = search_engine("exact", space, "vllm", cost_model=cm, resplit=False)
    found = search_engine("exact", space, "vllm", cost_model=cm)
    assert found.evaluations > alone.evaluations
    assert found.result.space is None
    assert found.result.best_value == alone.result.best_value
    np.testing.assert_array_equal(found.result.best_action, alone.result.best_action)


def test_serve_search_picks_attention_dp_with_expert_tp_where_it_wins(monkeypatch):
    """Mixtral-8x7B 8x1, aggregated 2048/512 (TTFT 2000 ms, TPOT 30 ms), vLLM: two workers
    of dp_attn=4 with the experts TP over the 4 ranks (moe_tp=4, vLLM data parallel without
    --enable-expert-parallel) beat vLLM's best at the default split (tp=4) by > 5%."""
    g = load_graph(MIXTRAL)
    wl = Workload(phase="serve", mode="agg", isl=2048, osl=512, ttft_slo_ms=2000,
                  tpot_slo_ms=30)

    def run():
        return serve_search(g, Mesh.parse("8x1"), "h100", wl, policy="exact", budget=1,
                            extra_policies=(), engine="vllm", runtime="vllm")

    out = run()
    _, _, s, _ = out.choice.pools[0]
    assert s.degrees.experts_resplit and s.degrees.expert_tp == s.degrees.tp * s.degrees.ep
    monkeypatch.setattr(engines, "searched_splits", lambda space, runtime: [])
    default = run()
    _, _, s0, _ = default.choice.pools[0]
    assert not s0.degrees.experts_resplit
    assert out.choice.tok_s_per_gpu > 1.05 * default.choice.tok_s_per_gpu


def test_dense_models_have_no_splits_to_search():
    _, _, _, _, space, _ = _setup(LLAMA, phase="decode")
    for runtime in ("vllm", "sglang", "trtllm", "any", "dtensor"):
        assert searched_splits(space, runtime) == []
        assert split_spaces(space, runtime) == [space]


def test_a_fixed_split_is_not_swept():
    _, _, _, _, space, _ = _setup(MIXTRAL, fixed={"moe_tp": 8}, phase="decode")
    assert searched_splits(space, "sglang") == []


@pytest.mark.parametrize("context, resplit", [(32768, True), (4096, False)])
def test_best_practice_baseline_keeps_the_better_split(context, resplit):
    """Mixtral 8x1 decode: at 32k context the baseline's best is tp=8 with the experts EP
    over the 8 ranks (moe_ep=8, SGLang --ep-size 8), just above tp=8 at the default split;
    at 4k tp=1 ep=8 at the default split stays. The sweep returns the best over the splits
    (ties: the default), a re-split decoding with its split in ``result.space``."""
    from shardc.search import cost_model_objective

    _, _, _, _, space, cm = _setup(MIXTRAL, phase="decode", context=context)
    default = run_search("best_practice", space, cost_model_objective(cm, space))
    got = best_practice_over_splits(space, cm, default, budget=1, seed=0)
    best_re = max(run_search("best_practice", sp, cost_model_objective(cm, sp)).best_value
                  for sp in split_spaces(space, "any")[1:])
    assert got.best_value == max(default.best_value, best_re)
    assert (got.space is not None) == resplit == (best_re > default.best_value)
    if resplit:
        s = got.space.decode(got.best_action)
        assert s.degrees.experts_resplit
        assert got.best_value == pytest.approx(cm.simulate(s).predicted["tok_s_per_gpu"])


def test_dtensor_search_sweeps_the_backend_splits_only_when_switched_on(monkeypatch):
    """The DTensor backend runs all-TP and all-EP (dtensor_runs_split, the one place); the
    dtensor search sweeps them only with DTENSOR_SEARCH_SWEEPS_RESPLITS (off: RL would run
    once per split), so today its plan keeps the default split. Switched on, the sweep holds
    exactly the splits the one place allows."""
    g, m, hw, w, space, cm = _setup(TINY_MIXTRAL, phase="decode")
    assert searched_splits(space, "dtensor") == []
    out = search_pass(g, m, hw, w, policy="megatron", budget=1)
    assert not out.strategy.degrees.experts_resplit and out.result.space is None
    monkeypatch.setattr(engines, "DTENSOR_SEARCH_SWEEPS_RESPLITS", True)
    on = searched_splits(space, "dtensor")
    assert on and on == searched_splits(space, "any")  # the engines spell all-TP / all-EP
    monkeypatch.setattr(engines, "dtensor_runs_split",
                        lambda tp, ep, mt, me: (mt, me) in ((tp, ep), (tp * ep, 1)))
    all_tp = searched_splits(space, "dtensor")  # the one place narrowed to all-TP
    assert all_tp == sorted({t * e for t in space.values["tp"] for e in space.values["ep"]
                             if e > 1 and m.gpus % (t * e) == 0})
    out = search_pass(g, m, hw, w, policy="exact", budget=1)
    s = out.strategy.degrees
    assert not s.experts_resplit or (s.expert_tp, s.expert_ep) == (s.tp * s.ep, 1)


def test_backend_verdict_reads_the_one_place(monkeypatch):
    from shardc.backends.support import experts_split_problem
    from shardc.ir.strategy import Degrees

    assert experts_split_problem(Degrees(tp=1, ep=8, pp=1, dp=1, moe_tp=8, moe_ep=1)) is None
    mixed = Degrees(tp=1, ep=8, pp=1, dp=1, moe_tp=2, moe_ep=4)
    assert experts_split_problem(mixed) is None  # the backend runs mixed splits too
    monkeypatch.setattr(engines, "dtensor_runs_split",
                        lambda tp, ep, mt, me: mt * me == tp * ep and 1 in (mt, me))
    assert "moe_tp=2 x moe_ep=4" in experts_split_problem(mixed)


def test_searched_resplits_are_the_ones_the_engine_spells():
    """The searches sweep every split that tiles tp x dp_attn (``plan_places_split``: the
    all-TP and all-EP ones and the mixed ones, moe_tp and moe_ep both > 1, which plan.json
    places on the experts mesh) where the engine spells it: Mixtral 8x1 decode at 32k on
    SGLang sweeps mixed splits too, each one SGLang's flags say."""
    _, _, _, _, space, cm = _setup(MIXTRAL, phase="decode", context=32768, engine="sglang")
    mixed = 0
    for mode, ms, sp in engine_mode_spaces(space, "sglang"):
        for t, e in ms.allowed_tp_ep:
            mt, me = (int(x) for x in sp.experts_split(t, e))
            assert mt * me == t * e
            assert (mt, me) == (t, e) or experts_split_ok("sglang", t, e, mt, me, False)
            mixed += (mt, me) != (t, e) and mt > 1 and me > 1
    assert mixed


def test_serve_search_finds_a_resplit_where_the_default_split_is_not_expressible():
    """tiny_mixtral serve at --degrees tp=2,ep=4 on vLLM: the default split has no vLLM flag
    (the search there finds nothing), a re-split over the 8 ranks does; the deployment is
    the re-split's."""
    from shardc.errors import InfeasibleError

    g = load_graph(TINY_MIXTRAL)
    wl = Workload(phase="serve", mode="agg", isl=256, osl=64)
    kw = dict(policy="exact", budget=1, extra_policies=(), engine="vllm", runtime="vllm",
              fixed={"tp": 2, "ep": 4})
    out = serve_search(g, Mesh.parse("8x1"), "h100", wl, **kw)
    _, _, s, _ = out.choice.pools[0]
    assert (s.degrees.tp, s.degrees.ep) == (2, 4)
    assert (s.degrees.expert_tp, s.degrees.expert_ep) in ((8, 1), (1, 8))
    with pytest.raises(InfeasibleError):
        serve_search(g, Mesh.parse("8x1"), "h100", wl,
                     **{**kw, "fixed": {"tp": 2, "ep": 4, "moe_tp": 2}})


def test_a_split_whose_derived_half_does_not_divide_is_an_invalid_row():
    """Mixtral (8 experts) on 8x128 with moe_tp=4: at tp=8, ep=8 the derived moe_ep = 16
    does not divide the experts, so that row is invalid (dp 0), not a plan that fails later."""
    _, _, _, _, space, _ = _setup(MIXTRAL, mesh="8x128", fixed={"moe_tp": 4}, phase="decode")
    mt, me = space.experts_split([8, 2], [8, 2])
    assert (int(mt[0]), int(me[0])) == (0, 0) and (int(mt[1]), int(me[1])) == (4, 1)


def test_the_baselines_split_copies_hold_splits_some_engine_runs():
    """Mixtral 8x1: the best-practice baseline's re-split copies (``split_spaces(space,
    "any")``) hold re-splits some engine spells -- mixed ones (moe_tp and moe_ep both > 1,
    SGLang's ``--ep-size``) included -- and the baseline's best decodes to one of them or
    to the default split."""
    from shardc.search import cost_model_objective

    _, _, _, _, space, cm = _setup(MIXTRAL, phase="decode")
    mixed = 0
    for sp in split_spaces(space, "any")[1:]:
        assert sp.allowed_tp_ep
        for t, e in sp.allowed_tp_ep:
            mt, me = (int(x) for x in sp.experts_split(t, e))
            assert (mt, me) != (t, e) and mt * me == t * e
            assert any(experts_split_ok(r, t, e, mt, me, False) for r in engines.ENGINES)
            mixed += mt > 1 and me > 1
    assert mixed
    default = run_search("best_practice", space, cost_model_objective(cm, space))
    got = best_practice_over_splits(space, cm, default, budget=1, seed=0)
    d = (got.space or space).decode(got.best_action).degrees
    assert not d.experts_resplit or d.moe_tp * d.moe_ep == d.tp * d.ep


def test_serve_baselines_are_the_best_over_the_swept_splits():
    """Mixtral-8x7B 8x1 serve on vLLM: the serving search sweeps the experts splits, and the
    Megatron and best-practice baselines it reports are each the best over the same splits
    (each split's own search ran them at the same budget), not the default split's alone --
    which here is beaten by a re-split's (the default's is what --runtime dtensor, sweeping
    no split, reports)."""
    from shardc.serving.splits import serve_splits

    g, mesh = load_graph(MIXTRAL), Mesh.parse("8x1")
    wl = Workload(phase="serve", mode="agg", isl=256, osl=64)
    kw = dict(policy="megatron", budget=50, extra_policies=("best_practice",), engine="vllm")
    out = serve_search(g, mesh, "h100", wl, runtime="vllm", **kw)
    splits = serve_splits(g, mesh, "h100", wl, {}, "vllm", False)
    assert splits
    per_split = [serve_search(g, mesh, "h100", wl, runtime="vllm", fixed={"moe_tp": mt}, **kw)
                 for mt in splits]
    default = serve_search(g, mesh, "h100", wl, runtime="dtensor", **kw)
    for name in ("megatron", "best_practice"):
        want = max([getattr(o, name).tok_s_per_gpu for o in per_split]
                   + [getattr(default, name).tok_s_per_gpu])
        assert getattr(out, name).tok_s_per_gpu == pytest.approx(want), name
        assert want > getattr(default, name).tok_s_per_gpu  # a re-split's baseline won
    assert out.choice.tok_s_per_gpu >= out.best_practice.tok_s_per_gpu


def test_megatron_baseline_sweeps_the_splits_like_best_practice():
    """The single-phase Megatron baseline runs its rule at the default split and in every
    re-split copy some engine runs (as the best-practice baseline does), and reports the
    best: Mixtral-8x7B 8x1 prefill, where Megatron's rule does better with the experts split
    moe_tp=2 x moe_ep=4 over tp=2 x dp_attn=4 than at any default split. The plan is still
    compared only with the baselines its runtime runs (the default split's)."""
    g, m = load_graph(MIXTRAL), Mesh.parse("8x1")
    w = Workload(phase="prefill", context=4096)
    out = search_pass(g, m, "h100", w, policy="megatron", budget=4000)
    cm = out.cost_model
    space = StrategySpace(g, m, w, tp_domain=nvlink_tp_domain(m, cm.hw.nvlink_domain, False))
    values = [run_search("megatron", sp, cost_model_objective(cm, sp), budget=4000,
                         seed=0).best_value for sp in split_spaces(space, "any")]
    assert out.megatron.best_value == pytest.approx(max(values))
    assert max(values[1:]) > values[0]  # a re-split won
    assert out.megatron.space.decode(out.megatron.best_action).degrees.experts_resplit
    assert out.result.best_value == pytest.approx(values[0])  # the plan: the default's
