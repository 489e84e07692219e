"""A tiny variant of an HF config: same architecture, same layer pattern, small shapes.

``shardc verify config.json`` runs a plan on a model built from :func:`tiny_config` (CPU,
float32, seeded weights). The tiny config is ``type(config)`` rebuilt from ``config.to_dict()``
with these fields changed (canonical names; a config's ``attribute_map`` spelling, e.g.
GPT-2's ``n_embd``, is followed), each only when the original has it (not None):

- widths: ``num_attention_heads`` / ``num_key_value_heads`` (MHA stays MHA with 4 heads,
  MQA keeps 1 KV head, GQA gets 2 KV heads with min(group, 4) heads each; heads rounded up to
  multiples of ``tp``), ``head_dim`` 16 (``hidden_size`` = heads x head_dim when the
  original derives head_dim that way, else 64), the :data:`INTERMEDIATE` sizes scaled with
  the hidden size, ``vocab_size`` 256; sizes are multiples of ``unit`` = lcm(8, tp, ep, dp);
- experts: ``n_routed_experts`` / ``num_experts`` / ``num_local_experts`` 8 (a multiple of
  ``ep`` and of the groups), top-k (``num_experts_per_tok``, ``experts_per_token``) at most
  2; group-limited routing (``n_group`` > 1) keeps 2 groups, ``topk_group`` 1 when it was
  below ``n_group``; ``n_shared_experts`` unchanged;
- MLA: ``kv_lora_rank`` 16, ``q_lora_rank`` 32 (None stays None; both multiples of ``unit``), ``qk_rope_head_dim`` /
  ``qk_nope_head_dim`` / ``v_head_dim`` 8 (``qk_head_dim`` their sum, ``head_dim`` the rope
  dim when it was);
- windows: ``sliding_window`` and ``attention_chunk_size`` at most 4 tokens, so that the
  windowed path is exercised by verify's 8-token sequences;
- RoPE: ``rope_parameters`` / ``rope_scaling`` dicts (nested ones too) keep their type and
  factors; ``short_factor`` / ``long_factor`` lists are resampled to rotary dim / 2 entries
  (rotary dim = head_dim x ``partial_rotary_factor``); ``query_pre_attn_scalar`` follows
  head_dim when it equalled it; token ids (bos/eos/pad) outside the tiny vocab become None;
- nested widths (:data:`NESTED`: DBRX's ``attn_config.kv_n_heads``, ``ffn_config``'s FFN
  width, experts, top-k and hidden size) are shrunk as their top-level names would be.
- a multimodal config's other towers (Gemma-3's vision config): :data:`TOWER`'s widths, one layer.

Layer pattern: each original layer has a signature (its modules' classes and parameter
shapes in a full-depth probe built on ``meta``, plus its entries in per-layer config lists
such as ``layer_types`` or ``no_rope_layers``). The tiny model keeps original layers
``kept`` -- the shortest prefix holding every distinct signature and at least
``max(2, pp)`` layers, so first_k_dense_replace=3 gives 4 layers (3 dense + 1 MoE) with the
field unchanged; when that prefix is longer than :data:`MAX_LAYERS`, the first layer of each
signature. Pattern fields are rewritten for ``kept``: per-layer lists (length
``num_hidden_layers``, e.g. ``layer_types``) are indexed by ``kept``; layer-index lists
(``mlp_only_layers``, ``moe_layers``) are renumbered; thresholds (:data:`THRESHOLDS`, e.g.
``first_k_dense_replace``, ``max_window_layers``) become the number of kept layers below them;
steps (``decoder_sparse_step``, ``interleave_moe_layer_step``) are unchanged. The tiny model is
then built on ``meta`` and its layers' signatures must equal the kept layers' (else
:class:`InputError`). ``kept`` is recorded on the result as ``shardc_source_layers`` (tiny
layer i plays original layer ``kept[i]``; verify maps the plan's layer kinds with it).
"""

from __future__ import annotations

import copy
import json
import math

import torch
from transformers import PretrainedConfig

from shardc.errors import InputError

MAX_LAYERS = 8  # longest prefix kept before falling back to one layer per signature
HEAD_DIM = 16
HIDDEN = 64  # when head_dim is not hidden / heads
VOCAB = 256
WINDOW = 4  # tokens (sliding_window, attention_chunk_size)
EXPERTS = 8
TOP_K = 2
INTERMEDIATE = ("intermediate_size", "moe_intermediate_size", "shared_expert_intermediate_size",
                "intermediate_size_mlp", "n_inner", "ffn_dim")
