"""The engine searches sweep the mixed experts splits (``moe_tp`` and ``moe_ep`` both > 1,
e.g. tp8 with expert TP2 x EP4) wherever the engine spells them (issue 21): SGLang and
TensorRT-LLM (``--tp-size tp*dp_attn --ep-size moe_ep``), never vLLM (its flags split the
experts over all of an instance's ranks, one way)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from shardc.backends.launch import LaunchPool, engine_flags
from shardc.cost import CostModel, load_hardware
from shardc.errors import InputError
from shardc.frontends import load_graph
from shardc.ir.engines import experts_split_ok, has_dense_mlp, runtime_choices
from shardc.ir.space import StrategySpace, nvlink_tp_domain
from shardc.ir.strategy import Degrees, Mesh, Strategy, Workload
from shardc.search.engine_search import engine_mode_spaces, search_engine
from shardc.validate import divisors

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = ROOT / "examples" / "configs"


def _setup(model: str, mesh: str, hardware: str = "h100", engine: str = "sglang",
           kernels: str = "roofline", **wl):
    g = load_graph(str(CONFIGS / model / "config.json"))
    m, hw = Mesh.parse(mesh), load_hardware(hardware)
    w = Workload(**wl)
    space = StrategySpace(g, m, w, tp_domain=nvlink_tp_domain(m, hw.nvlink_domain))
    return g, m, hw, w, space, CostModel(g, m, hw, w, engine=engine, kernels=kernels)


def _simulate_best(graph, mesh, hw, workload, cm, engine: str) -> tuple[float, Degrees | None]:
    """The best tok/s/GPU over every (tp, dp_attn, pp, moe_tp, moe_ep, batch) that ``shardc
    simulate --runtime ENGINE --degrees ...`` prices, each priced as simulate does: the space
    built with the split fixed (moe_tp, moe_ep and dp_attn, as simulate's), the engine's own
    per-op choices at those degrees (every mode of it), every batch candidate."""
    domain = nvlink_tp_domain(mesh, hw.nvlink_domain)
    best, arg = -np.inf, None
    world = mesh.gpus
    for tp in divisors(world):
        for ep in divisors(world // tp):
            for pp in divisors(world // (tp * ep)):
                for mt in divisors(tp * ep):
                    me = tp * ep // mt
                    split = {} if (mt, me) == (tp, ep) else {"moe_tp": mt, "moe_ep": me,
                                                             "ep": ep}
                    try:
                        space = StrategySpace(graph, mesh, workload, tp_domain=domain,
                                              fixed=split)
                    except InputError:  # simulate's exit 2: this split means nothing here
                        continue
                    if any(v not in space.values[k] for k, v in
                           (("tp", tp), ("ep", ep), ("pp", pp))):
                        continue
                    deg = Degrees(tp=tp, ep=ep, pp=pp, dp=world // (tp * ep * pp),
                                  moe_tp=mt, moe_ep=me)
                    candidates, _ = runtime_choices(engine, space, tp, ep, 1)
                    rows = [(c, b) for c in candidates for b in space.values["batch"]]
                    if not rows:
                        continue
                    acts = np.array([space.encode(Strategy(deg, b, c)) for c, b in rows])
                    ev = cm.evaluate(acts, space)
                    values = np.where(ev.feasible, ev.tok_s_per_gpu, -np.inf)
                    if values.max() > best:
                        best, arg = float(values.max()), deg
    return best, arg


@pytest.mark.parametrize("model, mesh, mixed", [("qwen3_30b_a3b", "8x1", False),
                                                 ("mixtral_8x7b", "8x2", False),
                                                 ("granite3_0_3b_a800m", "8x2", True)])
def test_sglang_exact_optimum_is_the_best_simulate_prices(model, mesh, mixed):
    """Closed form: ``--runtime sglang --search exact`` (the engine's space swept whole,
    re-splits included) finds exactly the best of every configuration ``shardc simulate
    --runtime sglang`` prices, enumerated independently of the search's split copies.
    Granite-3.0-3B-A800M 8x2 decode: the optimum is a mixed split (tp=1 pp=2 dp_attn=4 with
    the experts TP2 x EP2), which a sweep of the all-TP / all-EP splits alone misses;
    Mixtral 8x2: simulate also prices dp_attn=16 on the 8 experts (moe_ep 8 or 1), which
    the re-split copies hold."""
    g, m, hw, w, space, cm = _setup(model, mesh, phase="decode")
    found = search_engine("exact", space, "sglang", cost_model=cm)
    assert found.complete
    want, deg = _simulate_best(g, m, hw, w, cm, "sglang")
    assert np.isfinite(want)
    assert found.result.best_value == pytest.approx(want, rel=1e-9)
    s = (found.result.space or space).decode(found.result.best_action)
    assert cm.simulate(s).predicted["tok_s_per_gpu"] == pytest.approx(want, rel=1e-9)
    assert _mixed(deg) == _mixed(s.degrees) == mixed


def _mixed(d: Degrees) -> bool:
    return d.experts_resplit and d.moe_tp > 1 and d.moe_ep > 1


def test_engine_searches_sweep_mixed_splits_only_where_the_engine_spells_them():
    """Mixtral 8x1 (no dense MLP): SGLang's split copies hold mixed splits beside tp > 1 and
    dp_attn > 1, TensorRT-LLM's only at tp = 1 or dp_attn = 1; vLLM's none (c); every pair
    of every copy is a split the engine spells."""
    _, _, _, _, space, _ = _setup("mixtral_8x7b", "8x1", phase="decode")
    dense = has_dense_mlp(space)
    seen = {}
    for engine in ("sglang", "trtllm", "vllm"):
        kinds = set()
        for _, ms, sp in engine_mode_spaces(space, engine):
            for t, e in ms.allowed_tp_ep:
                mt, me = (int(x) for x in sp.experts_split(t, e))
                if (mt, me) == (t, e):
                    continue
                assert experts_split_ok(engine, t, e, mt, me, dense)
                if mt > 1 and me > 1:
                    kinds.add((t > 1, e > 1))
        seen[engine] = kinds
    assert seen["sglang"] == {(True, False), (False, True), (True, True)}
    assert seen["trtllm"] == {(True, False), (False, True)}
    assert seen["vllm"] == set()


def _pure_splits_only(monkeypatch):
    """The searches as before mixed splits were swept: default, all-TP and all-EP only."""
    import shardc.ir.engines as engines
    import shardc.search.engine_search as engine_search

    def pure(tp, ep, mt, me):
        return (mt, me) == (tp, ep) or (mt * me == tp * ep and 1 in (mt, me))

    monkeypatch.setattr(engines, "plan_places_split", pure)
    monkeypatch.setattr(engine_search, "plan_places_split", pure)


def test_a_mixed_split_wins_kimi_k2_fp8_on_32_h200s_and_the_scripts_carry_it(monkeypatch):
    """Kimi-K2 (DeepSeek-V3's architecture) FP8 decode on 8x4 H200, the engines' measured
    kernel tables: SGLang's and TensorRT-LLM's best is attention data-parallel over 16 ranks
    with the experts TP2 x EP8 (moe_tp=2, moe_ep=8), strictly above their best without
    mixed splits (the default split at dp_attn=16; today 1412.7 against 1353.3 tok/s/GPU for
    SGLang, 1937.9 against 1673.1 for TensorRT-LLM); the scripts say it with ``--tp-size 16
    --ep-size 8`` (MoE tp = 16 / 8). vLLM, which has no flag for it, keeps a pure split (c)."""
    from shardc.backends.launch import role_for_phase

    got = {}
    for engine in ("sglang", "trtllm", "vllm"):
        _, _, _, _, space, cm = _setup("kimi_k2", "8x4", "h200", engine, phase="decode",
                                       weights="fp8", kernels="silicon")
        found = search_engine("exact", space, engine, cost_model=cm)
        split_space = found.result.space or space
        s = split_space.decode(found.result.best_action)
        assert found.result.best_value == pytest.approx(
            cm.simulate(s).predicted["tok_s_per_gpu"], rel=1e-9)
        got[engine] = (found.result.best_value, s, split_space)
    for engine in ("sglang", "trtllm"):
        value, s, split_space = got[engine]
        d = s.degrees
        assert _mixed(d) and (d.tp, d.ep, d.moe_tp, d.moe_ep) == (1, 16, 2, 8)
        pool = LaunchPool.of(role_for_phase("decode"), s, split_space, 4096, 0.9)
        flags = engine_flags(engine, pool)
        tp_flag, ep_flag = ("--tp-size", "--ep-size") if engine == "sglang" else \
            ("--tp_size", "--ep_size")
        assert flags[flags.index(tp_flag) + 1] == "16"
        assert flags[flags.index(ep_flag) + 1] == "8"
    assert not _mixed(got["vllm"][1].degrees)
    _pure_splits_only(monkeypatch)
    for engine in ("sglang", "trtllm"):
        _, _, _, _, space, cm = _setup("kimi_k2", "8x4", "h200", engine, phase="decode",
                                       weights="fp8", kernels="silicon")
        pure = search_engine("exact", space, engine, cost_model=cm)
        assert not _mixed((pure.result.space or space).decode(pure.result.best_action).degrees)
        assert got[engine][0] > 1.03 * pure.result.best_value


@pytest.mark.parametrize("model, mesh", [("mixtral_8x7b", "8x1"), ("qwen3_30b_a3b", "8x2")])
def test_vllm_never_gets_a_mixed_split(model, mesh):
    """(c) vLLM's split copies hold only all-TP / all-EP pairs beside the default split, on
    models with and without mixed winners for the other engines."""
    _, _, _, _, space, _ = _setup(model, mesh, phase="decode", engine="vllm")
    for _, ms, sp in engine_mode_spaces(space, "vllm"):
        for t, e in ms.allowed_tp_ep:
            mt, me = (int(x) for x in sp.experts_split(t, e))
            assert (mt, me) == (t, e) or 1 in (mt, me)


def test_resplit_copies_keep_a_dp_attn_that_does_not_divide_the_experts():
    """Mixtral (8 experts) on 8x2: the searched space keeps dp_attn dividing the experts at
    the default split, but a re-split copy holds dp_attn=16 where its moe_ep divides them --
    vLLM's ``--data-parallel-size 16`` with the experts TP over the 16 ranks, SGLang's also
    with the experts TP2 x EP8 -- and never where moe_ep would not (moe_ep=16)."""
    _, _, _, _, space, _ = _setup("mixtral_8x7b", "8x2", phase="decode")
    assert 16 not in space.values["ep"]
    found = {}
    for engine in ("vllm", "sglang"):
        splits = set()
        for _, ms, sp in engine_mode_spaces(space, engine):
            assert sp.values["ep"][:len(space.values["ep"])] == space.values["ep"]
            for t, e in ms.allowed_tp_ep:
                mt, me = (int(x) for x in sp.experts_split(t, e))
                assert mt and 8 % me == 0
                if e == 16:
                    splits.add((t, mt, me))
        found[engine] = splits
    assert (1, 16, 1) in found["vllm"] and not any(1 < me for _, _, me in found["vllm"])
    assert {(1, 16, 1), (1, 2, 8)} <= found["sglang"]


def test_launch_entries_search_every_split_when_the_plan_is_a_resplit():
    """Mixtral-8x7B 8x128 decode: the dtensor plan is a mixed split (tp=1 pp=2 dp_attn=8 with
    the experts TP2 x EP4, found by re-pricing the search's best rows), decoded in its
    re-split copy; the engines' launch entries still search the whole space (every split),
    not that copy: vLLM's prediction is its exact optimum there (`dp_attn=8, moe_tp=8, pp=2`,
    3470.9 tok/s/GPU; the copy at moe_tp=2 holds no such split: 2763.8 there)."""
    from types import SimpleNamespace

    from shardc.driver import search_pass
    from shardc.launch_plan import single_phase_entry

    g, m, hw, w, space, _ = _setup("mixtral_8x7b", "8x128", phase="decode")
    outcome = search_pass(g, m, hw, w, policy="rl", budget=200, seed=0, kernels="silicon")
    d = outcome.strategy.degrees
    assert _mixed(d) and outcome.search_space is not None
    assert outcome.space.fixed.get("moe_tp") == d.moe_tp
    value = float(outcome.result.best_value)
    plan = SimpleNamespace(workload={"phase": "decode", "context": w.context},
                           predicted={"tok_s_per_gpu": value}, search={"policy": "rl"})
    entry = single_phase_entry("vllm", plan, outcome, graph=g, mesh=m, hw=hw, workload=w,
                               kernels="silicon", runtime="dtensor")
    cm = CostModel(g, m, hw, w, kernels="silicon", engine="vllm")
    best = search_engine("exact", space, "vllm", cost_model=cm).result.best_value
    assert entry["predicted"]["tok_s_per_gpu"] == pytest.approx(best, rel=1e-9)


def test_sglang_dp_attention_inside_tp_spells_a_resplit_with_ep_size():
    """SGLang's dp-attention mode at tp=8, dp_attn=1 (attention data-parallel inside the tp
    group) with the experts TP2 x EP4: ``--tp-size 8 --dp-size 8 --enable-dp-attention
    --ep-size 4`` -- the experts split is said even though dp_attn is 1."""
    from shardc.ir.engines import ENGINE_MODES, mode_row
    from shardc.ir.space import with_experts_split

    _, _, _, _, space, _ = _setup("mixtral_8x7b", "8x1", phase="decode")
    copy = with_experts_split(space, 2)
    mode = next(m for m in ENGINE_MODES["sglang"] if m.attention == "dp")
    row = mode_row(copy, mode, copy.values["tp"].index(8))
    s = Strategy(Degrees(tp=8, ep=1, pp=1, dp=1, moe_tp=2, moe_ep=4), 64,
                 {slot: int(c) for slot, c in zip(copy.op_slots, row)})
    pool = LaunchPool.of("decode", s, copy, 4096, 0.9)
    assert pool.dp_attention
    flags = engine_flags("sglang", pool)
    assert flags[flags.index("--tp-size") + 1] == "8"
    assert flags[flags.index("--dp-size") + 1] == "8"
    assert flags[flags.index("--ep-size") + 1] == "4"
