"""Run strategies on N local gloo processes and compare the logits with the unsharded model.

One launch runs a whole list of strategies (process start-up dominates the cost): every rank
builds the model from the same seed, computes the reference logits unsharded, then for each
strategy builds a fresh copy, shards it with a given ``parallelize.py`` or, for a case given
as degrees and choices, the one of the strategy's plan on the model's traced graph (the
file ``Plan.code`` emits and ``Plan.apply`` runs; ``plan_code``, e.g.
:func:`shardc.plan.strategy_code`), runs the same
batch and reports ``max |sharded - reference| / max |reference|`` from the ranks that hold
logits (the last pipeline stage). Logits with a NaN or an infinity on either side (or an
all-zero reference) are an error of the case, never a small error (:func:`compare_logits`,
:func:`worst_rel_err`). Loopback only (127.0.0.1).
"""

from __future__ import annotations

import inspect
import json
import logging
import math
import os
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
    code_text: str | None = None  # or its source (``shardc verify``: the scaled plan's)
    corrupt: bool = False  # perturb one local shard after sharding (checks the checker)
    kv_cache: int = 0  # >0: run the prompt minus its last N tokens, then N cached steps
    padded: str = ""  # "right" / "left": pad every other sequence (a padding attention_mask)

    def strategy(self, batch: int = 1) -> Strategy:
        from shardc.ir.strategy import strategy_from_names

        return strategy_from_names(self.degrees, self.choices, batch)


def _worker(rank: int, world: int, port: int, suites: list, batch: int, seq: int,
            plan_code, out_dir: str) -> None:
    import torch.distributed as dist

    from shardc.fingerprint import ModelMismatch
    from shardc.frontends import graph_from_module

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    # DTensor's advice to flatten dp x ep for a batch gather is not actionable for a user
    # reading verify's verdict; keep the ranks' stderr to real problems.
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    results = []
    try:
        for model_ref, cases, tiny_degrees in suites:
            t0 = time.perf_counter()
            model, ids = _build(model_ref, batch, seq, tiny_degrees)
            with torch.no_grad():
                ref = _logits(model(ids))
            ref_padded: dict[str, torch.Tensor] = {}  # side -> unsharded padded logits
            graph = []  # the model traced once, for the params rows of cases without code
            build_s = time.perf_counter() - t0
            for c in cases:
                case = Case(**c)
                res = {"name": case.name, "reference_s": build_s}
                t0, build_s = time.perf_counter(), 0.0
                try:
                    fresh = _build(model_ref, batch, seq, tiny_degrees)[0]
                    if case.code or case.code_text:
                        sharded = _load_code(case.code, case.code_text).parallelize(fresh)
                    else:
                        if not graph:
                            graph.append(graph_from_module(model, (ids,), name="verify"))
                        if plan_code is None:
                            raise ValueError("a strategy case needs run_suites(plan_code=...)")
                        text = plan_code(graph[0], case.strategy(batch), batch, seq,
                                         case.layer_kinds)
                        sharded = _load_code(None, text).parallelize(fresh)
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
                        res["rel_err"], err = compare_logits(out, expect)
                        if err:
                            res["error"] = f"rank {rank}: {err}"
                except Exception as e:  # reported per case; the other cases still run
                    res["error"] = f"{type(e).__name__}: {e}"
                    if isinstance(e, ModelMismatch):  # the model refused the plan: bad input
                        res["refused"] = str(e)
                    if os.environ.get("SHARDC_DEBUG"):
                        import traceback

                        res["error"] += "\n" + traceback.format_exc()
                res["seconds"] = time.perf_counter() - t0
                results.append(res)
                dist.barrier()
    finally:
        with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
            json.dump(results, f, allow_nan=False)
        dist.destroy_process_group()


def _load_code(path: str | None, text: str | None = None):
    """The module of a ``parallelize.py`` at ``path``, or of its source ``text`` (shardc's
    own emitted file: plan values in it are escaped literals)."""
    import importlib.util
    import types

    if text is not None:
        mod = types.ModuleType("_shardc_parallelize")
        exec(compile(text, "<parallelize.py>", "exec"), mod.__dict__)  # noqa: S102
        return mod
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


def compare_logits(out: torch.Tensor, expect: torch.Tensor) -> tuple[float | None, str | None]:
    """(``max |out - expect| / max |expect|``, None), or (None, why) when either side holds a
    NaN or an infinity or the reference is all zero (no relative error is defined)."""
    for what, t in (("reference (unsharded)", expect), ("sharded", out)):
        bad = ~torch.isfinite(t)
        if bad.any():
            kinds = "/".join(k for k, m in (("NaN", torch.isnan(t)), ("Inf", torch.isinf(t)))
                             if m.any())
            return None, f"{what} logits are not finite ({int(bad.sum())} {kinds} values)"
    scale = float(expect.abs().max())
    if scale == 0.0:
        return None, "reference (unsharded) logits are all zero"
    return float((out - expect).abs().max()) / scale, None


def worst_rel_err(a: float | None, b: float | None) -> float | None:
    """The worse of two ranks' relative errors; None means "no logits on that rank", and a
    NaN (or infinity) wins over every number (``max`` would drop a NaN)."""
    if a is None or b is None:
        return b if a is None else a
    if not math.isfinite(a) or not math.isfinite(b):
        return a if not math.isfinite(a) else b
    return max(a, b)


