"""Sliding-window attention arithmetic: how many positions a windowed attention core reads.

A sliding-window layer with window ``W`` (tokens; transformers' mask: a query sees the keys
less than ``W`` positions back, itself included) attends to ``min(position, W)`` keys at a
1-based query position and holds at most ``W`` positions of each sequence's KV cache. The
window is ``attn_core.attrs["window"]`` (:class:`shardc.ir.graph.FusedOp`); absent or None
means full causal attention. Every function takes scalars or numpy arrays.
"""

from __future__ import annotations

import numpy as np


def op_window(attrs: dict) -> int | None:
    """The sliding window (tokens) recorded in an ``attn_core``'s attrs, None for full
    attention (absent, None or not positive)."""
    w = attrs.get("window")
    return int(w) if isinstance(w, (int, float)) and not isinstance(w, bool) and w > 0 else None


def attended_positions(context, window: int | None):
    """Positions a query at 1-based position ``context`` attends to (= cached positions a
    decode step reads and a sequence's KV cache holds): ``min(context, window)``."""
    return context if window is None else np.minimum(context, window)


def causal_pairs(prompt, window: int | None):
    """(query, key) pairs of causal attention over a prompt of ``prompt`` tokens, banded
    to ``window``: ``sum_{i=1..prompt} min(i, window)`` -- ``prompt (prompt + 1) / 2``
    without a window, ``m (m + 1) / 2 + (prompt - m) * window`` with ``m = min(prompt,
    window)``."""
    if window is None:
        return prompt * (prompt + 1) / 2
    m = np.minimum(prompt, window)
    return m * (m + 1) / 2 + (prompt - m) * window


def attention_variant(kind) -> dict:
    """plan.json ``layer_kinds[]`` fields saying how a layer kind attends
    (:class:`shardc.ir.graph.LayerKind`): ``{"attention": "sliding_window", "window": W}``
    (tokens), ``{"attention": "full"}`` (full causal), ``{}`` for a kind without an
    attention core. A linear-attention / Mamba core (:mod:`shardc.ir.recurrent`):
    ``{"attention": "gated_deltanet" | "mamba" | "mamba2", "recurrent_state": {...}}`` with its state
    elements per sequence and layer (recurrent, conv, total; all heads, split with them)."""
    core = kind.op("attn_core")
    if core is None:
        return {}
    a = core.attrs
    if a.get("recurrent"):
        return {"attention": str(a["recurrent"]), "recurrent_state": {
            "recurrent_elems_per_sequence": int(a.get("recurrent_state_elems", 0)),
            "conv_elems_per_sequence": int(a.get("conv_state_elems", 0)),
            "elems_per_sequence": int(a.get("state_elems_per_sequence", 0)),
            "split": "heads", "heads": int(a.get("heads", 0)),
            "key_heads": int(a.get("kv_heads", 0))}}
    window = op_window(core.attrs)
    return {"attention": "full"} if window is None else \
        {"attention": "sliding_window", "window": int(window)}


def variant_text(row: dict) -> str:
    """A ``layer_kinds[]`` row's attention in words ("" when it has none)."""
    if row.get("attention") == "sliding_window":
        return f"sliding-window attention, window {int(row['window']):,} tokens"
    if row.get("attention") == "full":
        return "full causal attention"
    state = row.get("recurrent_state")
    if isinstance(state, dict):
        name = {"gated_deltanet": "Gated DeltaNet linear attention",
                "mamba": "Mamba state-space layer",
                "mamba2": "Mamba-2 state-space layer"}.get(row.get("attention"), "recurrent layer")
        return (f"{name}: a constant state of {int(state['elems_per_sequence']):,} elements "
                "per sequence, no KV cache")
    return ""
