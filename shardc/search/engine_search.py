"""The search in the space a serving engine expresses (``--runtime vllm|sglang|trtllm``, and
every launch script): each of the engine's modes (:func:`shardc.ir.engines.mode_spaces`) is
a restricted copy of the space, searched by the same searchers with the same rules; the best
over the modes is the engine's plan.

``exact`` in an engine's space: every mode fixes one op row per tp, so the space is its
degrees x batches; :func:`exact_sweep` evaluates all of them in a few vectorised calls (the
generic solver's per-degree-tuple calls would pay the evaluator's fixed cost per row).

Budget: a budgeted searcher (rl, sa, rw, ga) gets ``budget // modes`` evaluations per mode
(at least 1; ``modes`` counted at the default experts split), so the search at the default
split spends the budget it was given exactly as without the re-splits, and each re-split mode
of a MoE model (:func:`engine_mode_spaces`: every experts split ``moe_tp x moe_ep`` the engine
spells, mixed ones -- both > 1, as SGLang's and TensorRT-LLM's ``--ep-size`` below their tp
size -- included) gets the same per-mode budget on top (the re-splits can only add to the
result); the sweeps (exact, megatron, best_practice) run whole
in every mode. ``exact`` is complete when every mode's
sweep is (then the value is the optimum of the engine's space under the cost model).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from shardc.ir.engines import EngineMode, mode_spaces, plan_places_split, split_spaces
from shardc.search import SWEEPS, SearchResult, cost_model_objective, run_search
from shardc.search.baselines import sweep_actions
from shardc.search.exact import EXACT_TIME_LIMIT_S
from shardc.search.legal import LegalSampler
from shardc.search.objective import Budget


@dataclass
class EngineSearch:
    """The engine's best: ``result`` (over every mode; ``best_action`` decodes in ``space``
    and in ``result.space`` -- or, when that is None, the unrestricted space -- alike), the
    ``space`` and ``mode`` it came from, and
    ``complete`` (False when some mode's exact sweep hit its time limit)."""

    engine: str
    result: SearchResult
    space: object
    mode: EngineMode | None
    complete: bool
    evaluations: int


def engine_mode_spaces(space, engine: str, resplit: bool = True
                       ) -> list[tuple[EngineMode, object, object]]:
    """(mode, mode space, split space) for every mode of ``engine`` in ``space`` and in its
    fixed-split copies (:func:`shardc.ir.engines.split_spaces`; there only the (tp, ep)
    pairs whose split differs from (tp, ep), which ``space`` itself covers), in that order.
    ``split space``: the unrestricted space the mode's actions decode in. ``resplit`` False:
    ``space`` alone (a caller sweeping the splits itself, as the serving search)."""
    out = []
    for i, sp in enumerate(split_spaces(space, engine) if resplit else [space]):
        for mode, ms in mode_spaces(sp, engine):
            pairs = tuple((t, e) for t, e in ms.allowed_tp_ep if _kept(sp, t, e, i > 0))
            if not pairs:
                continue
            ms.allowed_tp_ep = pairs
            out.append((mode, ms, sp))
    return out


def _kept(space, tp: int, ep: int, resplit_copy: bool) -> bool:
    """Whether the (tp, ep) pair stays in a mode space: its experts split tiles the tp x ep
    ranks (:func:`shardc.ir.engines.plan_places_split`: default, all-TP, all-EP or mixed; a
    split fixed in the space, as the serving search's, gives no split -- an invalid row --
    where its other half does not divide), and in a re-split copy differs from (tp, ep)."""
    mt, me = (int(x) for x in space.experts_split(tp, ep))
    if (mt, me) == (tp, ep):
        return not resplit_copy
    return plan_places_split(tp, ep, mt, me)


def search_engine(policy: str, space, engine: str, budget: int = 4000, seed: int = 0,
                  cost_model=None, objective_for=None, progress=None, resplit: bool = True,
                  **options) -> EngineSearch | None:
    """Search ``engine``'s modes of ``space`` -- and of its experts re-split copies
    (:func:`engine_mode_spaces`: for a MoE model every split the engine spells, all-TP,
    all-EP and mixed ones, as an outer loop over fixed-``moe_tp`` spaces) -- with ``policy``; None when the engine expresses nothing
    here. ``objective_for(mode_space)`` gives each mode's objective (default: the
    ``cost_model``'s); ``exact`` is :func:`exact_sweep`. Ties keep the first (``space``'s own
    split before the re-splits). The best's ``result.space`` is the space its action
    decodes in when that is a re-split copy (None: ``space``)."""
    modes = engine_mode_spaces(space, engine, resplit)
    if not modes:
        return None
    if objective_for is None:
        def objective_for(ms):
            return cost_model_objective(cost_model, ms)
    n_default = sum(1 for _, _, sp in modes if sp is space) or len(modes)
    per_mode = budget if policy in SWEEPS else max(int(budget) // n_default, 1)
    best: EngineSearch | None = None
    complete, evals = True, 0
    for mode, ms, sp in modes:
        if policy == "exact":
            r = exact_sweep(ms, objective_for(ms), seed, progress, **options)
        else:
            r = run_search(policy, ms, objective_for(ms), budget=per_mode, seed=seed,
                           progress=progress, **options)
        r.space = None if sp is space else sp
        complete &= bool(r.complete)
        evals += int(r.evaluations)
        if r.best_action is None or not np.isfinite(r.best_value):
            if best is None:
                best = EngineSearch(engine, r, ms, mode, True, 0)
            continue
        if best is None or best.result.best_action is None or r.best_value > best.result.best_value:
            best = EngineSearch(engine, r, ms, mode, True, 0)
    best.complete, best.evaluations = complete, evals
    return best


def exact_sweep(space, objective, seed: int = 0, progress=None, *,
                time_limit_s: float = EXACT_TIME_LIMIT_S, chunk: int = 4096,
                clock=None) -> SearchResult:
    """Every legal action of a mode space (one op row per tp: :func:`mode_spaces`) through
    ``objective``, in chunks; ``complete`` False when ``time_limit_s`` seconds of ``clock``
    (default wall time) stopped it."""
    import time

    clock = clock or time.perf_counter
    t0, wall0 = clock(), time.perf_counter()
    sampler = LegalSampler(space)
    rows = space.op_mask_by_tp.argmax(axis=2)  # [n_tp, n_slots]: the mode's one choice
    assert (space.op_mask_by_tp.sum(axis=2) == 1).all(), "not an engine mode space"
    acts = sweep_actions(sampler, lambda t: rows[t])
    meter = Budget(objective, None, progress)
    complete = True
    for i in range(0, len(acts), chunk):
        meter(acts[i:i + chunk])
        if clock() - t0 > time_limit_s and i + chunk < len(acts):
            complete = False
            break
    return SearchResult(best_action=meter.best_action, best_value=meter.best_value,
                        evaluations=meter.evaluations, curve=meter.curve,
                        wall_s=time.perf_counter() - wall0, policy="exact", seed=seed,
                        complete=complete)
