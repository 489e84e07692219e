"""Where the fused ops live in the model families the DTensor backend knows (the structure
:mod:`shardc.backends.support` checks before compile writes anything).

An adapter answers "which modules run op X of layer i" for one family: HF decoder-only
causal LMs in the Llama mould (``model.model.layers[i].self_attn.{q,k,v,o}_proj``, dense
``mlp.{gate,up,down}_proj`` or a sparse MoE block ``mlp.gate`` + ``mlp.experts`` with 3-D
expert weights: Llama, Mistral, Mixtral, Qwen2/3(-MoE)), DeepSeek-V3 (MLA attention
``q_a_proj -> q_a_layernorm -> q_b_proj`` / ``kv_a_proj_with_mqa -> kv_a_layernorm ->
kv_b_proj``, group-limited sigmoid routing, ``mlp.shared_experts``; DeepSeek-V2 also without
the q low-rank projection), Phi-3.5-MoE, Gemma-2, OLMoE, HF GPT-2 (Conv1D layers, packed
q|k|v, learned positions) and shardc's plain GPT-MoE (``examples/gpt_moe.py``). It also
builds pipeline-stage modules. Anything else is refused with a clear message rather than
silently left unsharded (:mod:`shardc.backends.support` checks it before compile writes).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch.nn.functional as F
from torch import nn

from shardc.errors import InputError


@dataclass
class AttentionSite:
    module: nn.Module
    qkv: list[tuple[nn.Module, str]]  # (module, fqn prefix); one packed or three separate
    out: tuple[nn.Module, str]
    fused: int  # 3 when q|k|v is one packed linear
    heads: int
    kv_heads: int
    # MLA (DeepSeek): ``qkv`` holds the up projections (q_b_proj, kv_b_proj), ``down`` the
    # low-rank down projections (q_a_proj, kv_a_proj_with_mqa) and ``down_norms`` their
    # RMSNorms; all three lists are part of the fused ``qkv`` op.
    down: list[tuple[nn.Module, str]] = field(default_factory=list)
    down_norms: list[tuple[nn.Module, str]] = field(default_factory=list)
    # RMSNorms of q and k inside attention (Qwen3: per head over head_dim; OLMoE: over the
    # whole projection), replicated; applied by the layout-aware forward
    qk_norms: list[tuple[nn.Module, str]] = field(default_factory=list)
    q_low_rank: bool = True  # MLA: q through q_a_proj / q_b_proj (False: q_proj directly)

    @property
    def mla(self) -> bool:
        return bool(self.down)


@dataclass
class MoESite:
    block: nn.Module
    prefix: str
    router: tuple[nn.Module, str]  # module holding ``weight`` [E, hidden]
    experts: nn.Module
    w1: str  # attribute names on ``experts``
    w2: str
    transposed: bool  # True: weights stored [E, out, in] (HF); False: [E, in, out]
    gated: bool
    act: object
    top_k: int
    num_experts: int
    # shared experts (DeepSeek): ([gate_proj, up_proj], down_proj, module) -- fused ops
    # shared_ffn1 / shared_ffn2, run on the same (normed) residual as the router
    shared: tuple | None = None
    routing: str | None = "softmax_topk"  # see routing_kind()
    # DBRX: the experts' weights stored fused on ``experts.mlp`` (w1, v1, w2: [E * f, h])
    fused: tuple[str, ...] = ()
    # GPT-OSS: per-expert biases ([E, 2f], [E, h]) of the two matmuls, on ``experts``
    biases: tuple[str, ...] = ()


@dataclass
class LayerSites:
    index: int
    module: nn.Module
    prefix: str
    attention: AttentionSite
    norms: list[tuple[nn.Module, str]]
    mlp: tuple[list[tuple[nn.Module, str]], tuple[nn.Module, str]] | None = None
    moe: MoESite | None = None
    extra: dict = field(default_factory=dict)


def routing_kind(router: nn.Module) -> str | None:
    """Which routing maths an HF MoE router computes (None: one the backend does not know).

    ``sigmoid_group``: DeepSeek-V3 (sigmoid scores + correction bias, group-limited top-k);
    ``softmax_greedy``: DeepSeek-V2 (``topk_method`` greedy / group-limited greedy, scaled,
    not renormalised); ``sparsemixer``: Phi-3.5-MoE (top-2 by successive masked maxima);
    ``softmax_topk``: softmax over the experts then top-k, renormalised unless the router's
    ``norm_topk_prob`` is False (Mixtral, Qwen-MoE, OLMoE); ``softmax_topk_plain``: the same
    without renormalisation (a router with no ``norm_topk_prob`` that never sums);
    ``topk_softmax``: GPT-OSS (the top-k of the scores, then a softmax over those k). Read
    from the router's attributes and the source of its ``forward`` (as transformers itself
    inspects model sources), so a router computing something else is refused, not guessed."""
    import inspect

    if hasattr(router, "e_score_correction_bias"):
        return "sigmoid_group"
    if hasattr(router, "topk_method"):
        ok = router.topk_method in ("greedy", "group_limited_greedy")
        return "softmax_greedy" if ok else None
    try:
        src = inspect.getsource(type(router).forward)
    except (OSError, TypeError):
        return None
    if "sparsemixer(" in src and int(getattr(router, "top_k", 2)) == 2:
        return "sparsemixer"
    if "softmax" in src and "topk" in src and src.index("topk") < src.index("softmax"):
        return "topk_softmax"  # GPT-OSS: the top-k of the scores, a softmax over those k
    if "softmax" in src and "topk" in src and src.index("softmax") < src.index("topk"):
        after = src[src.index("topk"):]
        renormalises = hasattr(router, "norm_topk_prob") or ".sum(" in after
        return "softmax_topk" if renormalises else "softmax_topk_plain"
    return None


class HFCausalLM:
    """HF ``*ForCausalLM`` with a Llama-style decoder."""

    family = "hf"

    def __init__(self, model: nn.Module):
        self.model = model
        self.inner = model.model
        self.config = model.config

    @staticmethod
    def accepts(model: nn.Module) -> bool:
        inner = getattr(model, "model", None)
        return (hasattr(model, "lm_head") and inner is not None and hasattr(inner, "layers")
                and hasattr(inner, "embed_tokens")
                and hasattr(inner.layers[0], "self_attn")
                and (hasattr(inner.layers[0].self_attn, "q_proj")
                     or hasattr(inner.layers[0].self_attn, "kv_b_proj")))

    @property
    def embedding(self):
        return self.inner.embed_tokens, "model.embed_tokens"

    @property
    def final_norm(self):
        return self.inner.norm, "model.norm"

    @property
    def lm_head(self):
        return self.model.lm_head, "lm_head"

    @property
    def num_layers(self) -> int:
        return len(self.inner.layers)

    def layer(self, i: int) -> LayerSites:
        lay, pre = self.inner.layers[i], f"model.layers.{i}"
        a = lay.self_attn
        cfg = self.config
        if hasattr(a, "kv_b_proj"):
            att = _mla_site(a, f"{pre}.self_attn", cfg)
        else:
            att = AttentionSite(a, [(getattr(a, n), f"{pre}.self_attn.{n}")
                                    for n in ("q_proj", "k_proj", "v_proj")],
                                (a.o_proj, f"{pre}.self_attn.o_proj"), 1,
                                cfg.num_attention_heads, cfg.num_key_value_heads)
        att.qk_norms = [(getattr(a, n), f"{pre}.self_attn.{n}") for n in ("q_norm", "k_norm")
                        if isinstance(getattr(a, n, None), nn.Module)]
        sites = LayerSites(i, lay, pre, att, layer_norms(lay, pre))
        mlp = lay.mlp
        if hasattr(mlp, "experts"):
            ex = mlp.experts
            names = sorted(n for n, _ in ex.named_parameters())
            biases = ("gate_up_proj_bias", "down_proj_bias") if names == [
                "down_proj", "down_proj_bias", "gate_up_proj", "gate_up_proj_bias"] and \
                callable(getattr(ex, "_apply_gate", None)) else ()  # GPT-OSS: [E, in, out]
            if not biases and (names != ["down_proj", "gate_up_proj"]
                               or not hasattr(ex, "act_fn")):
                raise InputError(f"{pre}.mlp.experts: {type(ex).__name__} holds {names} (the "
                                 "backend runs stacked gate_up_proj [E, 2f, h] and down_proj "
                                 "[E, h, f] with act_fn, no expert biases)")
            gate_name = "gate" if hasattr(mlp, "gate") else "router"
            router = getattr(mlp, gate_name)
            shared = None
            sh = getattr(mlp, "shared_experts", None)
            if sh is not None:
                sp = f"{pre}.mlp.shared_experts"
                shared = ([(sh.gate_proj, f"{sp}.gate_proj"), (sh.up_proj, f"{sp}.up_proj")],
                          (sh.down_proj, f"{sp}.down_proj"), sh)
            sites.moe = MoESite(mlp, f"{pre}.mlp", (router, f"{pre}.mlp.{gate_name}"), ex,
                                "gate_up_proj", "down_proj", not biases, True,
                                getattr(ex, "_apply_gate", None) or ex.act_fn,
                                int(getattr(mlp, "top_k", None) or getattr(router, "top_k", None)
                                    or cfg.num_experts_per_tok),
                                int(ex.num_experts), shared, routing_kind(router),
                                biases=biases)
        else:
            sites.mlp = ([(mlp.gate_proj, f"{pre}.mlp.gate_proj"),
                          (mlp.up_proj, f"{pre}.mlp.up_proj")],
                         (mlp.down_proj, f"{pre}.mlp.down_proj"))
        return sites



def layer_norms(layer: nn.Module, pre: str) -> list[tuple[nn.Module, str]]:
    """The decoder layer's own norms: its direct children holding only 1-D parameters
    (input / post-attention norms; Gemma-2's pre- and post-feedforward norms too). They run
    on the residual stream, replicated."""
    out = []
    for name, mod in layer.named_children():
        ps = list(mod.parameters())
        if ps and all(p.ndim == 1 for p in ps):
            out.append((mod, f"{pre}.{name}"))
    return out


def _mla_site(a: nn.Module, pre: str, cfg) -> AttentionSite:
    """DeepSeek's multi-head latent attention as one fused ``qkv`` op (see AttentionSite).
    Without a q low-rank projection (DeepSeek-V2-Lite: ``q_lora_rank`` None) ``q_proj`` reads
    the block input directly and is an up projection like ``q_b_proj``."""
    kv_down = (a.kv_a_proj_with_mqa, f"{pre}.kv_a_proj_with_mqa")
    kv_norm = (a.kv_a_layernorm, f"{pre}.kv_a_layernorm")
    heads = cfg.num_attention_heads
    if getattr(a, "q_a_proj", None) is None:
        return AttentionSite(a, [(a.q_proj, f"{pre}.q_proj"), (a.kv_b_proj, f"{pre}.kv_b_proj")],
                             (a.o_proj, f"{pre}.o_proj"), 1, heads, heads,
                             down=[kv_down], down_norms=[kv_norm], q_low_rank=False)
    return AttentionSite(a, [(a.q_b_proj, f"{pre}.q_b_proj"), (a.kv_b_proj, f"{pre}.kv_b_proj")],
                         (a.o_proj, f"{pre}.o_proj"), 1, heads, heads,
                         down=[(a.q_a_proj, f"{pre}.q_a_proj"), kv_down],
                         down_norms=[(a.q_a_layernorm, f"{pre}.q_a_layernorm"), kv_norm])


class GPTMoEModel:
    """shardc's plain GPT-MoE (``examples/gpt_moe.py``)."""

    family = "gpt_moe"

    def __init__(self, model: nn.Module):
        self.model = model
        self.config = model.config

    @staticmethod
    def accepts(model: nn.Module) -> bool:
        return (hasattr(model, "embed") and hasattr(model, "layers") and hasattr(model, "ln_f")
                and hasattr(model.layers[0], "attn") and hasattr(model.layers[0].attn, "qkv"))

    @property
    def embedding(self):
        return self.model.embed, "embed"

    @property
    def final_norm(self):
        return self.model.ln_f, "ln_f"

    @property
    def lm_head(self):
        return self.model.lm_head, "lm_head"

    @property
    def num_layers(self) -> int:
        return len(self.model.layers)

    def layer(self, i: int) -> LayerSites:
        lay, pre = self.model.layers[i], f"layers.{i}"
        a, cfg = lay.attn, self.config
        att = AttentionSite(a, [(a.qkv, f"{pre}.attn.qkv")], (a.out, f"{pre}.attn.out"), 3,
                            cfg.num_heads, cfg.num_heads)
        norms = layer_norms(lay, pre)
        moe = lay.moe
        site = MoESite(moe, f"{pre}.moe", (moe.router, f"{pre}.moe.router"), moe.experts,
                       "w_in", "w_out", False, False, F.gelu, cfg.top_k, cfg.num_experts)
        return LayerSites(i, lay, pre, att, norms, moe=site)



class GPT2LMHead:
    """HF GPT-2 (``transformer.h[i]``: ``attn.c_attn`` packed q|k|v and ``attn.c_proj``,
    ``mlp.c_fc`` / ``mlp.c_proj`` -- Conv1D layers, weights stored ``[in, out]``; learned
    position embeddings ``transformer.wpe``, replicated)."""

    family = "gpt2"

    def __init__(self, model: nn.Module):
        self.model = model
        self.inner = model.transformer
        self.config = model.config

    @staticmethod
    def accepts(model: nn.Module) -> bool:
        inner = getattr(model, "transformer", None)
        return (hasattr(model, "lm_head") and inner is not None and hasattr(inner, "h")
                and hasattr(inner, "wte") and hasattr(inner, "wpe")
                and hasattr(inner.h[0], "attn") and hasattr(inner.h[0].attn, "c_attn"))

    @property
    def embedding(self):
        return self.inner.wte, "transformer.wte"

    @property
    def position_embeddings(self) -> list[tuple[nn.Module, str]]:
        return [(self.inner.wpe, "transformer.wpe")]

    @property
    def final_norm(self):
        return self.inner.ln_f, "transformer.ln_f"

    @property
    def lm_head(self):
        return self.model.lm_head, "lm_head"

    @property
    def num_layers(self) -> int:
        return len(self.inner.h)

    def layer(self, i: int) -> LayerSites:
        lay, pre = self.inner.h[i], f"transformer.h.{i}"
        a, heads = lay.attn, int(self.config.num_attention_heads)
        att = AttentionSite(a, [(a.c_attn, f"{pre}.attn.c_attn")], (a.c_proj, f"{pre}.attn.c_proj"),
                            3, heads, heads)
        mlp = ([(lay.mlp.c_fc, f"{pre}.mlp.c_fc")], (lay.mlp.c_proj, f"{pre}.mlp.c_proj"))
        return LayerSites(i, lay, pre, att, layer_norms(lay, pre), mlp=mlp)



class DbrxLM:
    """transformers' DBRX (``transformer.blocks[i]``: ``norm_attn_norm.{norm_1, attn.{Wqkv,
    out_proj}, norm_2}`` -- packed q|k|v clamped to ``clip_qkv`` -- and ``ffn.{router.layer,
    experts.mlp.{w1, v1, w2}}``, its experts stored fused ``[E * f, h]``: placed as ``[E, f,
    h]`` views, :mod:`shardc.frontends.fused_experts`; its routing softmax top-k p-norm)."""

    family = "hf"

    def __init__(self, model: nn.Module):
        self.model = model
        self.inner = model.transformer
        self.config = model.config

    @staticmethod
    def accepts(model: nn.Module) -> bool:
        inner = getattr(model, "transformer", None)
        return (hasattr(model, "lm_head") and hasattr(inner, "blocks") and hasattr(inner, "wte")
                and hasattr(inner.blocks[0], "norm_attn_norm")
                and hasattr(inner.blocks[0].norm_attn_norm.attn, "Wqkv"))

    @property
    def embedding(self):
        return self.inner.wte, "transformer.wte"

    @property
    def final_norm(self):
        return self.inner.norm_f, "transformer.norm_f"

    @property
    def lm_head(self):
        return self.model.lm_head, "lm_head"

    @property
    def num_layers(self) -> int:
        return len(self.inner.blocks)

    def layer(self, i: int) -> LayerSites:
        lay, pre = self.inner.blocks[i], f"transformer.blocks.{i}"
        nan, ap = lay.norm_attn_norm, f"{pre}.norm_attn_norm"
        a = nan.attn
        att = AttentionSite(a, [(a.Wqkv, f"{ap}.attn.Wqkv")], (a.out_proj, f"{ap}.attn.out_proj"),
                            3, int(a.num_heads), int(a.num_key_value_heads))
        norms = [(nan.norm_1, f"{ap}.norm_1"), (nan.norm_2, f"{ap}.norm_2")]
        ffn, ex = lay.ffn, lay.ffn.experts
        moe = MoESite(ffn, f"{pre}.ffn", (ffn.router.layer, f"{pre}.ffn.router.layer"), ex.mlp,
                      "w1", "w2", True, True, ex.mlp.activation_fn, int(ffn.top_k),
                      int(ex.num_experts), routing="softmax_topk_pnorm",
                      fused=("w1", "v1", "w2"))
        return LayerSites(i, lay, pre, att, norms, moe=moe)


ADAPTERS = (HFCausalLM, GPTMoEModel, GPT2LMHead, DbrxLM)


def adapter_for(model: nn.Module):
    for cls in ADAPTERS:
        if cls.accepts(model):
            return cls(model)
    raise InputError(f"the DTensor backend does not know the layout of {type(model).__name__} "
                     "(supported: HF Llama-style causal LMs incl. Mixtral-style MoE, "
                     "DeepSeek-V2/V3 MLA + shared experts, GPT-2, shardc GPT-MoE, DBRX)")


def default_layer_kinds(model: nn.Module) -> dict[int, str]:
    """Layer index -> kind when no IR is at hand: ``moe_block`` for layers with experts,
    ``dense_block`` otherwise (the layer-grouping pass's names for these families)."""
    ad = adapter_for(model)
    out = {}
    for i in range(ad.num_layers):
        s = ad.layer(i)
        out[i] = "moe_block" if s.moe is not None else "dense_block"
    return out
