"""Expert routing as a distribution: the load of the busiest EP rank (and expert) for T tokens.

A MoE layer sends each of its ``T`` tokens to ``k`` of ``E`` experts; the EP group's ``ep``
ranks hold ``E / ep`` experts each (contiguous expert ids, the engines' default placement) and
the busiest rank sets the pace of the layer (its grouped GEMMs and the rows its dispatch
receives). :func:`rank_imbalance` is the expected ``max_r L_r / mean_r L_r`` of the rows ``L_r``
the ranks receive (``mean = T k / ep``), replacing a fixed factor; :func:`expert_imbalance` is
the same over single experts (reported; a grouped GEMM's per-expert skew within a rank is not
priced: it needs a measurement, ``shardc calibrate``).

Routing models (``--routing``), as the probability ``q_e`` that a token picks expert ``e``
(``sum q_e = k``, ``q_e <= 1``):

* ``balanced``: every expert gets exactly ``T k / E`` rows (the kernel tables' setting);
* ``uniform``: ``q_e = k / E`` -- a router trained for balanced load; the rows per expert
  still spread (binomial), so the busiest rank carries more than the mean at small ``T``;
* ``powerlaw:ALPHA``: expert popularity falls as a power of its rank, ``p_i ~ i^-ALPHA``
  (Zipf), ``q = min(c p, 1)`` with ``c`` such that ``sum q = k``; which expert ids are the
  popular ones is random (so is their rank), averaged over placements.

Counts per expert are binomial ``n_e ~ B(T, q_e)`` (sampled as normals where every count's
variance is at least 25) rescaled to ``sum n_e = T k`` (each token
picks exactly ``k``). :data:`DEFAULT_ROUTING` is ``uniform``: routers are trained for a
balanced load (DeepSeek-V3's auxiliary-loss-free bias, the aux losses of the others) and the
engines that publish their EP numbers rebalance hot experts (DeepSeek's production ran EPLB),
so the spread that remains is the sampling one; DeepEP's own benchmark routes uniformly too
(benchmarks/deepep_validation.py). Skewed routing from NVIDIA's published notes
(AIConfigurator's MoE routing notes, from latency matching on CNN/DailyMail and OpenOrca):
the top 20% of DeepSeek-V3/R1's 256 experts take 30-40% of the tokens (``powerlaw:0.37``
gives 35%), of Qwen3-235B-A22B's 128 about 65% (``powerlaw:0.9``). See docs/validation.md.

EPLB (``--redundant-experts N``: vLLM ``--enable-eplb``, SGLang
``--ep-num-redundant-experts``): ``N`` extra expert slots (the multiple of ``ep`` below ``N``)
hold replicas of the most loaded experts (each replica takes an equal share of its expert's
rows) and the slots are packed onto the ranks by load (largest first onto the least loaded
rank with a free slot), from the known popularity -- EPLB's rebalancing from the measured
load history; it removes the placement skew, not the binomial spread.

Expectations are Monte Carlo with a fixed seed (deterministic), computed once per (E, k, ep,
routing, redundant) on a log grid of ``T`` (about 0.2 s; kept in ``$SHARDC_CACHE_DIR/routing``)
and interpolated in ``log T`` (vectorised over strategies). Units: tokens (rows).
"""

from __future__ import annotations

import numpy as np

from shardc.ir.strategy import DEFAULT_ROUTING, ROUTING_KINDS, parse_routing  # noqa: F401

DRAWS = 128  # Monte Carlo draws per grid point
SEED = 20260
_T_GRID = np.unique(np.round(np.geomspace(1, 1 << 22, 37)))  # tokens over the EP group
_CACHE: dict = {}


def pick_probabilities(experts: int, top_k: int, routing: str) -> np.ndarray:
    """``q`` [E] sorted most popular first: the probability a token picks each expert
    (``sum q = top_k``, ``q <= 1``)."""
    kind, alpha = parse_routing(routing)
    E, k = int(experts), min(int(top_k), int(experts))
    if kind != "powerlaw" or alpha == 0.0:
        return np.full(E, k / E)
    p = np.arange(1, E + 1, dtype=np.float64) ** -alpha
    p /= p.sum()
    q = k * p
    for _ in range(E):  # water-fill: cap at 1, hand the excess to the uncapped experts
        over = q > 1.0
        if not over.any():
            break
        excess = (q[over] - 1.0).sum()
        q[over] = 1.0
        free = q < 1.0
        q[free] += excess * q[free] / q[free].sum()
    return np.minimum(q, 1.0)


def eplb_layout(q: np.ndarray, ep: int, redundant: int) -> tuple[np.ndarray, np.ndarray]:
    """(copies [E], rank of each slot's expert: ``slots`` [ep, S] of expert indices) of
    EPLB with ``redundant`` extra slots (a multiple of ``ep``) for popularity ``q``."""
    E = len(q)
    copies = np.ones(E, dtype=np.int64)
    for _ in range(int(redundant)):
        copies[int(np.argmax(q / copies))] += 1
    per_slot = np.repeat(q / copies, copies)
    owner = np.repeat(np.arange(E), copies)
    S = (E + int(redundant)) // ep
    load = np.zeros(ep)
    filled = np.zeros(ep, dtype=np.int64)
    slots = np.zeros((ep, S), dtype=np.int64)
    for j in np.argsort(-per_slot, kind="stable"):
        r = int(np.argmin(np.where(filled < S, load, np.inf)))
        slots[r, filled[r]] = owner[j]
        filled[r] += 1
        load[r] += per_slot[j]
    return copies, slots


