"""Every searcher: legal strategies only, the budget respected, determinism."""

import numpy as np
import pytest

from shardc.search import POLICIES, run_search
from shardc.search.baselines import megatron_actions
from shardc.search.legal import LegalSampler
from shardc.search.objective import Budget
from shardc.search.synthetic import SyntheticObjective, toy_space


class Recorder:
    """Wraps an objective and keeps every action it was asked to evaluate."""

    def __init__(self, objective):
        self.objective = objective
        self.seen = []

    def __call__(self, actions):
        self.seen.append(np.array(actions))
        return self.objective(actions)


@pytest.fixture(scope="module")
def space():
    return toy_space(mesh="8x2")


@pytest.mark.parametrize("policy", POLICIES)
def test_searchers_evaluate_and_return_only_legal_strategies(space, policy):
    sampler = LegalSampler(space)
    rec = Recorder(SyntheticObjective(space, seed=2))
    budget = 256 if policy not in ("exact",) else None
    result = run_search(policy, space, rec, budget=budget or 1, seed=0)
    seen = np.concatenate(rec.seen)
    assert sampler.legal(seen).all()
    assert result.found and sampler.legal(result.best_action[None])[0]
    assert result.evaluations == len(seen)
    if policy in ("rl", "sa", "rw", "ga"):
        assert result.evaluations == 256
    v, f = rec.objective(result.best_action[None])
    assert f[0] and v[0] == pytest.approx(result.best_value)
    assert result.curve[-1] == (result.evaluations, result.best_value)
    assert all(b1 <= b2 for (_, b1), (_, b2) in zip(result.curve, result.curve[1:]))


@pytest.mark.parametrize("policy", ["sa", "rw", "ga"])
def test_baselines_are_deterministic_for_a_seed(space, policy):
    obj = SyntheticObjective(space, seed=3)
    a = run_search(policy, space, obj, budget=300, seed=7)
    b = run_search(policy, space, obj, budget=300, seed=7)
    assert a.curve == b.curve
    np.testing.assert_array_equal(a.best_action, b.best_action)


def test_megatron_sweeps_every_tiling_degree_tuple_with_megatron_dims(space):
    sampler = LegalSampler(space)
    acts = megatron_actions(sampler)
    assert sampler.legal(acts).all()
    d = space.degree_arrays(acts)
    assert (space.mesh.gpus % (d["tp"] * d["ep"] * d["pp"]) == 0).all()
    # every tiling (tp, ep, pp) x batch appears exactly once
    keys = {tuple(a[:5]) for a in acts}
    assert len(keys) == len(acts)
    n_tiling = sum(int(sampler.pp_mask[t].sum()) for t in range(sampler.nvec[0]))
    assert len(acts) == n_tiling * space.nvec[3] * space.nvec[4]


def test_sa_and_ga_beat_random_walk_on_average(space):
    obj = SyntheticObjective(space, seed=4)
    opt = run_search("exact", space, obj).best_value
    mean = {p: np.mean([run_search(p, space, obj, budget=1500, seed=s).best_value
                        for s in range(3)]) for p in ("rw", "sa", "ga")}
    assert mean["sa"] > mean["rw"] and mean["ga"] > mean["rw"]
    assert max(mean.values()) <= opt + 1e-9


def test_legal_sampler_masks_tiling_and_ops(space):
    sampler = LegalSampler(space)
    rng = np.random.default_rng(0)
    acts = sampler.sample(4000, rng)
    assert sampler.legal(acts).all()
    # arbitrary integer vectors are repaired into legal ones, legal ones left alone
    raw = np.stack([rng.integers(0, n, size=500) for n in space.nvec], axis=1)
    fixed = sampler.repair(raw, rng)
    assert sampler.legal(fixed).all()
    ok = sampler.legal(raw)
    np.testing.assert_array_equal(fixed[ok], raw[ok])
    mutated = sampler.mutate(acts[:500], rng)
    assert sampler.legal(mutated).all() and (mutated != acts[:500]).any(axis=1).mean() > 0.9


def test_budget_truncates_and_counts():
    calls = []

    def obj(a):
        calls.append(len(a))
        return np.arange(len(a), dtype=float), np.ones(len(a), dtype=bool)

    b = Budget(obj, 10)
    b(np.zeros((7, 3), dtype=np.int64))
    v, _ = b(np.zeros((7, 3), dtype=np.int64))
    assert len(v) == 3 and calls == [7, 3] and b.evaluations == 10 and b.remaining == 0
