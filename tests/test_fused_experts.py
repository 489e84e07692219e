"""DBRX: experts stored fused ([E * f, h] per projection), traced in grouped form, planned
with parallelize.py.

transformers' DbrxExperts loops over the experts the router hit (not exportable); while
traced, shardc.frontends.fused_experts computes the same function with grouped matmuls over
[E, f, h] views of the same parameters, so DBRX gets the expert op kinds of every MoE.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from family_matrix import config_path, tiny_config

from shardc.cli import main

H, F, E, K, L, V = 6144, 10752, 16, 4, 40, 100352  # DBRX-instruct's config.json
KV = 8 * 128  # 8 KV heads of 128


@pytest.fixture(autouse=True)
def _no_cache(monkeypatch):
    monkeypatch.setenv("SHARDC_NO_CACHE", "1")


def _tiny_dbrx():
    from shardc.frontends.hf_build import build_causal_lm

    return build_causal_lm(tiny_config(config_path("dbrx")), device="cpu", dtype=torch.float32)


def test_grouped_form_computes_what_dbrx_expert_loop_computes():
    """The tiny DBRX (8 experts, top-2) gives the same logits with its experts in the trace
    form as with transformers' loop; on exit its 2-D parameters and loop are back."""
    from shardc.frontends.fused_experts import fused_expert_modules, fused_experts

    model = _tiny_dbrx()
    mods = fused_expert_modules(model)
    assert len(mods) == model.config.n_layers
    glu = mods[0].mlp
    before = {n: getattr(glu, n) for n in ("w1", "v1", "w2")}
    ids = torch.randint(0, model.config.vocab_size, (2, 8), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = model(ids).logits
        with fused_experts(model):
            assert glu.w1.shape == (8, glu.ffn_hidden_size, glu.hidden_size)
            got = model(ids).logits
        again = model(ids).logits
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-5), (got - want).abs().max()
    assert torch.equal(again, want)
    assert all(getattr(glu, n) is p and p.dim() == 2 for n, p in before.items())
    assert "forward" not in vars(mods[0])


def _dbrx_config(folder: Path, layers: int | None = None) -> Path:
    data = json.loads(config_path("dbrx").read_text())
    if layers:
        data["n_layers"] = layers
    out = folder / "dbrx" / "config.json"
    out.parent.mkdir(parents=True)
    out.write_text(json.dumps(data))
    return out


def test_dbrx_layers_have_the_expert_ops_of_every_moe(tmp_path):
    """Wqkv packed q/k/v (clip_qkv an elementwise op), router over 16 experts with top-4,
    expert_ffn1 = gate + up grouped matmuls h -> 2f, expert_ffn2 f -> h."""
    from shardc.frontends import load_graph

    g = load_graph(_dbrx_config(tmp_path, layers=2))
    (kind,) = g.layer_kinds
    qkv, router = kind.op("qkv"), kind.op("router")
    e1, e2 = kind.op("expert_ffn1"), kind.op("expert_ffn2")
    assert (qkv.in_features, qkv.out_features) == (H, H + 2 * KV)
    assert kind.op("attn_core").attrs["kv_heads"] == 8
    assert router.attrs == {"num_experts": E, "top_k": K}
    assert (e1.in_features, e1.out_features, e1.params) == (H, 2 * F, 2 * E * F * H)
    assert (e2.in_features, e2.out_features, e2.params) == (F, H, E * F * H)
    assert e1.attrs["gated"] and e1.flops_per_token == K * 2 * H * 2 * F
    assert len(e1.nodes) == 2 and len(e2.nodes) == 1


def test_dbrx_plans_with_both_launch_scripts_and_parallelize_py(tmp_path, capsys):
    """The public config (40 layers): ~132B parameters (hand count below), ~36B active per
    token; plan.json, both engine scripts and parallelize.py placing the fused experts as
    their [E, f, h] views (tests/test_dbrx_runtime.py runs such files)."""
    per_layer_dense = H * (H + 2 * KV) + H * H + H * E + 2 * H  # Wqkv, out_proj, router, norms
    experts = 3 * E * F * H
    total = L * (per_layer_dense + experts) + 2 * V * H + H
    active = L * (per_layer_dense + experts * K // E) + 2 * V * H + H
    assert 131e9 < total < 133e9 and 35e9 < active < 37e9
    out = tmp_path / "out"
    rc = main(["compile", str(_dbrx_config(tmp_path)), "--mesh", "8x1", "--search", "megatron",
               "--budget", "1", "--context", "4096", "--batch", "64", "--out", str(out),
               "--quiet"])
    captured = capsys.readouterr()
    text = captured.out
    assert rc == 0
    assert (f"DbrxExperts stores each expert projection as one [{E * F}, {H}] parameter "
            f"(mlp.w1, mlp.v1, mlp.w2); traced as grouped matmuls over [{E}, {F}, {H}] views"
            in captured.err), captured.err
    plan = json.loads((out / "plan.json").read_text())
    assert plan["model"]["params"] == total
    kind = plan["layer_kinds"][0]
    assert kind["count"] == L
    for name in ("plan.json", "graph.txt", "launch/vllm_mixed.sh", "launch/sglang_mixed.sh"):
        assert (out / name).is_file(), name
    assert plan["backend"] == {"runs": True, "reason": None}
    code = (out / "parallelize.py").read_text()
    assert f"fused=('mlp', {F}, {H})" in code
    assert "no parallelize.py" not in text
    # weights per GPU: experts over every GPU, the rest by its own split (at most whole)
    mem = plan["predicted"]["breakdown"]["memory"]
    low = 2 * L * experts / 8 / 1e9
    assert low < mem["weights_gb"] < low + 2 * (L * per_layer_dense + 2 * V * H) / 1e9
