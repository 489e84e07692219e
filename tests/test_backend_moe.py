"""MoE routing and dispatch packing of the DTensor backend (single process, no mesh)."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from shardc.backends.models import adapter_for
from shardc.backends.moe import _pack, route

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))


class _NoMesh:
    mesh = None
    dims: list = []


def _deepseek_site():
    import deepseek_v3

    torch.manual_seed(0)
    model = deepseek_v3.tiny_model()
    return adapter_for(model).layer(1).moe


def test_deepseek_routing_is_the_models_own():
    site = _deepseek_site()
    router = site.router[0]
    with torch.no_grad():
        router.e_score_correction_bias.copy_(torch.linspace(-0.1, 0.1, site.num_experts))
        router.num_group, router.topk_group = 2, 1  # exercise the group-limited top-k
        x = torch.randn(32, router.weight.shape[1])
        _, want_w, want_i = router(x)
        got_w, got_i = route(site, torch.nn.functional.linear(x, router.weight))
    order_w, order_g = want_i.sort(dim=-1), got_i.sort(dim=-1)
    assert torch.equal(order_w.values, order_g.values)
    assert torch.allclose(want_w.gather(1, order_w.indices), got_w.gather(1, order_g.indices))
    assert site.shared is not None and len(site.shared[0]) == 2


def test_pack_sends_only_routed_rows_exactly():
    torch.manual_seed(0)
    t, k, e, h = 12, 2, 8, 4
    flat = torch.randn(t, h)
    top_i = torch.stack([torch.randperm(e)[:k] for _ in range(t)])
    send, slot = _pack(_NoMesh(), flat, top_i, e)
    counts = torch.bincount(top_i.reshape(-1), minlength=e)
    assert send.shape == (e, int(counts.max()), h)
    # every (token, k) pair sits in its expert's slot; nothing else is non-zero
    assert torch.equal(send.reshape(-1, h)[slot], flat.repeat_interleave(k, dim=0))
    assert int((send.abs().sum(-1) > 0).sum()) == t * k
    assert torch.equal(slot // send.shape[1], top_i.reshape(-1))


def test_pack_on_meta_has_the_charged_volume():
    t, k, e, h = 64, 8, 256, 16
    flat = torch.zeros(t, h, device="meta")
    top_i = torch.zeros(t, k, dtype=torch.long, device="meta")
    send, _ = _pack(_NoMesh(), flat, top_i, e)
    assert send.shape == (e, 2, h)  # ceil(64 * 8 / 256): tokens x top_k x hidden elements
    assert send.numel() == t * k * h
