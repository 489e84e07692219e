"""Linear-attention / Mamba cores (``attn_core`` with ``attrs["recurrent"]``): what they hold.

A recurrent core (Gated DeltaNet, Mamba; :func:`shardc.passes.layers` builds it from the
``causal_conv`` and ``recurrent_scan`` nodes) keeps no KV cache: per sequence it holds a
constant state, ``attrs["state_elems_per_sequence"]`` = recurrent state (Gated DeltaNet:
value heads x key dim x value dim; Mamba: channels x state size) + conv state (conv channels
x (kernel - 1)), per layer, whatever the context. It is split with the heads under a heads
split and with the sequences under a batch split, exactly as a KV cache is. The state is
held in the model's activation dtype (vLLM's ``--mamba-cache-dtype auto``), not in the KV
cache format (an fp8 KV cache does not make it fp8).
"""

from __future__ import annotations


def is_recurrent(attrs: dict | None) -> bool:
    """Whether an ``attn_core``'s attrs describe a recurrent (linear-attention / Mamba) core."""
    return bool((attrs or {}).get("recurrent"))


def state_elems_per_sequence(attrs: dict | None) -> int:
    """Recurrent + conv state elements one sequence holds in one such layer (0 otherwise)."""
    a = attrs or {}
    return int(a.get("state_elems_per_sequence", 0) or 0) if is_recurrent(a) else 0
