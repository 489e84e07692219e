"""Hand-built IR graphs (layer kinds + fused ops only) from the REFERENCE.md configs.

Test fixtures for the cost model, independent of the frontend: they follow the FusedOp
conventions of shardc/ir/graph.py. The validation tests prefer graphs traced by the real
frontend when it is available (see tests/test_cost_validation.py).
"""

from __future__ import annotations

from shardc.ir.graph import FusedOp, Graph, LayerKind
from shardc.passes.layers import attention_flops_per_context, mla_absorbed_flops_per_context


def _lin(name, fin, fout, count=1, **attrs):
    p = fin * fout * count
    return FusedOp(name, fin, fout, params=p, shardable_params=p,
                   flops_per_token=2 * fin * fout, attrs=attrs)


def _attention(c) -> list[FusedOp]:
    h, H, KV, hd = c["hidden"], c["heads"], c["kv_heads"], c["head_dim"]
    vhd = c.get("v_head_dim", hd)
    if c.get("mla"):
        ql, kl, rope, nope = c["q_lora"], c["kv_lora"], c["rope"], c["nope"]
        down = h * ql + h * (kl + rope)  # replicated low-rank down projections
        up = ql * H * (nope + rope) + kl * H * (nope + vhd)
        out_f = H * (nope + rope) + H * (nope + vhd)
        qkv = FusedOp("qkv", h, out_f, params=down + up, shardable_params=up,
                      flops_per_token=2 * (down + up))
        core = FusedOp("attn_core", out_f, H * vhd, attrs=dict(
            heads=H, kv_heads=H, head_dim=nope + rope, v_head_dim=vhd,
            kv_cache_elems_per_token=kl + rope, kv_cache_split_by_heads=False,
            flops_per_token_per_context=attention_flops_per_context(H, nope + rope, vhd),
            decode_flops_per_token_per_context=mla_absorbed_flops_per_context(H, kl, rope)))
    else:
        out_f = (H + 2 * KV) * hd
        qkv = _lin("qkv", h, out_f)
        core = FusedOp("attn_core", out_f, H * vhd, attrs=dict(
            heads=H, kv_heads=KV, head_dim=hd, v_head_dim=vhd,
            kv_cache_elems_per_token=2 * KV * hd, kv_cache_split_by_heads=True,
            flops_per_token_per_context=attention_flops_per_context(H, hd, vhd),
            decode_flops_per_token_per_context=attention_flops_per_context(H, hd, vhd)))
    return [qkv, core, _lin("out_proj", H * vhd, h)]


def build_graph(name: str, c: dict) -> Graph:
    h, gated = c["hidden"], c.get("gated", True)
    mult = 2 if gated else 1
    kinds = []
    n_dense = c.get("dense_layers", 0 if c.get("num_experts") else c["layers"])
    n_moe = c["layers"] - n_dense
    if n_dense:
        ops = _attention(c) + [_lin("ffn1", h, c["ffn"] * mult, gated=gated),
                               _lin("ffn2", c["ffn"], h)]
        kinds.append(LayerKind("dense_block", n_dense, list(range(n_dense)), ops))
    if n_moe:
        E, k, ef = c["num_experts"], c["top_k"], c["expert_ffn"]
        ops = _attention(c) + [_lin("router", h, E)]
        e1 = _lin("expert_ffn1", h, ef * mult, count=E, num_experts=E, top_k=k, gated=gated)
        e2 = _lin("expert_ffn2", ef, h, count=E, num_experts=E, top_k=k)
        e1.flops_per_token *= k
        e2.flops_per_token *= k
        ops += [e1, e2]
        if c.get("num_shared_experts"):
            sf = ef * c["num_shared_experts"]
            ops += [_lin("shared_ffn1", h, sf * mult, gated=gated), _lin("shared_ffn2", sf, h)]
        kinds.append(LayerKind("moe_block", n_moe, list(range(n_dense, c["layers"])), ops))
    V = c["vocab"]
    emb = FusedOp("embedding", V, h, params=V * h, shardable_params=V * h, flops_per_token=0)
    g = Graph(name=name, layer_kinds=kinds, global_ops=[emb, _lin("lm_head", h, V)])
    g.config = dict(hidden=h, heads=c["heads"], kv_heads=c["kv_heads"], head_dim=c["head_dim"],
                    v_head_dim=c.get("v_head_dim", c["head_dim"]), vocab=V, layers=c["layers"],
                    num_experts=c.get("num_experts", 0), top_k=c.get("top_k", 0),
                    ffn=c.get("ffn", 0), expert_ffn=c.get("expert_ffn", 0),
                    num_shared_experts=c.get("num_shared_experts", 0), dtype_bytes=2)
    return g


CONFIGS = {
    "llama3_70b": dict(layers=80, hidden=8192, ffn=28672, heads=64, kv_heads=8, head_dim=128,
                       vocab=128256),
    "mixtral_8x7b": dict(layers=32, hidden=4096, expert_ffn=14336, num_experts=8, top_k=2,
                         heads=32, kv_heads=8, head_dim=128, vocab=32000),
    "deepseek_v3": dict(layers=61, dense_layers=3, hidden=7168, ffn=18432, expert_ffn=2048,
                        num_experts=256, top_k=8, num_shared_experts=1, heads=128,
                        kv_heads=128, head_dim=192, v_head_dim=128, vocab=129280, mla=True,
                        q_lora=1536, kv_lora=512, rope=64, nope=128),
    "kimi_k2": dict(layers=61, dense_layers=1, hidden=7168, ffn=18432, expert_ffn=2048,
                    num_experts=384, top_k=8, num_shared_experts=1, heads=64, kv_heads=64,
                    head_dim=192, v_head_dim=128, vocab=163840, mla=True, q_lora=1536,
                    kv_lora=512, rope=64, nope=128),
    "deepseek_v2": dict(layers=60, dense_layers=1, hidden=5120, ffn=12288, expert_ffn=1536,
                        num_experts=160, top_k=6, num_shared_experts=2, heads=128,
                        kv_heads=128, head_dim=192, v_head_dim=128, vocab=102400, mla=True,
                        q_lora=1536, kv_lora=512, rope=64, nope=128),
    "gpt_moe_1p2t": dict(layers=60, hidden=12288, expert_ffn=49152, num_experts=16, top_k=2,
                         heads=96, kv_heads=96, head_dim=128, vocab=51200, gated=False),
    "gpt_moe_1p6t": dict(layers=80, hidden=12288, expert_ffn=49152, num_experts=16, top_k=2,
                         heads=96, kv_heads=96, head_dim=128, vocab=51200, gated=False),
    "qwen3_30b_a3b": dict(layers=48, hidden=2048, expert_ffn=768, num_experts=128, top_k=8,
                          heads=32, kv_heads=4, head_dim=128, vocab=151936),
    "tiny_llama": dict(layers=4, hidden=256, ffn=688, heads=8, kv_heads=4, head_dim=32,
                       vocab=1024),
}


def fixture_graph(name: str) -> Graph:
    return build_graph(name, CONFIGS[name])


def param_count(g: Graph) -> int:
    n = sum(o.params for o in g.global_ops)
    return n + sum(k.count * sum(o.params for o in k.ops) for k in g.layer_kinds)
