"""One decoder layer's modules as plan.json's params rows describe them (op and layer from
the IR, :mod:`shardc.ir.param_roles`): which module suffix realises which fused op, its
weights' rows, the replicated 2-D weights and the norms; and the model-level modules
(embedding, lm_head). Read by the style builders (:mod:`shardc.backends.torch_styles`,
:mod:`shardc.backends.pipeline_styles`)."""

from __future__ import annotations

from dataclasses import dataclass, field

from shardc.backends.style_entry import NotCovered


@dataclass
class LayerModules:
    """One decoder layer as the plan's params rows describe it (op and layer from the IR,
    :mod:`shardc.ir.param_roles`): module suffixes (relative to the layer) per fused op,
    and what the styles need to know about their weights."""

    container: str  # module path of the decoder-layer list (``model.layers``)
    ops: dict[str, list[str]] = field(default_factory=dict)  # op -> module suffixes
    weights: dict[str, dict] = field(default_factory=dict)  # suffix.param -> params row
    replicated: list[str] = field(default_factory=list)  # 2-D weights of no op (MLA down)
    norms: list[tuple[str, int]] = field(default_factory=list)  # (suffix, width) 1-D params

    def weight_of(self, mod: str) -> dict | None:
        """The params row of module ``mod``'s (>= 2-D) weight."""
        return next((r for key, r in self.weights.items()
                     if key.rsplit(".", 1)[0] == mod and len(r["shape"]) >= 2), None)

    def params_of(self, op: str) -> list[tuple[str, str, dict]]:
        """(module suffix, parameter name, row) of every parameter of ``op``."""
        out = []
        for key, row in self.weights.items():
            mod, name = key.rsplit(".", 1)
            if row.get("op") == op:
                out.append((mod, name, row))
        return out


def _split_fqn(fqn: str, layer: int) -> tuple[str, str] | None:
    """(container, suffix.param) of a parameter of decoder layer ``layer``."""
    parts = fqn.split(".")
    for i, part in enumerate(parts[:-1]):
        if part == str(layer) and i > 0:
            return ".".join(parts[:i]), ".".join(parts[i + 1:])
    return None


def layer_modules(rows: list[dict], layer: int) -> LayerModules:
    """:class:`LayerModules` of decoder layer ``layer`` from plan.json params rows."""
    lm = None
    for r in rows:
        if r.get("layer") != layer:
            continue
        where = _split_fqn(str(r["fqn"]), layer)
        if where is None:
            raise NotCovered(f"parameter {r['fqn']!r} of layer {layer} is not under a "
                             "decoder-layer list")
        if lm is None:
            lm = LayerModules(where[0])
        elif where[0] != lm.container:
            raise NotCovered(f"layer {layer}: parameters under {lm.container!r} and "
                             f"{where[0]!r}")
        key = where[1]
        if "." not in key:
            raise NotCovered(f"layer {layer}: parameter {key!r} directly on the layer module")
        mod = key.rsplit(".", 1)[0]
        lm.weights[key] = r
        op = r.get("op")
        if op is not None:
            mods = lm.ops.setdefault(op, [])
            if mod not in mods:
                mods.append(mod)
        elif len(r["shape"]) >= 2:
            lm.replicated.append(mod)
        elif len(r["shape"]) == 1:
            lm.norms.append((mod, int(r["shape"][0])))
    if lm is None:
        raise NotCovered(f"layer {layer} has no parameters in the plan")
    return lm


def attention_module(lm: LayerModules) -> str:
    """The module holding the qkv projections (their common parent: ``self_attn``)."""
    mods = lm.ops.get("qkv", [])
    parents = {m.rsplit(".", 1)[0] if "." in m else "" for m in mods}
    if len(parents) != 1 or "" in parents:
        raise NotCovered(f"qkv projections {mods} do not share one attention module")
    return parents.pop()


def full_width_qk_norms(lm: LayerModules, attn: str) -> list[str]:
    """Norms inside the attention module over a whole projection's output (OLMoE's q/k
    norms), not per head: their width is the output width of a qkv weight."""
    widths = {int(r["shape"][r["split_dims"][0]]) for _, _, r in lm.params_of("qkv")
              if len(r["shape"]) == 2 and r.get("split_dims", [None])[0] is not None}
    return [m for m, w in lm.norms if m.startswith(attn + ".") and w in widths]


def parent_module(mods: list[str], what: str) -> str:
    parents = {m.rsplit(".", 1)[0] if "." in m else "" for m in mods}
    if len(parents) != 1 or "" in parents:
        raise NotCovered(f"{what} projections {mods} do not share one module")
    return parents.pop()


def global_modules(rows: list[dict]) -> dict[str, str]:
    """op -> module path of the model-level ops (embedding, lm_head; a tied lm_head reads
    the embedding table through its own module)."""
    out: dict[str, str] = {}
    for r in rows:
        if r.get("layer") is not None:
            continue
        op = r.get("op")
        if op is not None:
            out.setdefault(op, str(r["fqn"]).rsplit(".", 1)[0])
        for t in r.get("tied", []):
            out.setdefault(str(t["op"]), str(t["module"]))
    return out
