"""The serving choice is the best feasible deployment of every row the run evaluated.

Rows with random values, latencies and feasibility are recorded under the run's search tags
(the policy, the baselines, the exact sweep) in real pools (the mixtral fixture graph's
spaces and cost models, 8x2 mesh); :func:`shardc.serving.search.summarise` must then return a plan
that no printed alternative, SLO move at tighter SLOs, per-mode best or baseline beats, and
that equals the brute-force best of the feasible rows (agg)."""

from __future__ import annotations

import numpy as np
import pytest

from shardc.ir.space import DECODE_BATCHES, StrategySpace
from shardc.ir.strategy import Mesh, Workload
from shardc.search import SearchResult
from shardc.search.legal import LegalSampler
from shardc.serving.pool_models import pool_cost_model, pool_workload
from shardc.serving.pools import PoolObjective, PoolSearch
from shardc.serving.search import half_mesh, summarise
from tests.cost_graphs import fixture_graph

TAGS = ("rl", "megatron", "best_practice", "exact")
MESH = Mesh.parse("8x2")


@pytest.fixture(scope="module")
def graph():
    return fixture_graph("mixtral_8x7b")


def _pool(graph, mesh: Mesh, wl: Workload, role: str) -> PoolSearch:
    space = StrategySpace(graph, mesh, pool_workload(wl, role))
    if role != "prefill":
        space.values["batch"] = list(DECODE_BATCHES)
    cm = pool_cost_model(graph, mesh, "h100", wl, role)
    obj = PoolObjective(cm, space, role)
    return PoolSearch(role, space, cm, obj,
                      {t: SearchResult(None, 0.0, 0, [], 0.0, t, 0) for t in TAGS})


def _record(pool: PoolSearch, tag: str, actions: np.ndarray, rng, wl: Workload) -> None:
    deg = pool.space.degree_arrays(actions)
    n = len(actions)
    pool.objective.rows.append(dict(
        actions=actions.copy(), value=rng.uniform(1.0, 100.0, n),
        tpot=rng.uniform(0.5, 1.5, n) * wl.tpot_slo_ms, ttft=rng.uniform(0.5, 1.5, n) * wl.ttft_slo_ms,
        fits=rng.random(n) < 0.9, memory=np.zeros(n, bool), gpus=deg["tp"] * deg["ep"] * deg["pp"],
        batch=deg["batch"], tag=np.full(n, tag, dtype=object)))


def _random_pools(graph, mode: str, seed: int, wl: Workload) -> dict:
    rng = np.random.default_rng(seed)
    roles = {"agg": [("mixed", MESH)], "disagg": [("prefill", half_mesh(MESH)),
                                                  ("decode", half_mesh(MESH))]}[mode]
    pools = {}
    for role, mesh in roles:
        pool = _pool(graph, mesh, wl, role)
        sampler = LegalSampler(pool.space)
        shared = sampler.sample(4, rng)  # rows two searches both evaluated
        for tag in TAGS:
            own = sampler.sample(int(rng.integers(5, 40)), rng)
            pool.objective.tag = tag
            _record(pool, tag, np.concatenate([own, shared]), rng, wl)
        pools[role] = pool
    return pools


@pytest.mark.parametrize("mode", ["agg", "disagg"])
def test_nothing_printed_beats_the_choice(graph, mode):
    wl = Workload(phase="serve", isl=1024, osl=256, mode=mode, tpot_slo_ms=40.0,
                  ttft_slo_ms=1500.0)
    for seed in range(6):
        pools = _random_pools(graph, mode, seed, wl)
        out = summarise(pools, wl, MESH, "rl", ("best_practice", "exact"))
        v = out.choice.tok_s_per_gpu * (1 + 1e-12)
        assert all(a["tok_s_per_gpu"] <= v for a in out.alternatives)
        for move in out.slo_moves:
            if move["slo_scale"] < 1 and move["tok_s_per_gpu"] is not None:
                assert move["tok_s_per_gpu"] <= v
            if move["slo_scale"] > 1:  # looser SLOs keep every plan of the asked ones
                assert move["tok_s_per_gpu"] >= out.choice.tok_s_per_gpu * (1 - 1e-12)
        for c in (*out.by_mode.values(), out.megatron, out.best_practice, out.own, out.agent,
                  out.exact):
            assert c is None or c.tok_s_per_gpu <= v
        assert out.agent is None or out.agent.tok_s_per_gpu >= out.own.tok_s_per_gpu
        if mode == "agg":  # the brute-force best feasible row of every search
            t = pools["mixed"].objective.table()
            ok = pools["mixed"].objective.feasible(t, wl.tpot_slo_ms, wl.ttft_slo_ms)
            assert out.choice.tok_s_per_gpu == t["value"][ok].max()
        parts = out.chosen_from.split("+")
        parts = parts * len(out.choice.pools) if len(parts) == 1 else parts
        for (role, _, _, row), tag in zip(out.choice.pools, parts):  # a search of the row
            t = pools[role].objective.table()
            assert tag in set(t["tag"][(t["actions"] == row["actions"]).all(axis=1)])


def test_a_tie_keeps_the_policy_plan(graph):
    wl = Workload(phase="serve", isl=1024, osl=256, mode="agg", tpot_slo_ms=40.0,
                  ttft_slo_ms=1500.0)
    pool = _pool(graph, MESH, wl, "mixed")
    rng = np.random.default_rng(0)
    acts = LegalSampler(pool.space).sample(2, rng)
    for tag, a in (("megatron", acts[:1]), ("rl", acts[1:])):
        pool.objective.tag = tag
        pool.objective.rows.append(dict(
            actions=a, value=np.array([10.0]), tpot=np.array([30.0]), ttft=np.array([900.0]),
            fits=np.array([True]), memory=np.array([False]), gpus=np.array([8]),
            batch=np.array([8]), tag=np.full(1, tag, dtype=object)))
    out = summarise({"mixed": pool}, wl, MESH, "rl", ())
    assert out.chosen_from == "rl"
    assert (out.choice.pools[0][3]["actions"] == acts[1]).all()
