"""The torch-style plan's entries for an attention (or Mamba-2) core split by heads, beyond
the column-parallel projections (:mod:`shardc.backends.torch_styles` calls them while it
walks a layer kind's attention branch): GQA's KV heads repeated over ``tp / kv_heads``
ranks (``kv_repeat=`` on the k / v projections, ``GroupedKVAttention``), per-head vectors cut
to this rank's heads (GPT-OSS's sinks: ``HeadSlices``), the head-count attributes of a
packed q|k|v module (``HeadParallelAttention``), whole-projection q/k norms
(``FullWidthNormParallel``) and a Mamba-2 mixer's conv parts, per-head vectors and gated
norm (``Mamba2HeadsParallel``). Module and parameter names enter the code as literals."""

from __future__ import annotations

from typing import TYPE_CHECKING

from shardc.backends.emit_text import _literal
from shardc.backends.layer_modules import LayerModules, full_width_qk_norms
from shardc.backends.style_entry import Entry, NotCovered

if TYPE_CHECKING:
    from shardc.backends.torch_styles import KindPlan


def head_vectors(kp: KindPlan, lm: LayerModules, attn: str) -> None:
    """A heads split of an attention module holding per-head vectors (GPT-OSS's sinks: the
    ``attn_core`` params rows on the module itself): ``HeadSlices`` cuts them to this
    rank's heads, wrapping the module's other style (one style per module). Names enter
    the code as literals."""
    names = tuple(n for m, n, r in lm.params_of("attn_core")
                  if m == attn and len(r["shape"]) == 1 and r.get("split_dims", [None])[0] == 0)
    if not names:
        return
    note = f"attn_core heads: {', '.join(names)} cut to this rank's heads"
    prep = next((e for e in kp.entries if e.suffix == attn), None)
    if prep is None:
        kp.entries.append(Entry(attn, f"HeadSlices({_literal(names)})", note))
    else:
        prep.style = f"HeadSlices({_literal(names)}, {prep.style})"
        prep.comment += "; " + note


def kv_modules(kp: KindPlan, lm: LayerModules) -> dict[str, int]:
    """k / v projections of GQA attention whose KV heads are replicated (heads split at
    tp > kv_heads): module suffix -> head_dim. They are the separate (unpacked) qkv
    projections narrower than the query projection, whose width is ``heads x head_dim``."""
    if kp.kv_replicas == 1:
        return {}
    rows = {m: lm.weight_of(m) for m in lm.ops.get("qkv", [])}
    if any(r is None or r.get("parts") or len(r["shape"]) != 2 for r in rows.values()):
        raise NotCovered(f"{kp.kind}: KV heads replicated (tp > kv_heads) with packed or "
                         "non-linear q|k|v projections")
    widths = {m: int(r["shape"][int((r.get("split_dims") or (0, 1))[0])])
              for m, r in rows.items()}
    widest = max(widths.values())
    if not kp.heads or widest % kp.heads:
        raise NotCovered(f"{kp.kind}: KV heads replicated, but the query heads are unknown")
    head_dim = widest // kp.heads
    return {m: head_dim for m, w in widths.items() if w < widest}


def kv_repeat(code: str | None, head_dim: int | None, copies: int) -> str | None:
    """``code`` of a k / v projection with ``kv_repeat=(head_dim, copies)`` added (integers):
    the heads are repeated before the split (col: the weight; row: the partial sums; rep:
    the output), so each rank gets the one KV head its query heads read."""
    if code is None or head_dim is None:
        return code
    if code.startswith("ColwiseParallel("):
        code = "WeightColwiseParallel(out_dim=0" + (", " if code[16:-1] else "") + code[16:]
    elif code.startswith("RowwiseParallel("):
        code = "WeightRowwiseParallel(in_dim=1" + (", " if code[16:-1] else "") + code[16:]
    return f"{code[:-1]}, kv_repeat=({int(head_dim)}, {int(copies)}))"


