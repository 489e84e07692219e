"""Expert routing as a distribution (shardc.cost.routing): closed forms, Monte Carlo of the
exact top-k routing, EPLB, and the cost model reading it per strategy."""

from __future__ import annotations

import numpy as np
import pytest

from shardc.cost.routing import (
    eplb_layout,
    expert_imbalance,
    pick_probabilities,
    rank_imbalance,
)
from shardc.errors import InputError
from shardc.ir.strategy import Workload, parse_routing


def _exact_topk(tokens: int, experts: int, k: int, ep: int, q=None, trials=40, seed=1):
    """Monte Carlo of the real thing: every token picks k distinct experts (uniform, or with
    popularity ``q`` via Gumbel top-k on log q, placed at random expert ids), rows per
    contiguous block of experts/ep."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(trials):
        scores = rng.random((tokens, experts)) if q is None else \
            np.log(q)[None, :] + rng.gumbel(size=(tokens, experts))
        chosen = np.argpartition(-scores, k - 1, axis=1)[:, :k]
        ids = rng.permutation(experts)[chosen]
        per_rank = np.bincount((ids // (experts // ep)).ravel(), minlength=ep)
        out.append(per_rank.max() / per_rank.mean())
    return float(np.mean(out))


def test_parse_routing_and_workload_field():
    assert parse_routing("balanced") == ("balanced", 0.0)
    assert parse_routing("PowerLaw:1.2") == ("powerlaw", 1.2)
    assert Workload(routing="powerlaw:0.370").routing == "powerlaw:0.37"
    for bad in ("zipf", "powerlaw", "powerlaw:x", "powerlaw:-1", "powerlaw:nan", "uniform:2"):
        with pytest.raises(InputError, match="--routing"):
            Workload(routing=bad)
    with pytest.raises(InputError, match="--redundant-experts"):
        Workload(redundant_experts=-1)


def test_probabilities_sum_to_top_k_and_are_capped():
    for routing in ("uniform", "powerlaw:0.37", "powerlaw:1.2", "powerlaw:4"):
        q = pick_probabilities(64, 8, routing)
        assert q.sum() == pytest.approx(8.0) and (q <= 1 + 1e-12).all()
        assert (np.diff(q) <= 1e-15).all()  # most popular first
    # the default's published statistic: the top 20% of DeepSeek-V3's 256 experts take ~35%
    q = pick_probabilities(256, 8, "powerlaw:0.37")
    assert q[:51].sum() / 8 == pytest.approx(0.35, abs=0.01)


def test_balanced_and_single_rank_are_exactly_one():
    t = np.array([1.0, 64.0, 4096.0, 1e6])
    assert (rank_imbalance(t, 256, 8, 8, "balanced") == 1).all()
    assert (rank_imbalance(t, 256, 8, 1, "powerlaw:1.2") == 1).all()
    assert (expert_imbalance(t, 128, 8, "balanced") == 1).all()


@pytest.mark.parametrize("ep", [8, 32])
def test_uniform_rank_load_matches_exact_topk_monte_carlo(ep):
    for tokens in (64, 1024):
        got = float(rank_imbalance(tokens, 256, 8, ep, "uniform"))
        want = _exact_topk(tokens, 256, 8, ep)
        assert got == pytest.approx(want, rel=0.03), (tokens, got, want)


def test_powerlaw_rank_load_matches_exact_topk_monte_carlo():
    q = pick_probabilities(64, 4, "powerlaw:0.6")
    got = float(rank_imbalance(512, 64, 4, 8, "powerlaw:0.6"))
    want = _exact_topk(512, 64, 4, 8, q=q / q.sum(), trials=200)
    assert got == pytest.approx(want, rel=0.05), (got, want)


def test_uniform_closed_form_at_large_counts():
    """One expert per rank, many tokens: the busiest of E binomial counts is about
    mean + z(E) sd (Blom's expected maximum of E normals), so factor - 1 ~ z sqrt((1-q)/(Tq))."""
    from shardc.cost.imbalance import expected_max_normal

    E, k = 16, 2
    for T in (4096.0, 65536.0):
        q = k / E
        want = 1 + expected_max_normal(E) * np.sqrt((1 - q) / (T * q))
        assert float(rank_imbalance(T, E, k, E, "uniform")) == pytest.approx(want, rel=0.01)
        assert float(expert_imbalance(T, E, k, "uniform")) == pytest.approx(want, rel=0.01)


def test_skew_grows_with_alpha_and_falls_with_tokens_and_eplb():
    T = np.array([16.0, 256.0, 4096.0, 65536.0])
    f = {a: rank_imbalance(T, 256, 8, 32, f"powerlaw:{a}") for a in (0, 0.37, 0.9)}
    assert (f[0] <= f[0.37] + 1e-9).all() and (f[0.37] < f[0.9]).all()
    assert (np.diff(rank_imbalance(T, 256, 8, 32, "uniform")) < 0).all()
    prev = f[0.9]
    for r in (32, 64, 256):
        cur = rank_imbalance(T, 256, 8, 32, "powerlaw:0.9", redundant=r)
        assert (cur <= prev + 1e-9).all()
        prev = cur
    # EPLB removes the placement skew: at many tokens only the statistical spread is left
    assert float(prev[-1]) < 1.03 and float(f[0.9][-1]) > 3


def test_eplb_layout_fills_every_rank_and_replicates_the_hot_experts():
    q = pick_probabilities(32, 4, "powerlaw:1.0")
    copies, slots = eplb_layout(q, 4, 8)
    assert copies.sum() == 40 and slots.shape == (4, 10)
    assert np.bincount(slots.ravel(), minlength=32).tolist() == copies.tolist()
    assert copies[0] == copies.max() > 1
    load = (q / copies)[slots].sum(axis=1)
    assert load.max() / load.mean() < 1.1


def test_cost_model_reads_the_routing_per_strategy():
    """ep > 1 rows: the expert time follows the routing model (balanced = no extra rows,
    skewed = more); a fixed expert_imbalance still overrides; EPLB slots add expert weights."""
    from cost_graphs import fixture_graph

    from shardc.cost import CostModel
    from shardc.ir.space import StrategySpace
    from shardc.ir.strategy import Mesh
    from shardc.search.legal import LegalSampler

    g, mesh = fixture_graph("mixtral_8x7b"), Mesh(8, 1)
    base = Workload(context=2048, batch=None, tpot_slo_ms=1e9, ttft_slo_ms=1e9)
    space = StrategySpace(g, mesh, base)
    acts = LegalSampler(space).sample(256, np.random.default_rng(0))
    ep = space.degree_arrays(acts)["ep"]
    ev = {r: CostModel(g, mesh, "h100", Workload(**{**base.__dict__, "routing": r}))
          .evaluate(acts, space) for r in ("balanced", "uniform", "powerlaw:0.9")}
    fixed = CostModel(g, mesh, "h100", base, expert_imbalance=1.0).evaluate(acts, space)
    ok = np.isfinite(ev["balanced"].tpot_ms)
    assert (ok & (ep > 1)).sum() > 10
    np.testing.assert_allclose(ev["balanced"].tpot_ms[ok], fixed.tpot_ms[ok], rtol=1e-12)
    one = ok & (ep == 1)
    np.testing.assert_allclose(ev["powerlaw:0.9"].tpot_ms[one], fixed.tpot_ms[one], rtol=1e-12)
    many = ok & (ep > 1)
    assert (ev["uniform"].tpot_ms[many] > ev["balanced"].tpot_ms[many]).all()
    assert (ev["powerlaw:0.9"].tpot_ms[many] > ev["uniform"].tpot_ms[many]).all()
    skew = Workload(**{**base.__dict__, "routing": "powerlaw:0.9"})
    eplb_wl = Workload(**{**skew.__dict__, "redundant_experts": 8})
    cm_e = CostModel(g, mesh, "h100", eplb_wl)
    eplb = cm_e.evaluate(acts, space)
    tokens = space.degree_arrays(acts)["batch"].astype(float)  # decode: tokens over the group
    assert (cm_e.imbalance(tokens, ep)[many]
            < CostModel(g, mesh, "h100", skew).imbalance(tokens, ep)[many]).all()
    # the replicas are weights too (and a memory-bound decode step reads them)
    assert (eplb.memory_gb_per_gpu[many] > ev["powerlaw:0.9"].memory_gb_per_gpu[many]).all()


def test_bad_routing_flags_are_one_line_exit_2(capsys):
    from pathlib import Path

    from shardc.cli import main

    tiny = str(Path(__file__).resolve().parents[1] / "examples" / "tiny_llama.py")
    for flags, what in ((["--routing", "zipf"], "--routing 'zipf'"),
                        (["--redundant-experts", "-3"], "--redundant-experts")):
        try:
            code = main(["simulate", tiny, "--mesh", "1x1", "--degrees", "tp=1", *flags])
        except SystemExit as e:  # argparse's own check
            code = e.code
        assert code == 2
        err = capsys.readouterr().err
        assert err.startswith(f"shardc: error: {what}") and len(err.strip().splitlines()) == 1
