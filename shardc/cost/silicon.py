"""``--kernels silicon``: price ops with NVIDIA's measured kernel latencies, roofline elsewhere.

:func:`kernels_for` gives a :class:`SiliconKernels` for a preset the tables cover (h100,
h200, b200, unmodified) and an engine (``vllm``, ``sglang``, ``trtllm``: whose kernels), or
None (the roofline prices everything: ``--kernels roofline``, TOML hardware, a preset changed
by a TOML file, or tables that cannot be read). The grids come from
:mod:`shardc.cost.silicon_tables`.

What is priced from the tables (one GPU, one micro-batch, the shapes of
:mod:`shardc.cost.layer_costs`):

* a linear op as one GEMM ``(m, n, k)``: m = its tokens, k = its input features per GPU,
  n = its weight elements per GPU / k (for a plain linear exactly its output features);
* the attention core: context attention (batch = sequences, isl = prompt) in prefill,
  generation attention (batch, KV length = context) in decode, at the per-GPU heads / KV heads;
  exact match on (heads, KV heads, head dim, KV dtype); an MLA core with DeepSeek-V3's latent
  from the MLA tables (heads per GPU, KV dtype) where the engine has them;
* an expert op as its share (its FLOPs over both expert matrices') of the grouped MoE
  kernel, exact match on (hidden, inter, top-k, experts, moe_tp = the op's weight split,
  moe_ep = ep), num_tokens = tokens entering the layer over the EP group x imbalance;
* a tp collective: NCCL (all-gather, reduce-scatter, all-reduce, all-to-all) inside one
  node; an all-reduce takes the faster of NCCL and the engine's custom all-reduce (its
  CUDA-graph variant in decode, eager in prefill).

Interpolation is piecewise linear in log(size) over the measured grid (exact on grid points,
monotone between them). Outside the grid on a size axis the time scales proportionally from
the largest measured size (m, tokens, batch, bytes, n, k: the throughput-bound regime where
the roofline is proportional too) or holds at the smallest, and the op is recorded as
extrapolated; a shape with no measured row (other heads, other expert configs, MLA on an
engine without MLA core tables, groups across nodes or of untabled size) and ops with no
table (embedding gather, norms, pipeline send, the expert all-to-all) use the roofline, recorded with the reason. No measured time is allowed below the
physics floor ``max(FLOPs / peak, bytes / HBM peak)``.
"""

from __future__ import annotations

import numpy as np

from shardc.cost import silicon_tables as st

MEASURED, EXTRAPOLATED, ROOFLINE = 0, 1, 2
KERNEL_CHOICES = ("silicon", "roofline")
DEFAULT_KERNELS = "silicon"
DEFAULT_ENGINE = "vllm"
_NCCL_CODE = np.array([-1, 0, 1, 2, 3])  # collectives.COLLECTIVE_KINDS code -> NCCL_OPS index
_ALL_REDUCE_OP = 2
_CACHE: dict = {}


def kernels_for(hw, kernels: str = DEFAULT_KERNELS, engine: str = DEFAULT_ENGINE):
    """``(SiliconKernels or None, kernel_source, reason)``: what prices a cost model on ``hw``.
    ``kernel_source`` is ``"silicon:<engine>-<gemm table version>:<system>"`` or
    ``"roofline"``; ``reason`` says why the roofline ("" when silicon)."""
    from shardc.cost.hardware_presets import CUSTOM_SUFFIX, load_hardware, preset_names

    if is_table_file(kernels):  # `shardc calibrate`'s measurements of the user's machine
        return _calibrated(hw, kernels)
    if kernels not in KERNEL_CHOICES:
        raise ValueError(f"kernels {kernels!r}")
    if kernels == "roofline":
        return None, "roofline", "--kernels roofline"
    name = getattr(hw, "name", "")
    base = name[:-len(CUSTOM_SUFFIX)] if name.endswith(CUSTOM_SUFFIX) else ""
    if base in st.SYSTEMS and base in preset_names():  # a preset changed by a TOML file
        return None, "roofline", (f"hardware {name!r} differs from the {base} preset the "
                                  "tables were measured on (changed by a TOML file)")
    if name not in st.SYSTEMS or name not in preset_names():
        return None, "roofline", (f"hardware {name!r} is not a measured preset "
                                  f"({', '.join(st.SYSTEMS)})")
    if load_hardware(name) != hw:
        return None, "roofline", (f"hardware {name!r} differs from the {name} preset the "
                                  "tables were measured on (changed by a TOML file)")
    key = (name, engine)
    if key not in _CACHE:
        try:
            _CACHE[key] = SiliconKernels(hw, engine, st.load_tables(name, engine))
        except st.TablesUnavailable as e:
            _CACHE[key] = str(e)
    k = _CACHE[key]
    if isinstance(k, str):
        return None, "roofline", k
    return k, k.source, ""


