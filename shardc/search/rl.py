"""The paper's agent: PPO over an elite-history-conditioned policy, with confidence restarts.

Each update the policy (:mod:`shardc.search.policy`) reads the elite history, samples a batch
of ``batch`` legal actions (masked heads), and the cost model evaluates them in one call.
Because the observation is shared by the whole batch, the problem is a contextual bandit:
the advantage is the reward minus the batch mean (a group baseline), divided by the batch
standard deviation, and the PPO clipped objective is taken over ``epochs`` passes.

Reward, per sample (``RLConfig``): ``r = alpha * raw + beta * (raw - best)`` where
``raw = value / ref`` and ``best = best_so_far / ref`` with ``ref`` the best feasible
tok/s/GPU seen up to and including this batch (so ``raw`` is in (0, 1] and the bonus term
is <= 0 except for a new record, where it is 0 and every other sample pays its gap to it).
Infeasible samples get ``infeasible_reward`` (-1: below every feasible sample, without
dwarfing the differences between feasible ones once advantages are normalised).
alpha = 1, beta = 1 by default.

Confidence exit: the budget is split into ``chunks`` equal chunks; a chunk ends when its
evaluations are spent or every head's largest probability is >= ``confidence`` (averaged
over the batch's masks). A new chunk re-initialises the network (and Adam, and the cosine
learning-rate schedule) but keeps the elite history and the best-so-far; evaluations a
chunk did not use roll over, so the whole budget is always spent.

Self-imitation (``elite_replay``): the elite strategies, with their already-known rewards,
are appended to every PPO batch (no simulator call; their old log-probabilities are taken
under the current policy, so the clipped ratio bounds how fast they are imitated). This lets
a freshly re-initialised network return to the best region quickly instead of rediscovering
it; it is an addition to the paper's recipe, on by default, and measured in
benchmarks/search_ablations.md.

Risk-seeking advantage (``risk_quantile`` = 0.15): instead of the batch mean, the baseline is
the batch's 85th-percentile reward and only samples at or above it learn (advantage
``r - q`` >= 0, others 0) -- the policy is trained to make its *best* samples better, which is
what a search that keeps the best-so-far needs. Elite-neighbour proposals (``mutate_mix`` =
0.25): a quarter of every batch is not drawn from the heads but proposed as neighbours of the
elite history (a uniformly chosen elite row with 1..``mutate_changes`` = 2 components set to a
different legal value, then legal repair); they are evaluated (every one counts against the
budget) and enter the PPO batch like the policy's own samples. Both are additions to the
paper's recipe, on by default.

Batch-following neighbours (``batch_follow``, decode only): a neighbour whose data-parallel
degree differs from its parent's (a tp/ep/pp change) also rescales its per-replica batch so
the global batch dp * batch stays the parent's times 2**j, j uniform in {-1, 0, 1} (nearest
legal batch in log2); pp, batch and the embedding choice often have to move together.

Factor moves (``factor_mix``): a fraction of the elite neighbours are moves on the degree
lattice (:meth:`LegalSampler.factor_move`: one prime factor taken from one of tp, ep, pp, dp
and given to another, e.g. ep 4 -> 8 with pp 8 -> 4).

Canonical tp = 1 elite (``tp1_canonical``): when the objective declares op choices free at
tp = 1 (:class:`~shardc.search.objective.CostModelObjective`), elite rows at tp = 1 are
stored with Megatron's op choices -- the same strategy under one name -- so the elite does
not fill with copies of one tp = 1 point, and a neighbour that raises tp starts from
Megatron's dims.

Row polishing (``polish_frac`` = 0.25): the agent's chunks spend the first 75% of the budget;
the last quarter goes to :class:`~shardc.search.polish.RowPolisher`, which takes the degree
rows (tp, ep, pp, sp, batch) the agent mapped, best first, and at each one evaluates every
combination of each branch's op choices with the other branches held (the step time is a sum
over branches at fixed degrees), applies the improving branches together, then carries the
polished choices to the neighbouring rows (batch +-1, sp toggled, factor moves with the
batch rescaled). It makes the joint 3-4-component op changes a row's optimum often needs,
which 1-2-component neighbours and the heads' independent draws rarely do. Every evaluation
counts; none is repeated. After the best row, the polisher's lean screen
(:mod:`shardc.search.lean_screen`) tries every degree tuple the agent left without a feasible
row with the per-branch memory-leanest op choices at its largest feasible batch. When every
row seen is polished, the agent spends what is left.

Every default of :class:`RLConfig` beyond the paper's recipe was adopted on measurements
(fraction of the exact optimum over seeds, paper and zoo suites); the dated ablation log,
including the variants tried and dropped, is benchmarks/search_ablations.md.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from shardc.ir.space import DEGREE_COMPONENTS, megatron_ops_at_tp1
from shardc.search.legal import LegalSampler
from shardc.search.objective import Budget, BudgetExhausted
from shardc.search.policy import EliteHistory, ElitePolicy, masked_log_probs, sample_masked
from shardc.search.polish import Archive, RowPolisher

BATCH = DEGREE_COMPONENTS.index("batch")
TOP_ROWS = 8  # degree rows handed back in ``extra["top_rows"]``


@dataclass
class RLConfig:
    """The agent's knobs (defaults measured: benchmarks/search_ablations.md)."""

    batch: int = 64  # actions sampled (and evaluated) per update
    history: int = 3  # T, rows of the elite history
    lr: float = 1e-3  # Adam, cosine-annealed to 0 over each chunk
    epochs: int = 4  # PPO passes over each batch
    clip: float = 0.2  # PPO ratio clip
    entropy_coef: float = 0.0  # the confidence restarts do the exploring
    alpha: float = 1.0  # reward weight of raw throughput (fraction of the best seen)
    beta: float = 1.0  # reward weight of the gap to the best-so-far
    infeasible_reward: float = -1.0  # reward of an OOM / SLO-violating strategy
    chunks: int = 5  # network lives: the budget is split into this many chunks
    confidence: float = 0.95  # a chunk ends early when every head is this sure
    elite_replay: bool = True  # append the elite (known rewards) to every PPO batch
    risk_quantile: float = 0.15  # >0: risk-seeking advantage (only the top fraction learns)
    uniform_mix: float = 0.0  # fraction of each batch drawn uniformly over legal actions
    mutate_mix: float = 0.25  # fraction of each batch proposed as elite neighbours
    mutate_changes: int = 2  # at most this many components changed per neighbour
    batch_follow: float = 1.0  # decode: fraction of dp-changing neighbours whose batch follows
    factor_mix: float = 0.1  # fraction of the neighbours that are factor moves of the degrees
    tp1_canonical: bool = True  # elite rows at tp = 1 keep Megatron's (equivalent) op choices
    polish_frac: float = 0.4  # budget fraction left to the row polisher (shardc.search.polish)
    polish_sweeps: int = 3  # branch best-response rounds per polished row


