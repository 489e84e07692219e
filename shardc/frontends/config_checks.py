"""Shape fields of an HF config.json checked before anything is built.

Every field that sizes a tensor or a loop (layers, heads, KV heads, experts, top-k,
positions, widths) must be a plain JSON integer inside its bounds, and the fields must agree
(KV heads divide the heads, top-k is at most the experts); otherwise :class:`InputError`
names the field, its value and what is expected -- instead of a ZeroDivisionError, a NaN, a
torch.export broadcast error or an hour of building 100000 layers. A field that is absent or
``null`` is left to HF's default. The fields of a multimodal config's ``text_config`` are
checked the same way.
"""

from __future__ import annotations

from shardc.errors import InputError
from shardc.validate import MAX_TOKENS

MAX_LAYERS = 1024  # decoder layers (the largest published models have ~130)
MAX_WIDTH = 1 << 20  # hidden / intermediate sizes (elements)
MAX_HEADS = 1 << 16  # attention heads, experts, head dims
MAX_VOCAB = 1 << 24  # tokens

# (names (aliases across families), minimum, maximum, unit)
SHAPE_FIELDS = (
    (("num_hidden_layers", "n_layer", "num_layers"), 1, MAX_LAYERS, "decoder layers"),
    (("hidden_size", "n_embd", "d_model"), 1, MAX_WIDTH, "elements"),
    (("num_attention_heads", "n_head"), 1, MAX_HEADS, "heads"),
    (("num_key_value_heads",), 1, MAX_HEADS, "heads"),
    (("head_dim",), 1, MAX_HEADS, "elements"),
    (("intermediate_size", "n_inner", "intermediate_size_mlp", "moe_intermediate_size",
      "ffn_dim"), 1, MAX_WIDTH, "elements"),
    (("num_local_experts", "num_experts", "n_routed_experts"), 1, MAX_HEADS, "experts"),
    (("num_experts_per_tok", "experts_per_token", "moe_topk"), 1, MAX_HEADS, "experts"),
    (("n_shared_experts",), 0, MAX_HEADS, "experts"),
    (("max_position_embeddings", "n_positions", "n_ctx"), 1, MAX_TOKENS, "tokens"),
    (("vocab_size",), 1, MAX_VOCAB, "tokens"),
    (("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"),
     1, MAX_WIDTH, "elements"),
)


def _field(section: dict, name: str, lo: int, hi: int, unit: str, where: str):
    v = section.get(name)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
        shown = repr(v) if not isinstance(v, (dict, list)) else type(v).__name__
        shown = shown if len(shown) <= 30 else shown[:27] + "..."
        kind = "a positive integer" if lo == 1 else f"an integer >= {lo}"
        raise InputError(f"{where}: {name} = {shown}: expected {kind} <= {hi:,} ({unit})")
    return v


def check_shape_fields(data: dict, where: str) -> None:
    """InputError naming the first bad shape field of ``data`` (a config.json dict) or of
    its ``text_config``; see the module docstring."""
    sections = [(data, where)]
    if isinstance(data.get("text_config"), dict):
        sections.append((data["text_config"], f"{where}: text_config"))
    for section, at in sections:
        values: dict[str, int | None] = {}
        for names, lo, hi, unit in SHAPE_FIELDS:
            for name in names:
                values[name] = _field(section, name, lo, hi, unit, at)
        heads = values["num_attention_heads"] or values["n_head"]
        kv = values["num_key_value_heads"]
        if heads and kv and heads % kv:
            raise InputError(f"{at}: num_key_value_heads = {kv}: expected a divisor of "
                             f"num_attention_heads = {heads}")
        hidden = values["hidden_size"] or values["n_embd"]
        mla = values["kv_lora_rank"] is not None
        if heads and hidden and not values["head_dim"] and not mla and hidden < heads:
            raise InputError(f"{at}: hidden_size = {hidden} is smaller than "
                             f"num_attention_heads = {heads} (head_dim would be 0)")
        experts = next((values[n] for n in SHAPE_FIELDS[6][0] if values[n]), None)
        for name in SHAPE_FIELDS[7][0]:
            k = values[name]
            if k and experts and k > experts:
                raise InputError(f"{at}: {name} = {k}: expected at most the {experts} experts")