def is_table_file(kernels: str) -> bool:
    """``--kernels`` names a calibrated table (``shardc calibrate --out FILE.npz``)."""
    return str(kernels).endswith(".npz")


def _calibrated(hw, path: str):
    """(SiliconKernels of a calibrated table, source, "") or (None, "roofline", why)."""
    from shardc.cost.calibrate import load_calibrated

    key = ("file", str(path), getattr(hw, "name", ""))
    if key not in _CACHE:
        try:
            _CACHE[key] = SiliconKernels(hw, "calibrated", load_calibrated(path))
        except (OSError, ValueError, KeyError) as e:
            _CACHE[key] = f"--kernels {path}: {e}"
    k = _CACHE[key]
    if isinstance(k, str):
        return None, "roofline", k
    return k, k.source, ""


def _interp_rows(grid: np.ndarray, curves: np.ndarray, rows: np.ndarray, x: np.ndarray):
    """Per strategy i: ``curves[rows[i]]`` (a latency over ``grid``) at size ``x[i]``,
    linear in log(size); above the grid proportional to size, below it held.
    Returns (seconds, inside the grid)."""
    x = np.asarray(x, dtype=np.float64)
    lo, hi = grid[0], grid[-1]
    lg = _log_grid(grid)
    lx = np.log(np.minimum(np.maximum(x, lo), hi))
    j = np.minimum(np.maximum(np.searchsorted(lg, lx, side="right") - 1, 0), len(grid) - 2)
    w = (lx - lg[j]) / (lg[j + 1] - lg[j])
    t = curves[rows, j] * (1.0 - w) + curves[rows, j + 1] * w
    above = x > hi
    if above.any():
        t = np.where(above, t * x / hi, t)
    return t, (x >= lo * (1 - 1e-9)) & (x <= hi * (1 + 1e-9))


def interp_log(grid: np.ndarray, curve: np.ndarray, x):
    """A measured latency ``curve`` over a size ``grid`` at sizes ``x``: piecewise linear in
    log(size), proportional to size above the grid, held below it. Returns (seconds, inside
    the grid). The lookup every table here uses, for other measured tables (e.g. the expert
    all-to-all)."""
    x = np.asarray(x, dtype=np.float64)
    t, inside = _interp_rows(np.asarray(grid, dtype=np.float64),
                             np.asarray(curve, dtype=np.float64)[None, :],
                             np.zeros(x.shape, dtype=np.int64), x)
    return t, inside


_LOG_GRIDS: dict = {}


def _log_grid(grid: np.ndarray) -> np.ndarray:
    """np.log(grid), computed once per grid array."""
    lg = _LOG_GRIDS.get(id(grid))
    if lg is None or lg[0] is not grid:
        lg = _LOG_GRIDS[id(grid)] = (grid, np.log(grid))
    return lg[1]


def _unique_pairs(a, b):
    """(unique (a, b) pairs [U, 2], index of each strategy's pair) for arrays [B] (sizes
    with up to 3 decimals), by one 1-D sort."""
    a, b = np.broadcast_arrays(np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64))
    code = np.round(a * 1e3).astype(np.int64) * (1 << 31) + np.round(b * 1e3).astype(np.int64)
    uniq, first, inv = np.unique(code.reshape(-1), return_index=True, return_inverse=True)
    pairs = np.stack([a.reshape(-1)[first], b.reshape(-1)[first]], axis=1)
    return pairs, inv.reshape(-1)


def _lookup(keys: np.ndarray, want: np.ndarray) -> np.ndarray:
    """Row of ``keys`` [K, d] equal to each row of ``want`` [B, d], -1 where none."""
    if keys is None or len(keys) == 0:
        return np.full(len(want), -1, dtype=np.int64)
    eq = np.all(np.isclose(want[:, None, :], keys[None, :, :], rtol=0, atol=1e-6), axis=2)
    return np.where(eq.any(axis=1), eq.argmax(axis=1), -1)