EXPERT_COUNTS = ("n_routed_experts", "num_experts", "num_local_experts")
TOP_KS = ("num_experts_per_tok", "experts_per_token")
THRESHOLDS = ("first_k_dense_replace", "max_window_layers")
TOKEN_IDS = ("bos_token_id", "eos_token_id", "pad_token_id", "decoder_start_token_id")
LAYER_SOURCE_KEY = "shardc_source_layers"
# widths a config keeps in a nested dict (DBRX's attn_config / ffn_config): canonical name ->
# (dict, field); read and shrunk like the top-level fields (``hidden_size`` copies d_model)
NESTED = {"num_key_value_heads": ("attn_config", "kv_n_heads"),
          "intermediate_size": ("ffn_config", "ffn_hidden_size"),
          "num_experts": ("ffn_config", "moe_num_experts"),
          "num_experts_per_tok": ("ffn_config", "moe_top_k"),
          "hidden_size": ("ffn_config", "hidden_size")}
NOT_PER_LAYER = (*TOKEN_IDS, "architectures", LAYER_SOURCE_KEY)  # lists that are no pattern


def _deg(degrees, name: str) -> int:
    if degrees is None:
        return 1
    v = degrees.get(name, 1) if isinstance(degrees, dict) else getattr(degrees, name, 1)
    return max(1, int(v or 1))


def _up(x: float, m: int) -> int:
    """``x`` rounded up to a positive multiple of ``m``."""
    return max(m, int(math.ceil(x / m)) * m)


_CACHE: dict[tuple, dict] = {}  # (class, config json, degrees) -> tiny config dict


def tiny_config(config: PretrainedConfig, degrees=None) -> PretrainedConfig:
    """A small config of ``config``'s class (see the module docstring) whose shapes the
    degrees divide. ``degrees``: a dict or :class:`~shardc.ir.strategy.Degrees` with
    ``tp`` / ``ep`` / ``pp`` / ``dp`` (missing ones are 1). Deterministic; a fresh object
    per call. Raises :class:`InputError` when the layer pattern cannot be kept."""
    degs = tuple(_deg(degrees, n) for n in ("tp", "ep", "pp", "dp"))
    key = (type(config).__name__, json.dumps(config.to_dict(), sort_keys=True, default=str), degs)
    if key not in _CACHE:
        _CACHE[key] = _derive_outer(config, degs)
    return type(config)(**copy.deepcopy(_CACHE[key]))


def _derive_outer(config: PretrainedConfig, degs: tuple) -> dict:
    """A multimodal config (e.g. ``llama4``, ``gemma3``) has its decoder in a text sub-config:
    that one is shrunk and put back; the other towers get :data:`TOWER`'s widths."""
    text = config.get_text_config()
    if text is config:
        return _derive(config, *degs)
    name = next((k for k in getattr(config, "sub_configs", {}) if getattr(config, k, None) is text),
                None)
    if name is None:
        raise InputError(f"{config.model_type}: cannot find the text model's config to shrink")
    tiny_text = _derive(text, *degs)
    outer = config.to_dict()
    for other in getattr(config, "sub_configs", {}):
        if other != name and isinstance(outer.get(other), dict):
            outer[other] = _tiny_tower(outer[other])
    return dict(outer, **{name: tiny_text, LAYER_SOURCE_KEY: tiny_text[LAYER_SOURCE_KEY]})


# a non-text tower (Gemma-3's SigLIP vision config): one narrow layer (its geometry -- image
# and patch size -- kept, since the projector's pooling is derived from it)
TOWER = {"num_hidden_layers": 1, "hidden_size": HIDDEN, "intermediate_size": 2 * HIDDEN,
         "num_attention_heads": 4}


def _tiny_tower(sub: dict) -> dict:
    """``sub`` (a vision / audio sub-config's dict) with :data:`TOWER`'s widths where it has
    those fields: verify never feeds it, but every tiny rank builds it."""
    return dict(sub, **{k: v for k, v in TOWER.items() if sub.get(k) is not None})