class _Chunk:
    """One network life: policy + optimiser + schedule."""

    def __init__(self, sampler: LegalSampler, cfg: RLConfig, seed: int, n_updates: int):
        torch.manual_seed(seed)
        width = int(sampler.offsets[-1])
        self.net = ElitePolicy(width + 2, width)
        self.opt = torch.optim.Adam(self.net.parameters(), lr=cfg.lr, foreach=True)
        self.n_updates = max(n_updates, 1)
        self.step = 0
        self.cfg = cfg

    def set_lr(self) -> None:
        frac = min(self.step / self.n_updates, 1.0)
        for g in self.opt.param_groups:
            g["lr"] = self.cfg.lr * 0.5 * (1.0 + math.cos(math.pi * frac))


def rewards_for(values, feasible, ref, best_before, cfg: RLConfig) -> np.ndarray:
    """The agent's reward (module docstring); ``ref`` = best tok/s/GPU including this batch."""
    raw = values / ref
    best = best_before / ref
    r = cfg.alpha * raw + cfg.beta * (raw - best)
    return np.where(feasible, r, cfg.infeasible_reward)


def risk_seeking_advantage(rewards: np.ndarray, quantile: float) -> np.ndarray:
    """Risk-seeking policy gradient: the baseline is the reward at the ``1 - quantile``
    quantile of the batch and only samples at or above it get a (non-negative) advantage;
    the rest get 0. It optimises the best of a batch, not its mean."""
    q = np.quantile(rewards, 1.0 - quantile)
    return np.where(rewards >= q, rewards - q, 0.0)


