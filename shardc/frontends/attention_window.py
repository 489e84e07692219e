"""Sliding-window attention read from the traced model: the window (tokens) of each decoder
layer, recorded as ``Node.attrs["attention_window"]`` on every node of the layer.

The traced graph alone cannot say it: a full-size model is traced at a few tokens, where a
4096-token window's mask equals the causal one (transformers then skips it), so sliding and
full layers trace to the same nodes. The window comes from the model the trace ran, by
transformers' conventions (no model names), per layer ``j`` (a module's layer is
:func:`shardc.frontends.torch_export.layer_of` of its path, as for nodes):

1. a module of layer ``j`` with its own ``sliding_window`` attribute (Gemma-2/3, Qwen2/3,
   GPT-OSS attention set it per layer: the config's window on sliding layers, None on full
   ones) decides: a positive int is the window, anything else full attention;
2. else the text config's per-layer ``layer_types[j]``: ``"sliding_attention"`` -> the
   config's ``sliding_window``, any other type full attention;
3. else the config's ``sliding_window`` for every layer (Mistral, Mixtral, Phi-3.5-MoE mask
   every layer with it when set), unless ``use_sliding_window`` is False.

Layers without a window get no attribute, so graphs of full-attention models are unchanged.
A model without a config and without such attributes (plain PyTorch, ONNX) is full
attention.
"""

from __future__ import annotations

from torch import nn

from shardc.ir.graph import Node

ATTR = "attention_window"


def _positive_int(value) -> int | None:
    return int(value) if isinstance(value, int) and not isinstance(value, bool) and value > 0 \
        else None


def _config_window(config, layer: int) -> int | None:
    """Rules 2 and 3 of the module docstring for ``layer``."""
    if config is None:
        return None
    window = _positive_int(getattr(config, "sliding_window", None))
    types = getattr(config, "layer_types", None)
    if isinstance(types, (list, tuple)) and layer < len(types):
        return window if types[layer] == "sliding_attention" else None
    if getattr(config, "use_sliding_window", None) is False:
        return None
    return window


def layer_windows(model: nn.Module, layers: set[int], layer_of) -> dict[int, int]:
    """Decoder layer -> sliding window (tokens) for the ``layers`` that have one (module
    docstring); ``layer_of`` maps a module path to its layer index (or None)."""
    config = getattr(model, "config", None)
    if config is not None and hasattr(config, "get_text_config"):
        config = config.get_text_config()
    own: dict[int, int | None] = {}
    for path, module in model.named_modules():
        if "sliding_window" not in vars(module):
            continue
        layer = layer_of(path)
        if layer is not None and layer not in own:
            own[layer] = _positive_int(vars(module)["sliding_window"])
    out = {}
    for layer in sorted(layers):
        window = own[layer] if layer in own else _config_window(config, layer)
        if window:
            out[layer] = window
    return out


def record_windows(nodes: list[Node], model: nn.Module, layer_of) -> None:
    """Set ``attrs["attention_window"]`` on every node of a sliding-window layer (in place)."""
    windows = layer_windows(model, {n.layer for n in nodes if n.layer is not None}, layer_of)
    for n in nodes:
        if n.layer in windows:
            n.attrs[ATTR] = windows[n.layer]
