"""Run strategies on N local gloo processes and compare the logits with the unsharded model.

One launch runs a whole list of strategies (process start-up dominates the cost): every rank
builds the model from the same seed, computes the reference logits unsharded, then for each
strategy builds a fresh copy, shards it (:func:`shardc.backends.apply.apply`), runs the same
batch and reports ``max |sharded - reference| / max |reference|`` from the ranks that hold
logits (the last pipeline stage). Loopback only (127.0.0.1).
"""

from __future__ import annotations

import json
import logging
import os
import socket
import tempfile
import time
from dataclasses import dataclass

import torch

from shardc.ir.strategy import Strategy


@dataclass
class Case:
    """One strategy to check: ``choices`` by name or index, ``layer_kinds`` kind -> layers."""

    name: str
    degrees: dict
    choices: dict
    layer_kinds: dict | None = None

    code: str | None = None  # path of a parallelize.py to run instead of apply()
    corrupt: bool = False  # perturb one local shard after sharding (checks the checker)
    kv_cache: int = 0  # >0: run the prompt minus its last N tokens, then N cached steps
    padded: str = ""  # "right" / "left": pad every other sequence (a padding attention_mask)

    def strategy(self) -> Strategy:
        from shardc.backends.apply import strategy_from_names

        return strategy_from_names(self.degrees, self.choices)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world: int, port: int, suites: list, batch: int, seq: int,
            out_dir: str) -> None:
    import torch.distributed as dist

    from shardc.backends.apply import apply

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    # DTensor's advice to flatten dp x ep for a batch gather is not actionable for a user
    # reading verify's verdict; keep the ranks' stderr to real problems.
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    results = []
    try:
        for model_ref, cases in suites:
            t0 = time.perf_counter()
            model, ids = _build(model_ref, batch, seq)
            with torch.no_grad():
                ref = _logits(model(ids))
            ref_padded: dict[str, torch.Tensor] = {}  # side -> unsharded padded logits
            build_s = time.perf_counter() - t0
            for c in cases:
                case = Case(**c)
                res = {"name": case.name, "reference_s": build_s}
                t0, build_s = time.perf_counter(), 0.0
                try:
                    fresh = _build(model_ref, batch, seq)[0]
                    if case.code:
                        sharded = _load_code(case.code).parallelize(fresh)
                    else:
                        sharded = apply(fresh, case.strategy(), layer_kinds=case.layer_kinds)
                    if case.corrupt and rank == 0:
                        _perturb(sharded)
                    expect = ref
                    with torch.no_grad():
                        if case.padded:
                            mask = padding_mask(ids, case.padded)
                            if case.padded not in ref_padded:
                                ref_padded[case.padded] = _logits(model(ids, attention_mask=mask))
                            expect = ref_padded[case.padded]
                            out = sharded(ids, attention_mask=mask)
                        elif case.kv_cache:
                            out = _cached_logits(sharded, ids, case.kv_cache)
                        else:
                            out = sharded(ids)
                    if out is not None:
                        out = _logits(out)
                        res["shape_ok"] = list(out.shape) == list(expect.shape)
                        if case.padded:  # the logits of real tokens (pad positions are unread)
                            keep = mask.bool()
                            out, expect = out[keep], expect[keep]
                        res["rel_err"] = float((out - expect).abs().max() / expect.abs().max())
                except Exception as e:  # reported per case; the other cases still run
                    res["error"] = f"{type(e).__name__}: {e}"
                    if os.environ.get("SHARDC_DEBUG"):
                        import traceback

                        res["error"] += "\n" + traceback.format_exc()
                res["seconds"] = time.perf_counter() - t0
                results.append(res)
                dist.barrier()
    finally:
        with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
            json.dump(results, f)
        dist.destroy_process_group()


def _load_code(path: str):
    import importlib.util

    spec = importlib.util.spec_from_file_location(f"_shardc_parallelize_{abs(hash(path))}", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _perturb(model) -> None:
    from torch.distributed.tensor import DTensor

    for p in model.parameters():
        if isinstance(p, DTensor) and p.ndim >= 2:
            with torch.no_grad():
                p.to_local().mul_(1.05)
            return


def _build(model_ref: str, batch: int, seq: int):
    """``model_ref`` = path of a model file (tiny_model) or ``module:function``."""
    if model_ref.endswith(".py"):
        from shardc.frontends.model_file import load_model_file

        src = load_model_file(model_ref)
        model, _ = src.build(tiny=True)
    else:
        import importlib

        mod, fn = model_ref.split(":")
        model = getattr(importlib.import_module(mod), fn)()
    model = model.float().eval()
    vocab = _vocab(model)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, vocab, (batch, seq), generator=g, dtype=torch.long)
    return model, ids


def _vocab(model) -> int:
    cfg = model.config
    return int(getattr(cfg, "vocab_size"))