def _build(model_ref: str, batch: int, seq: int, tiny_degrees: dict | None = None):
    """``model_ref`` = path of a model file (``.py`` or ``config.json``: its tiny model,
    shaped for ``tiny_degrees``) or ``module:function``."""
    if model_ref.endswith((".py", ".json")):
        from shardc.frontends.model_file import load_model_file

        src = load_model_file(model_ref, tiny_degrees)
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
    """The model's vocabulary size (a multimodal HF config's: its text model's)."""
    cfg = model.config
    text = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
    return int(getattr(text, "vocab_size"))


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
    ``steps`` one-token forwards reusing a KV cache; equal to one whole-sequence forward when
    the cache is right. None on ranks that hold no logits.

    Only transformers' public cache API is used: the cache is made here
    (``DynamicCache(config=...)``), kept by this function (never read back from the model's
    output, whose field was renamed ``past_key_values`` -> ``cache`` in 5.24) and passed
    under the name the model's ``forward`` declares (:func:`cache_kwarg`)."""
    from transformers import DynamicCache

    config = getattr(model, "config", None)  # none on a pipelined model (which refuses use_cache)
    cache = DynamicCache(config=config) if config is not None else DynamicCache()
    kw = {cache_kwarg(model): cache, "use_cache": True}
    out = model(ids[:, :-steps], **kw)
    if out is None:
        return None
    parts = [_logits(out)]
    for t in range(ids.shape[1] - steps, ids.shape[1]):
        parts.append(_logits(model(ids[:, t:t + 1], **kw)))
    return torch.cat(parts, dim=1)


def cache_kwarg(model) -> str:
    """The keyword a transformers model's ``forward`` takes its KV cache under: ``cache``
    from transformers 5.24, ``past_key_values`` before (read from the public signature)."""
    params = inspect.signature(model.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def _logits(out) -> torch.Tensor:
    return out if isinstance(out, torch.Tensor) else out.logits


def run_cases(model_ref: str, cases: list[Case], world: int, batch: int | None = None,
              seq: int = 8, timeout_s: float = 900, tiny_degrees: dict | None = None) -> list[dict]:
    """Run ``cases`` on ``world`` gloo processes; returns per case {name, rel_err, error,
    seconds} (the worst over ranks holding logits; ``seconds``: rank 0's wall time for the
    case, ``reference_s`` its model's unsharded reference run, first case only).
    ``tiny_degrees``: see :func:`shardc.frontends.model_file.load_model_file`."""
    return run_suites([(model_ref, cases)], world, batch, seq, timeout_s, tiny_degrees)


# Imported once by the fork server; every worker forks from it instead of importing torch,
# transformers and shardc again (start-up dominated the launch: ~4x the import CPU time).
_PRELOAD = ["torch", "torch.distributed", "torch.distributed.tensor", "transformers",
            "transformers.modeling_utils", "transformers.models.auto.modeling_auto",
            "shardc.frontends.model_file", "shardc.plan", "shardc.backends.verify",
            "shardc.frontends.torch_export", "shardc.passes", "shardc.testing.launch"]


def run_suites(suites: list[tuple[str, list[Case]]], world: int, batch: int | None = None,
               seq: int = 8, timeout_s: float = 900,
               tiny_degrees: dict | None = None, plan_code=None) -> list[dict]:
    """Several models' cases in ONE launch (process start-up dominates): results in order.
    A suite is ``(model_ref, cases)`` or ``(model_ref, cases, tiny_degrees)`` (that model's
    own; else ``tiny_degrees``). ``plan_code(graph, strategy, batch, seq, layer_kinds)`` (a
    module-level function, e.g. :func:`shardc.plan.strategy_code`) writes the
    ``parallelize.py`` of a case given as degrees and choices."""
    from shardc.testing.launch import launch

    batch = batch or 2 * world
    suites = [(os.path.abspath(s[0]) if s[0].endswith((".py", ".json")) else s[0], s[1],
               s[2] if len(s) > 2 else tiny_degrees) for s in suites]
    cases = [c for _, cs, _ in suites for c in cs]
    payload = [(m, [c.__dict__ for c in cs], degs) for m, cs, degs in suites]
    try:
        per_rank = launch(_worker, world, (payload, batch, seq, plan_code), timeout_s,
                          _PRELOAD)
    except TimeoutError:
        raise TimeoutError(f"verify workers did not finish in {timeout_s:.0f} s") from None
    return [merge_rank_results(c.name, [rr[i] if i < len(rr) else None for rr in per_rank])
            for i, c in enumerate(cases)]


def merge_rank_results(name: str, per_rank: list[dict | None]) -> dict:
    """One case's result from every rank's (None: the rank did not finish it): the first
    error, the worst relative error (:func:`worst_rel_err`), ``seconds`` from rank 0, and
    ``refused`` (the first rank's message) where the plan's file refused the model
    (:class:`shardc.fingerprint.ModelMismatch`, e.g. a parameter left whole)."""
    res = {"name": name, "rel_err": None, "error": None}
    if per_rank and per_rank[0] is not None:
        res["seconds"] = per_rank[0].get("seconds")
        res["reference_s"] = per_rank[0].get("reference_s", 0.0)
    for rr in per_rank:
        if rr is None:
            res["error"] = res["error"] or "a rank did not finish"
            continue
        if rr.get("error"):
            res["error"] = res["error"] or rr["error"]
        if rr.get("refused"):  # the first rank's: every rank checks the same rows
            res["refused"] = res.get("refused") or rr["refused"]
        res["rel_err"] = worst_rel_err(res["rel_err"], rr.get("rel_err"))
        if rr.get("shape_ok") is False:
            res["error"] = res["error"] or "logits shape differs"
    if res["rel_err"] is not None and not math.isfinite(res["rel_err"]):
        res["error"] = res["error"] or f"relative error is {res['rel_err']} (NaN/Inf logits)"
    if res["rel_err"] is None and not res["error"]:
        res["error"] = "no rank produced logits"
    return res