def search_rl(sampler: LegalSampler, budget: Budget, rng: np.random.Generator, seed: int,
              cfg: RLConfig | None = None) -> dict:
    """Spend ``budget`` with the agent (deterministic given ``seed`` and ``rng``); returns
    ``{"network_lives": n, "top_rows": [A] actions}`` (chunks run, each with a freshly
    initialised network; the best action of each of the :data:`TOP_ROWS` best degree rows
    seen, best first: what :mod:`shardc.search.resplit` re-prices at the experts re-splits)."""
    cfg = cfg or RLConfig()
    prev_threads = torch.get_num_threads()
    torch.set_num_threads(1)
    torch.set_flush_denormal(True)
    lives = [0]
    archives: list[Archive] = []
    try:
        _run(sampler, budget, rng, seed, cfg, lives, archives)
    except BudgetExhausted:
        pass
    finally:
        torch.set_num_threads(prev_threads)
    return {"network_lives": lives[0], "top_rows": top_rows(archives[0]) if archives else []}


def top_rows(archive: Archive, k: int | None = None) -> list[np.ndarray]:
    """The best action of each of the ``k`` (:data:`TOP_ROWS`) best degree rows of
    ``archive``, best first (ties: row order, so deterministic)."""
    rows = sorted(archive.rows.items(), key=lambda kv: (-kv[1][0], kv[0]))
    return [a.copy() for _, (_, a) in rows[:TOP_ROWS if k is None else k]]


def _run(sampler: LegalSampler, budget: Budget, rng, seed: int, cfg: RLConfig, lives,
         archives: list) -> None:
    history = EliteHistory(sampler.n_comp, cfg.history)
    free_at_tp1 = getattr(budget.objective, "op_choices_free_at_tp1", False)
    archive = Archive(sampler.space)
    archives.append(archive)
    if cfg.polish_frac <= 0:
        archive = None
    total = budget.remaining
    agent = total - int(cfg.polish_frac * total)
    _agent(sampler, budget, rng, seed, cfg, lives, history, agent, archive)
    if archive is not None:
        RowPolisher(sampler, budget, archive, free_at_tp1, cfg.polish_sweeps).run()
        # every row seen is polished: the agent spends what is left
        _agent(sampler, budget, rng, seed, cfg, lives, history, budget.remaining, archive)


