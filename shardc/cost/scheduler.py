"""The aggregated pool's scheduler as vLLM and SGLang run it: decode first, then the waiting
prompts chunked under a per-step token budget (SPEC section 11).

Per scheduler step (one micro-batch of one attention group) the engine runs the decode token
of each of its ``s`` running sequences and fills the rest of its token budget ``P`` (vLLM
``--max-num-batched-tokens``: decode + prefill tokens; SGLang ``--chunked-prefill-size``: the
prefill part ``P - s``) with prompt tokens of the waiting requests, oldest first. Arrivals are
those of a closed loop at concurrency = the running sequences (what the published benchmarks
run): a request arrives when one completes, so in steady state the prompt tokens arriving per
step are ``d = s * isl / osl`` (the demand) and arrivals are evenly spread.

Request-level model (all arrays ``[B, K]`` over strategies x budget candidates):

* the prompt tokens a step carries when it carries any: ``c = min(P - s, max(d, isl))`` (a
  long prompt fills the budget; short prompts arriving faster than one per step share it);
* ``c < d``: the budget cannot keep up with the arrivals, the queue grows: TTFT is unbounded;
* else a fraction ``rho = d / c`` of the steps carry a chunk (time ``t_mix(c)``), the rest are
  pure decode steps (``t_dec``); a request's mean TPOT over its ``osl`` decode steps is
  ``rho * t_mix + (1 - rho) * t_dec``;
* ``TTFT = 0.5 * TPOT + ceil(isl / c) * t_mix``: half a step joining the running batch
  (no queue ahead of it: the closed loop's arrivals never exceed what the budget drains),
  then its own prompt's chunks, one mixed step each; its first token comes out of the last.

Where the budget binds every step (``P = s + d``: ``c = d``, ``rho = 1``) this is the
steady-state average of :mod:`shardc.serving.pool_models` exactly (``TPOT = t_mix(d)``, ``TTFT =
(ceil(isl / d) + 0.5) * TPOT``; tested). SGLang's default runs a prefill batch apart from the
decode batch instead of mixing them (``--enable-mixed-chunk`` mixes); the mixed step prices
both with one pass over the weights, a lower bound on the separate passes. Percentiles of
TTFT under random (Poisson) arrivals are not modelled.

The budget is a searched knob: every strategy is priced at each candidate of
:data:`TOKEN_BUDGETS` (the largest raised to the steady-state need ``s + d`` where that is
larger; one vectorised pass per candidate) and runs the one with the most
tokens/s/GPU meeting both SLOs (:func:`choose`). Units: tokens, seconds (or ms: the formulas
are linear in time).
"""

from __future__ import annotations

import numpy as np

from shardc.cost.evaluation import OK, TPOT_SLO, TTFT_SLO, Evaluation

# vLLM --max-num-batched-tokens / SGLang's budget candidates (tokens per scheduler step); the
# engines' defaults are 2048-16384 (vLLM 2048 / 8192 by usage context, SGLang 8192 / 16384 by
# GPU memory); 512 is the small budget that keeps decode steps short
TOKEN_BUDGETS = (512, 2048, 8192, 16384)


def row_budgets(seqs, demand, budgets=TOKEN_BUDGETS) -> np.ndarray:
    """[B, K] the budget candidates of each strategy: ``budgets``, the largest raised to the
    steady-state need ``ceil(s + d)`` where that is larger (a large batch's arrivals would
    otherwise outgrow every candidate)."""
    seqs, demand = np.asarray(seqs, float), np.asarray(demand, float)
    out = np.tile(np.asarray(sorted(budgets), float), (len(seqs), 1))
    out[:, -1] = np.maximum(out[:, -1], np.ceil(seqs + demand - 1e-9))
    return out


