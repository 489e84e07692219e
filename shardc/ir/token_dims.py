"""Token dims: which dims of each node's shape grow with the batch and sequence, and the
shapes at a workload's batch and sequence instead of the traced example's.

A model is traced at a small example (e.g. 1 x 16 token ids), so node shapes carry that
example's sizes. :func:`token_dims` tags every dim of every node whose size is proportional
to the traced tokens, following the data from the token-id input:

* ``"b"`` -- batch (sequences); ``"s"`` -- query tokens of a sequence; ``"t"`` -- rows of
  flattened tokens (batch x sequence, also the routed rows ``tokens x top_k`` of a MoE);
  ``"kv"`` -- key positions (the second sequence dim of a query x key tensor, e.g. an
  attention mask or eager attention scores);
* the token-id input is ``["b", "s"]``; a position range (``arange`` of the traced sequence
  length) is ``["s"]``; a linear / embedding keeps its input's leading tags; a transpose swaps
  them; a reshape keeps a tag on the output dim with the same element-count boundaries (a
  merge of tagged dims becomes ``"t"``, a split keeps the tag on the outermost part); any other
  op copies a tag from an input dim of the same size aligned from the right (broadcasting),
  else from the left; a shape with two ``"s"`` dims has its last one relabelled ``"kv"``.
  Dims computed from constants only (weights, rotary frequencies) stay untagged.

:func:`workload_shape` rescales tagged dims (sizes are proportional, so a routed-rows dim of
``tokens x top_k`` scales by the token ratio). Per decode step: ``b`` -> batch, ``s`` -> 1
new token, ``kv`` -> the context (KV-cache length); prefill: ``b`` -> batch, ``s`` and
``kv`` -> the prompt. :func:`shape_text` writes ``8(b)x2048(s)x8192``.
"""

from __future__ import annotations

import math

from shardc.ir.graph import Graph, Node

TOKEN_TAGS = ("b", "s", "t", "kv")
_RESHAPES = {"view", "reshape", "_unsafe_view", "unsqueeze", "squeeze", "flatten", "unflatten"}


def traced_batch_seq(graph: Graph) -> tuple[int, int]:
    """(batch, sequence) of the traced example: the first integer input's shape [B, S]
    (a 1-D input is one sequence), else (1, ``graph.tokens``)."""
    for n in graph.nodes:
        if n.op == "input" and str(n.dtype).startswith("int") and n.output_shape:
            shape = [int(s) for s in n.output_shape]
            return (shape[0], shape[-1]) if len(shape) >= 2 else (1, shape[0])
    return 1, max(int(graph.tokens or 1), 1)


def _base(target: str) -> str:
    parts = str(target).split(".")
    return parts[1] if len(parts) >= 3 and parts[0] == "aten" else parts[-1]


def _bounds(shape: list[int]) -> list[tuple[int, int]]:
    """Per dim the (elements before, elements up to and including) it, outermost first."""
    out, acc = [], 1
    for s in shape:
        out.append((acc, acc * int(s)))
        acc *= int(s)
    return out


def _merge(tags: list[str]) -> str | None:
    tags = [t for t in tags if t]
    if not tags:
        return None
    return tags[0] if len(set(tags)) == 1 and tags[0] != "kv" else "t"


def _reshape(src: list[int], tags: list, out: list[int], traced: tuple[int, int]) -> list:
    """Tags through a reshape (same element count), by element-count boundaries."""
    ib, ob = _bounds(src), _bounds(out)
    res: list = [None] * len(out)
    used_units: set[int] = set()
    for j, (lo, hi) in enumerate(ob):
        if out[j] == 1:  # a unit dim keeps the tag of a unit input dim at the same place
            for i, bounds in enumerate(ib):
                if src[i] == 1 and bounds == (lo, hi) and tags[i] and i not in used_units:
                    res[j] = tags[i]
                    used_units.add(i)
                    break
            continue
        inside = [i for i, (a, b) in enumerate(ib)
                  if lo <= a and b <= hi
                  and (src[i] > 1 or (tags[i] and a == lo and i not in used_units))]
        if inside:  # the output dim is one input dim, or a merge of several
            res[j] = _merge([tags[i] for i in inside])
            continue
        host = next((i for i, (a, b) in enumerate(ib) if src[i] > 1 and a <= lo and hi <= b),
                    None)
        if host is None or not tags[host]:
            continue
        group = [k for k, (a, b) in enumerate(ob)
                 if out[k] > 1 and ib[host][0] <= a and b <= ib[host][1]]
        if tags[host] == "t" and [out[k] for k in group] == list(traced):
            res[j] = "b" if j == group[0] else "s"  # tokens split back into batch x sequence
        elif j == group[0]:
            res[j] = tags[host]  # a split: the outermost part keeps the tag
    return res


