"""Phi-3 / Phi-4 on the fast runtime (issue 20; refused before: "an attention or MLP module
of another layout"): one packed ``qkv_proj`` (q|k|v, each rank's ``[q_r | k_r | v_r]`` as the
styles placed it) and ``o_proj``, a packed ``gate_up_proj`` with ``activation_fn``, and the
decoder layer's residual dropouts (the identity in inference).

On 4 gloo ranks (``test_fast_runtime_moe``'s worker, one launch): the emitted file's greedy
``generate`` of 32 tokens from left-padded prompts equals the unsharded HF model's and the
prefill and one decode step's last-position logits are within 1e-4 (relative), for Phi-4's
tiny variant (from its config.json) at dp=2 x tp=2 (Megatron) and tp=2 x dp=2 with a ``row``
qkv and ffn1. On 4 fake ranks a decode step issues the cost model's collectives.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from test_backend_gloo import DENSE, D, _with
from test_fast_runtime import assert_unsharded_tokens, launch_plans
from test_fast_runtime_moe import _worker as moe_worker

PHI4 = str(Path(__file__).resolve().parents[1] / "examples" / "configs" / "phi4" / "config.json")
CASES = {
    "phi4 dp2 tp2": (PHI4, {"tp": 2, "dp": 2}, DENSE),
    "phi4 dp2 tp2 row qkv, row ffn1": (PHI4, {"tp": 2, "dp": 2},
                                       _with(DENSE, D, qkv="row", ffn1="row", ffn2="col")),
}


@pytest.fixture(scope="module")
def launched():
    return launch_plans(moe_worker, CASES)


@pytest.mark.parametrize("name", list(CASES))
def test_greedy_generate_equals_unsharded(launched, name):
    per_rank = launched[name]
    assert_unsharded_tokens(per_rank, 1e-4)


@pytest.mark.parametrize("name", list(CASES))
def test_decode_step_collectives_are_the_cost_models(name):
    from test_fast_runtime_bytes import decode_collectives_match

    decode_collectives_match(name, *CASES[name])
