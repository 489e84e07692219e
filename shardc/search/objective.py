"""The searchers' view of the cost model: a batched objective with a hard evaluation budget.

An *objective* is any callable ``objective(actions[B, A]) -> (value[B], feasible[B])`` with
``value`` in tokens/s per GPU and ``feasible`` a bool array (memory fits, SLOs met). The cost
model is adapted by :func:`cost_model_objective`; tests use synthetic objectives.

:class:`Budget` wraps one and is the single place where evaluations are counted: every row
passed to the simulator counts, feasible or not, and a call is truncated to what is left of
the budget. It keeps the best feasible action, the best-so-far curve and reports progress.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

Objective = Callable[[np.ndarray], tuple[np.ndarray, np.ndarray]]
Progress = Callable[[int, float], Any]


class BudgetExhausted(Exception):
    """Raised by :meth:`Budget.__call__` when no evaluation is left."""


class Budget:
    """Counts and caps evaluations of ``objective``; remembers the best feasible action.

    ``best_value`` is in tokens/s per GPU (0.0 while nothing feasible was seen);
    ``curve`` is a list of ``(evaluations, best_value)`` recorded after every call.
    """

    def __init__(self, objective: Objective, budget: int | None, progress: Progress | None = None):
        self.objective = objective
        self.budget = None if budget is None else int(budget)
        self.progress = progress
        self.evaluations = 0
        self.best_value = 0.0
        self.best_action: np.ndarray | None = None
        self.curve: list[tuple[int, float]] = []

    @property
    def remaining(self) -> int:
        return (1 << 62) if self.budget is None else max(self.budget - self.evaluations, 0)

    def __call__(self, actions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Evaluate up to ``remaining`` rows of ``actions``; returns (value, feasible) for the
        rows evaluated (possibly fewer than given). Raises BudgetExhausted when none is left."""
        a = np.atleast_2d(np.asarray(actions, dtype=np.int64))
        n = min(a.shape[0], self.remaining)
        if n <= 0:
            raise BudgetExhausted
        a = a[:n]
        value, feasible = self.objective(a)
        value = np.asarray(value, dtype=np.float64).reshape(n)
        feasible = np.asarray(feasible, dtype=bool).reshape(n) & np.isfinite(value)
        self.evaluations += n
        if feasible.any():
            masked = np.where(feasible, value, -np.inf)
            i = int(np.argmax(masked))
            if self.best_action is None or masked[i] > self.best_value:
                self.best_value = float(masked[i])
                self.best_action = a[i].copy()
        self.curve.append((self.evaluations, self.best_value))
        if self.progress is not None:
            self.progress(self.evaluations, self.best_value)
        return value, feasible


class CostModelObjective:
    """``CostModel.evaluate(actions, space) -> Evaluation`` (shardc.cost) as an objective:
    value = ``tok_s_per_gpu``, feasible = ``feasible``. Keeps ``cost_model`` and ``space``
    so ``exact`` can use the cost model's branch decomposition.

    ``op_choices_free_at_tp1``: with tp = 1 there is no tensor-parallel mesh dimension, so
    every per-op choice means the same placement (replicated) and costs the same; searchers
    may store such strategies with any representative op choices
    (:func:`shardc.ir.space.megatron_ops_at_tp1`; tests check the claim on the Llama,
    Mixtral, DeepSeek-V3 and GPT-MoE configurations, prefill and decode)."""

    op_choices_free_at_tp1 = True

    def __init__(self, cost_model, space):
        self.cost_model = cost_model
        self.space = space
        # the exact sweep's branch costs of the next call's rows, priced before
        # (:class:`shardc.cost.decomposition.GridTermCosts`); None: the cost model prices them
        self.term_costs = None

    def __call__(self, actions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        ev = self.cost_model.evaluate(np.atleast_2d(actions), self.space,
                                      term_costs=self.term_costs)
        wl = self.cost_model.workload
        # how far from feasible (CostModel.violation), read by the row polisher's repair
        self.last_violation = self.cost_model.violation(ev, wl.tpot_slo_ms, wl.ttft_slo_ms)
        # model bytes / usable HBM, read by the row polisher's lean screen
        self.last_memory = self.cost_model.memory_ratio(ev)
        return np.asarray(ev.tok_s_per_gpu, dtype=np.float64), np.asarray(ev.feasible, dtype=bool)


def cost_model_objective(cost_model, space) -> CostModelObjective:
    """The objective for ``run_search`` over ``space`` scored by ``cost_model``."""
    return CostModelObjective(cost_model, space)
