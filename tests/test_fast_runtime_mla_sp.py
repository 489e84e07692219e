"""MLA after a replicated qkv before a heads split under sequence parallelism (issue 20; the
fast runtime refused it before): each tp rank computes q and the latents of its own rows,
``q`` reaches the rank's heads of every row with the walk's all-to-all and the latents are
all-gathered (one collective more than the walk charges: docs/backend.md, "Known
differences"; numerics only here).

On 4 gloo ranks (``test_fast_runtime_moe``'s worker, one launch): the emitted file's greedy
``generate`` of 32 tokens from left-padded prompts equals the unsharded HF model's, and the
prefill and one decode step's last-position logits are within 1e-4 (relative), for a
DeepSeek of dense layers (tp=4, sp) and tiny DeepSeek-V3 with MoE layers (ep=2 x tp=2, sp).
"""

from __future__ import annotations

import pytest
from test_backend_gloo import DEEPSEEK, DENSE, DS_MEGATRON, D, M
from test_fast_runtime import assert_unsharded_tokens, launch_plans
from test_fast_runtime_attn import DS_DENSE
from test_fast_runtime_moe import _worker as moe_worker

CASES = {
    "deepseek (dense) MLA tp4 sp rep qkv, heads split": (
        DS_DENSE, {"tp": 4, "sp": 4}, {**DENSE, f"{D}.qkv": "rep"}),
    "deepseek MLA ep2 tp2 sp rep qkv, heads split": (
        DEEPSEEK, {"ep": 2, "tp": 2, "sp": 2},
        {**DS_MEGATRON, f"{D}.qkv": "rep", f"{M}.qkv": "rep"}),
}


@pytest.fixture(scope="module")
def launched():
    return launch_plans(moe_worker, CASES)


@pytest.mark.parametrize("name", list(CASES))
def test_greedy_generate_equals_unsharded(launched, name):
    per_rank = launched[name]
    assert_unsharded_tokens(per_rank, 1e-4)