def _derive(config: PretrainedConfig, tp: int, ep: int, pp: int, dp: int) -> dict:
    """The tiny config's fields (``to_dict`` form) of a decoder config: widths, then the kept
    layers and the pattern fields rewritten for them, checked by building both on meta."""
    amap = dict(getattr(config, "attribute_map", {}) or {})
    src = config.to_dict()

    def key(name: str) -> str:
        return amap.get(name, name)

    nested = {n: (d, f) for n, (d, f) in NESTED.items()
              if isinstance(src.get(d), dict) and src[d].get(f) is not None}

    def get(name: str):
        if name in nested and key(name) not in src:
            d, f = nested[name]
            return src[d][f]
        return src.get(key(name))

    n_layers = get("num_hidden_layers")
    if n_layers is None:  # a property over the layer list (Nemotron-H's layers_block_type)
        n_layers = getattr(config, "num_hidden_layers", None)
    if not isinstance(n_layers, int) or n_layers < 1:
        raise InputError(f"{config.model_type}: config has no num_hidden_layers to shrink")
    widths = _tiny_widths(src, key, get, tp, ep, dp)
    for name, (d, f) in nested.items():  # back into their nested dicts (kept on top too
        if key(name) in widths:          # where the config mirrors them there)
            inner = widths.setdefault(d, dict(src[d]))
            inner[f] = widths[key(name)] if key(name) in src else widths.pop(key(name))
    probe = dict(src, **widths)
    signatures = _signatures(type(config), probe, n_layers)
    distinct = list(dict.fromkeys(signatures))
    first = [signatures.index(s) for s in distinct]
    min_layers = min(n_layers, max(2, pp))
    prefix = max(min_layers, max(first) + 1)
    if prefix <= MAX_LAYERS:
        kept = list(range(prefix))
    else:
        kept = sorted(set(first) | set(range(min_layers)))
    tiny = dict(probe, **_pattern(src, key, n_layers, kept))
    tiny[LAYER_SOURCE_KEY] = kept
    got = _signatures(type(config), tiny, len(kept))
    want = [signatures[i] for i in kept]
    if got != want:
        raise InputError(f"{config.model_type}: cannot derive a tiny variant that keeps the "
                         f"layer pattern (original layers {kept} do not come out the same)")
    return tiny


