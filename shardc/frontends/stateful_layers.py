"""Layers whose state does not grow with context -- linear attention (Gated DeltaNet,
lightning attention) and state-space layers (Mamba / Mamba-2) -- which the cost model does
not represent yet.

Pricing them as attention would be silently wrong (a KV cache growing with context where
the layer keeps a constant recurrent + conv state), so every command refuses such a model by
name (:class:`InputError`, exit 2). They are found from the model, not from a list of names:
a decoder layer holding a ``torch.nn.Conv1d`` (the causal depthwise convolution of Gated
DeltaNet and Mamba), or one the config's ``layer_types`` calls anything but an attention or
FFN-only layer (transformers spells Mamba layers ``linear_attention`` too).
"""

from __future__ import annotations

import re

from shardc.errors import InputError

ATTENTION_TYPES = ("full_attention", "sliding_attention", "chunked_attention", "attention")
FFN_TYPES = ("mlp", "moe", "dense", "sparse", "ffn")  # Nemotron-H lists its FFN-only layers too
_LAYER = re.compile(r"(?:^|\.)(?:layers|h|blocks)\.(\d+)\.")


def stateful_layers(model) -> dict[int, str]:
    """Decoder-layer index -> the class (or config layer type) of its recurrent part."""
    from torch import nn

    found: dict[int, str] = {}
    modules = dict(model.named_modules())
    for path, mod in modules.items():
        if not isinstance(mod, nn.Conv1d):
            continue
        m = _LAYER.search(path + ".")
        if m is None:
            continue
        owner = modules.get(path.rsplit(".", 1)[0]) if "." in path else None
        found.setdefault(int(m.group(1)), type(owner or mod).__name__)
    config = getattr(model, "config", None)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    types = getattr(text, "layer_types", None)
    if isinstance(types, (list, tuple)):
        for i, t in enumerate(types):
            if isinstance(t, str) and t not in ATTENTION_TYPES + FFN_TYPES:
                found.setdefault(i, t)
    return found


def _layer_list(layers: list[int], shown: int = 6) -> str:
    head = ", ".join(str(i) for i in layers[:shown])
    return head + (", ..." if len(layers) > shown else "")


def refuse_stateful_layers(model, where: str) -> None:
    """:class:`InputError` (one line) naming the recurrent layers of ``model``, if any."""
    found = stateful_layers(model)
    if not found:
        return
    config = getattr(model, "config", None)
    family = str(getattr(config, "model_type", "") or type(model).__name__)
    total = getattr(getattr(config, "get_text_config", lambda: config)(), "num_hidden_layers",
                    None)
    layers = sorted(found)
    kinds = sorted(set(found.values()))
    of = f" of {total}" if isinstance(total, int) else ""
    raise InputError(
        f"{where}: {family}: {len(layers)}{of} layers ({_layer_list(layers)}) are linear "
        f"attention / state-space layers ({', '.join(kinds)}): a recurrent state that does not "
        "grow with context, which shardc does not model yet (it will not price them as "
        "attention with a KV cache) -- not supported")
