"""The gymnasium environment, and Stable-Baselines3 PPO on it (the paper's own setup)."""

import numpy as np
import pytest

from shardc.search.env import ShardingEnv
from shardc.search.legal import LegalSampler
from shardc.search.synthetic import SyntheticObjective, toy_space


def make_env(budget=64):
    space = toy_space()
    return ShardingEnv(space, SyntheticObjective(space, seed=0), budget=budget)


def test_env_follows_the_gymnasium_api():
    from gymnasium.utils.env_checker import check_env

    check_env(make_env(), skip_render_check=True)


def test_env_repairs_illegal_actions_and_counts_every_step():
    env = make_env(budget=5)
    sampler = LegalSampler(env.space)
    obs, _ = env.reset(seed=0)
    assert obs.shape == env.observation_space.shape and not obs.any()
    illegal = np.array(env.space.nvec) - 1  # tp 8, ep 8, pp 8: 512 GPUs on an 8-GPU mesh
    assert not sampler.legal(illegal[None])[0]
    _, _, _, trunc, info = env.step(illegal)
    assert info["repaired"] and sampler.legal(info["action"][None])[0] and not trunc
    for _ in range(4):
        obs, reward, term, trunc, info = env.step(env.action_space.sample())
    assert trunc and not term and info["evaluations"] == 5
    assert obs[0, -1] == 1.0 or info["best_value"] == 0.0  # elite row present once feasible


def test_sb3_ppo_runs_on_the_env():
    sb3 = pytest.importorskip("stable_baselines3")
    import torch

    torch.set_num_threads(1)
    env = make_env(budget=256)
    model = sb3.PPO("MlpPolicy", env, n_steps=64, batch_size=32, n_epochs=2, seed=0,
                    policy_kwargs={"net_arch": [64]}, device="cpu")
    model.learn(total_timesteps=256)
    obs, _ = env.reset(seed=0)
    action, _ = model.predict(obs, deterministic=True)
    assert env.action_space.contains(np.asarray(action))