class SiliconKernels:
    """Measured kernel times of one system and engine (methods vectorised over strategies;
    every method returns ``(seconds, status)`` with status :data:`MEASURED`,
    :data:`EXTRAPOLATED` or :data:`ROOFLINE` (= no measured row; seconds are NaN there))."""

    def __init__(self, hw, engine: str, tables: dict):
        self.hw, self.engine, self.t = hw, engine, tables
        self.system = (str(tables["system"]) if "system" in tables
                       else st.SYSTEMS[hw.name])
        self.versions = dict(str(v).split("=", 1) for v in tables.get("versions", []))
        gemm_ver = self.versions.get("gemm", f"{engine}/?").split("/", 1)[1].split("+")[0]
        self.source = f"silicon:{engine}-{gemm_ver}:{self.system}"
        self._gemm_curves: dict = {}
        self._curve_sets: dict = {}
        self._comm_rows = {name: self._row_index(name) for name in ("nccl", "car")}

    def _row_index(self, name: str) -> np.ndarray:
        """[code, GPUs] -> row of the ``name`` comm table (-1: not measured)."""
        idx = np.full((4, 65), -1, dtype=np.int64)
        for i, (c, n) in enumerate(self.t.get(f"{name}_keys", np.zeros((0, 2)))):
            if 0 <= c < 4 and 0 < n < 65:
                idx[int(c), int(n)] = i
        return idx

    # ----------------------------------------------------------------------- GEMM
    def _axes(self, dtype: str):
        """(m, n, k) grids of the ``gemm_<dtype>`` table (fp8_block has its own)."""
        p = f"gemm_{dtype}_" if f"gemm_{dtype}_m" in self.t else "gemm_"
        return self.t[p + "m"], self.t[p + "n"], self.t[p + "k"]

    def _gemm_curve(self, dtype: str, n: float, k: float) -> np.ndarray:
        """Latency over the m grid at weight shape (n, k): bilinear in (log n, log k),
        proportional beyond the largest n / k, held below the smallest."""
        key = (dtype, n, k)
        c = self._gemm_curves.get(key)
        if c is None:
            lat = self.t[f"gemm_{dtype}"]
            c = np.ones(lat.shape[0])
            weights = []
            _, gn, gk = self._axes(dtype)
            for axis_vals, v in ((gn, n), (gk, k)):
                lg, lv = np.log(axis_vals), np.log(np.clip(v, axis_vals[0], axis_vals[-1]))
                j = int(np.clip(np.searchsorted(lg, lv, side="right") - 1, 0, len(lg) - 2))
                w = (lv - lg[j]) / (lg[j + 1] - lg[j])
                weights.append((j, w, max(v / axis_vals[-1], 1.0)))
            (jn, wn, sn), (jk, wk, sk) = weights
            c = ((1 - wn) * ((1 - wk) * lat[:, jn, jk] + wk * lat[:, jn, jk + 1])
                 + wn * ((1 - wk) * lat[:, jn + 1, jk] + wk * lat[:, jn + 1, jk + 1])) * sn * sk
            self._gemm_curves[key] = c
        return c

    def gemm_dtype(self, fp8: bool, block: bool = False) -> str:
        """The table an FP8 (``block``: block-scaled) or BF16 GEMM reads."""
        if fp8 and block and "gemm_fp8_block" in self.t:
            return "fp8_block"
        return "fp8" if fp8 and "gemm_fp8" in self.t else "bf16"

    def gemm(self, m, n, k, fp8: bool, block: bool = False):
        """GEMM of m x k times k x n (arrays [B]): (seconds, status); ``block``: the
        block-scaled FP8 table where the engine has one."""
        dtype = self.gemm_dtype(fp8, block)
        gm, gn, gk = self._axes(dtype)
        m, n, k = np.broadcast_arrays(*(np.asarray(x, dtype=np.float64) for x in (m, n, k)))
        uniq, inv = _unique_pairs(n, k)
        curves = np.stack([self._gemm_curve(dtype, float(a), float(b)) for a, b in uniq])
        t, inside = _interp_rows(gm, curves, inv, m)
        box = lambda v, g: (v >= g[0]) & (v <= g[-1])  # noqa: E731
        inside &= box(n, gn) & box(k, gk)
        return t, np.where(inside, MEASURED, EXTRAPOLATED)

    # ---------------------------------------------------------- curves over one size axis
    def _curves(self, name: str, a, b, fixed: tuple, build, size: int):
        """Rows of a lazily built curve set ``name`` for keys ``(a, b, *fixed)`` (a, b arrays
        [B]): (curves [U, size], row per strategy, found mask). ``build(key_tuple)`` ->
        curve or None."""
        cache = self._curve_sets.setdefault(name, {})
        uniq, inv = _unique_pairs(a, b)
        rows = []
        for u in (tuple(p) + fixed for p in uniq.tolist()):
            if u not in cache:
                cache[u] = build(u)
            rows.append(cache[u])
        found = np.array([r is not None for r in rows])
        curves = np.stack([r if r is not None else np.full(size, np.nan) for r in rows])
        return curves, inv, found[inv]

    def attention(self, phase: str, batch, length: float, heads, kv_heads, head_dim: int,
                  kv_fp8: bool, mla: bool = False):
        """Attention core of ``batch`` sequences (arrays [B]) at ``length`` tokens (prompt
        in prefill, KV length in decode) with per-GPU ``heads`` / ``kv_heads`` (MLA: the
        MLA tables of DeepSeek-V3's latent, keyed by heads per GPU; kv_heads = head_dim = 0)."""
        kind = ("ctx_" if phase == "prefill" else "gen_") + ("mla" if mla else "attn")
        batch = np.asarray(batch, dtype=np.float64)
        if kind not in self.t:
            return np.full(batch.shape, np.nan), np.full(batch.shape, ROOFLINE)
        keys, grid_b, grid_l = self.t[f"{kind}_keys"], self.t[f"{kind}_batch"], self.t[f"{kind}_len"]
        power = 2.0 if phase == "prefill" else 1.0  # causal FLOPs ~ isl^2; KV reads ~ length

        def build(key):
            i = _lookup(keys, np.array([key]))[0]
            if i < 0:
                return None
            lat = self.t[kind][i]  # [batch, length]
            lv = np.log(np.clip(length, grid_l[0], grid_l[-1]))
            lg = np.log(grid_l)
            j = int(np.clip(np.searchsorted(lg, lv, side="right") - 1, 0, len(lg) - 2))
            w = (lv - lg[j]) / (lg[j + 1] - lg[j])
            scale = max(length / grid_l[-1], 1.0) ** power
            return ((1 - w) * lat[:, j] + w * lat[:, j + 1]) * scale

        heads, kv_heads, batch = np.broadcast_arrays(np.asarray(heads, float),
                                                     np.asarray(kv_heads, float), batch)
        curves, rows, found = self._curves(f"{kind}@{length}", heads, kv_heads,
                                           (float(head_dim), float(bool(kv_fp8))), build,
                                           len(grid_b))
        t, inside = _interp_rows(grid_b, curves, rows, batch)
        inside &= (length >= grid_l[0]) & (length <= grid_l[-1])
        status = np.where(~found, ROOFLINE, np.where(inside, MEASURED, EXTRAPOLATED))
        return np.where(found, t, np.nan), status

    def moe(self, tokens, hidden: int, inter: int, topk: int, experts: int, moe_tp, moe_ep,
            fp8: bool):
        """Both expert matrices of one EP rank, ``tokens`` [B] entering the layer over the EP
        group, at expert weight split ``moe_tp`` and ``moe_ep`` (arrays [B])."""
        dtype = "fp8" if fp8 else "bf16"
        tokens = np.asarray(tokens, dtype=np.float64)
        if f"moe_{dtype}" not in self.t:
            return np.full(tokens.shape, np.nan), np.full(tokens.shape, ROOFLINE)
        keys, table = self.t[f"moe_{dtype}_keys"], self.t[f"moe_{dtype}"]

        def build(key):  # key = (moe_tp, moe_ep, hidden, inter, topk, experts)
            i = _lookup(keys, np.array([key[2:] + key[:2]]))[0]
            return None if i < 0 else table[i]

        moe_tp, moe_ep, tokens = np.broadcast_arrays(np.asarray(moe_tp, float),
                                                     np.asarray(moe_ep, float), tokens)
        curves, rows, found = self._curves(
            f"moe_{dtype}", moe_tp, moe_ep,
            (float(hidden), float(inter), float(topk), float(experts)), build,
            len(self.t["moe_tokens"]))
        t, inside = _interp_rows(self.t["moe_tokens"], curves, rows, tokens)
        status = np.where(~found, ROOFLINE, np.where(inside, MEASURED, EXTRAPOLATED))
        return np.where(found, t, np.nan), status

    def moe_source(self, dtype: str, hidden: int, inter: int, topk: int, experts: int) -> str:
        """The table dtype that measured this expert configuration (``fp8`` or ``fp8_block``
        for FP8, :data:`shardc.cost.silicon_tables.MOE_SOURCES`), "" if none did."""
        keys = self.t.get(f"moe_{dtype}_keys")
        src = self.t.get(f"moe_{dtype}_source")
        if keys is None or not len(keys):
            return ""
        hit = np.all(np.isclose(keys[:, :4], [hidden, inter, topk, experts]), axis=1)
        if not hit.any():
            return ""
        names = st.MOE_SOURCES[dtype]
        return names[int(src[np.argmax(hit)])] if src is not None else names[0]

    def collective(self, code, nbytes, group, cuda_graph: bool):
        """A tp collective (:data:`shardc.cost.collectives.COLLECTIVE_KINDS` code [B]) moving
        ``nbytes`` (the NCCL message: full tensor; all-to-all: one rank's send buffer)."""
        code = np.asarray(code)
        nbytes = np.asarray(nbytes, dtype=np.float64)
        shape = np.broadcast(code, nbytes).shape
        if "nccl" not in self.t or not code.any():
            return np.full(shape, np.nan), np.full(shape, ROOFLINE)
        op = _NCCL_CODE[np.clip(code, 0, len(_NCCL_CODE) - 1)].astype(float)
        size = np.clip(np.broadcast_to(group.size, shape), 0, 64).astype(np.int64)
        one_node = np.broadcast_to(group.nodes, shape) == 1
        opi = op.astype(np.int64)
        rows = np.where(opi >= 0, self._comm_rows["nccl"][np.maximum(opi, 0), size], -1)
        ok = (rows >= 0) & one_node & (op >= 0)
        t, inside = _interp_rows(self.t["nccl_bytes"], self.t["nccl"], np.maximum(rows, 0), nbytes)
        if "car" in self.t:
            car_keys = self.t["car_keys"]
            graph = 1 if cuda_graph and (car_keys[:, 0] == 1).any() else 0
            if not (car_keys[:, 0] == graph).any():
                graph = int(car_keys[0, 0])
            crow = self._comm_rows["car"][graph, size]
            tc, _ = _interp_rows(self.t["car_bytes"], self.t["car"], np.maximum(crow, 0), nbytes)
            use = (crow >= 0) & (op == _ALL_REDUCE_OP)
            t = np.where(use, np.minimum(t, tc), t)
        status = np.where(~ok, ROOFLINE, np.where(inside, MEASURED, EXTRAPOLATED))
        return np.where(ok, t, np.nan), status


