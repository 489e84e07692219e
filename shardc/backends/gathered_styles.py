"""The experts entry of a layer whose experts are split ``moe_tp x moe_ep`` other than
(tp, ep) (:class:`shardc.ir.strategy.Degrees`): one
:class:`~shardc.runtime.gathered_experts.GatheredExperts` style on the sparse-MoE block
(the experts' parent module), applied on the ep x tp mesh -- the all-gather dispatch the
cost model charges (:func:`shardc.cost.moe_dispatch.gather_exchange`). Covered: all-TP
(``moe_tp = tp x ep``), all-EP (``moe_ep = tp x ep``) and mixed (both > 1, on the experts
mesh ``(moe_ep, moe_tp)``) splits of HF stacked experts
(``[E, out, in]``, one weight per matmul, expert dim 0; or DBRX's fused ``[E * f, h]`` ones
at their ``[E, f, h]`` views), column / row experts and a
replicated router, shared experts beside them run on the rank's own rows (else
:class:`~shardc.backends.style_entry.NotCovered`)."""

from __future__ import annotations

from shardc.backends.emit_text import _literal
from shardc.backends.runtime_walks import gather_split
from shardc.backends.style_entry import Entry, NotCovered
from shardc.ir.contract import CHOICE_NAMES


def gathered_entry(kind: str, lm, choice, deg):
    """The :class:`~shardc.backends.style_entry.Entry` of a re-split layer ``lm`` (its
    :class:`~shardc.backends.layer_modules.LayerModules`); ``choice(op)`` the op's choice
    index."""
    split = gather_split(deg)
    names = tuple(CHOICE_NAMES[op][choice(op)] for op in ("expert_ffn1", "expert_ffn2"))
    if names != ("col", "row") or CHOICE_NAMES["router"][choice("router")] != "rep":
        raise NotCovered(f"{kind}: re-split experts {'/'.join(names)} (covered: col/row "
                         "experts after a replicated router)")
    if "ffn1" in lm.ops:
        raise NotCovered(f"{kind}: re-split experts beside a dense MLP")
    mods = lm.ops["expert_ffn1"] + [m for m in lm.ops.get("expert_ffn2", [])
                                    if m not in lm.ops["expert_ffn1"]]
    first = [(n, r) for _, n, r in lm.params_of("expert_ffn1") if len(r["shape"]) == 3]
    second = [(n, r) for _, n, r in lm.params_of("expert_ffn2") if len(r["shape"]) == 3]
    if len(mods) == 1 and len(first) == 2 and len(second) == 1:
        return _fused_entry(kind, lm, mods[0], first + second, deg, split)
    if len(mods) != 1 or "." not in mods[0] or len(first) != 1 or len(second) != 1 or \
            len(lm.params_of("expert_ffn1")) + len(lm.params_of("expert_ffn2")) != 2:
        raise NotCovered(f"{kind}: experts in {mods}: one stacked weight per expert matmul "
                         "under a sparse-MoE block, no biases, is covered")
    (n1, r1), (n2, r2) = first[0], second[0]
    if r1.get("expert_dim") != 0 or r2.get("expert_dim") != 0 or \
            [r1["split_dims"], r2["split_dims"]] != [[1, 2], [1, 2]]:
        raise NotCovered(f"{kind}: re-split experts stored other than HF's [E, out, in]")
    parts = tuple(int(w) for w in r1.get("parts", ()))
    if parts and len(set(parts)) == 1:
        parts = (len(parts),)
    block, child = mods[0].rsplit(".", 1)
    shared_mods = [m for op in ("shared_ffn1", "shared_ffn2") for m in lm.ops.get(op, [])]
    routers = lm.ops.get("router", [])
    if any(not m.startswith(block + ".") for m in shared_mods) or len(routers) != 1 \
            or routers[0].rsplit(".", 1)[0] != block:
        raise NotCovered(f"{kind}: re-split experts with shared experts {shared_mods} / router "
                         f"{routers} other than children of the block {block!r}")
    shared = sorted({m[len(block) + 1:].split(".")[0] for m in shared_mods})
    weights = f"{{{_literal(str(n1))}: (1, {parts!r}), {_literal(str(n2))}: (2, ())}}"
    beside = (f", shared={_literal(shared)}, router={_literal(routers[0].rsplit('.', 1)[1])}"
              if shared else "")
    style = (f"GatheredExperts(experts={_literal(child)}, weights={weights}, "
             f"split={split!r}{beside})")
    group = deg.tp * deg.ep
    what = (f"experts split moe_tp={deg.moe_tp} x moe_ep={deg.moe_ep}: "
            + (f"every expert at 1/{group} of its width" if split == "tp" else
               f"{group} ways by expert" if split == "ep" else
               f"{deg.moe_ep} ways by expert, each at 1/{deg.moe_tp} of its width on the "
               "experts mesh (moe_ep, moe_tp)")
            + f"; all_gather of the tokens over ep={deg.ep}, reduce_scatter over ep"
            + (f", all_reduce over tp={deg.tp}" if deg.tp > 1 else "") + " after the block"
            + (f"; shared experts {', '.join(shared)} on this rank's own rows" if shared
               else ""))
    return Entry(block, style, what)


def _fused_entry(kind: str, lm, mod: str, rows, deg, split) -> Entry:
    """A re-split layer whose experts are stored fused (DBRX: ``ffn.experts.mlp.{w1, v1,
    w2}``, rows at their ``[E, f, h]`` views): GatheredExperts on the block ``ffn`` with
    ``fused``, each weight's tp dim the ``f`` rows (1), no shared experts."""
    parts = mod.split(".")
    if len(parts) < 3 or any(r.get("expert_dim") != 0 for _, r in rows) or \
            any(op in lm.ops for op in ("shared_ffn1", "shared_ffn2")):
        raise NotCovered(f"{kind}: re-split fused experts in {mod!r} (covered: "
                         "block.experts.glu, no shared experts)")
    block, child, glu = ".".join(parts[:-2]), parts[-2], parts[-1]
    _, f, h = (int(d) for d in rows[0][1]["shape"])
    weights = ", ".join(f"{_literal(str(n))}: (1, ())" for n, _ in rows)
    style = (f"GatheredExperts(experts={_literal(child)}, weights={{{weights}}}, "
             f"split={split!r}, fused=({_literal(glu)}, {f}, {h}))")
    group = deg.tp * deg.ep
    what = (f"experts split moe_tp={deg.moe_tp} x moe_ep={deg.moe_ep} ([E, f, h] views of the "
            "fused weights): " + (f"every expert at 1/{group} of its f rows" if split == "tp"
                                  else f"{group} ways by expert" if split == "ep" else
                                  f"{deg.moe_ep} ways by expert, each at 1/{deg.moe_tp} of "
                                  "its f rows")
            + f"; all_gather of the tokens over ep={deg.ep}, reduce_scatter over ep"
            + (f", all_reduce over tp={deg.tp}" if deg.tp > 1 else "") + " after the block")
    return Entry(block, style, what)
