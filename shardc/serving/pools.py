"""A serving pool's recorded rows and the solves over them (:mod:`shardc.serving.search` searches).

:class:`PoolObjective` records every row a search evaluates in one pool (action, value =
the pool's tok/s/GPU, TPOT and TTFT in ms, whether memory and divisibility pass, which search
produced it); the solvers read those rows back:

* :func:`solve_agg`: the aggregated pool's best row meeting both SLOs (value = output
  tok/s/GPU of the mesh: dp replicas tile it);
* :func:`solve_disagg` / :func:`disagg_points`: per prefill worker size the best prompts/s
  meeting TTFT (prefill + KV transfer), per decode row its requests/s meeting TPOT, combined
  over worker ratios (:func:`shardc.serving.pool_models.best_ratio`);
* :func:`agg_points`: the aggregated (TPOT, tok/s/GPU) front meeting TTFT.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import numpy as np

from shardc.cost import CostModel
from shardc.cost.model import NO_MEMORY, OK, TPOT_SLO, TTFT_SLO
from shardc.ir.space import StrategySpace
from shardc.ir.strategy import Strategy, Workload
from shardc.search.fronts import latency_front
from shardc.search.objective import CostModelObjective
from shardc.serving.pool_models import best_ratio

_TAKEN_ON_USE = ("actions", "tag")  # wide / object columns a selection does not copy


class _TakenRows:
    """Rows ``idx`` of ``array``, taken when indexed (``[i]``, ``[rows]``): a tag selection's
    wide columns, which the solvers read only a few rows of."""

    def __init__(self, array: np.ndarray, idx: np.ndarray):
        self.array, self.idx = array, idx

    def __getitem__(self, i):
        return self.array[self.idx[i]]

    def __len__(self) -> int:
        return len(self.idx)


class PoolObjective(CostModelObjective):
    """A pool's objective (value = the pool's tok/s/GPU: output tokens for mixed and decode,
    prompt tokens for prefill) that records every evaluated row under the current ``tag``.
    Prefill rows add the KV transfer of their worker size to TTFT before the SLO check."""

    def __init__(self, cost_model: CostModel, space: StrategySpace, role: str,
                 transfer=None):
        super().__init__(cost_model, space)
        self.role, self.transfer, self.tag = role, transfer, ""
        self.rows: list[dict] = []
        self._tag_codes: dict[str, int] = {}  # search tag -> code in the cached table
        self._cache: tuple = (None,)  # (rows recorded, full table, tag codes)
        self._tables: dict = {}  # (tags, ordered) -> table(tags), for the cached full table

    def __call__(self, actions):
        a = np.atleast_2d(actions)
        ev = self.cost_model.evaluate(a, self.space)
        deg = self.space.degree_arrays(a)
        gpus = deg["tp"] * deg["ep"] * deg["pp"]
        ttft = np.asarray(ev.ttft_ms, dtype=float)
        if self.role == "prefill" and self.transfer is not None:
            ttft = ttft + self.transfer(gpus) * 1e3
        fits = np.isin(ev.reason, (OK, TPOT_SLO, TTFT_SLO))
        self.rows.append(dict(actions=a.copy(), value=np.asarray(ev.tok_s_per_gpu, float),
                              tpot=np.asarray(ev.tpot_ms, float), ttft=ttft, fits=fits,
                              memory=ev.reason == NO_MEMORY, gpus=gpus, batch=deg["batch"],
                              tag=np.full(len(a), self.tag, dtype=object)))
        wl = self.cost_model.workload
        ok = self.feasible(self.rows[-1], wl.tpot_slo_ms, wl.ttft_slo_ms)
        self.last_violation = self.cost_model.violation(
            ev, wl.tpot_slo_ms if self.role != "prefill" else None,
            wl.ttft_slo_ms if self.role != "decode" else None, ttft)
        self.last_memory = self.cost_model.memory_ratio(ev)
        return np.asarray(ev.tok_s_per_gpu, float), ok

    def feasible(self, r: dict, tpot_slo: float, ttft_slo: float) -> np.ndarray:
        ok = r["fits"] & (r["value"] > 0)
        if self.role in ("mixed", "decode"):
            ok = ok & (r["tpot"] <= tpot_slo)
        if self.role in ("mixed", "prefill"):
            ok = ok & (r["ttft"] <= ttft_slo)
        return ok

    def table(self, tags=None) -> dict:
        """The recorded rows (of the searches in ``tags``) as arrays; when ``tags`` is a list
        or tuple, its searches' rows come in its order (ties go to the earlier search)."""
        full, code = self._full_table()
        if not full or tags is None:
            return full
        key = (tuple(tags), isinstance(tags, (list, tuple)))  # the summary asks the same often
        if key not in self._tables:
            self._tables[key] = self._tagged(full, code, tags)
        return self._tables[key]

    def _tagged(self, full: dict, code: np.ndarray, tags) -> dict:
        """:meth:`table` of ``tags`` from the full table and its tag codes (read only)."""
        names = list(tags)
        rank = np.full(len(self._tag_codes) + 1, len(names))
        for i, t in enumerate(names):
            if t in self._tag_codes:
                rank[self._tag_codes[t]] = min(rank[self._tag_codes[t]], i)
        r = rank[code]
        idx = np.flatnonzero(r < len(names))
        if isinstance(tags, (list, tuple)):
            idx = idx[np.argsort(r[idx], kind="stable")]
        if not len(idx):
            return {}
        return {k: (_TakenRows(v, idx) if k in _TAKEN_ON_USE else v[idx]) for k, v in full.items()}

    def _full_table(self) -> tuple[dict, np.ndarray]:
        """Every recorded row as arrays, and each row's tag code (cached until a new call)."""
        if self._cache[0] == len(self.rows):
            return self._cache[1], self._cache[2]
        rows = [r for r in self.rows if len(r["value"])]
        full = {k: np.concatenate([r[k] for r in rows]) for k in rows[0]} if rows else {}
        codes = []
        for r in rows:
            tags = r["tag"]
            if (tags == tags[0]).all():
                code = self._tag_codes.setdefault(tags[0], len(self._tag_codes))
                codes.append(np.full(len(tags), code))
            else:
                codes.append(np.array([self._tag_codes.setdefault(t, len(self._tag_codes))
                                       for t in tags]))
        code = np.concatenate(codes) if codes else np.zeros(0, dtype=np.int64)
        self._cache = (len(self.rows), full, code)
        self._tables = {}
        return full, code