def _tiny_widths(src: dict, key, get, tp: int, ep: int, dp: int) -> dict:
    """The width fields of the tiny config (see the module docstring)."""
    unit = math.lcm(8, tp, ep, dp)
    out: dict = {}
    heads, kv = get("num_attention_heads"), get("num_key_value_heads")
    hidden, head_dim = get("hidden_size"), get("head_dim")
    new_heads = new_kv = None
    if isinstance(heads, int) and heads > 0:
        if kv is None or kv == heads:  # MHA (MLA models declare kv == heads)
            new_heads = new_kv = _up(4, tp)
        elif kv == 1:  # MQA
            new_heads, new_kv = _up(4, tp), 1
        else:  # GQA: a group of heads per KV head
            new_kv = _up(2, tp)
            new_heads = new_kv * min(heads // kv, 4)
        out[key("num_attention_heads")] = new_heads
        if kv is not None:
            out[key("num_key_value_heads")] = new_kv
    derived_hd = (head_dim is None or (isinstance(hidden, int) and isinstance(heads, int)
                                       and heads * head_dim == hidden))
    new_hd = HEAD_DIM
    if get("kv_lora_rank") is not None:  # MLA
        rope = 8
        out.update({key("kv_lora_rank"): _up(16, unit), key("qk_rope_head_dim"): rope,
                    key("qk_nope_head_dim"): 8, key("v_head_dim"): 8})
        if get("q_lora_rank") is not None:
            out[key("q_lora_rank")] = _up(32, unit)
        if get("qk_head_dim") is not None:
            out[key("qk_head_dim")] = 16
        if head_dim is not None and head_dim == get("qk_rope_head_dim"):
            new_hd, derived_hd = rope, False
    if isinstance(hidden, int):
        new_hidden = new_heads * new_hd if derived_hd and new_heads else _up(HIDDEN, unit)
        out[key("hidden_size")] = new_hidden
        if head_dim is not None:
            out[key("head_dim")] = new_hd
        for name in INTERMEDIATE:
            v = get(name)
            if isinstance(v, int) and v > 0:
                out[key(name)] = _up(v * new_hidden / hidden, unit)
    if get("query_pre_attn_scalar") is not None and get("query_pre_attn_scalar") == head_dim:
        out[key("query_pre_attn_scalar")] = new_hd
    if isinstance(get("vocab_size"), int):
        out[key("vocab_size")] = _up(VOCAB, unit)
        for name in TOKEN_IDS:
            ids = get(name)
            if ids is not None and max(ids if isinstance(ids, list) else [ids]) >= out[key("vocab_size")]:
                out[key(name)] = None
    out.update(_tiny_experts(get, key, ep))
    for name in ("sliding_window", "attention_chunk_size"):
        v = get(name)
        if isinstance(v, int) and v > WINDOW:
            out[key(name)] = WINDOW
    rope = get("rope_parameters") or get("rope_scaling") or {}
    rotary = new_hd * float(get("partial_rotary_factor") or rope.get("partial_rotary_factor") or 1.0)
    if get("kv_lora_rank") is not None:
        rotary = out[key("qk_rope_head_dim")]
    for name in ("rope_parameters", "rope_scaling"):
        if isinstance(get(name), dict):
            out[key(name)] = _tiny_rope(get(name), int(rotary) // 2)
    return out


def _tiny_experts(get, key, ep: int) -> dict:
    out: dict = {}
    groups = get("n_group")
    new_groups = 2 if isinstance(groups, int) and groups > 1 else groups
    count = _up(EXPERTS, math.lcm(ep, new_groups or 1))
    has_experts = False
    for name in EXPERT_COUNTS:
        v = get(name)
        if isinstance(v, int) and v > 0:
            out[key(name)] = count
            has_experts = True
    if not has_experts:
        return out
    for name in TOP_KS:
        v = get(name)
        if isinstance(v, int) and v > 0:
            out[key(name)] = min(v, TOP_K)
    if new_groups != groups:
        out[key("n_group")] = new_groups
        tg = get("topk_group")
        if isinstance(tg, int):
            out[key("topk_group")] = 1 if tg < groups else new_groups
    return out


def _resample(values: list, n: int) -> list:
    """``n`` entries of ``values`` at evenly spaced positions (first and last kept)."""
    if n <= 1 or len(values) <= 1:
        return list(values[:1]) * max(n, 0)
    return [values[round(i * (len(values) - 1) / (n - 1))] for i in range(n)]


def _tiny_rope(rope: dict, half_rotary: int) -> dict:
    """``rope`` with per-frequency factor lists resampled to ``half_rotary`` entries (nested
    dicts, e.g. one per layer type, too)."""
    out = {}
    for k, v in rope.items():
        if isinstance(v, dict):
            out[k] = _tiny_rope(v, half_rotary)
        elif k in ("short_factor", "long_factor") and isinstance(v, list):
            out[k] = _resample(v, half_rotary)
        else:
            out[k] = v
    return out


def _is_index_list(v, n_layers: int, name: str) -> bool:
    """Whether field ``name`` = ``v`` lists layer indices (``mlp_only_layers``, ``moe_layers``)
    rather than one entry per layer."""
    return (name.endswith("layers") and isinstance(v, list) and all(isinstance(i, int) and not isinstance(i, bool) for i in v)
            and v == sorted(set(v)) and all(0 <= i < n_layers for i in v)
            and (len(v) < n_layers or v == list(range(n_layers))))


def _pattern(src: dict, key, n_layers: int, kept: list[int]) -> dict:
    """The layer-pattern fields of the tiny config for original layers ``kept``."""
    out: dict = {key("num_hidden_layers"): len(kept)}
    pos = {j: t for t, j in enumerate(kept)}
    for name, v in src.items():
        if not isinstance(v, list) or name in NOT_PER_LAYER:
            continue
        if _is_index_list(v, n_layers, name):
            out[name] = [pos[j] for j in v if j in pos]
        elif len(v) == n_layers:
            out[name] = [v[j] for j in kept]
    for name in THRESHOLDS:
        v = src.get(key(name))
        if isinstance(v, int):
            out[key(name)] = sum(1 for j in kept if j < v)
    return out


def _layer_list(model: torch.nn.Module, n_layers: int) -> torch.nn.ModuleList:
    for m in model.modules():
        if isinstance(m, torch.nn.ModuleList) and len(m) == n_layers:
            return m
    raise InputError(f"{type(model).__name__}: no list of {n_layers} decoder layers found")


def _signatures(cls: type, fields: dict, n_layers: int) -> list[tuple]:
    """Per layer: (module classes + parameter shapes, per-layer config entries), from a
    model built on ``meta`` from ``fields``."""
    from transformers import AutoModelForCausalLM

    config = cls(**fields)
    try:  # structure only: eager attention (every family has it), no weights
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    except Exception as e:
        msg = str(e).strip().splitlines()[0] if str(e).strip() else ""
        raise InputError(f"{config.model_type}: the tiny variant does not build: "
                         f"{type(e).__name__}: {msg}") from e
    layers = _layer_list(model, n_layers)
    per_layer = {k: v for k, v in fields.items()
                 if isinstance(v, list) and len(v) == n_layers and k not in NOT_PER_LAYER
                 and not _is_index_list(v, n_layers, k)}
    out = []
    for i, layer in enumerate(layers):
        structure = tuple((name, type(m).__name__) for name, m in layer.named_modules()) + \
            tuple((name, tuple(p.shape)) for name, p in layer.named_parameters())
        entries = tuple((k, json.dumps(v[i], default=str)) for k, v in sorted(per_layer.items()))
        out.append((structure, entries))
    return out