def _aligned(node: Node, known: dict[str, list]) -> list:
    """Tags by broadcasting: right-aligned input dims of equal size first, then left."""
    out = node.output_shape
    res: list = [None] * len(out)
    ins = [(shape, known.get(name)) for name, shape in zip(node.inputs, node.input_shapes)]
    for j in range(len(out)):
        for align in ("right", "left"):
            for shape, tags in ins:
                if not tags or len(tags) != len(shape):
                    continue
                p = j - (len(out) - len(shape)) if align == "right" else j
                if 0 <= p < len(shape) and shape[p] == out[j] and tags[p]:
                    res[j] = tags[p]
                    break
            if res[j]:
                break
    return res


def _node_tags(node: Node, known: dict[str, list], traced: tuple[int, int]) -> list:
    out = [int(s) for s in node.output_shape]
    base = _base(node.target)
    first = known.get(node.inputs[0]) if node.inputs else None
    src = node.input_shapes[0] if node.input_shapes else []
    if node.op == "input":  # token ids [B, S] (or [S]); other inputs, e.g. masks, [B, S] too
        if str(node.dtype).startswith("int") and 1 <= len(out) <= 2:
            return ["b", "s"][-len(out):]
        return [None] * len(out)
    if base == "arange" and not node.inputs:
        return ["s"] if out == [traced[1]] and traced[1] > 1 else [None] * len(out)
    if node.op == "embedding" and first and len(out) == len(first) + 1:
        return list(first) + [None]
    if node.op == "linear" and first and len(out) == len(first):
        return list(first[:-1]) + [None]
    if first and base == "transpose" and len(out) == len(first):
        d = [int(x) % len(out) for x in (node.attrs.get("scalars") or [])[:2]]
        if len(d) == 2:
            res = list(first)
            res[d[0]], res[d[1]] = res[d[1]], res[d[0]]
            return res
    if first and base in _RESHAPES and math.prod(src) == math.prod(out):
        return _reshape([int(s) for s in src], first, out, traced)
    return _aligned(node, known)


def token_dims(graph: Graph) -> dict[str, list]:
    """{node name: per-dim tag (one of :data:`TOKEN_TAGS`) or None}, see the module doc."""
    traced = traced_batch_seq(graph)
    known: dict[str, list] = {}
    for n in graph.nodes:
        tags = _node_tags(n, known, traced) if n.output_shape else []
        if tags.count("s") >= 2:
            tags[len(tags) - 1 - tags[::-1].index("s")] = "kv"
        known[n.name] = tags
    return known


def workload_sizes(phase: str, batch: int, context: int, prompt: int) -> dict[str, int]:
    """Size of each tag at a workload (tokens): one decode step, or one prefill pass."""
    seq, keys = (1, int(context)) if phase == "decode" else (int(prompt), int(prompt))
    return {"b": int(batch), "s": seq, "t": int(batch) * seq, "kv": keys}


def workload_shape(shape: list[int], tags: list | None, traced: tuple[int, int],
                   sizes: dict[str, int]) -> list[int]:
    """``shape`` with every tagged dim rescaled from the traced example to ``sizes``."""
    if not tags:
        return list(shape)
    b, s = traced
    was = {"b": b, "s": s, "t": b * s, "kv": s}
    out = []
    for size, tag in zip(shape, tags):
        if tag in was and was[tag] > 0:
            out.append(int(size) * sizes[tag] // was[tag] if int(size) * sizes[tag] % was[tag]
                       == 0 else round(int(size) * sizes[tag] / was[tag]))
        else:
            out.append(int(size))
    return out


def shape_text(shape: list[int] | None, tags: list | None = None) -> str:
    """``8(b)x2048(s)x8192``: token dims carry their tag in parentheses; "-" if no shape."""
    if not shape:
        return "-"
    tags = list(tags or []) + [None] * len(shape)
    return "x".join(f"{s}({t})" if t else str(s) for s, t in zip(shape, tags))