def padding_mask(ids: torch.Tensor, side: str = "right") -> torch.Tensor:
    """[batch, seq] 0/1 attention mask: every other sequence padded on ``side`` to about half
    its length (only the real tokens' logits are compared)."""
    mask = torch.ones_like(ids)
    half = ids.shape[1] // 2
    if side == "left":
        mask[1::2, :half - 1] = 0
    else:
        mask[1::2, half + 1:] = 0
    return mask


def _cached_logits(model, ids: torch.Tensor, steps: int) -> torch.Tensor | None:
    """Logits of ``ids`` computed as a prefill of all but the last ``steps`` tokens, then
    ``steps`` one-token forwards reusing the model's KV cache (``past_key_values``); equal to
    one whole-sequence forward when the cache is right. None on ranks that hold no logits."""
    out = model(ids[:, :-steps], use_cache=True)
    if out is None:
        return None
    parts, cache = [_logits(out)], out.past_key_values
    for t in range(ids.shape[1] - steps, ids.shape[1]):
        out = model(ids[:, t:t + 1], past_key_values=cache, use_cache=True)
        parts.append(_logits(out))
        cache = out.past_key_values
    return torch.cat(parts, dim=1)


def _logits(out) -> torch.Tensor:
    return out if isinstance(out, torch.Tensor) else out.logits


def run_cases(model_ref: str, cases: list[Case], world: int, batch: int | None = None,
              seq: int = 8, timeout_s: float = 900) -> list[dict]:
    """Run ``cases`` on ``world`` gloo processes; returns per case {name, rel_err, error,
    seconds} (the worst over ranks holding logits; ``seconds``: rank 0's wall time for the
    case, ``reference_s`` its model's unsharded reference run, first case only)."""
    return run_suites([(model_ref, cases)], world, batch, seq, timeout_s)


# Imported once by the fork server; every worker forks from it instead of importing torch,
# transformers and shardc again (start-up dominated the launch: ~4x the import CPU time).
_PRELOAD = ["torch", "torch.distributed", "torch.distributed.tensor", "transformers",
            "transformers.modeling_utils", "transformers.models.auto.modeling_auto",
            "shardc.frontends.model_file", "shardc.backends.apply", "shardc.backends.verify"]


def _start_method() -> str:
    """``forkserver`` with the heavy imports preloaded (a fresh single-threaded server
    process, so forking it is safe); ``spawn`` where there is no fork server or when
    ``SHARDC_VERIFY_SPAWN=1``."""
    import multiprocessing

    if os.environ.get("SHARDC_VERIFY_SPAWN", "") not in ("", "0") or \
            "forkserver" not in multiprocessing.get_all_start_methods():
        return "spawn"
    multiprocessing.get_context("forkserver").set_forkserver_preload(_PRELOAD)
    return "forkserver"


def run_suites(suites: list[tuple[str, list[Case]]], world: int, batch: int | None = None,
               seq: int = 8, timeout_s: float = 900) -> list[dict]:
    """Several models' cases in ONE launch (process start-up dominates): results in order."""
    import torch.multiprocessing as mp

    batch = batch or 2 * world
    suites = [(os.path.abspath(m) if m.endswith(".py") else m, cs) for m, cs in suites]
    cases = [c for _, cs in suites for c in cs]
    payload = [(m, [c.__dict__ for c in cs]) for m, cs in suites]
    method = _start_method()
    with tempfile.TemporaryDirectory(prefix="shardc-verify-") as tmp:
        ctx = mp.start_processes(_worker, args=(world, _free_port(), payload, batch, seq, tmp),
                                 nprocs=world, join=False, start_method=method)
        deadline = time.monotonic() + timeout_s
        while not ctx.join(timeout=5):
            if time.monotonic() > deadline:
                for proc in ctx.processes:
                    proc.terminate()
                raise TimeoutError(f"verify workers did not finish in {timeout_s:.0f} s")
        per_rank = []
        for r in range(world):
            p = os.path.join(tmp, f"rank{r}.json")
            per_rank.append(json.load(open(p)) if os.path.exists(p) else [])
    merged = []
    for i, c in enumerate(cases):
        res = {"name": c.name, "rel_err": None, "error": None}
        if per_rank and i < len(per_rank[0]):
            res["seconds"] = per_rank[0][i].get("seconds")
            res["reference_s"] = per_rank[0][i].get("reference_s", 0.0)
        for rank_res in per_rank:
            if i >= len(rank_res):
                res["error"] = res["error"] or "a rank did not finish"
                continue
            rr = rank_res[i]
            if rr.get("error"):
                res["error"] = res["error"] or rr["error"]
            if rr.get("rel_err") is not None:
                res["rel_err"] = max(res["rel_err"] or 0.0, rr["rel_err"])
            if rr.get("shape_ok") is False:
                res["error"] = res["error"] or "logits shape differs"
        if res["rel_err"] is None and not res["error"]:
            res["error"] = "no rank produced logits"
        merged.append(res)
    return merged
