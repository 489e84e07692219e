"""Zero the cost of work that is not per-input work, so every frontend counts the same FLOPs.

Two kinds of node do no work when the model runs on new token ids, yet appear in a
torch.export graph (an ONNX exporter removes them by constant folding and cast elision):

* *input-independent* nodes: nothing they read depends on the data of a graph input
  (rotary ``cos``/``sin`` tables from ``arange``, causal-mask construction). Ops that read
  only their input's *shape* (``new_ones``, ``zeros_like`` ...) do not carry the dependence.
  Parameters count as data (a node reading a weight is kept).
* *same-dtype casts*: ``to`` / ``_to_copy`` / ``type_as`` whose output dtype equals the
  input's dtype return their input unchanged.

Such nodes keep their kind (the dataflow is untouched) but get 0 FLOPs and 0 bytes, and
``attrs["no_work"]`` says why (``"constant"`` or ``"same_dtype_cast"``). Run after
canonicalise (it reads ``Node.op`` and ``Node.dtype``).
"""

from __future__ import annotations

from shardc.ir.graph import Graph

SHAPE_ONLY_OPS = frozenset((
    "new_ones", "new_zeros", "new_empty", "new_full", "zeros_like", "ones_like", "empty_like",
    "full_like", "sym_size", "sym_numel", "Shape", "Size", "ConstantOfShape",
))
CAST_OPS = frozenset(("to", "_to_copy", "type_as", "convert_element_type", "Cast", "CastLike"))


def _base(target: str) -> str:
    parts = target.split(".")
    return parts[1] if len(parts) >= 3 else parts[-1]


def zero_no_work(graph: Graph) -> Graph:
    """Set FLOPs and bytes of input-independent nodes and same-dtype casts to 0 (in place)."""
    by_name = {n.name: n for n in graph.nodes}
    data: set[str] = set()  # names of nodes whose output depends on input data
    for n in graph.nodes:
        base = _base(n.target)
        if n.op == "input":
            data.add(n.name)
            continue
        if n.op == "output":
            continue
        depends = bool(n.params) or (base not in SHAPE_ONLY_OPS
                                     and any(i in data for i in n.inputs))
        if depends:
            data.add(n.name)
            first = by_name.get(n.inputs[0]) if n.inputs else None
            if base in CAST_OPS and first is not None and first.dtype == n.dtype and n.dtype:
                n.flops, n.bytes = 0, 0
                n.attrs["no_work"] = "same_dtype_cast"
        elif n.flops or n.bytes:
            n.flops, n.bytes = 0, 0
            n.attrs["no_work"] = "constant"
    return graph
