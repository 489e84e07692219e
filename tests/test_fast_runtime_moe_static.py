"""The capture-safe MoE decode path (``ExpertsLocal.static``, issue 20): without an ep
dispatch the per-expert offsets stay on the device and each expert weight runs as one
``F.grouped_mm`` -- no host read, static shapes, so ``FastModel.graphable`` holds and a GPU
captures the decode step as a CUDA graph. On a GPU the path is on for bf16 weights; here it
is forced on (CPU, float32: ``F.grouped_mm`` runs there too) to check its numerics.

On 4 gloo ranks (tp = 4, one launch): Mixtral with experts col/row and row/col (a col
router), DeepSeek-V3 (sigmoid group-limited router, shared experts) and GPT-MoE (rep/rep,
not gated) generate the unsharded model's 32 greedy tokens from left-padded prompts, and one
decode step calls nothing that reads a tensor on the host (``tolist``, ``item``,
``bincount``, ``nonzero``: what breaks a CUDA graph capture) -- while the eager path does
(the check can fail). plan.json's ``predicted.runtime`` says ``cuda_graph`` for such a plan
and not for one with an ep dispatch or a tp row gather.
"""

from __future__ import annotations

import pytest
import torch
from test_backend_gloo import DEEPSEEK, DS_MEGATRON, GPT_MOE, MIXTRAL, MOE, M, _with
from test_fast_runtime import launch_plans

TP4 = {"tp": 4}
CASES = {
    "mixtral tp4 experts col/row": (MIXTRAL, TP4, MOE),
    "mixtral tp4 experts row/col router col": (
        MIXTRAL, TP4, _with(MOE, M, expert_ffn1="row", expert_ffn2="col", router="col")),
    "deepseek tp4 shared experts": (DEEPSEEK, TP4, DS_MEGATRON),
    "gpt-moe tp4 experts rep/rep": (
        GPT_MOE, TP4, _with(MOE, M, expert_ffn1="rep", expert_ffn2="rep")),
}
HOST_READS = ("tolist", "item", "bincount", "nonzero")


class _HostReads(torch.overrides.TorchFunctionMode):
    """Records the host-reading calls made while active."""

    def __init__(self):
        super().__init__()
        self.seen: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name in HOST_READS:
            self.seen.append(name)
        return func(*args, **(kwargs or {}))


def _worker(rank, world, port, payloads, out_dir):
    from shardc.testing.launch import run_cases

    run_cases(rank, world, port, out_dir, payloads, _run_case)


def _run_case(p) -> dict:
    import copy

    from test_fast_runtime import NEW, PROMPT, placed, plan_file_and_model, reference_greedy
    from test_fast_runtime_gpt_moe import row_reference

    from shardc.runtime.fast import FastModel
    from shardc.runtime.generate import decode_step, fast_generate, left_padding

    ns, model, ids, mask = plan_file_and_model(p, 4)
    ref = copy.deepcopy(model)
    want = row_reference(ref, ids, mask, NEW)[0] if p["model"] == GPT_MOE \
        else reference_greedy(ref, ids, mask, NEW)
    model, mesh = placed(ns, model)
    fast = FastModel(model, mesh, ns["WALKS"], ns["LAYER_KINDS"])
    moe = [lay.experts for lay in fast.layers.values() if lay.experts is not None]
    assert moe and all(e.capture_safe and not e.static for e in moe)  # CPU: off
    assert not fast.graphable
    reads = {}
    for static in (False, True):
        for e in moe:
            e.static = static
        cache = fast.new_cache(4, PROMPT + 2)
        cache.reset(left_padding(mask))
        with torch.no_grad():
            fast.forward(ids, cache, torch.arange(PROMPT), PROMPT, True)
            cache.advance(PROMPT)
            with _HostReads() as rec:
                decode_step(fast, cache, want[:, PROMPT:PROMPT + 1])
        reads[static] = sorted(set(rec.seen))
    got = fast_generate(fast, ids, NEW, attention_mask=mask)
    return {"equal": bool(torch.equal(got, want)),
            "got": got[:, PROMPT:].tolist(),
            "want": want[:, PROMPT:].tolist(),
            "graphable": fast.graphable, "reads": reads[True],
            "eager_reads": reads[False]}


@pytest.fixture(scope="module")
def launched():
    return launch_plans(_worker, CASES)


@pytest.mark.parametrize("name", list(CASES))
def test_capture_safe_decode_equals_unsharded_without_host_reads(launched, name):
    per_rank = launched[name]
    for r, res in enumerate(per_rank):
        assert "error" not in res, f"rank {r}: {res.get('error')}"
        assert res["equal"], f"rank {r}: got {res['got']}\nwant {res['want']}"
        assert res["graphable"], f"rank {r}"
        assert res["reads"] == [], f"rank {r}: {res['reads']}"
        assert res["eager_reads"], f"rank {r}: the eager path reads nothing on the host?"


def test_runtime_prediction_captures_moe_decode_without_a_dispatch():
    from test_runtime_prediction import _plan

    assert _plan(MIXTRAL, TP4, MOE).predicted["runtime"]["cuda_graph"] is True
    assert _plan(MIXTRAL, {"tp": 2, "ep": 2}, MOE).predicted["runtime"]["cuda_graph"] is False
    # sequence parallelism with tp-split experts: the routed rows gathered over tp (host read)
    assert _plan(MIXTRAL, {"tp": 4, "sp": 4}, MOE).predicted["runtime"]["cuda_graph"] is False
    rep = _with(MOE, M, expert_ffn1="rep", expert_ffn2="rep")
    assert _plan(MIXTRAL, {"tp": 4, "sp": 4}, rep).predicted["runtime"]["cuda_graph"] is True
