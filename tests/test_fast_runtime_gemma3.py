"""Gemma-3 on the fast runtime (issue 20): a rotary table per layer type (the sliding layers'
local base, the full-attention layers' global base with its linear scaling), the text model
of a multimodal ``Gemma3ForConditionalGeneration`` (``model.language_model``), ``(1 +
weight)`` RMSNorms (per-head q / k norms too), a scaled embedding, sandwich norms and
alternating sliding windows.

On 4 gloo ranks (``test_fast_runtime_moe``'s worker: one launch): the emitted file's
``generate`` of 32 greedy tokens from left-padded prompts equals the unsharded HF model's
(full recompute), and the last-position logits of the prefill and one cached decode step are
within 1e-4 (relative). On 4 fake ranks one decode step issues the cost model's collectives.
On one process, the multimodal model's text model generates the unsharded tokens and the
per-type tables are shown to matter: one table for every layer changes the tokens (the
check can fail). The gloo ranks run ``Gemma3ForCausalLM`` built from the same tiny text
config (``tests/data/tiny_gemma3_text.py``).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from test_backend_gloo import DENSE, D, _with
from test_fast_runtime import BATCH_ATTN, assert_unsharded_tokens, launch_plans
from test_fast_runtime_moe import _worker as moe_worker

ROOT = Path(__file__).resolve().parents[1]
# the multimodal model (one process) and its text model (gloo ranks: the tiny multimodal
# variant keeps a full-size vision tower, 1.7 GB per process)
GEMMA3 = str(ROOT / "examples" / "configs" / "gemma3_27b" / "config.json")
GEMMA3_TEXT = str(ROOT / "tests" / "data" / "tiny_gemma3_text.py")
D2 = "dense_block_2"  # tiny Gemma-3: 5 sliding layers, then a full-attention one
GEMMA_DENSE = {**DENSE, **{k.replace(D, D2): v for k, v in DENSE.items() if k.startswith(D)}}
CASES = {
    "gemma3 tp4 KV heads replicated": (GEMMA3_TEXT, {"tp": 4}, GEMMA_DENSE),
    "gemma3 dp2 tp2 batch-split attention": (
        GEMMA3_TEXT, {"tp": 2, "dp": 2}, _with(_with(GEMMA_DENSE, D, **BATCH_ATTN), D2, **BATCH_ATTN)),
    "gemma3 pp2 tp2": (GEMMA3_TEXT, {"pp": 2, "tp": 2}, GEMMA_DENSE),
}
BYTES = ["gemma3 tp4 KV heads replicated", "gemma3 dp2 tp2 batch-split attention"]


@pytest.fixture(scope="module")
def launched():
    return launch_plans(moe_worker, CASES)


@pytest.mark.parametrize("name", list(CASES))
def test_greedy_generate_equals_unsharded(launched, name):
    per_rank = launched[name]
    assert_unsharded_tokens(per_rank, 1e-4)


@pytest.mark.parametrize("name", BYTES)
def test_decode_step_collectives_are_the_cost_models(name):
    from test_fast_runtime_bytes import decode_collectives_match

    decode_collectives_match(name, *CASES[name])


def test_one_table_for_every_layer_changes_the_tokens():
    import torch.distributed as dist
    from test_fast_runtime import prompts, reference_greedy
    from torch.distributed.device_mesh import init_device_mesh

    from shardc.backends.runtime_walks import plan_walks
    from shardc.backends.verify import _build, _vocab
    from shardc.ir.strategy import Degrees
    from shardc.runtime.fast import FastModel
    from shardc.runtime.generate import fast_generate
    from shardc.testing.launch import free_port

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        model, _ = _build(GEMMA3, 4, 6)
        ids, mask = prompts(_vocab(model))
        want = reference_greedy(model, ids, mask, 32)
        mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("tp",))
        fast = FastModel(model, mesh, plan_walks(GEMMA_DENSE, Degrees()),
                         {D: [0, 1, 2, 3, 4], D2: [5]})
        assert set(fast.rope_type.values()) == {"sliding_attention", "full_attention"}
        assert torch.equal(fast_generate(fast, ids, 32, attention_mask=mask), want)
        fast.rope_type = dict.fromkeys(fast.rope_type, "sliding_attention")
        assert not torch.equal(fast_generate(fast, ids, 32, attention_mask=mask), want)
    finally:
        dist.destroy_process_group()
