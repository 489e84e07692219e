"""benchmarks/gpu/op_bench.py (issue 23's GPU op rows): the routing counts it times and the
grouped expert computation it times are what they say, checked on CPU (no timing)."""

import importlib.util
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("op_bench", ROOT / "benchmarks" / "gpu" /
                                               "op_bench.py")
op_bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(op_bench)


def test_routing_counts_cover_every_row():
    gen = torch.Generator().manual_seed(1)
    for tokens, experts, k in ((64, 128, 8), (5, 8, 2), (4096, 16, 4)):
        rnd = op_bench.random_topk_counts(tokens, experts, k, gen)
        bal = op_bench.balanced_counts(tokens, experts, k)
        assert int(rnd.sum()) == int(bal.sum()) == tokens * k
        assert len(rnd) == len(bal) == experts
        assert int(bal.max()) - int(bal.min()) <= 1
        assert int(rnd.max()) <= tokens  # k distinct experts per token


def test_grouped_experts_equals_a_loop_over_experts():
    torch.manual_seed(0)
    hidden, inter, experts = 16, 8, 4
    counts = torch.tensor([3, 0, 5, 2])
    x = torch.randn(int(counts.sum()), hidden)
    w1 = torch.randn(experts, 2 * inter, hidden)
    w2 = torch.randn(experts, hidden, inter)
    offs = torch.cumsum(counts, 0).to(torch.int32)
    got = op_bench.grouped_experts(x, w1, w2, offs)
    parts, start = [], 0
    for e, c in enumerate(counts.tolist()):
        g, u = F.linear(x[start:start + c], w1[e]).chunk(2, dim=-1)
        parts.append(F.linear(F.silu(g) * u, w2[e]))
        start += c
    torch.testing.assert_close(got, torch.cat(parts), rtol=1e-4, atol=1e-4)


def test_quantise_per_tensor_round_trips_within_e4m3():
    x = torch.randn(32, 64) * 3
    q, scale = op_bench.quantise_per_tensor(x)
    assert q.dtype == torch.float8_e4m3fn and q.float().abs().max() <= op_bench.FP8_MAX
    torch.testing.assert_close(q.float() * scale, x, rtol=0.07, atol=0.07 * float(scale))