# ------------------------------------------------------------- adapters for layer_costs
STATUS_TEXT = {MEASURED: "silicon", EXTRAPOLATED: "silicon (extrapolated)", ROOFLINE: "roofline"}


def _fmt(x) -> str:
    x = float(np.asarray(x).reshape(-1)[0])
    return f"{x:.0f}" if x >= 10 or x == int(x) else f"{x:.3g}"


def _merge(oc, t, status, floor_s, b, op: str, table: str, shape: str, why: str):
    """``oc`` (the roofline OpCost) with its time replaced by the measured one where there
    is one (never below ``floor_s``); in detail mode records the source and any fallback."""
    measured = status != ROOFLINE
    oc.time_s = np.where(measured, np.maximum(t, floor_s), oc.time_s)
    if b.detail:
        s0 = int(np.asarray(status).reshape(-1)[0])
        oc.source = STATUS_TEXT[s0]
        if s0 != MEASURED:
            reason = (f"{shape} is outside the measured {table} grid: scaled from the nearest "
                      "measured size" if s0 == EXTRAPOLATED else why)
            b.fallbacks.append({"op": op, "shape": shape, "source": oc.source,
                                "reason": reason})
    return oc


def price_linear(oc, op: str, m, n, k, flops, nbytes, b):
    """A linear op as one GEMM (m tokens, n x k weight shard per GPU)."""
    fp8 = b.gemm_peak > b.hw.peak_flops(False)
    block = fp8 and b.fp8_scaling == "block"
    t, status = b.kernels.gemm(m, n, k, fp8, block)
    # the measured FP8 linear includes its input quantisation (module shardc.cost.quantisation)
    floor = np.maximum(flops / b.gemm_peak, nbytes / b.hw.hbm_bytes_s)
    shape = f"gemm m={_fmt(m)} n={_fmt(n)} k={_fmt(k)} {b.kernels.gemm_dtype(fp8, block)}"
    return _merge(oc, t, status, floor, b, op, "GEMM", shape, "")


