"""The fast runtime's sliding-window layers (a ring of ``window`` cache slots) and the GPU
benchmark's harness, on one process: a tiny Mistral with ``sliding_window=5`` generating
well past the window from left-padded prompts gives the unsharded HF model's greedy tokens
(its own forward, full recompute, HF's sliding-window mask); the ring holds ``window`` slots
only. Prefill buckets: the bucket a prompt runs at, the compiled (GPU) path off on CPU, and
prompts padded further on the left to a bucket give the same tokens. And
``benchmarks/gpu/run_gpu_bench.py`` imports and parses its flags on CPU."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from test_backend_gloo import DENSE
from test_fast_runtime import reference_greedy

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def one_rank():
    from shardc.testing.launch import free_port

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_sliding_window_ring_matches_unsharded(one_rank):
    from torch.distributed.device_mesh import init_device_mesh
    from transformers import MistralConfig, MistralForCausalLM

    from shardc.backends.runtime_walks import plan_walks
    from shardc.ir.strategy import Degrees
    from shardc.runtime.fast import FastModel
    from shardc.runtime.generate import fast_generate

    cfg = MistralConfig(vocab_size=128, hidden_size=32, intermediate_size=64,
                        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                        sliding_window=5, max_position_embeddings=64,
                        attn_implementation="sdpa")
    torch.manual_seed(0)
    model = MistralForCausalLM(cfg).eval()
    ids = torch.randint(1, 128, (3, 6))
    mask = torch.ones_like(ids)
    ids[1, :2], mask[1, :2] = 0, 0
    ids[2, :4], mask[2, :4] = 0, 0
    want = reference_greedy(model, ids, mask, 12)
    mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("tp",))
    fast = FastModel(model, mesh, plan_walks(DENSE, Degrees()), {"dense_block": [0, 1]})
    got = fast_generate(fast, ids, 12, attention_mask=mask)
    assert torch.equal(got, want), (got[:, 6:], want[:, 6:])
    cache = fast.new_cache(3, 18)
    assert all(layer.slots == 5 and layer.ring for layer in cache.layers.values())
    # the window changes the tokens here: without it they differ (the test can fail)
    for layer in fast.layers.values():
        layer.attn.window = None
    assert not torch.equal(fast_generate(fast, ids, 12, attention_mask=mask), want)


def test_prefill_buckets_pick_the_smallest_that_fits():
    from shardc.runtime.generate import PREFILL_BUCKETS, pad_left, prefill_bucket

    assert [prefill_bucket(p) for p in (1, 16, 17, 100, 2048, 2049)] == \
        [16, 16, 32, 128, 2048, 4096]
    assert prefill_bucket(17, limit=31) == 17  # no bucket fits the cache: the prompt's own
    assert prefill_bucket(40000) == 40000 > max(PREFILL_BUCKETS)
    assert prefill_bucket(5, buckets=(8, 4, 6)) == 6
    ids, start = pad_left(torch.tensor([[0, 7, 8]]), torch.tensor([1]), 5)
    assert ids.tolist() == [[0, 0, 0, 7, 8]] and start.tolist() == [3]


def test_prefill_is_eager_on_cpu_and_buckets_change_no_token(one_rank):
    from torch.distributed.device_mesh import init_device_mesh
    from transformers import LlamaConfig, LlamaForCausalLM

    from shardc.backends.runtime_walks import plan_walks
    from shardc.ir.strategy import Degrees
    from shardc.runtime.fast import FastModel
    from shardc.runtime.generate import Prefill, fast_generate

    cfg = LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=64)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).eval()
    mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("tp",))
    fast = FastModel(model, mesh, plan_walks(DENSE, Degrees()), {"dense_block": [0, 1]})
    run = Prefill(fast)
    if not torch.cuda.is_available():  # the GPU path (torch.compile per bucket) is off
        assert not run.compiled and run.forward == fast.forward and run.buckets == ()
        assert run.length(6) == 6
    ids = torch.randint(1, 128, (2, 6))
    mask = torch.ones_like(ids)
    ids[1, :3], mask[1, :3] = 0, 0
    want = reference_greedy(model, ids, mask, 5)
    got = fast_generate(fast, ids, 5, attention_mask=mask, prefill_buckets=(4, 8, 16))
    assert torch.equal(got, want), (got[:, 6:], want[:, 6:])
    bucketed = Prefill(fast, buckets=(4, 8, 16))
    cache = fast.new_cache(2, 13)
    bucketed(cache, ids, torch.tensor([0, 3]), limit=8)
    assert cache.filled == 8 and cache.start.tolist() == [2, 5]  # padded to the 8 bucket


def test_granite_multipliers_match_unsharded(one_rank):
    """Granite scales the embedding, each branch before its residual add and the logits
    (``embedding_multiplier``, ``residual_multiplier``, ``logits_scaling``; attention by
    ``attention_multiplier``): the runtime's greedy tokens are the HF model's."""
    from torch.distributed.device_mesh import init_device_mesh
    from transformers import GraniteConfig, GraniteForCausalLM

    from shardc.backends.runtime_walks import plan_walks
    from shardc.ir.strategy import Degrees
    from shardc.runtime.fast import FastModel
    from shardc.runtime.generate import fast_generate

    cfg = GraniteConfig(vocab_size=128, hidden_size=32, intermediate_size=64,
                        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                        max_position_embeddings=64, embedding_multiplier=6.0,
                        residual_multiplier=0.3, logits_scaling=4.0, attention_multiplier=0.1)
    torch.manual_seed(0)
    model = GraniteForCausalLM(cfg).eval()
    ids = torch.randint(1, 128, (2, 6))
    mask = torch.ones_like(ids)
    ids[1, :2], mask[1, :2] = 0, 0
    want = reference_greedy(model, ids, mask, 8)
    mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("tp",))
    fast = FastModel(model, mesh, plan_walks(DENSE, Degrees()), {"dense_block": [0, 1]})
    assert torch.equal(fast_generate(fast, ids, 8, attention_mask=mask), want)
    for layer in fast.layers.values():  # the multipliers matter here (the test can fail)
        layer.res_mult = 1.0
    assert not torch.equal(fast_generate(fast, ids, 8, attention_mask=mask), want)


def test_gpu_benchmark_parses_and_refuses_without_gpu(capsys):
    spec = importlib.util.spec_from_file_location(
        "run_gpu_bench", ROOT / "benchmarks" / "gpu" / "run_gpu_bench.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    with pytest.raises(SystemExit) as e:
        mod.main(["--help"])
    assert e.value.code == 0 and "--dry-run" in capsys.readouterr().out
    assert [c[3] for c in mod.CASES if c[2] == "decode" and c[1] == "llama3_1_8b"] \
        == [1, 1, 16, 16, 64, 64]
    if not torch.cuda.is_available():
        with pytest.raises(SystemExit, match="no GPU"):
            mod.main([])
