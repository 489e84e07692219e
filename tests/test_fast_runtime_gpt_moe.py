"""The fast runtime runs shardc's GPT-MoE (``examples/gpt_moe.py``: a plain PyTorch model, not
an HF class; :mod:`shardc.runtime.gpt_moe_local`) on 4 gloo ranks and 4 fake ranks.

Each case's plan file places the weights of the tiny GPT-MoE; its own ``generate`` (greedy,
32 new tokens from left-padded prompts) must equal the unsharded model's tokens. GPT-MoE's
forward takes token ids only (no padding mask, positions from 0), so the reference runs
each row alone without its padding, full recompute per token (what the runtime's left
padding means: positions from the first real token, padding masked). The runtime's
last-position logits of the prompt prefill and one cached decode step are compared too
(relative 1e-4). One decode step on 4 fake ranks issues exactly the cost model's
collectives, the ep count exchange (``E`` int64 per MoE layer) the exempt extra
(:func:`test_fast_runtime_bytes.decode_collectives_match`). A GPT-MoE whose routers carry a
bias (``tests/data/tiny_gpt_moe_router_bias.py``) runs its router ``col`` (this rank's slice
of the bias added before the all-gather), ``row`` (the whole bias on tp rank 0 before the
all-reduce) and ``rep``; the unsharded model with the bias zeroed gives other tokens (the
check can fail).
"""

from __future__ import annotations

import pytest
import torch
from test_backend_gloo import GPT_MOE, MOE, ROOT, _with
from test_fast_runtime import assert_unsharded_tokens, launch_plans

M = "moe_block"
# routers with a bias (drawn): a sharded router adds it around its collective
BIASED = str(ROOT / "tests" / "data" / "tiny_gpt_moe_router_bias.py")
TOL = 1e-4
EP_TP = {"ep": 2, "tp": 2}
CASES = {
    "gpt-moe ep2 tp2": (GPT_MOE, EP_TP, MOE),
    "gpt-moe ep2 tp2 experts row/col router col": (
        GPT_MOE, EP_TP, _with(MOE, M, expert_ffn1="row", expert_ffn2="col", router="col")),
    "gpt-moe ep2 tp2 experts rep/rep router row": (
        GPT_MOE, EP_TP, _with(MOE, M, expert_ffn1="rep", expert_ffn2="rep", router="row")),
    "gpt-moe ep2 tp2 experts col/col, qkv row": (
        GPT_MOE, EP_TP, _with(MOE, M, expert_ffn1="col", expert_ffn2="col", qkv="row")),
    "gpt-moe ep2 tp2 sp": (GPT_MOE, {**EP_TP, "sp": 2}, MOE),
    "gpt-moe pp2 tp2": (GPT_MOE, {"pp": 2, "tp": 2}, MOE),
    "gpt-moe router bias, router col": (BIASED, EP_TP, _with(MOE, M, router="col")),
    "gpt-moe router bias, router row": (BIASED, EP_TP, _with(MOE, M, router="row")),
    "gpt-moe router bias, router rep": (BIASED, EP_TP, MOE),
}
BYTES = ["gpt-moe ep2 tp2", "gpt-moe ep2 tp2 experts row/col router col",
         "gpt-moe ep2 tp2 experts rep/rep router row", "gpt-moe ep2 tp2 experts col/col, qkv row",
         "gpt-moe router bias, router col", "gpt-moe router bias, router row"]


def row_reference(model, ids: torch.Tensor, mask: torch.Tensor, new: int):
    """The unsharded GPT-MoE's greedy continuation of each left-padded row run alone
    without its padding (full recompute per token), and the last-position logits of the
    prompt and of the prompt plus the first new token (``[rows, 2, vocab]``)."""
    out, logits = [], []
    with torch.no_grad():
        for b in range(ids.shape[0]):
            pad = int((mask[b] == 0).sum())
            row = ids[b:b + 1, pad:]
            seen = []
            for _ in range(new):
                last = model(row)[:, -1]
                seen.append(last)
                row = torch.cat([row, last.argmax(-1, keepdim=True)], 1)
            out.append(torch.cat([ids[b:b + 1, :pad], row], 1))
            logits.append(torch.cat(seen[:2], 0))
    return torch.cat(out, 0), torch.stack(logits, 0)


def _worker(rank, world, port, payloads, out_dir):
    from shardc.testing.launch import run_cases

    run_cases(rank, world, port, out_dir, payloads, _run_case)


def _run_case(p) -> dict:
    import copy

    from test_fast_runtime import NEW, PROMPT, placed, plan_file_and_model

    from shardc.runtime.generate import decode_step, left_padding

    ns, model, ids, mask = plan_file_and_model(p, 4)
    want, ref_logits = row_reference(copy.deepcopy(model), ids, mask, NEW)
    model, _ = placed(ns, model)
    got = ns["generate"](model, ids, NEW, attention_mask=mask)
    fast = model._shardc_fast
    g = fast.batch
    rows = slice(g.rank * 4 // g.size, (g.rank + 1) * 4 // g.size)
    cache = fast.new_cache(rows.stop - rows.start, PROMPT + 2)
    err = 0.0
    with torch.no_grad():
        cache.reset(left_padding(mask)[rows])
        first = fast.forward(ids[rows], cache, torch.arange(PROMPT), PROMPT, True)
        cache.advance(PROMPT)
        second = decode_step(fast, cache, want[rows, PROMPT:PROMPT + 1])
    if first is not None:  # the last pipeline stage
        for i, y in enumerate((first, second)):
            ref = ref_logits[rows, i]
            err = max(err, float((y[:, -1] - ref).abs().max() / ref.abs().max()))
    return {"equal": bool(torch.equal(got, want)),
            "got": got[:, PROMPT:].tolist(),
            "want": want[:, PROMPT:].tolist(), "logits_error": err}


@pytest.fixture(scope="module")
def launched():
    return launch_plans(_worker, CASES)


@pytest.mark.parametrize("name", list(CASES))
def test_greedy_generate_equals_unsharded(launched, name):
    per_rank = launched[name]
    assert_unsharded_tokens(per_rank, TOL)


@pytest.mark.parametrize("name", BYTES)
def test_decode_step_collectives_are_the_cost_models(name):
    from test_fast_runtime_bytes import decode_collectives_match

    decode_collectives_match(name, *CASES[name])


def test_router_bias_changes_the_tokens():
    """Without its router bias the biased model picks other tokens: the cases above would
    fail if a sharded router dropped it."""
    from test_fast_runtime import NEW, prompts

    from shardc.backends.verify import _build, _vocab

    torch.manual_seed(0)
    model, _ = _build(BIASED, 4, 6)
    ids, mask = prompts(_vocab(model))
    want, _ = row_reference(model, ids, mask, NEW)
    with torch.no_grad():
        for layer in model.layers:
            layer.moe.router.bias.zero_()
    assert not torch.equal(row_reference(model, ids, mask, NEW)[0], want)