def price_expert(oc, op: str, share: float, tokens, hidden: int, inter: int, topk: int,
                 experts: int, moe_tp, flops, nbytes, b):
    """One expert matrix as ``share`` of the grouped MoE kernel of its EP rank."""
    fp8 = b.gemm_peak > b.hw.peak_flops(False)
    t, status = b.kernels.moe(tokens, hidden, inter, topk, experts, moe_tp, b.ep, fp8)
    floor = np.maximum(flops / b.gemm_peak, nbytes / b.hw.hbm_bytes_s)
    src = b.kernels.moe_source("fp8" if fp8 else "bf16", hidden, inter, topk, experts) \
        if b.detail else ""
    shape = (f"moe tokens={_fmt(tokens)} hidden={hidden} inter={inter} topk={topk} "
             f"experts={experts} moe_tp={_fmt(moe_tp)} moe_ep={_fmt(b.ep)} "
             f"{src or ('fp8' if fp8 else 'bf16')}")
    why = f"{shape}: no measured {b.kernels.engine} MoE row for this expert configuration"
    return _merge(oc, t * share, status, floor, b, op, "MoE", shape, why)


def price_attention(oc, op: str, batch, length: float, heads, kv_heads, head_dim: int,
                    mla: bool, flops, nbytes, b, mla_v3: bool = False, scale: float = 1.0):
    """The attention core (per-GPU heads / KV heads, ``batch`` sequences); ``mla_v3``: an
    MLA core with DeepSeek-V3's latent (the only one the MLA tables measure); ``scale``
    multiplies the measured time (a sliding window's banded prefill: its query-key pairs
    over the causal kernel's)."""
    kv_fp8 = b.kv_bytes <= 1
    shape = (f"{'context' if b.phase == 'prefill' else 'generation'} attention "
             f"batch={_fmt(batch)} length={_fmt(length)} heads={_fmt(heads)} "
             f"kv_heads={_fmt(kv_heads)} head_dim={head_dim} kv={'fp8' if kv_fp8 else 'bf16'}")
    if mla:  # the tables hold MLA with DeepSeek-V3's latent (512 + rope 64)
        t, status = b.kernels.attention(b.phase, batch, length, heads, 0, 0, kv_fp8, mla=True)
        if not mla_v3:
            status = np.full(np.shape(batch), ROOFLINE)
        why = (f"{shape}: MLA attention is measured only with DeepSeek-V3's latent (512 + "
               "rope 64), for engines with MLA core tables (trtllm, sglang)")
    else:
        t, status = b.kernels.attention(b.phase, batch, length, heads, kv_heads, head_dim,
                                        kv_fp8)
        why = f"{shape}: no measured {b.kernels.engine} row for these heads / head dim"
    floor = np.maximum(flops / b.hw.peak_flops(False), nbytes / b.hw.hbm_bytes_s)
    return _merge(oc, t * scale, status, floor, b, op, "attention", shape, why)


