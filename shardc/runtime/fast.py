"""The fast runtime's model (torch only): an HF decoder whose weights ``parallelize`` has
placed (DTensor shards, or plain tensors for replicated ops) run as a small per-family
forward over the *local* shards, with the plan's repairs as explicit functional
collectives and a :class:`shardc.runtime.kv_cache.KVCache` it owns.

Families: Llama-style attention (GQA -- KV heads replicated when tp exceeds them --, q/k/v
biases, Qwen3's per-head and OLMoE's whole-projection q/k norms, sliding windows, Gemma-2's
softcapping, scaled embedding and sandwich norms, Gemma-3's rotary table per layer type and
a multimodal class's text model, Granite's multipliers), GPT-2 (packed Conv1D q|k|v, learned
positions, layer norms, a plain MLP), shardc's GPT-MoE (a packed ``qkv`` linear, rotary
tables from ``rope_theta``, ``[E, in, out]`` experts: :mod:`shardc.runtime.gpt_moe_local`),
DeepSeek-V2/V3 MLA (absorbed: attention runs in the latent space, the cache holds the
latent; per head after a ``row`` qkv or a ``col`` one before a batch split,
:mod:`shardc.runtime.mla_local`), gated MLPs, sparse MoE blocks with HF stacked experts
(Mixtral, Qwen3-MoE, DeepSeek routed + shared experts; :mod:`shardc.runtime.moe_local`),
GPT-OSS (attention sinks: a learned logit per head joining each softmax, the rank's heads'
under a heads split; q/k/v and o_proj biases; its rotary module's ``d / 2``-frequency YaRN
tables; a biased router, top-k then softmax; experts ``[E, h, 2f]`` with gate / up
alternating, per-expert biases and their own clamped activation), Nemotron-H's hybrid blocks
(Mamba-2 mixers -- the chunked SSD scan, a conv + SSM state per row beside the KV cache --,
attention without rotary embeddings, ungated relu2 MLPs: :mod:`shardc.runtime.mamba2_local`).
Other linear-attention / state-space layers (Jamba's Mamba-1, Qwen3-Next's Gated DeltaNet) are
not run (the backend gate refuses them by class).
Sequence parallelism: the residual ``S(0)`` holds this tp rank's rows.

What runs is the plan's walk, as data (``walks``, written into ``parallelize.py`` from the
contract's :func:`shardc.ir.contract.walk`)::

    {"residual": "R",                                      # or "S(0)": sequence parallel
     "embedding": {"steps": [["embedding", "vocab", "R", "P"]], "end": "R"},
     "lm_head": {"steps": [["lm_head", "col", "R", "S(1)"]], "end": "R"},
     "kinds": {"dense_block": {"attention": {"steps": [[op, choice, need, produced], ...],
                                             "end": "R"}, "mlp": {...}}, ...}}

Before each op the activation is moved from the placement it holds to the one the op needs
(:func:`shardc.runtime.local_ops.repair`: the collective the walk names), the op runs on
the local shard, and after the branch's last op the output is moved to the branch end:
the collectives of a decode step are the cost model's rows, nothing else (plus the ep
count exchange). Rows: over dp x ep each rank serves its slice of the batch
(:func:`shardc.runtime.apply.batch_mesh`); an ``S(0)`` attention core (batch-split) runs
and caches this tp rank's share of those rows.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from shardc.runtime.apply import batch_mesh
from shardc.runtime.dbrx_local import clip_of, dbrx_block_parts, is_dbrx_block
from shardc.runtime.gathered_experts import GatheredExpertsLocal
from shardc.runtime.gpt_moe_local import is_gpt_moe, rotary_tables
from shardc.runtime.kv_cache import KVCache, positions, visible
from shardc.runtime.local_ops import (
    Group,
    attend,
    held_rows,
    linear,
    linear_parts,
    local_tensor,
    norm_of,
    projection_norms,
    repair,
    repeat_kv_heads,
    rope,
)
from shardc.runtime.mamba2_local import HybridBlock, is_hybrid_block
from shardc.runtime.mla_local import LatentAttention, PerHeadLatentAttention
from shardc.runtime.moe_local import DenseMLP, ExpertsLocal, PlainMLP, shared_branch


def _lm_config(model):
    cfg = model.config
    return cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg


def _window(cfg, attn, i: int):
    types = getattr(cfg, "layer_types", None)
    if types is not None and types[i] != "sliding_attention":
        return None
    w = getattr(attn, "sliding_window", None) or getattr(cfg, "sliding_window", None)
    return int(w) if w else None


def _rope_interleaved(attn, d: int) -> bool | str:
    """Whether the attention module's own ``apply_rotary_pos_emb`` (its modeling module's)
    rotates adjacent pairs (ERNIE-4.5's GLM style: cos / sin halves repeated pairwise) rather
    than the two halves (Llama's), told by running it once on a probe of head dim ``d``;
    ``"half_tables"``: the two halves rotated by tables of the ``d / 2`` frequencies alone
    (GPT-OSS's, whose rotary module returns them so: the runtime repeats them, Llama's
    tables); NotImplementedError for any other convention. Adjacent pairs are run as DeepSeek's
    ``rope_interleave`` (q and k permuted alike: the scores are unchanged)."""
    import sys

    fn = getattr(sys.modules.get(type(attn).__module__), "apply_rotary_pos_emb", None)
    if fn is None:
        return False
    x = torch.arange(1.0, d + 1.0).view(1, 1, 1, d)
    freqs = torch.linspace(0.3, 1.1, d // 2)
    emb = torch.cat([freqs, freqs])
    cos, sin = emb.cos().view(1, 1, d), emb.sin().view(1, 1, d)
    try:
        got = fn(x, x, cos, sin)[0].float()
    except RuntimeError:  # GPT-OSS: tables of the d / 2 frequencies, rotating the halves
        got = fn(x, x, cos[..., :d // 2], sin[..., :d // 2])[0].float()
        if torch.allclose(got, rope(x, cos, sin)):
            return "half_tables"
        raise NotImplementedError(f"the rotary embedding of {type(attn).__module__}") from None
    if torch.allclose(got, rope(x, cos, sin)):
        return False
    halves = got.view(1, 1, 1, d // 2, 2).transpose(-1, -2).reshape(1, 1, 1, d)
    if torch.allclose(halves, rope(x, cos, sin, True)):
        return True
    raise NotImplementedError(f"the rotary embedding of {type(attn).__module__}")


class Attention:
    """Llama-style grouped-query attention of one layer on local shards."""

    def __init__(self, attn, walk: dict, tp: Group, cfg, i: int):
        (_, self.c_qkv, _, _), (_, core, self.core_need, _), (_, self.c_out, _, _) = \
            walk["steps"]
        if core not in ("heads", "batch", "rep"):
            raise NotImplementedError(f"attention core {core}")
        self.walk, self.tp, self.i = walk, tp, i
        self.d = int(attn.head_dim)
        self.hq = int(getattr(cfg, "num_attention_heads", None) or cfg.num_heads)  # GPT-MoE's
        self.hkv = int(getattr(cfg, "num_key_value_heads", None) or self.hq)
        if hasattr(attn, "Wqkv"):  # DBRX: n_heads, attn_config.kv_n_heads (the module's own
            # counts are this rank's share once HeadParallelAttention has placed it)
            self.hq, self.hkv = int(cfg.n_heads), int(cfg.attn_config.kv_n_heads)
        self.split = core == "heads" and tp.size > 1
        n = tp.size if self.split else 1
        if self.hkv % n and n % self.hkv:
            raise NotImplementedError(f"a heads split at tp {n} over {self.hkv} KV heads")
        # GQA with tp > KV heads: each rank keeps the one KV head its query heads read
        self.kv_rep = max(n // self.hkv, 1)
        self.hkv_local = max(self.hkv // n, 1)
        self.parts = (self.hq * self.d, self.hkv * self.d, self.hkv * self.d)
        # GPT-2's reorder_and_upcast_attn (HF honours it under eager attention only)
        self.upcast = bool(getattr(attn, "reorder_and_upcast_attn", False)) and \
            getattr(cfg, "_attn_implementation", None) == "eager"
        if hasattr(attn, "c_attn"):  # GPT-2: packed q|k|v Conv1D weights [in, out]
            self.wqkv, self.bqkv = [local_tensor(attn.c_attn.weight).t()], [local_tensor(attn.c_attn.bias)]
            self.wo, self.bo = local_tensor(attn.c_proj.weight).t(), attn.c_proj.bias
        elif any(hasattr(attn, a) for a in ("qkv", "qkv_proj", "Wqkv")):  # packed q|k|v
            qkv = next(getattr(attn, a) for a in ("qkv", "qkv_proj", "Wqkv")  # GPT-MoE's,
                       if hasattr(attn, a))  # Phi-3's, DBRX's
            out = next(getattr(attn, a) for a in ("out", "o_proj", "out_proj") if hasattr(attn, a))
            self.wqkv, self.bqkv = [local_tensor(qkv.weight)], [local_tensor(qkv.bias)]
            self.wo, self.bo = local_tensor(out.weight), out.bias
        else:
            projs = (attn.q_proj, attn.k_proj, attn.v_proj)
            self.wqkv = [local_tensor(p.weight) for p in projs]  # the shards themselves: no copy
            self.bqkv = [None if p.bias is None else local_tensor(p.bias) for p in projs]
            self.wo, self.bo = local_tensor(attn.o_proj.weight), attn.o_proj.bias
        self.bo = None if self.bo is None else local_tensor(self.bo)
        self.q_norm = getattr(attn, "q_norm", None)
        self.k_norm = getattr(attn, "k_norm", None)
        # OLMoE: q / k norms over the whole projection (else per head)
        self.whole_norms = self.q_norm is not None and self.q_norm.weight.shape[0] != self.d
        self.scale = float(getattr(attn, "scaling", None) or self.d ** -0.5)
        self.window = _window(cfg, attn, i)
        self.softcap = getattr(cfg, "attn_logit_softcapping", None)
        self.interleave = _rope_interleaved(attn, self.d)
        self.half_tables = self.interleave == "half_tables"
        self.interleave = self.interleave is True
        # GPT-OSS: a learned logit per query head joins each softmax; a heads split holds
        # its heads' (placed so by parallelize.py, or sliced here from the whole vector)
        sinks = getattr(attn, "sinks", None)
        self.sinks = None if sinks is None else local_tensor(sinks).detach()
        if self.sinks is not None and self.split and self.sinks.shape[0] == self.hq:
            self.sinks = self.sinks.chunk(tp.size)[tp.rank]
        self.clip = clip_of(attn)  # DBRX: q|k|v clamped, on whole values (after the repair)

    def alloc(self, cache: KVCache, rows: int) -> None:
        cache.add_heads(self.i, held_rows(rows, self.core_need, self.tp), self.hkv_local,
                        self.d, window=self.window)

    def __call__(self, x, residual, cache: KVCache, steps, upto, rope_tables, prefill):
        tp = self.tp
        steps_w = self.walk["steps"]
        y = linear_parts(repair(x, residual, steps_w[0][2], tp), self.wqkv, self.bqkv,
                         self.c_qkv, tp)
        parts = self.parts
        if self.kv_rep > 1 and steps_w[0][3] != "S(1)":  # whole k / v: repeat the KV heads
            y, parts = repeat_kv_heads(y, parts, self.d, self.kv_rep)
        y = repair(y, steps_w[0][3], self.core_need, tp, parts)
        if self.clip is not None:
            y = y.clamp(min=-self.clip, max=self.clip)
        n = tp.size if self.split else 1
        hq, hkv, d = self.hq // n, self.hkv_local, self.d
        r, s = y.shape[0], y.shape[1]
        q, k, v = y.split([hq * d, hkv * d, hkv * d], -1)
        if self.whole_norms:
            q, k = projection_norms(q, k, self.q_norm, self.k_norm, tp if self.split else None,
                                    self.kv_rep)
        q = q.view(r, s, hq, d).transpose(1, 2)
        k = k.view(r, s, hkv, d).transpose(1, 2)
        v = v.view(r, s, hkv, d).transpose(1, 2)
        if self.q_norm is not None and not self.whole_norms:
            q = norm_of(self.q_norm, q)
            k = norm_of(self.k_norm, k)
        layer = cache.layers[self.i]
        start = cache.start[layer.rows]
        if rope_tables is not None:  # rotary positions (GPT-2's are learned: embedded)
            cos, sin = rope_tables(positions(steps, start))
            q, k = rope(q, cos, sin, self.interleave), rope(k, cos, sin, self.interleave)
        layer.write(steps, k, v)
        if prefill:  # from an empty cache: the fresh keys are all there is
            keys, vals, kst = k, v, steps
        else:
            keys, vals, kst = layer.view(upto)
        o = attend(q, keys, vals, visible(kst, steps, start, self.window), self.scale,
                   self.softcap, self.upcast, self.sinks)
        (_, _, need, prod) = steps_w[2]
        o = linear(repair(o, self.core_need, need, tp), self.wo, self.bo, self.c_out, tp)
        return repair(o, prod, self.walk["end"], tp)


class Layer:
    """One decoder layer: norms (replicated), attention and the MLP / MoE branches."""

    def __init__(self, layer, kind_walk: dict, tp: Group, ep: Group, cfg, i: int):
        if is_dbrx_block(layer):  # DBRX: norm_attn_norm (norm_1, attn, norm_2), ffn
            attn, self.ln1, self.ln2, _ = dbrx_block_parts(layer)
            names = {"norm_attn_norm", "ffn"}
        elif hasattr(layer, "ln_1"):  # GPT-2's block: ln_1, attn, ln_2, mlp
            attn, self.ln1, self.ln2 = layer.attn, layer.ln_1, layer.ln_2
            names = {"attn", "ln_1", "ln_2", "mlp"}
        elif hasattr(layer, "ln_attn"):  # GPT-MoE's block: ln_attn, attn, ln_moe, moe
            attn, self.ln1, self.ln2 = layer.attn, layer.ln_attn, layer.ln_moe
            names = {"attn", "ln_attn", "ln_moe", "moe"}
        else:  # OLMo-2: no input norm (norms after the branches only)
            attn, self.ln1, self.ln2 = (layer.self_attn, getattr(layer, "input_layernorm", None),
                                        layer.post_attention_layernorm)
            names = {"self_attn", "mlp", "input_layernorm", "post_attention_layernorm",
                     "pre_feedforward_layernorm", "post_feedforward_layernorm",
                     "block_sparse_moe"}
        if not any(hasattr(attn, a) for a in ("q_proj", "c_attn", "qkv", "qkv_proj", "Wqkv",
                                               "kv_a_proj_with_mqa")):
            raise NotImplementedError(f"attention module {type(attn).__name__}")
        walk = kind_walk["attention"]
        per_head = walk["steps"][0][1] == "row" or (walk["steps"][0][1] == "col"
                                                    and walk["steps"][1][1] != "heads")
        if hasattr(attn, "kv_a_proj_with_mqa"):
            cls = PerHeadLatentAttention if per_head else LatentAttention
            self.attn = cls(attn, walk, tp, cfg, i, _window(cfg, attn, i))
        else:
            self.attn = Attention(attn, walk, tp, cfg, i)
        # Granite: the branches' outputs scaled before their residual adds
        self.res_mult = float(getattr(layer, "residual_multiplier", 1.0) or 1.0)
        # Gemma-2/3: the attention / MLP outputs are normed before their residual adds and
        # the MLP input after it; OLMo-2: the outputs only (no input norms)
        self.post_ff = getattr(layer, "post_feedforward_layernorm", None)
        self.pre_ff = getattr(layer, "pre_feedforward_layernorm", None)
        sandwich = (self.pre_ff is None) == (self.post_ff is None)  # both or neither
        olmo2 = self.pre_ff is None and self.post_ff is not None
        if not (olmo2 if self.ln1 is None else sandwich):
            raise NotImplementedError("a decoder layer with these input / pre / post feed-forward "
                                      "norms")
        extra = {n for n, m in layer.named_children()  # dropout: the identity in inference
                 if not isinstance(m, torch.nn.Dropout)} - names
        if extra:
            raise NotImplementedError(f"decoder-layer modules {sorted(extra)}")
        mlp = next(getattr(layer, a) for a in ("mlp", "moe", "block_sparse_moe", "ffn")  # GPT-MoE's,
                   if hasattr(layer, a))  # Granite-MoE's
        experts = GatheredExpertsLocal if "gather" in kind_walk.get("experts", {}) \
            else ExpertsLocal  # the experts split their own way: the all-gather dispatch
        self.experts = experts(mlp, kind_walk, tp, ep) if "experts" in kind_walk else None
        dense = PlainMLP if hasattr(mlp, "c_fc") else DenseMLP
        if not self.experts and not any(hasattr(mlp, a) for a in ("c_fc", "gate_proj",
                                                                  "gate_up_proj")):
            raise NotImplementedError(f"MLP module {type(mlp).__name__}")
        self.mlp = None if self.experts else dense(mlp, kind_walk["mlp"], tp)
        self.shared = shared_branch(mlp, kind_walk, tp) if self.experts else None

    def alloc(self, cache: KVCache, rows: int) -> None:
        self.attn.alloc(cache, rows)

    def __call__(self, h, residual, cache, steps, upto, rope_tables, prefill):
        x = h if self.ln1 is None else norm_of(self.ln1, h)
        a = self.attn(x, residual, cache, steps, upto, rope_tables, prefill)
        if self.pre_ff is not None:  # Gemma-2's sandwich norms
            h = h + norm_of(self.ln2, a)
            x = norm_of(self.pre_ff, h)
        elif self.ln1 is None:  # OLMo-2: the branch output normed, the MLP reads h
            h = h + norm_of(self.ln2, a)
            x = h
        else:
            h = h + (a if self.res_mult == 1.0 else a * self.res_mult)
            x = norm_of(self.ln2, h)
        if self.experts is None:
            out = self.mlp(x, residual)
        else:
            out = self.experts(x, residual)
            if self.shared is not None:
                out = out + self.shared(x, residual)
        if self.post_ff is not None:
            out = norm_of(self.post_ff, out)
        return h + (out if self.res_mult == 1.0 else out * self.res_mult)


def _layer(layer, kind_walk: dict, tp: Group, ep: Group, cfg, i: int):
    """The runtime's layer ``i``: a Nemotron-H block (its one mixer: Mamba-2, attention --
    this module's -- or the MLP; :mod:`shardc.runtime.mamba2_local`) or a decoder layer."""
    if not is_hybrid_block(layer):
        return Layer(layer, kind_walk, tp, ep, cfg, i)
    attention = Attention(layer.mixer, kind_walk["attention"], tp, cfg, i) \
        if layer.block_type == "full_attention" else None
    return HybridBlock(layer, kind_walk, tp, i, attention)


class FastModel:
    """This rank's share of a parallelized HF causal LM, run on local shards.

    ``model``: what ``parallelize`` returned (a pipelined model: its stage's cut model);
    ``world_mesh``: the plan's mesh (dims among ``pp``, ``dp``, ``ep``, ``tp``); ``walks``:
    the plan's walk data (module docstring); ``layer_kinds``: kind -> layer indices.
    :meth:`forward` maps this rank's token rows to last-position logits (last stage) or
    sends the hidden states on (other stages)."""

    def __init__(self, model, world_mesh, walks: dict, layer_kinds: dict):
        if hasattr(model, "stage") and hasattr(model.stage, "model"):
            model = model.stage.model
        plain = is_gpt_moe(model)  # GPT-MoE: embed, layers, ln_f, lm_head on the model
        if not (hasattr(model, "model") or hasattr(model, "transformer") or plain):
            raise NotImplementedError(f"{type(model).__name__}: not an HF causal LM layout "
                                      "(model.model, GPT-2's transformer) nor GPT-MoE's")
        self.cfg = cfg = _lm_config(model)
        names = tuple(world_mesh.mesh_dim_names or ())
        self.tp = Group(world_mesh["tp"] if "tp" in names else None)
        self.ep = Group(world_mesh["ep"] if "ep" in names else None)
        self.pp = Group(world_mesh["pp"] if "pp" in names else None)
        self.batch = Group(batch_mesh(world_mesh))
        # "S(0)": sequence parallel -- the residual stream holds this tp rank's share of
        # the rows (a decode step's tokens are its rows); the walk's all-gather before a
        # branch and reduce-scatter after it are the plan's
        self.residual = walks.get("residual", "R")
        self.walks = walks
        # DBRX: transformer.{wte, blocks, norm_f, rotary_emb}
        dbrx = hasattr(getattr(model, "transformer", None), "blocks")
        gpt2 = hasattr(model, "transformer") and not dbrx  # GPT-2: transformer.{wte, wpe, h, ln_f}
        inner = model.transformer if gpt2 or dbrx else model if plain else model.model
        inner = getattr(inner, "language_model", inner)  # a multimodal model's text model
        kind_of = {i: k for k, idx in layer_kinds.items() for i in idx}
        layers = inner.h if gpt2 else inner.blocks if dbrx else inner.layers
        self.layers = {i: _layer(layers[i], walks["kinds"][kind_of[i]], self.tp, self.ep, cfg, i)
                       for i in range(len(layers)) if any(True for _ in layers[i].parameters())}
        embed = inner.wte if gpt2 or dbrx else inner.embed if plain else \
            inner.embeddings if hasattr(inner, "embeddings") else inner.embed_tokens  # Nemotron-H
        # a pipeline stage's dropped embedding / lm_head: None (HF) or a pass-through
        self.first = hasattr(embed, "weight")
        self.last = hasattr(getattr(model, "lm_head", None), "weight")
        if self.first:
            self.embed = local_tensor(embed.weight)
            # GPT-2's learned positions (replicated), added after the embedding's repair
            self.positions = local_tensor(inner.wpe.weight) if gpt2 else None
            # Gemma's scaled embedding (a Python float: the buffer is not a parameter)
            self.embed_scale = getattr(embed, "scalar_embed_scale", None)
            if self.embed_scale is None and getattr(embed, "embed_scale", None) is not None:
                raise NotImplementedError("a scaled embedding without its scale as a float")
            # Granite's embedding multiplier (a Python float, as HF multiplies by it)
            self.embed_mult = float(getattr(inner, "embedding_multiplier", 1.0) or 1.0)
        if self.last:
            self.norm = inner.ln_f if gpt2 or plain else \
                inner.norm_f if dbrx or hasattr(inner, "norm_f") else inner.norm  # Nemotron-H
            self.head = local_tensor(model.lm_head.weight)
            self.head_bias = None if model.lm_head.bias is None else local_tensor(model.lm_head.bias)
            self.final_softcap = getattr(cfg, "final_logit_softcapping", None)
            self.logits_scaling = float(getattr(cfg, "logits_scaling", 1.0) or 1.0)  # Granite
        self.rotary = getattr(inner, "rotary_emb", None)
        # GPT-MoE: rotate-half tables from rope_theta (its attention computes them per call)
        self.theta = (float(cfg.rope_theta), int(cfg.head_dim)) if plain else None
        # Gemma-3: a table per layer type (local / global rope bases), else one for all
        types = getattr(self.rotary, "layer_types", None) and getattr(cfg, "layer_types", None)
        self.rope_type = {i: types[i] if types else None for i in self.layers}
        self.hidden = int(cfg.hidden_size)
        self.dtype = next(p for p in model.parameters()).dtype
        self.device = next(p for p in model.parameters()).device
        if self.pp:
            ranks = dist.get_process_group_ranks(self.pp.pg)
            me = self.pp.rank
            self.prev = ranks[me - 1] if me > 0 else None
            self.next = ranks[me + 1] if me + 1 < len(ranks) else None
            self.last_rank = ranks[-1]
        self._tables: dict = {}  # layer type (None: every layer) -> (cos, sin [context, d])

    @property
    def graphable(self) -> bool:
        """Whether a decode step can be captured as a CUDA graph: no host-read split sizes
        (ep = 1, MoE experts on their capture-safe path: ``ExpertsLocal.static``), no
        point-to-point sends (pp = 1)."""
        return not self.ep and not self.pp and all(
            layer.experts is None or getattr(layer.experts, "static", False)
            for layer in self.layers.values())

    def new_cache(self, rows: int, context: int) -> KVCache:
        """This rank's KV cache for ``rows`` rows (its dp x ep slice) and ``context`` steps.
        ValueError when sequence parallelism cannot split the rows over tp."""
        held_rows(rows, self.residual, self.tp)
        cache = KVCache(rows, context, self.device, self.dtype)
        for layer in self.layers.values():
            layer.alloc(cache, rows)
        if self.theta is not None:
            self._tables = {None: rotary_tables(*self.theta, context, self.device, self.dtype)}
        for kind in (set(self.rope_type.values()) if self.rotary is not None else ()):
            args = (torch.zeros(1, dtype=self.dtype, device=self.device),
                    torch.arange(context, device=self.device)[None])
            tables = self.rotary(*args) if kind is None else self.rotary(*args, kind)
            if torch.is_tensor(tables) and tables.is_complex():  # DeepSeek-V2's e^(i pos freq):
                for layer in self.layers.values():  # a complex product of adjacent pairs
                    if not isinstance(layer.attn, (LatentAttention, PerHeadLatentAttention)):
                        raise NotImplementedError("complex rotary tables outside MLA")
                    layer.attn.interleave = True
                tables = (torch.cat([tables.real] * 2, -1).to(self.dtype),
                          torch.cat([tables.imag] * 2, -1).to(self.dtype))
            cos, sin = tables
            attns = [layer.attn for layer in self.layers.values()
                     if isinstance(layer.attn, Attention)]
            if attns and all(a.half_tables and a.d == 2 * cos.shape[-1] for a in attns):
                cos, sin = torch.cat([cos, cos], -1), torch.cat([sin, sin], -1)  # GPT-OSS's
            if any(isinstance(layer.attn, Attention) and layer.attn.d != cos.shape[-1]
                   for layer in self.layers.values()):
                raise NotImplementedError("a partial rotary embedding (rotary dim "
                                          f"{cos.shape[-1]} of the head dim)")
            self._tables[kind] = (cos[0], sin[0])
        return cache

    def rope_tables(self, pos: torch.Tensor, kind=None):
        """cos / sin ``[rows, seq, rope dim]`` of positions ``pos [rows, seq]`` (``kind``:
        the layer type of a model with a table per type)."""
        cos, sin = self._tables[kind]
        return cos[pos], sin[pos]

    def _embed(self, ids: torch.Tensor, cache: KVCache, steps: torch.Tensor) -> torch.Tensor:
        (_, choice, _, prod), = self.walks["embedding"]["steps"]
        w = self.embed
        if choice == "vocab" and self.tp:
            lo = self.tp.rank * w.shape[0]
            local = ids - lo
            hit = (local >= 0) & (local < w.shape[0])
            e = F.embedding(local.clamp(0, w.shape[0] - 1), w) * hit[..., None].to(w.dtype)
        else:
            e = F.embedding(ids, w)
        if self.embed_scale is not None:  # as HF: the scale cast to the weights' dtype
            e = e * torch.tensor(self.embed_scale, dtype=w.dtype)
        if self.embed_mult != 1.0:
            e = e * self.embed_mult
        h = repair(e, prod if self.tp else "R", self.residual, self.tp)
        if self.positions is not None:  # learned positions of the rows the residual holds
            start = cache.start[held_rows(cache.rows, self.residual, self.tp)]
            h = h + F.embedding(positions(steps, start), self.positions)
        return h

    def _logits(self, h: torch.Tensor) -> torch.Tensor:
        (_, choice, need, prod), = self.walks["lm_head"]["steps"]
        x = norm_of(self.norm, h)
        y = linear(repair(x, self.residual, need, self.tp), self.head, self.head_bias, choice,
                   self.tp)
        y = repair(y, prod, "R", self.tp)
        y = y.wait() if hasattr(y, "wait") else y  # the step's output: collective done
        if self.logits_scaling != 1.0:
            y = y / self.logits_scaling
        if self.final_softcap:
            y = torch.tanh(y / self.final_softcap) * self.final_softcap
        return y

    def forward(self, ids: torch.Tensor | None, cache: KVCache, steps: torch.Tensor,
                upto: int, prefill: bool) -> torch.Tensor | None:
        """Run this rank's stage on token ids ``[rows, seq]`` (the first stage; later stages
        receive the hidden states) written at ``steps [seq]``; attention reads ``upto``
        cache slots. Returns the last position's logits ``[rows, 1, vocab]`` on the last
        stage, None elsewhere."""
        if self.first:
            h = self._embed(ids, cache, steps)
        else:
            rows = held_rows(cache.rows, self.residual, self.tp)
            h = torch.empty(rows.stop - rows.start, steps.shape[0], self.hidden,
                            dtype=self.dtype, device=self.device)
            dist.recv(h, src=self.prev, group=self.pp.pg)
        for i, layer in self.layers.items():
            kind = self.rope_type[i]
            tables = (lambda pos, k=kind: self.rope_tables(pos, k)) if self._tables else None
            h = layer(h, self.residual, cache, steps, upto, tables, prefill)
        if not self.last:
            dist.send(h.contiguous(), dst=self.next, group=self.pp.pg)
            return None
        return self._logits(h[:, -1:])