def _agent(sampler: LegalSampler, budget: Budget, rng, seed: int, cfg: RLConfig, lives,
           history: EliteHistory, evaluations: int, archive: Archive | None) -> None:
    """The agent's chunks (network lives) over the next ``evaluations`` evaluations."""
    canonical = cfg.tp1_canonical and getattr(budget.objective, "op_choices_free_at_tp1", False)
    stop = budget.evaluations + evaluations
    chunk_evals = max(-(-evaluations // cfg.chunks), cfg.batch)  # a remainder is no extra life
    offsets = sampler.offsets
    while min(budget.remaining, stop - budget.evaluations) > 0:
        chunk_id = lives[0]
        chunk = _Chunk(sampler, cfg, seed * 1009 + chunk_id, chunk_evals // cfg.batch)
        lives[0] = chunk_id + 1
        used = 0
        while used < chunk_evals and min(budget.remaining, stop - budget.evaluations) > 0:
            obs = torch.from_numpy(history.observation(sampler))[None]
            with torch.no_grad():
                logits = chunk.net(obs)
            n = min(cfg.batch, budget.remaining, stop - budget.evaluations, chunk_evals - used)
            actions, masks = _propose(logits[0].double().numpy(), sampler, history, n, rng, cfg)
            best_before = budget.best_value
            values, feasible = budget(actions)
            if archive is not None:
                archive.record(actions[:len(values)], values, feasible,
                               getattr(budget.objective, "last_violation", None),
                               getattr(budget.objective, "last_memory", None))
            used += len(values)
            ref = budget.best_value if budget.best_value > 0 else 1.0
            rewards = rewards_for(values, feasible, ref, best_before, cfg)
            if cfg.elite_replay and history.values.size:
                actions = np.concatenate([actions, history.actions])
                masks = np.concatenate([masks, sampler.full_mask(history.actions)])
                rewards = np.concatenate(
                    [rewards, rewards_for(history.values, np.ones(len(history.values), bool),
                                       ref, best_before, cfg)])
            history.add(megatron_ops_at_tp1(sampler.space, actions[:n]) if canonical else actions[:n],
                        values, feasible)
            maxp = _update(chunk, obs, actions, masks, rewards, offsets, cfg)
            if maxp.min() >= cfg.confidence:
                break  # converged: early exit, re-initialise


def _propose(logits: np.ndarray, sampler: LegalSampler, history: EliteHistory, n: int, rng,
             cfg: RLConfig) -> tuple[np.ndarray, np.ndarray]:
    """``n`` legal actions: mostly from the policy heads, plus (``uniform_mix``) uniform legal
    draws and (``mutate_mix``) neighbours of the elite (1..``mutate_changes`` components
    changed); returns (actions [n, A], masks [n, sum(nvec)])."""
    n_uni = int(round(cfg.uniform_mix * n))
    n_mut = int(round(cfg.mutate_mix * n)) if history.values.size else 0
    n_pol = max(n - n_uni - n_mut, 0)
    n_mut = n - n_pol - n_uni
    parts = []
    if n_pol:
        parts.append(sample_masked(logits, sampler, n_pol, rng)[0])
    if n_uni:
        parts.append(sampler.sample(n_uni, rng))
    if n_mut:
        parents = history.actions[rng.integers(0, len(history.actions), size=n_mut)]
        k = rng.integers(1, cfg.mutate_changes + 1, size=n_mut)
        kids = parents.copy()
        factor = rng.random(n_mut) < cfg.factor_mix
        for c in range(1, cfg.mutate_changes + 1):
            sel = (k >= c) & ~factor
            if sel.any():
                kids[sel] = sampler.mutate(kids[sel], rng, 1)
        if factor.any():
            kids[factor] = sampler.factor_move(kids[factor], rng)
        if cfg.batch_follow > 0 and sampler.space.workload.phase == "decode":
            kids = _follow_batch(sampler, parents, kids, rng, cfg.batch_follow)
        parts.append(kids)
    actions = np.concatenate(parts) if len(parts) > 1 else parts[0]
    return actions, sampler.full_mask(actions)


def _follow_batch(sampler: LegalSampler, parents: np.ndarray, kids: np.ndarray, rng,
                  frac: float) -> np.ndarray:
    """For a ``frac`` of the neighbours whose data-parallel degree differs from their
    parent's, rescale the per-replica batch so the global batch (dp * batch) stays about the
    parent's, times 2**j with j uniform in {-1, 0, 1}; the batch index is the legal value
    nearest in log2. Other neighbours are returned unchanged."""
    space = sampler.space
    dp_p = space.degree_arrays(parents)["dp"]
    dp_k = space.degree_arrays(kids)["dp"]
    sel = (dp_p != dp_k) & (dp_k > 0) & (rng.random(len(kids)) < frac)
    if not sel.any():
        return kids
    kids = kids.copy()
    values = np.log2(np.asarray(space.values["batch"], dtype=np.float64))
    old = values[parents[sel, BATCH]]
    target = old + np.log2(dp_p[sel] / dp_k[sel]) + rng.integers(-1, 2, size=int(sel.sum()))
    kids[sel, BATCH] = np.abs(values[None, :] - target[:, None]).argmin(axis=1)
    return kids


def _update(chunk: _Chunk, obs, actions, masks, rewards, offsets, cfg: RLConfig) -> np.ndarray:
    """PPO clipped update on one batch; returns each head's max probability [A]."""
    if cfg.risk_quantile > 0:
        adv = risk_seeking_advantage(rewards, cfg.risk_quantile)
    else:
        adv = rewards - rewards.mean()
    std = adv.std()
    adv = adv / std if std > 1e-12 else adv * 0.0
    a_t = torch.from_numpy(actions)
    m_t = torch.from_numpy(masks)
    adv_t = torch.from_numpy(adv).float()
    with torch.no_grad():
        logits = chunk.net(obs)
        old_logp, _, _ = masked_log_probs(logits[0], m_t, a_t, offsets)
    chunk.set_lr()
    for _ in range(cfg.epochs):
        logits = chunk.net(obs)
        logp, ent, _ = masked_log_probs(logits[0], m_t, a_t, offsets)
        ratio = torch.exp(logp - old_logp)
        obj = torch.min(ratio * adv_t, ratio.clamp(1 - cfg.clip, 1 + cfg.clip) * adv_t)
        loss = -obj.mean() - cfg.entropy_coef * ent
        chunk.opt.zero_grad()
        loss.backward()
        chunk.opt.step()
    chunk.step += 1
    with torch.no_grad():
        logits = chunk.net(obs)
        _, _, maxp = masked_log_probs(logits[0], m_t, a_t, offsets)
    return maxp.numpy()