def price_collective(roof_s, kind, nbytes, group, b, before: str):
    """A tp collective: measured where the tables cover it, else ``roof_s``."""
    from shardc.cost.collectives import COLLECTIVE_KINDS

    t, status = b.kernels.collective(kind, nbytes, group, cuda_graph=b.phase == "decode")
    active = np.asarray(kind) > 0
    out = np.where((status != ROOFLINE) & active, t, roof_s)
    if b.detail and bool(np.asarray(active).reshape(-1)[0]):
        s0 = int(np.asarray(status).reshape(-1)[0])
        if s0 != MEASURED:
            name = COLLECTIVE_KINDS[int(np.asarray(kind).reshape(-1)[0])]
            n = int(np.asarray(group.size).reshape(-1)[0])
            nodes = int(np.asarray(group.nodes).reshape(-1)[0])
            shape = f"{name} gpus={n} nodes={nodes} bytes={_fmt(nbytes)}"
            reason = ("outside the measured NCCL message sizes: scaled from the nearest"
                      if s0 == EXTRAPOLATED else
                      "no measured NCCL row (tables cover 2-8 GPUs inside one node)")
            b.fallbacks.append({"op": f"{name} before {before}", "shape": shape,
                                "source": STATUS_TEXT[s0], "reason": reason})
    return out