def _disk_path(key: tuple):
    """The on-disk cache entry of one curve pair (keyed by this file's code too)."""
    import hashlib
    from pathlib import Path

    from shardc.cache import cache_dir

    code = hashlib.sha256(Path(__file__).read_bytes()).hexdigest()[:12]
    name = hashlib.sha256(repr(key).encode()).hexdigest()[:20]
    return cache_dir() / "routing" / f"{name}-{code}.npy"


def _curves(experts: int, top_k: int, ep: int, routing: str, redundant: int):
    """(rank factor [G], expert factor [G]) over :data:`_T_GRID`, from memory, the on-disk
    cache (``$SHARDC_CACHE_DIR/routing``) or computed (then cached)."""
    from shardc.cache import cache_enabled, write_entry

    key = (int(experts), int(top_k), int(ep), str(routing), int(redundant))
    if key in _CACHE:
        return _CACHE[key]
    path = _disk_path(key) if cache_enabled() else None
    if path is not None and path.is_file():
        try:
            both = np.load(path, allow_pickle=False)
            if both.shape == (2, len(_T_GRID)):
                _CACHE[key] = (both[0], both[1])
                return _CACHE[key]
        except (OSError, ValueError):
            pass  # a corrupt entry: recompute
    out = _compute_curves(*key)
    _CACHE[key] = out
    if path is not None:
        write_entry(path, lambda fh: np.save(fh, np.stack(out)), ".npy")
    return out


def _compute_curves(experts: int, top_k: int, ep: int, routing: str, redundant: int):
    """The Monte Carlo behind :func:`_curves` (module docstring)."""
    E, k = int(experts), min(int(top_k), int(experts))
    kind, _ = parse_routing(routing)
    G = len(_T_GRID)
    if kind == "balanced" or E <= 1:
        return np.ones(G), np.ones(G)
    rng = np.random.default_rng(SEED)
    q = pick_probabilities(E, k, routing)
    R = (int(redundant) // ep) * ep if ep > 1 else 0
    if R:
        copies, slots = eplb_layout(q, ep, R)
    elif ep > 1:  # popularity ranks land on random expert ids (one set of placements for every T)
        perm = np.argsort(rng.random((DRAWS, E)), axis=1)
    rank_f, expert_f = np.ones(G), np.ones(G)
    for g, T in enumerate(_T_GRID):
        var = T * q * (1 - q)
        big = var >= 25  # these counts ~ normal: its fast sampler; the rest binomial
        n = np.empty((DRAWS, E))
        n[:, big] = np.maximum(T * q[big] + np.sqrt(var[big]) * rng.standard_normal(
            (DRAWS, int(big.sum()))), 0.0)
        n[:, ~big] = rng.binomial(int(T), np.broadcast_to(q[~big], (DRAWS, int((~big).sum()))))
        tot = n.sum(axis=1, keepdims=True)
        n = np.where(tot > 0, n * (T * k) / np.maximum(tot, 1e-300), T * k / E)
        expert_f[g] = float(np.mean(n.max(axis=1)) / (T * k / E))
        if ep <= 1:
            continue
        if R:  # each replica takes an equal share; a rank sums its slots
            share = n / copies[None, :]
            loads = share[:, slots].sum(axis=2)  # [DRAWS, ep]
        else:  # rank r holds a contiguous block of expert ids
            placed = np.take_along_axis(n, perm, axis=1)
            loads = placed.reshape(DRAWS, ep, E // ep).sum(axis=2)
        rank_f[g] = float(np.mean(loads.max(axis=1)) / (T * k / ep))
    return rank_f, expert_f


def _interp(curve: np.ndarray, tokens) -> np.ndarray:
    t = np.clip(np.asarray(tokens, dtype=np.float64), 1.0, _T_GRID[-1])
    return np.interp(np.log(t), np.log(_T_GRID), curve)


def rank_imbalance(tokens, experts: int, top_k: int, ep, routing: str = DEFAULT_ROUTING,
                   redundant: int = 0) -> np.ndarray:
    """Expected rows of the busiest EP rank / the mean rank's, for ``tokens`` entering the
    layer over the EP group (arrays [B]; ``ep`` array or int; 1 where ep = 1). Needs ``ep |
    experts`` (the space guarantees it)."""
    tokens = np.asarray(tokens, dtype=np.float64)
    ep = np.broadcast_to(np.asarray(ep, dtype=np.int64), tokens.shape)
    out = np.ones(tokens.shape)
    for e in np.unique(ep):
        if e <= 1 or experts % e:
            continue
        rows = ep == e
        out[rows] = _interp(_curves(experts, top_k, int(e), routing, redundant)[0], tokens[rows])
    return np.maximum(out, 1.0)


def expert_imbalance(tokens, experts: int, top_k: int, routing: str = DEFAULT_ROUTING
                     ) -> np.ndarray:
    """Expected rows of the busiest expert / the mean expert's (``T k / E``) for ``tokens``."""
    return np.maximum(_interp(_curves(experts, top_k, 1, routing, 0)[1], tokens), 1.0)