def heads_split(kp: KindPlan, lm: LayerModules, attn: str) -> None:
    """What a heads split needs beyond the column-parallel projections: an attention module
    whose q|k|v come packed in one weight sizes its head views from attributes
    (``HeadParallelAttention``); q/k norms over the whole projection (OLMoE) see this rank's
    heads (``FullWidthNormParallel``: one ``[tokens, 1]`` all-reduce each)."""
    prep = next((e for e in kp.entries if e.suffix == attn), None)
    if kp.recurrent is not None:
        recurrentheads_split(kp, lm, attn, prep)
        return
    if prep is not None and prep.style.startswith("CoreRowsAttention("):
        if any(r.get("parts") for _, _, r in lm.params_of("qkv")):
            prep.style = prep.style[:-1] + ", heads_split=True)"
        if kp.kv_replicas > 1:
            prep.style = prep.style[:-1] + f", kv_replicas={kp.kv_replicas})"
        prep.comment += "; heads split"
        for mod in full_width_qk_norms(lm, attn):
            kp.entries.append(Entry(mod, "FullWidthNormParallel()",
                                    "norm over all heads: all_reduce of the sum of squares"))
        return
    if any(r.get("parts") for _, _, r in lm.params_of("qkv")):
        note = "attn_core heads: the module's head counts / tp"
        prep = next((e for e in kp.entries if e.suffix == attn), None)
        if prep is None:
            kp.entries.append(Entry(attn, "HeadParallelAttention()", note))
        else:  # one style per module: the heads split also moves the input
            prep.style = prep.style.replace("PrepareHiddenStates(", "HeadParallelAttention(")
            prep.comment += "; " + note
    if kp.kv_replicas > 1:
        note = f"attn_core heads: each KV head on {kp.kv_replicas} ranks"
        prep = next((e for e in kp.entries if e.suffix == attn), None)
        if prep is None:
            kp.entries.append(Entry(attn, f"GroupedKVAttention(kv_replicas={kp.kv_replicas})",
                                    note))
        elif prep.style.startswith("PrepareHiddenStates("):
            prep.style = (f"GroupedKVAttention(kv_replicas={kp.kv_replicas}, "
                          + prep.style[len("PrepareHiddenStates("):])
            prep.comment += "; " + note
        else:
            raise NotCovered(f"{kp.kind}: KV heads replicated with {prep.style}")
    for mod in full_width_qk_norms(lm, attn):
        kp.entries.append(Entry(mod, "FullWidthNormParallel()",
                                "norm over all heads: all_reduce of the sum of squares"))


def mamba2_core(lm: LayerModules) -> str | None:
    """``"mamba2"`` when the layer's ``attn_core`` params rows are a Mamba-2 mixer's (its
    ``A_log`` and a conv weight packing ``x | B | C``): a plan whose ``layer_kinds`` rows
    do not name the variant (``shardc verify``'s scaled plan)."""
    names = {n for _, n, _ in lm.params_of("attn_core")}
    conv = [r for _, n, r in lm.params_of("attn_core")
            if n == "weight" and len(r.get("parts") or ()) == 3 and len(r["shape"]) == 3]
    return "mamba2" if {"A_log", "dt_bias", "D"} <= names and conv else None


def recurrentheads_split(kp: KindPlan, lm: LayerModules, attn: str, prep) -> None:
    """A heads split of a recurrent core: a Mamba-2 mixer's conv (cut per ``x | B | C``
    part, widths from its params row), per-head vectors and gated norm placed by heads
    (``Mamba2HeadsParallel``; merged with the input move of a ``PrepareHiddenStates``)."""
    if kp.recurrent != "mamba2":
        raise NotCovered(f"{kp.kind}: a heads split of a {kp.recurrent} core")
    conv = [r for m, n, r in lm.params_of("attn_core") if n == "weight" and r.get("parts")]
    if len(conv) != 1:
        raise NotCovered(f"{kp.kind}: a Mamba-2 core without one packed conv weight")
    parts = tuple(int(w) for w in conv[0]["parts"])
    note = "attn_core heads: conv per x|B|C part, A_log / D / dt_bias / gated norm by heads"
    if prep is None:
        kp.entries.append(Entry(attn, f"Mamba2HeadsParallel(conv_parts={parts!r})", note))
    elif prep.style.startswith("PrepareHiddenStates("):
        prep.style = f"Mamba2HeadsParallel(conv_parts={parts!r}, " + \
            prep.style[len("PrepareHiddenStates("):]
        prep.comment += "; " + note
    elif prep.style.startswith("CoreRowsAttention("):  # applied first, by the Mamba-2 style
        prep.style = f"Mamba2HeadsParallel(conv_parts={parts!r}, rows={prep.style})"
        prep.comment += "; " + note
    else:
        raise NotCovered(f"{kp.kind}: a Mamba-2 heads split with {prep.style.split('(')[0]}")