def prefill_chunks(seqs, demand, isl: float, budgets) -> np.ndarray:
    """[B, K] prompt tokens a step carries when it carries any: ``min(P - s, max(d, isl))``
    at budgets ``P`` ([B, K] or [K]); 0 where the budget leaves no room after the ``s``
    decode tokens."""
    seqs, demand = np.asarray(seqs, float)[:, None], np.asarray(demand, float)[:, None]
    room = np.asarray(budgets, float).reshape(-1 if np.ndim(budgets) == 1 else len(seqs),
                                              np.shape(budgets)[-1]) - seqs
    return np.maximum(np.minimum(room, np.maximum(demand, float(isl))), 0.0)


def schedule(t_dec, t_mix, chunk, demand, isl: float):
    """(TPOT [B, K], TTFT [B, K], keeps_up [B, K]) of the request-level model (module
    docstring) from the pure-decode step ``t_dec`` [B], the step carrying ``chunk`` [B, K]
    prompt tokens ``t_mix`` [B, K] and the demand ``d`` [B] (prompt tokens per step)."""
    t_dec = np.asarray(t_dec, float)[:, None]
    demand = np.asarray(demand, float)[:, None]
    keeps_up = (chunk > 0) & (chunk >= demand * (1 - 1e-9))
    safe = np.where(chunk > 0, chunk, 1.0)
    rho = np.where(keeps_up, np.minimum(demand / safe, 1.0), 1.0)
    tpot = rho * t_mix + (1.0 - rho) * t_dec
    steps = np.ceil(float(isl) / safe - 1e-9)
    ttft = np.where(keeps_up, 0.5 * tpot + steps * t_mix, np.inf)
    return tpot, ttft, keeps_up


def choose(value, tpot, ttft, fits, tpot_slo: float, ttft_slo: float) -> np.ndarray:
    """[B] the budget index each strategy runs: the highest ``value`` (tokens/s/GPU) among
    the candidates that ``fits`` (memory, divisibility) and meet both SLOs; where none does,
    the one closest to its SLOs (smallest ``max(TPOT / SLO, TTFT / SLO)``), fitting ones
    first.
    Ties keep the smaller budget."""
    meets = fits & (tpot <= tpot_slo) & (ttft <= ttft_slo)
    miss = np.maximum(tpot / tpot_slo, ttft / ttft_slo)
    miss = np.where(np.isfinite(miss), miss, np.inf)
    best = np.argmax(np.where(meets, value, -np.inf), axis=1)
    near_fit = np.argmin(np.where(fits, miss, np.inf), axis=1)
    near = np.argmin(miss, axis=1)
    return np.where(meets.any(axis=1), best, np.where(fits.any(axis=1), near_fit, near))