@dataclass
class PoolSearch:
    role: str
    space: StrategySpace
    cost_model: CostModel
    objective: PoolObjective
    results: dict = field(default_factory=dict)  # tag -> SearchResult


@dataclass
class ServeChoice:
    """One deployment: ``pools`` [(role, workers, Strategy, row dict)], predicted numbers."""

    mode: str
    pools: list
    tok_s_per_gpu: float
    tpot_ms: float
    ttft_ms: float
    req_s: float

    @property
    def tok_s_per_user(self) -> float:
        return 1000.0 / self.tpot_ms if self.tpot_ms > 0 else 0.0

    def describe(self) -> str:
        parts = []
        for role, workers, s, _ in self.pools:
            d = s.degrees
            deg = " ".join(f"{k}={v}" for k, v in d.as_dict().items()
                           if k in ("tp", "ep", "pp", "moe_tp", "moe_ep") and v > 1)
            parts.append(f"{role} {workers}x[{deg or 'tp=1'} batch={s.batch}]")
        return f"{self.mode}: " + ", ".join(parts)

    def predicted(self) -> dict:
        return {"tok_s_per_gpu": float(self.tok_s_per_gpu),
                "tok_s_per_user": float(self.tok_s_per_user), "ttft_ms": float(self.ttft_ms),
                "tpot_ms": float(self.tpot_ms), "req_s": float(self.req_s)}


def pool_strategy(pool: PoolSearch, action, workers: int) -> Strategy:
    s = pool.space.decode(action)
    return Strategy(replace(s.degrees, dp=int(workers)), s.batch, s.choices)


def solve_agg(pool: PoolSearch, tags, tpot_slo: float, ttft_slo: float,
              mesh_gpus: int, osl: int) -> ServeChoice | None:
    t = pool.objective.table(tags)
    if not t:
        return None
    ok = pool.objective.feasible(t, tpot_slo, ttft_slo)
    if not ok.any():
        return None
    i = int(np.argmax(np.where(ok, t["value"], -np.inf)))
    workers = mesh_gpus // int(t["gpus"][i])
    s = pool_strategy(pool, t["actions"][i], workers)
    v = float(t["value"][i])
    return ServeChoice("agg", [("mixed", workers, s, row_of(t, i))], v, float(t["tpot"][i]),
                       float(t["ttft"][i]), v * mesh_gpus / osl)


def row_of(t: dict, i: int) -> dict:
    return {k: (v[i] if k != "actions" else v[i].copy()) for k, v in t.items()}


