"""The RL agent on a small constructed case with a known optimum."""

import numpy as np
import pytest

from shardc.search import run_search
from shardc.search.legal import LegalSampler
from shardc.search.policy import EliteHistory
from shardc.search.rl import RLConfig
from shardc.search.synthetic import SyntheticObjective, toy_space


@pytest.fixture(scope="module")
def case():
    space = toy_space()
    objective = SyntheticObjective(space, seed=2)
    optimum = run_search("exact", space, objective, seed=0)
    return space, objective, optimum


def test_exact_is_the_brute_force_optimum(case):
    space, objective, optimum = case
    sampler = LegalSampler(space)
    assert optimum.complete
    assert optimum.evaluations <= sampler.count_legal()
    # brute force without pruning over a random legal sample never beats it
    acts = sampler.sample(20000, np.random.default_rng(0))
    v, f = objective(acts)
    assert np.where(f, v, 0).max() <= optimum.best_value + 1e-9


def test_agent_finds_the_known_optimum_within_budget(case):
    space, objective, optimum = case
    result = run_search("rl", space, objective, budget=4000, seed=0)
    assert result.evaluations == 4000
    assert result.best_value == pytest.approx(optimum.best_value)
    np.testing.assert_array_equal(result.best_action, optimum.best_action)


def test_agent_is_deterministic_for_a_seed(case):
    space, objective, _ = case
    a = run_search("rl", space, objective, budget=320, seed=3)
    b = run_search("rl", space, objective, budget=320, seed=3)
    c = run_search("rl", space, objective, budget=320, seed=4)
    np.testing.assert_array_equal(a.best_action, b.best_action)
    assert a.curve == b.curve
    assert a.curve != c.curve


def test_budget_counts_infeasible_evaluations():
    space = toy_space()
    calls = []

    def never_feasible(actions):
        calls.append(len(actions))
        return np.ones(len(actions)), np.zeros(len(actions), dtype=bool)

    result = run_search("rl", space, never_feasible, budget=100, seed=0)
    assert sum(calls) == 100 == result.evaluations
    assert result.best_action is None and result.best_value == 0.0


def test_confidence_exit_reinitialises_and_keeps_the_elite():
    """A one-point objective makes the policy converge fast; the search still spends the
    whole budget over several network lives and keeps the best it found."""
    space = toy_space()
    sampler = LegalSampler(space)
    target = sampler.sample(1, np.random.default_rng(5))[0]

    def peaked(actions):
        hits = (actions == target).sum(axis=1)
        return np.exp(hits.astype(float)), np.ones(len(actions), dtype=bool)

    cfg = RLConfig(lr=3e-3, batch=32)
    result = run_search("rl", space, peaked, budget=1600, seed=0, cfg=cfg)
    assert result.evaluations == 1600
    np.testing.assert_array_equal(result.best_action, target)
    assert result.extra["network_lives"] > cfg.chunks  # early exits happened
    plain = run_search("rl", space, peaked, budget=1600, seed=0,
                       cfg=RLConfig(lr=3e-3, batch=32, confidence=1.01))
    assert plain.extra["network_lives"] == cfg.chunks  # never confident: one life per chunk


def test_elite_history_keeps_the_best_distinct_feasible():
    h = EliteHistory(2, size=3)
    acts = np.array([[0, 0], [0, 1], [0, 1], [1, 1], [1, 0]])
    h.add(acts, np.array([5.0, 9.0, 9.0, 7.0, 100.0]), np.array([1, 1, 1, 1, 0], bool))
    np.testing.assert_array_equal(h.actions, [[0, 1], [1, 1], [0, 0]])
    h.add(np.array([[1, 0]]), np.array([6.0]), np.array([True]))
    np.testing.assert_array_equal(h.values, [9.0, 7.0, 6.0])
