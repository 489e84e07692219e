"""``shardc calibrate``: measure this machine's kernels into a table ``--kernels FILE`` reads.

Hardware outside NVIDIA's measured tables (A100, L40S, H20, MI300X under ROCm, ...) is then
priced from its own measurements. The file is an ``.npz`` holding the grids of
:mod:`shardc.cost.silicon_tables` (seconds; the same keys and cleaning: the fastest of the
repeats' median, made non-decreasing along each size axis), so
:class:`shardc.cost.silicon.SiliconKernels` reads it as it reads NVIDIA's:

* ``gemm_bf16`` (and ``gemm_fp8`` where ``torch._scaled_mm`` runs: activations already
  FP8, per-tensor scales) over an ``m x n x k`` grid;
* ``ctx_attn`` / ``gen_attn``: ``torch.nn.functional.scaled_dot_product_attention`` (causal
  over the prompt; one query over the KV length) at the per-GPU heads / KV heads / head dim
  of ``--model``'s attention at tp = 1, 2, 4, 8 (a default Llama-like shape without it);
* ``moe_bf16``: one EP rank's grouped expert GEMMs (``x W1``, SiLU-gated, ``W2`` per local
  expert) of ``--model``'s experts at moe_tp x moe_ep splits, the rows per local expert drawn
  from the routing model (``--routing``, shardc.cost.routing) for the mean rank's share of
  ``num_tokens x top_k`` -- so the per-expert skew inside a rank is in the measurement;
* collectives: not measured by this version (one process); the alpha-beta model prices them.

``grid="tiny"`` is a few points of each (seconds on a CPU: the mechanism's test);
``grid="full"`` the sizes serving needs (minutes on a GPU). Units: seconds.
"""

from __future__ import annotations

import time

import numpy as np

GRIDS = {
    "tiny": dict(m=(1, 8, 32), nk=(64, 128), batch=(1, 2), length=(16, 32), tokens=(1, 4, 16),
                 tps=(1, 2), eps=(1, 2), repeats=3),
    "full": dict(m=tuple(2 ** i for i in range(15)), nk=(512, 1024, 2048, 4096, 8192, 16384,
                                                       32768),
                 batch=(1, 2, 4, 8, 16, 32, 64, 128, 256), length=(128, 512, 1024, 2048, 4096,
                                                                   8192, 16384),
                 tokens=(1, 4, 16, 64, 256, 1024, 4096, 16384), tps=(1, 2, 4, 8),
                 eps=(1, 2, 4, 8), repeats=20),
}
DEFAULT_ATTENTION = (32, 8, 128)  # heads, KV heads, head dim when no --model is given


def _timer(device):
    import torch

    def run(fn, repeats: int) -> float:
        fn()  # warm up (kernel selection, allocation)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            fn()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            times.append(time.perf_counter() - t0)
        return float(np.median(times))

    return run


def _monotone(a: np.ndarray, axis: int) -> np.ndarray:
    return np.maximum.accumulate(a, axis=axis)


def measure_gemm(device, dtype, grid: dict, run) -> dict:
    import torch

    m, nk = grid["m"], grid["nk"]
    out = {"gemm_m": np.array(m, float), "gemm_n": np.array(nk, float),
           "gemm_k": np.array(nk, float)}
    lat = np.zeros((len(m), len(nk), len(nk)))
    for j, n in enumerate(nk):
        for q, k in enumerate(nk):
            w = torch.randn(k, n, device=device, dtype=dtype)
            for i, rows in enumerate(m):
                x = torch.randn(rows, k, device=device, dtype=dtype)
                lat[i, j, q] = run(lambda: x @ w, grid["repeats"])
    out["gemm_bf16"] = _monotone(lat, 0)
    if device.type == "cuda" and hasattr(torch, "_scaled_mm") and hasattr(torch, "float8_e4m3fn"):
        try:
            f8 = np.zeros_like(lat)
            one = torch.ones((), device=device, dtype=torch.float32)
            for j, n in enumerate(nk):
                for q, k in enumerate(nk):
                    w = torch.randn(n, k, device=device).to(torch.float8_e4m3fn).t()
                    for i, rows in enumerate(m):
                        x = torch.randn(max(rows, 16), k, device=device).to(torch.float8_e4m3fn)
                        f8[i, j, q] = run(lambda: torch._scaled_mm(
                            x, w, scale_a=one, scale_b=one, out_dtype=torch.bfloat16),
                            grid["repeats"])
            out["gemm_fp8"] = _monotone(f8, 0)
        except (RuntimeError, TypeError):  # no FP8 tensor cores here
            pass
    return out