def _best_prefill(pool: PoolSearch, tags, ttft_slo: float, isl: int) -> dict:
    """worker GPUs -> (prompts/s of the best worker, row index, table)."""
    t = pool.objective.table(tags)
    out = {}
    if not t:
        return out
    ok = pool.objective.feasible(t, np.inf, ttft_slo)
    rate = np.where(ok, t["value"] * t["gpus"] / isl, -np.inf)
    for g in np.unique(t["gpus"][ok]):
        idx = np.flatnonzero(t["gpus"] == g)
        i = int(idx[np.argmax(rate[idx])])
        out[int(g)] = (float(rate[i]), i, t)
    return out


def _disagg_rows(prefill: PoolSearch, decode: PoolSearch, tags, tpot_slo: float,
                 ttft_slo: float, mesh_gpus: int, wl: Workload):
    """(best prefill workers, decode table, [(decode row, best_ratio combo)]) of
    :func:`disagg_points`, in its order, nothing decoded."""
    best_p = _best_prefill(prefill, tags, ttft_slo, wl.isl)
    t = decode.objective.table(tags)
    if not best_p or not t:
        return best_p, t, []
    ok = decode.objective.feasible(t, tpot_slo, np.inf)
    rate = t["value"] * t["gpus"] / wl.osl
    rates = {k: v[0] for k, v in best_p.items()}
    out = []
    for g in np.unique(t["gpus"][ok]):
        # fastest first, the rows not beaten by a faster one
        for i in latency_front(t["tpot"], rate, np.flatnonzero(ok & (t["gpus"] == g))):
            combo = best_ratio(rates, int(g), float(rate[i]), mesh_gpus)
            if combo is not None:
                out.append((int(i), combo))
    return best_p, t, out


def _disagg_choice(prefill: PoolSearch, decode: PoolSearch, best_p: dict, t: dict, i: int,
                   combo, mesh_gpus: int, wl: Workload) -> ServeChoice:
    gp, x, y, req = combo
    p_rate, pi, pt = best_p[gp]
    pools = [("prefill", x, pool_strategy(prefill, pt["actions"][pi], x), row_of(pt, pi)),
             ("decode", y, pool_strategy(decode, t["actions"][i], y), row_of(t, i))]
    return ServeChoice("disagg", pools, req * wl.osl / mesh_gpus, float(t["tpot"][i]),
                       float(pt["ttft"][pi]), req)


def disagg_points(prefill: PoolSearch, decode: PoolSearch, tags, tpot_slo: float,
                  ttft_slo: float, mesh_gpus: int, wl: Workload) -> list[ServeChoice]:
    """Every decode row on the (TPOT, requests/s) front of its worker size, meeting
    ``tpot_slo``, combined with the best prefill workers and ratio."""
    best_p, t, rows = _disagg_rows(prefill, decode, tags, tpot_slo, ttft_slo, mesh_gpus, wl)
    return [_disagg_choice(prefill, decode, best_p, t, i, c, mesh_gpus, wl) for i, c in rows]


def solve_disagg(prefill, decode, tags, tpot_slo, ttft_slo, mesh_gpus, wl):
    """The first of :func:`disagg_points` with the most tok/s/GPU (only it decoded)."""
    best_p, t, rows = _disagg_rows(prefill, decode, tags, tpot_slo, ttft_slo, mesh_gpus, wl)
    if not rows:
        return None
    k = max(range(len(rows)), key=lambda j: rows[j][1][3] * wl.osl / mesh_gpus)
    return _disagg_choice(prefill, decode, best_p, t, *rows[k], mesh_gpus, wl)


def agg_choice(pool: PoolSearch, t: dict, i: int, wl: Workload, G: int) -> ServeChoice:
    workers = G // int(t["gpus"][i])
    v = float(t["value"][i])
    return ServeChoice("agg", [("mixed", workers, pool_strategy(pool, t["actions"][i], workers),
                                row_of(t, int(i)))], v, float(t["tpot"][i]), float(t["ttft"][i]),
                       v * G / wl.osl)


def agg_points(pool: PoolSearch, tags, wl: Workload, G: int) -> list[dict]:
    """The aggregated rows meeting TTFT on the (TPOT, tok/s/GPU) front, as points."""
    t = pool.objective.table(tags)
    if not t:
        return []
    ok = np.flatnonzero(pool.objective.feasible(t, np.inf, wl.ttft_slo_ms))
    out = []
    for i in latency_front(t["tpot"], t["value"], ok):
        c = agg_choice(pool, t, int(i), wl, G)
        out.append({"user": c.tok_s_per_user, "gpu": c.tok_s_per_gpu, "choice": c})
    return out


def point_of(c: ServeChoice) -> dict:
    return {**c.predicted(), "plan": c.describe()}
