"""Measured kernel tables: NVIDIA's per-kernel latencies from the ``aiconfigurator-core`` wheel.

The wheel (Apache-2.0, pinned in pyproject) ships parquet tables under
``aiconfigurator_core/systems/data/<system>/<op>/<engine>/<version>/``. shardc reads the
TABLES only (never the package's Python API): for one system and serving engine it takes, per
op and shape, the rows of the newest version folder that measured that shape (the newest
folder first; an older folder fills only the shapes a newer one lacks, since some newer
folders re-measure a few shapes only), keeps the rows it prices with, and stores them as dense grids in a compact ``.npz`` under ``$SHARDC_CACHE_DIR/kernels`` (default
``~/.cache/shardc/graphs/kernels``), keyed by the wheel version, system, engine and this
file's code, so a warm compile reads one small file and never imports pyarrow/pandas.

Grids (all latencies in SECONDS; sizes as the tables give them):

* ``gemm_<dtype>``: ``[M, N, K]`` over ``gemm_m`` x ``gemm_n`` x ``gemm_k`` (dtype ``bf16`` /
  ``fp8``: per-tensor scaled); ``gemm_fp8_block`` over its own ``gemm_fp8_block_m/n/k`` (FP8
  with 1 x 128 activation / 128 x 128 weight scales, the engine's block-scaled linear);
* ``ctx_attn`` / ``gen_attn``: keys ``[A, 4]`` (heads, kv_heads, head_dim, kv_fp8) -> ``[A,
  batch, length]`` (context: ``isl``; generation: KV length = isl + step);
* ``ctx_mla`` / ``gen_mla``: the MLA attention core with DeepSeek-V3's latent (512 + rope
  64), keys ``[A, 4]`` (heads per GPU, 0, 0, kv_fp8; the tables sweep the heads per GPU),
  grids as for attention (engines whose tables have it: trtllm, sglang);
* ``moe_<dtype>``: keys ``[E, 6]`` (hidden, inter, topk, experts, moe_tp, moe_ep) -> ``[E,
  num_tokens]`` (balanced routing; ``num_tokens`` = tokens entering the layer over the whole
  EP group; the latency is one rank's grouped GEMMs of both expert matrices);
  ``moe_<dtype>_source`` ``[E]``: which table dtype measured the row (index into
  :data:`MOE_SOURCES`: fp8 = the per-tensor ``fp8`` rows where the shape has them, else
  ``fp8_block``);
* ``nccl``: keys ``[C, 2]`` (op code, GPUs) -> ``[C, message bytes]``; ``car``: the engine's
  custom all-reduce, keys ``[R, 2]`` (GPUs, CUDA-graph 1/0) -> ``[R, message bytes]``.

Cleaning, stated once: duplicate rows (several kernels for one shape) keep the fastest (the
engine picks its fastest kernel); along each size axis the latency is made non-decreasing
(running max: more work never takes less time; this removes measurement noise the search
could otherwise exploit), after a cell more than 3x both neighbouring sizes' measurements
is lowered to the larger one's (a glitch: the H200 TensorRT-LLM MLA generation table holds 1.47 ms at batch 2 and KV
length 32 among 0.013-0.016 ms neighbours, which the running max carried to every larger
batch and length -- DeepSeek-V3 decode attention priced 1.47 ms at batch 16 and 4096 tokens
instead of 0.057 ms); a hole where a longer sequence did not fit at a large batch is
filled proportionally in batch from the largest measured batch (sequences are independent).
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import re
from pathlib import Path

import numpy as np

from shardc.cache import cache_dir, cache_enabled, write_entry

WHEEL = "aiconfigurator-core"
WHEEL_VERSION = "0.12.0"
SYSTEMS = {"h100": "h100_sxm", "h200": "h200_sxm", "b200": "b200_sxm"}
ENGINES = ("vllm", "sglang", "trtllm")
NCCL_OPS = ("all_gather", "reduce_scatter", "all_reduce", "alltoall")
_DTYPES = {"bf16": ("bfloat16",), "fp8": ("fp8",)}
# MoE: FP8 per-tensor where measured, else FP8 with 128x128 weight blocks (DeepSeek-V3's
# checkpoint format; the only FP8 MoE rows SGLang's tables hold)
_MOE_DTYPES = {"bf16": ("bfloat16",), "fp8": ("fp8", "fp8_block")}
MOE_SOURCES = {"bf16": ("bfloat16",), "fp8": _MOE_DTYPES["fp8"]}


class TablesUnavailable(Exception):
    """The measured tables cannot be read (wheel or system missing); the message says why."""


def data_root() -> Path:
    """``aiconfigurator_core/systems/data`` of the installed wheel (found without importing it)."""
    spec = importlib.util.find_spec("aiconfigurator_core")
    if spec is None or not spec.submodule_search_locations:
        raise TablesUnavailable(f"the {WHEEL} wheel is not installed")
    root = Path(list(spec.submodule_search_locations)[0]) / "systems" / "data"
    if not root.is_dir():
        raise TablesUnavailable(f"{root} is missing from the {WHEEL} wheel")
    return root


def wheel_version() -> str:
    try:
        return importlib.metadata.version(WHEEL)
    except importlib.metadata.PackageNotFoundError:
        return "none"


def version_key(v: str) -> tuple:
    """Sort key of a version folder name: ``0.5.6.post2 < 0.5.14``, ``1.3.0rc20 < 1.3.0rc23
    < 1.3.0`` (a release sorts after its release candidates)."""
    m = re.match(r"^v?(\d+(?:\.\d+)*)(?:\.?(rc|post|dev)(\d+))?", v)
    if not m:
        return ((), 0, 0)
    nums = tuple(int(x) for x in m.group(1).split("."))
    tag = {"dev": -2, "rc": -1, None: 0, "post": 1}[m.group(2)]
    return (nums, tag, int(m.group(3) or 0))


def table_versions(root: Path, system: str, op: str, engine: str, filename: str) -> list:
    """[(path, version)] of ``filename`` in every ``<op>/<engine>/<version>`` folder that
    holds it, newest first."""
    base = root / system / op / engine
    if not base.is_dir():
        return []
    vers = sorted((p.name for p in base.iterdir() if (p / filename).is_file()),
                  key=version_key, reverse=True)
    return [(base / v / filename, v) for v in vers]


def read_newest(root: Path, system: str, op: str, engine: str, filename: str,
                columns: list[str], key_cols: list[str], versions: dict, label: str):
    """The rows of ``filename`` for ``engine``, each shape (``key_cols``) from the newest
    version folder that measured it (a newer folder that re-measured a few shapes does not
    hide the older folder's other shapes), or None if no folder holds the table.
    ``versions[label]`` records the folders used, newest first."""
    import pandas as pd

    found = table_versions(root, system, op, engine, filename)
    if not found:
        return None
    parts, seen, used = [], None, []
    for path, ver in found:
        df = _read(path, columns)
        keys = pd.MultiIndex.from_frame(df[key_cols])
        if seen is not None:
            df = df[~keys.isin(seen)]
            keys = pd.MultiIndex.from_frame(df[key_cols])
        if len(df):
            parts.append(df)
            used.append(ver)
            seen = keys.unique() if seen is None else seen.union(keys.unique())
    versions[label] = f"{engine}/{'+'.join(used)}"
    return pd.concat(parts, ignore_index=True)


# ------------------------------------------------------------------------------ cache
def cache_folder() -> Path:
    return cache_dir() / "kernels"


def cache_path(system: str, engine: str) -> Path:
    code = hashlib.sha256(Path(__file__).read_bytes()).hexdigest()[:12]
    return cache_folder() / f"{system}-{engine}-{wheel_version()}-{code}.npz"


def load_tables(hardware: str, engine: str) -> dict:
    """The grids of :data:`SYSTEMS` ``[hardware]`` for ``engine`` (see the module docstring),
    from the npz cache or built from the parquet tables (then cached)."""
    system = SYSTEMS[hardware]
    path = cache_path(system, engine)
    if cache_enabled() and path.is_file():
        try:
            with np.load(path, allow_pickle=False) as z:
                return {k: z[k] for k in z.files}
        except (OSError, ValueError, EOFError):
            pass  # a corrupt entry: rebuild
    tables = build_tables(system, engine)
    if cache_enabled():
        _store(path, tables)
    return tables


def _store(path: Path, tables: dict) -> None:
    if write_entry(path, lambda fh: np.savez_compressed(fh, **tables), ".npz"):
        system_engine = path.name.split("-")[:2]
        for old in path.parent.glob(f"{'-'.join(system_engine)}-*.npz"):
            if old != path:  # an older wheel or loader: never read again
                old.unlink(missing_ok=True)


# ------------------------------------------------------------------------------ build
def _read(path: Path, columns: list[str]):
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise TablesUnavailable("pyarrow is not installed (needed once to read the "
                                "measured tables)") from None
    return pq.read_table(path, columns=columns).to_pandas()


# a cell more than SPIKE x both its neighbours along a size axis is a measurement glitch
SPIKE = 3.0


def _monotone(a: np.ndarray, axis: int) -> np.ndarray:
    """Running max along ``axis`` ignoring NaN (NaN stays NaN), after each spike -- an
    interior cell more than :data:`SPIKE` x both its neighbours along ``axis`` -- is lowered
    to the next (larger) one: the running max would otherwise carry one glitch to every
    larger size. A slow regime (small sizes slower than larger ones, several cells long) is
    the engine's kernel choice and is kept."""
    m = np.moveaxis(np.asarray(a, dtype=np.float64), axis, 0).copy()
    if m.shape[0] > 2:
        mid, prev, nxt = m[1:-1], m[:-2], m[2:]
        spike = (mid > SPIKE * prev) & (mid > SPIKE * nxt)
        m[1:-1] = np.where(spike, nxt, mid)
    a = np.moveaxis(m, 0, axis)
    filled = np.where(np.isnan(a), -np.inf, a)
    run = np.maximum.accumulate(filled, axis=axis)
    return np.where(np.isnan(a), np.nan, run)


def _fill_along(a: np.ndarray, axis_vals: np.ndarray) -> np.ndarray:
    """Fill NaN of 1-D ``a`` by linear interpolation in log(axis), edges held."""
    ok = ~np.isnan(a)
    if ok.all() or not ok.any():
        return a
    lx = np.log(axis_vals)
    return np.interp(lx, lx[ok], a[ok])


def _grid(df, axes: list[str], value: str = "latency"):
    """(axis value arrays, dense array of the fastest ``value`` per cell, NaN where absent);
    numpy only (a pandas groupby per sub-table made the first read of the tables slow)."""
    vals, idx = [], []
    for a in axes:
        v, inv = np.unique(df[a].to_numpy(dtype=np.float64), return_inverse=True)
        vals.append(v)
        idx.append(inv.reshape(-1))
    shape = tuple(len(v) for v in vals)
    out = np.full(int(np.prod(shape)), np.nan)
    np.fmin.at(out, np.ravel_multi_index(idx, shape), df[value].to_numpy(dtype=np.float64))
    return vals, out.reshape(shape)


def _build_gemm(root, system, engine, out, versions):
    df = read_newest(root, system, "gemm", engine, "gemm_perf.parquet",
                     ["gemm_dtype", "m", "n", "k", "latency"], ["gemm_dtype", "n", "k"],
                     versions, "gemm")
    if df is None:
        return
    for name, dts in _DTYPES.items():
        sub = df[df.gemm_dtype.isin(dts)]
        if sub.empty:
            continue
        (m, n, k), lat = _grid(sub, ["m", "n", "k"])
        for axis, vals in ((0, m), (2, k), (1, n)):  # a missing shape: from its neighbours
            lat = np.apply_along_axis(_fill_along, axis, lat, vals)
        out[f"gemm_{name}"] = _monotone(lat, 0) * 1e-3
        out["gemm_m"], out["gemm_n"], out["gemm_k"] = m, n, k
    sub = df[df.gemm_dtype == "fp8_block"]  # block-scaled FP8: its own (m, n, k) grid
    if not sub.empty:
        (m, n, k), lat = _grid(sub, ["m", "n", "k"])
        for axis, vals in ((0, m), (2, k), (1, n)):
            lat = np.apply_along_axis(_fill_along, axis, lat, vals)
        if not np.isnan(lat).any():
            out["gemm_fp8_block"] = _monotone(lat, 0) * 1e-3
            out["gemm_fp8_block_m"], out["gemm_fp8_block_n"], out["gemm_fp8_block_k"] = m, n, k


def _attention_frames(root, system, engine, versions):
    """(kind, length column, rows with columns num_heads, num_key_value_heads, head_dim,
    kv_fp8, batch_size, isl, kvlen, latency) of the attention and MLA tables."""
    for kind, fname, length in (("ctx_attn", "context_attention_perf.parquet", "isl"),
                                ("gen_attn", "generation_attention_perf.parquet", "kvlen")):
        df = read_newest(root, system, "attention", engine, fname,
                         ["batch_size", "isl", "step", "num_heads", "num_key_value_heads",
                          "head_dim", "kv_cache_dtype", "window_size", "beam_width", "latency"],
                         ["num_heads", "num_key_value_heads", "head_dim", "kv_cache_dtype"],
                         versions, kind)
        if df is not None:
            df = df[(df.window_size == 0) & (df.beam_width == 1)]
            yield kind, length, df
    for kind, fname, length in (("ctx_mla", "context_mla_perf.parquet", "isl"),
                                ("gen_mla", "generation_mla_perf.parquet", "kvlen")):
        df = read_newest(root, system, "mla", engine, fname,
                         ["batch_size", "isl", "step", "num_heads", "tp_size", "mla_dtype",
                          "kv_cache_dtype", "latency"],
                         ["num_heads", "tp_size", "mla_dtype", "kv_cache_dtype"], versions, kind)
        if df is not None:
            df = df[df.mla_dtype == "bfloat16"]
            yield kind, length, df.assign(num_key_value_heads=0, head_dim=0)


def _build_attention(root, system, engine, out, versions):
    for kind, length, df in _attention_frames(root, system, engine, versions):
        df = df.assign(kvlen=df.isl + df.step, kv_fp8=(df.kv_cache_dtype == "fp8").astype(int))
        keys = ["num_heads", "num_key_value_heads", "head_dim", "kv_fp8"]
        batch = np.array(sorted(df.batch_size.unique()), dtype=np.float64)
        lens = np.array(sorted(df[length].unique()), dtype=np.float64)
        key_rows, grids = [], []
        for key, sub in df.groupby(keys, sort=True):
            (b, L), lat = _grid(sub, ["batch_size", length])
            full = np.full((len(batch), len(lens)), np.nan)
            full[np.ix_(np.searchsorted(batch, b), np.searchsorted(lens, L))] = lat
            for j in range(full.shape[1]):  # a longer sequence that did not fit a large batch
                col = full[:, j]
                ok = np.flatnonzero(~np.isnan(col))
                if len(ok):
                    last = ok[-1]
                    col[last + 1:] = col[last] * batch[last + 1:] / batch[last]
            for i in range(full.shape[0]):
                full[i] = _fill_along(full[i], lens)
            if np.isnan(full).any():
                continue
            key_rows.append([float(x) for x in key])
            grids.append(_monotone(_monotone(full, 0), 1) * 1e-3)
        if key_rows:
            out[f"{kind}_keys"] = np.array(key_rows)
            out[f"{kind}_batch"], out[f"{kind}_len"] = batch, lens
            out[kind] = np.stack(grids)


def _build_moe(root, system, engine, out, versions):
    keys = ["hidden_size", "inter_size", "topk", "num_experts", "moe_tp_size", "moe_ep_size"]
    df = read_newest(root, system, "moe", engine, "moe_perf.parquet",
                     ["moe_dtype", "num_tokens", "distribution", "latency"] + keys,
                     ["moe_dtype", "distribution"] + keys, versions, "moe")
    if df is None:
        return
    df = df[df.distribution == "balanced"]
    tokens = np.array(sorted(df.num_tokens.unique()), dtype=np.float64)
    out["moe_tokens"] = tokens
    for name, dts in _MOE_DTYPES.items():
        key_rows, curves, sources = [], [], []
        for src, dt in enumerate(dts):  # a shape from the first dtype that measured it
            have = {tuple(r) for r in key_rows}
            for key, s in df[df.moe_dtype == dt].groupby(keys, sort=True):
                if tuple(float(x) for x in key) in have:
                    continue
                (t,), lat = _grid(s, ["num_tokens"])
                full = np.full(len(tokens), np.nan)
                full[np.searchsorted(tokens, t)] = lat
                if np.isnan(full[0]) or np.isnan(full[-1]):
                    continue  # measured over part of the token range only: not used
                key_rows.append([float(x) for x in key])
                curves.append(_monotone(_fill_along(full, tokens), 0) * 1e-3)
                sources.append(src)
        if key_rows:
            out[f"moe_{name}_keys"], out[f"moe_{name}"] = np.array(key_rows), np.stack(curves)
            out[f"moe_{name}_source"] = np.array(sources, dtype=np.int64)


def _build_comm(root, system, engine, out, versions):
    base = root / system / "comm" / "nccl"
    vers = sorted((p.name for p in base.iterdir() if (p / "nccl_perf.parquet").is_file()),
                  key=version_key) if base.is_dir() else []
    if vers:
        versions["nccl"] = f"nccl/{vers[-1]}"
        df = _read(base / vers[-1] / "nccl_perf.parquet",
                   ["op_name", "nccl_dtype", "num_gpus", "message_size", "latency"])
        df = df[df.nccl_dtype == "half"].assign(nbytes=lambda d: d.message_size * 2.0)
        _comm_curves(df, "op_name", {op: i for i, op in enumerate(NCCL_OPS)}, "nccl", out)
    df = read_newest(root, system, "comm", engine, "custom_allreduce_perf.parquet",
                     ["kernel_source", "num_gpus", "message_size", "latency"],
                     ["kernel_source", "num_gpus"], versions, "custom_allreduce")
    if df is not None:
        df = df.assign(nbytes=df.message_size * 2.0,  # bfloat16 elements
                       graph=(~df.kernel_source.str.contains("eager", case=False)).astype(int))
        _comm_curves(df, "graph", {0: 0, 1: 1}, "car", out)


def _comm_curves(df, col, codes, name, out):
    sizes = np.array(sorted(df.nbytes.unique()), dtype=np.float64)
    key_rows, curves = [], []
    for (c, n), s in df.groupby([col, "num_gpus"], sort=True):
        if c not in codes:
            continue
        (x,), lat = _grid(s, ["nbytes"])
        full = np.full(len(sizes), np.nan)
        full[np.searchsorted(sizes, x)] = lat
        hi = np.flatnonzero(~np.isnan(full))[-1]
        full = _fill_along(full, sizes)  # below the smallest measured: held
        full[hi + 1:] = full[hi] * sizes[hi + 1:] / sizes[hi]  # bandwidth-bound: bytes
        key_rows.append([float(codes[c]), float(n)])
        curves.append(_monotone(full, 0) * 1e-3)
    if key_rows:
        out[f"{name}_keys"], out[f"{name}_bytes"] = np.array(key_rows), sizes
        out[name] = np.stack(curves)


def build_tables(system: str, engine: str) -> dict:
    """Read the parquet tables of ``system`` / ``engine`` into the grids (module docstring)."""
    root = data_root()
    if not (root / system).is_dir():
        raise TablesUnavailable(f"the {WHEEL} wheel has no tables for {system}")
    out: dict = {}
    versions: dict = {}
    for build in (_build_gemm, _build_attention, _build_moe, _build_comm):
        build(root, system, engine, out, versions)
    if "gemm_bf16" not in out:
        raise TablesUnavailable(f"the {WHEEL} wheel has no {engine} GEMM table for {system}")
    out["versions"] = np.array(sorted(f"{k}={v}" for k, v in versions.items()))
    return out