def attention_shapes(graph) -> list[tuple[int, int, int]]:
    """(heads, KV heads, head dim) per GPU of the model's attention at tp = 1, 2, 4, 8 (the
    keys :func:`shardc.cost.silicon.price_attention` looks up under a heads split)."""
    if graph is None:
        base = [DEFAULT_ATTENTION]
    else:
        base = []
        for kind in graph.layer_kinds:
            op = kind.op("attn_core")
            if op is not None:
                a = op.attrs
                h = int(a.get("heads", 1) or 1)
                base.append((h, int(a.get("kv_heads", h) or h), int(a.get("head_dim", 0) or 0)))
    shapes = []
    for h, kv, hd in dict.fromkeys(base):
        for tp in (1, 2, 4, 8):
            if h % tp == 0 and hd > 0:
                shapes.append((h // tp, max(kv // min(tp, kv), 1), hd))
    return list(dict.fromkeys(shapes))


def measure_attention(device, dtype, grid: dict, shapes, run) -> dict:
    import torch
    import torch.nn.functional as F

    batch, length = grid["batch"], grid["length"]
    out = {}
    for kind in ("ctx_attn", "gen_attn"):
        keys, grids = [], []
        for h, kv, hd in shapes:
            lat = np.zeros((len(batch), len(length)))
            for i, b in enumerate(batch):
                for j, L in enumerate(length):
                    q_len = L if kind == "ctx_attn" else 1
                    q = torch.randn(b, h, q_len, hd, device=device, dtype=dtype)
                    k = torch.randn(b, kv, L, hd, device=device, dtype=dtype)
                    v = torch.randn(b, kv, L, hd, device=device, dtype=dtype)
                    causal = kind == "ctx_attn"
                    lat[i, j] = run(lambda: F.scaled_dot_product_attention(
                        q, k, v, is_causal=causal, enable_gqa=kv != h), grid["repeats"])
            keys.append([float(h), float(kv), float(hd), 0.0])
            grids.append(_monotone(_monotone(lat, 0), 1))
        if keys:
            out[f"{kind}_keys"] = np.array(keys)
            out[f"{kind}_batch"], out[f"{kind}_len"] = np.array(batch, float), np.array(length,
                                                                                        float)
            out[kind] = np.stack(grids)
    return out


def expert_shapes(graph) -> list[tuple[int, int, int, int]]:
    """(hidden, inter, top-k, experts) of the model's routed experts (none without one)."""
    if graph is None:
        return []
    hidden = int(graph.config.get("hidden", 0) or 0)
    out = []
    for kind in graph.layer_kinds:
        f2 = kind.op("expert_ffn2")
        if f2 is not None:
            E = int(f2.attrs.get("num_experts", graph.config.get("num_experts", 0)) or 0)
            k = int(f2.attrs.get("top_k", graph.config.get("top_k", 0)) or 0)
            if E and k:
                out.append((hidden, int(f2.in_features), k, E))
    return list(dict.fromkeys(out))


def measure_moe(device, dtype, grid: dict, shapes, routing: str, run, seed: int = 0) -> dict:
    import torch
    import torch.nn.functional as F

    from shardc.cost.routing import pick_probabilities

    tokens = grid["tokens"]
    rng = np.random.default_rng(seed)
    keys, curves = [], []
    for hidden, inter, k, E in shapes:
        q = pick_probabilities(E, k, routing)
        for mtp in grid["tps"]:
            for mep in grid["eps"]:
                if inter % mtp or E % mep:
                    continue
                local, width = E // mep, inter // mtp
                w1 = torch.randn(local, hidden, 2 * width, device=device, dtype=dtype) * 0.02
                w2 = torch.randn(local, width, hidden, device=device, dtype=dtype) * 0.02
                lat = np.zeros(len(tokens))
                for i, T in enumerate(tokens):
                    # the mean rank's rows: T x k / ep, spread over its experts by the routing
                    mine = rng.permutation(E)[:local]
                    counts = rng.binomial(T, np.broadcast_to(q[mine], (local,)))
                    xs = [torch.randn(int(c), hidden, device=device, dtype=dtype)
                          for c in counts]

                    def grouped():
                        for e, x in enumerate(xs):
                            if len(x):
                                g, u = (x @ w1[e]).chunk(2, dim=-1)
                                (F.silu(g) * u) @ w2[e]

                    lat[i] = run(grouped, grid["repeats"])
                keys.append([float(hidden), float(inter), float(k), float(E), float(mtp),
                             float(mep)])
                curves.append(_monotone(lat, 0))
    if not keys:
        return {}
    return {"moe_tokens": np.array(tokens, float), "moe_bf16_keys": np.array(keys),
            "moe_bf16": np.stack(curves)}


def calibrate(grid: str = "tiny", graph=None, routing: str = "uniform", device: str | None = None,
              progress=None) -> dict:
    """Measure the kernels of this machine on ``grid`` (:data:`GRIDS`) for ``graph``'s
    shapes (or the defaults): the tables dict (module docstring)."""
    import torch

    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = torch.bfloat16
    g = GRIDS[grid]
    run = _timer(dev)
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"
    tables = {}
    for what, fn in (("gemm", lambda: measure_gemm(dev, dtype, g, run)),
                     ("attention", lambda: measure_attention(dev, dtype, g,
                                                             attention_shapes(graph), run)),
                     ("moe", lambda: measure_moe(dev, dtype, g, expert_shapes(graph), routing,
                                                 run))):
        if progress:
            progress(what)
        tables.update(fn())
    ver = f"calibrated/torch-{torch.__version__.split('+')[0]}"
    tables["versions"] = np.array(sorted(f"{k}={ver}" for k in ("gemm", "attention", "moe")))
    tables["system"] = np.array(f"calibrated:{name.replace(' ', '_')}")
    tables["routing"] = np.array(routing)
    return tables


def save_tables(path, tables: dict) -> None:
    with open(path, "wb") as fh:
        np.savez_compressed(fh, **tables)


def load_calibrated(path) -> dict:
    """The tables of a ``shardc calibrate`` file (``ValueError`` if it is not one)."""
    with np.load(path, allow_pickle=False) as z:
        tables = {k: z[k] for k in z.files}
    if "gemm_bf16" not in tables or "system" not in tables:
        raise ValueError("not a shardc calibrate table (no gemm_bf16 / system)")
    return tables
