"""A gymnasium environment over the strategy space and the cost model (external agents).

One step = one strategy proposed and evaluated (one simulator call against the budget).
An episode is one search: it ends (``truncated``) when ``budget`` evaluations are spent;
``reset`` starts a new search (empty elite history, best-so-far 0).

* action space: ``MultiDiscrete(space.nvec)`` -- the StrategySpace action vector;
* observation: the elite history (:class:`~shardc.search.policy.EliteHistory`), a
  ``[T, sum(nvec) + 2]`` float32 box in [0, 1];
* reward: the agent's reward (:mod:`shardc.search.rl`): ``alpha * raw + beta * (raw - best)``
  with ``raw`` = tok/s/GPU over the best seen so far (this step included), infeasible ->
  ``infeasible_reward``.

External agents do not know the conditional masks, so an illegal action (degrees not tiling
the mesh, an op choice illegal at the chosen tp) is *repaired* before evaluation: each
offending component, in order tp, ep, pp, ..., op slots, is replaced by the legal value
nearest in index (ties: the lower). ``info["action"]`` is what was evaluated and
``info["repaired"]`` says whether it differs. ``info`` also carries ``value``, ``feasible``,
``best_value`` and ``evaluations``.
"""

from __future__ import annotations

import gymnasium as gym
import numpy as np

from shardc.search.legal import LegalSampler
from shardc.search.objective import Budget, Objective
from shardc.search.policy import EliteHistory
from shardc.search.rl import RLConfig, rewards_for


class ShardingEnv(gym.Env):
    metadata = {"render_modes": []}

    def __init__(self, space, objective: Objective, budget: int = 4000, history: int = 3,
                 cfg: RLConfig | None = None):
        super().__init__()
        self.space = space
        self.objective = objective
        self.budget_size = int(budget)
        self.cfg = cfg or RLConfig(history=history)
        self.sampler = LegalSampler(space)
        width = int(self.sampler.offsets[-1]) + 2
        self.action_space = gym.spaces.MultiDiscrete(np.asarray(space.nvec, dtype=np.int64))
        self.observation_space = gym.spaces.Box(0.0, 1.0, shape=(self.cfg.history, width),
                                                dtype=np.float32)
        self._new_search()

    def _new_search(self) -> None:
        self.meter = Budget(self.objective, self.budget_size)
        self.history = EliteHistory(self.sampler.n_comp, self.cfg.history)

    def nearest_legal(self, action: np.ndarray) -> np.ndarray:
        """The repair described in the module docstring (deterministic)."""
        a = np.clip(np.asarray(action, dtype=np.int64).reshape(1, -1), 0,
                    self.sampler.nvec[None, :] - 1)
        for j in range(self.sampler.n_comp):
            m = self.sampler.component_mask(a, j)[0]
            if not m[a[0, j]]:
                legal = np.flatnonzero(m)
                a[0, j] = legal[np.argmin(np.abs(legal - a[0, j]))]
        return a[0]

    def reset(self, *, seed: int | None = None, options=None):
        super().reset(seed=seed)
        self._new_search()
        return self.history.observation(self.sampler), {}

    def step(self, action):
        a = self.nearest_legal(action)
        best_before = self.meter.best_value
        value, feasible = self.meter(a[None])
        ref = self.meter.best_value if self.meter.best_value > 0 else 1.0
        reward = float(rewards_for(value, feasible, ref, best_before, self.cfg)[0])
        self.history.add(a[None], value, feasible)
        obs = self.history.observation(self.sampler)
        truncated = self.meter.remaining == 0
        info = {"action": a, "repaired": not np.array_equal(a, np.asarray(action)),
                "value": float(value[0]), "feasible": bool(feasible[0]),
                "best_value": self.meter.best_value, "evaluations": self.meter.evaluations}
        return obs, reward, False, truncated, info
