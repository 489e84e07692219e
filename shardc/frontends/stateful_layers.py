"""Layers whose state does not grow with context -- linear attention (Gated DeltaNet,
lightning attention) and state-space layers (Mamba / Mamba-2).

They are found from the model, not from a list of names: a decoder layer holding a
``torch.nn.Conv1d`` (the causal depthwise convolution of Gated DeltaNet and Mamba), or one
the config's ``layer_types`` calls anything but an attention or FFN-only layer
(transformers spells Mamba layers ``linear_attention`` too).

A layer is *modelled* when its recurrent module's forward calls one of the kernel functions
:mod:`shardc.frontends.recurrent_kernels` traces as one node (Gated DeltaNet's chunked delta
rule: Qwen3-Next; Mamba's selective scan: Jamba; Mamba-2's chunked SSD scan: Nemotron-H, Bamba)
and the layer holds no attention beside it; the cost model then prices it with its own op
kinds (``causal_conv``, ``recurrent_scan``: a constant per-sequence state, no KV cache).
Every other such layer (Falcon-H1's Mamba-2 mixer in parallel with attention in one layer,
lightning attention: MiniMax) is refused by name (:class:`InputError`, exit 2) by every command,
before a trace could price it as attention; after the trace,
:func:`check_traced_recurrent_layers` proves that every layer found here did become a
``recurrent_scan`` node.
"""

from __future__ import annotations

import re

from shardc.errors import InputError

ATTENTION_TYPES = ("full_attention", "sliding_attention", "chunked_attention", "attention")
FFN_TYPES = ("mlp", "moe", "dense", "sparse", "ffn")  # Nemotron-H lists its FFN-only layers too
_LAYER = re.compile(r"(?:^|\.)(?:layers|h|blocks)\.(\d+)\.")


def layer_index(path: str) -> int | None:
    """The decoder-layer index of module ``path`` itself (``model.layers.3``), else None."""
    m = re.search(r"(?:^|\.)(?:layers|h|blocks)\.(\d+)$", path)
    return int(m.group(1)) if m else None


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


def _modelled(owner) -> bool:
    """Whether ``owner``'s forward calls a scan the frontend traces as one node (a shared
    conv kernel alone is not enough: Mamba-2 mixers call it and scan otherwise)."""
    import inspect

    from shardc.frontends.recurrent_kernels import TRACED_SCANS

    try:
        src = inspect.getsource(inspect.unwrap(type(owner).forward))
    except (OSError, TypeError):
        return False
    return any(f"{name}(" in src for name in TRACED_SCANS)


def modelled_layers(model) -> set[int]:
    """Decoder-layer indices whose recurrent module the cost model represents: its scan
    traces as one node and the layer holds no attention module beside it (a layer has one
    core: Falcon-H1's attention running in parallel with its Mamba-2 mixer is not modelled)."""
    from torch import nn

    out: set[int] = set()
    modules = dict(model.named_modules())
    with_attention = _layers_with_attention(modules)
    for path, mod in modules.items():
        if not isinstance(mod, nn.Conv1d) or "." not in path:
            continue
        m = _LAYER.search(path + ".")
        owner = modules.get(path.rsplit(".", 1)[0])
        if m is not None and owner is not None and _modelled(owner) \
                and int(m.group(1)) not in with_attention:
            out.add(int(m.group(1)))
    return out


def _layers_with_attention(modules: dict) -> set[int]:
    """Decoder-layer indices holding a module whose class name ends in ``Attention``."""
    return {int(m.group(1)) for path, mod in modules.items()
            if type(mod).__name__.endswith("Attention")
            and (m := _LAYER.search(path + ".")) is not None}


def _layer_list(layers: list[int], shown: int = 6) -> str:
    head = ", ".join(str(i) for i in layers[:shown])
    return head + (", ..." if len(layers) > shown else "")


def refuse_stateful_layers(model, where: str) -> None:
    """:class:`InputError` (one line) naming the recurrent layers of ``model`` the cost model
    does not represent, if any."""
    found = stateful_layers(model)
    if found:
        done = modelled_layers(model)
        found = {i: kind for i, kind in found.items() if i not in done}
    if not found:
        return
    config = getattr(model, "config", None)
    family = str(getattr(config, "model_type", "") or type(model).__name__)
    total = getattr(getattr(config, "get_text_config", lambda: config)(), "num_hidden_layers",
                    None)
    layers = sorted(found)
    kinds = sorted(set(found.values()))
    of = f" of {total}" if isinstance(total, int) else ""
    beside = ", beside attention in the same layer (two cores)" \
        if set(layers) <= _layers_with_attention(dict(model.named_modules())) else ""
    raise InputError(
        f"{where}: {family}: {len(layers)}{of} layers ({_layer_list(layers)}) are linear "
        f"attention / state-space layers ({', '.join(kinds)}): a recurrent state that does not "
        f"grow with context{beside}, which shardc does not model yet (it will not price them "
        "as attention with a KV cache) -- not supported")


def check_traced_recurrent_layers(model, graph, where: str) -> None:
    """:class:`InputError` when a layer :func:`modelled_layers` counts on traced without
    its ``recurrent_scan`` node (the model called another kernel): it would be mispriced."""
    expected = set(modelled_layers(model))
    if not expected:
        return
    traced = {n.layer for n in graph.nodes if n.op == "recurrent_scan"}
    missing = sorted(expected - traced)
    if missing:
        raise InputError(
            f"{where}: layers {_layer_list(missing)} hold a recurrent layer whose scan did not "
            "trace as one recurrent_scan node; shardc would misprice it -- not supported")