def evaluate_scheduled(cm, actions, space, detail: bool = False) -> dict:
    """:meth:`CostModel.evaluate` of the aggregated pool ``cm`` (its ``token_budgets``) under
    the scheduler: every row at the pure-decode step and at each budget candidate's mixed
    step (one vectorised pass), each row running its best budget (:func:`choose`). Returns
    the simulator's dict with ``ev`` the :class:`~shardc.cost.model.Evaluation` (token budget,
    prompt chunk and mixed fraction filled); ``detail``: the step returned (ops, stages) is
    the chosen budget's mixed step."""

    a = np.atleast_2d(np.asarray(actions, dtype=np.int64))
    B, budgets = a.shape[0], cm.token_budgets
    K = len(budgets)
    deg = space.degree_arrays(a)
    bf = deg["batch"].astype(np.float64)
    gpus = (deg["tp"] * deg["ep"] * deg["pp"]).astype(np.float64)
    seqs = bf / deg["pp"] / deg["ep"]
    demand = seqs * cm.mixed_prefill
    isl = float(cm.workload.prompt)
    budgets = row_budgets(seqs, demand, budgets)  # [B, K]
    chunk = prefill_chunks(seqs, demand, isl, budgets)
    # the decode step (chunk 0) and each candidate's mixed step, simulating each distinct
    # (row, chunk) once: chunks are non-decreasing over the sorted budgets
    C = np.concatenate([np.zeros((B, 1)), chunk], axis=1)  # [B, K + 1]
    new = np.ones(C.shape, dtype=bool)
    new[:, 1:] = C[:, 1:] != C[:, :-1]
    ri, cj = np.nonzero(new)
    r = cm._simulate(a[ri], space, chunk=C[ri, cj])
    pos = np.zeros(C.shape, dtype=np.int64)
    pos[ri, cj] = np.arange(len(ri))
    src = np.maximum.accumulate(np.where(new, np.arange(K + 1)[None, :], 0), axis=1)
    idx = pos[np.arange(B)[:, None], src]  # [B, K + 1] row of the simulated batch
    step = r["ev"].tpot_ms[idx]  # ms, pp ticks of one micro-batch
    tpot, ttft, _ = schedule(step[:, 0], step[:, 1:], chunk, demand, isl)
    hard = r["hard"][idx][:, 1:]
    with np.errstate(divide="ignore", invalid="ignore"):
        value = np.where(deg["dp"][:, None] > 0,
                         bf[:, None] / (tpot / 1e3) / gpus[:, None], 0.0)
    wl = cm.workload
    k = choose(value, tpot, ttft, hard == OK, wl.tpot_slo_ms, wl.ttft_slo_ms)
    rows = np.arange(B)
    tp_, tt_, hd, c = (x[rows, k] for x in (tpot, ttft, hard, chunk))
    reason = np.where(hd != OK, hd, np.where(tp_ > wl.tpot_slo_ms, TPOT_SLO,
                                             np.where(tt_ > wl.ttft_slo_ms, TTFT_SLO, OK)))
    mem = r["ev"].memory_gb_per_gpu[idx][:, 1:]
    ev = Evaluation(tok_s_per_gpu=value[rows, k], tpot_ms=tp_, ttft_ms=tt_,
                    memory_gb_per_gpu=mem[rows, k], feasible=reason == OK, reason=reason,
                    token_budget=budgets[rows, k], prefill_chunk=c,
                    mixed_fraction=np.minimum(demand / np.where(c > 0, c, np.inf), 1.0))
    if detail:
        r = cm._simulate(a, space, detail=True, chunk=c)
    r["ev"] = ev
    return r


# ------------------------------------------------------------------ KV cache occupancy
# How a pool reserves KV cache per running sequence (plan.json pools' ``kv_reservation``):
# ``paged``: what a paged engine holds (module :func:`paged_kv_tokens`); ``full``: the
# whole request (isl + osl) from the first step, as a static allocator would
KV_RESERVATIONS = ("paged", "full")
PAGE_TOKENS = {"vllm": 16, "sglang": 1, "trtllm": 32}  # KV block (page) size, tokens
PREEMPTION_SIGMAS = 2.0  # standard deviations of the batch's generated tokens kept free


def paged_kv_tokens(isl: float, osl: float, seqs, page: int = 1) -> np.ndarray:
    """KV tokens reserved per running sequence by a paged engine (vLLM, SGLang, TRT-LLM
    hold a sequence's prompt and the tokens generated so far, in pages): in steady state the
    ``seqs`` sequences sharing a GPU's KV pool sit at independent uniform points of their
    ``osl`` decode steps, so the pool holds ``seqs * (isl + osl / 2)`` tokens on average with
    a standard deviation of ``osl * sqrt(seqs / 12)``; the engine preempts (recomputes) a
    sequence when the pool runs out, so the reservation is the mean plus
    :data:`PREEMPTION_SIGMAS` deviations (preemption in about 2% of steps), plus half a page
    per sequence of page rounding, never more than the whole request ``isl + osl``."""
    seqs = np.maximum(np.asarray(seqs, dtype=np.float64), 1.0)
    margin = PREEMPTION_SIGMAS * osl / np.sqrt(12.0 * seqs)
    return np.minimum(isl + osl / 2.0 + margin + (page - 1) / 2.0, float(isl + osl))
