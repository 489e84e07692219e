"""OLMo-2 on the fast runtime (issue 20: a decoder layer without input norms, the attention
and MLP outputs normed before their residual adds, RMSNorms applying the weight in fp32;
q / k norms over the whole projection, all-reduced under a heads split). Before, the runtime
refused it (one of pre / post feed-forward norms) -- and ``shardc compile`` emits its file.

On 4 gloo ranks (``test_fast_runtime_moe``'s worker, one launch): the emitted file's greedy
``generate`` of 32 tokens from left-padded prompts equals the unsharded HF model's and the
prefill and one decode step's last-position logits are within 1e-4 (relative), for tp=4 and
dp=2 x tp=2 batch-split attention (norm weights drawn: HF initialises them to 1). On 4 fake
ranks a decode step issues the cost model's collectives.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from test_backend_gloo import DENSE, D, _with
from test_fast_runtime import BATCH_ATTN, assert_unsharded_tokens, launch_plans
from test_fast_runtime_moe import _worker as moe_worker

OLMO2 = str(Path(__file__).resolve().parent / "data" / "tiny_olmo2.py")
CASES = {
    "olmo2 tp4": (OLMO2, {"tp": 4}, DENSE),
    "olmo2 dp2 tp2 batch-split attention": (OLMO2, {"tp": 2, "dp": 2},
                                            _with(DENSE, D, **BATCH_ATTN)),
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
