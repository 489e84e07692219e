"""Reduced-depth tracing: trace one representative per layer kind, expand to full depth.

A full-size trace costs ~0.5 CPU ms per IR node (DeepSeek-V3: 9,274 nodes, ~38 CPU s) though
its 61 decoder layers come in two kinds. A model that *opts in* -- its ``build_model``
accepts ``num_layers`` (HF ``config.json`` models and the HF examples do, through
:func:`shardc.frontends.hf_build.build_causal_lm`; a plain PyTorch model file may) -- is
traced at a reduced depth ``R`` and the raw IR is expanded to the full depth ``L`` before
the passes run. The result is the graph a full trace gives, node for node.

1. *Layer kinds* from the full model built on ``meta`` (~1 CPU s, no trace): per decoder
   layer (parameters / modules whose path has layer index ``j``, :func:`layer_of`) the
   signature = every submodule's relative path, class and plain attributes (except index
   attributes such as ``layer_idx``), every parameter's and buffer's relative name, shape
   and dtype, and the ``j``-th entry of every per-layer config list (``layer_types`` ...).
   Dense-first layers, interleaved MoE steps, ``mlp_only_layers``, sliding-window
   alternation all show there, whatever config field sets them.
2. *Depth* ``R`` (:func:`choose_depth`): the shortest prefix of the layers in which every
   kind used at ``j >= R`` occurs at least twice among layers ``1 .. R-1`` (layer 0 reads the
   embedding, not a previous layer), every kind transition ``(kind[j-1], kind[j])`` at
   ``j >= R`` occurs, and whose last layer has the kind of the model's last layer. The
   reduced model (``build_model(num_layers=R)``) must give layers ``0 .. R-1`` the full
   model's signatures.
3. *Proof* on the reduced trace, else :class:`NotProvable` (``load_graph`` then traces all
   layers and says so): the call_function nodes form prefix, layer 0, ..., layer R-1,
   suffix, contiguously; every layer node reads only its own layer, the previous layer
   (referenced by position from the end) or the prefix; parameters of layer ``j`` are named
   with index ``j``; the instances of one kind are equal node for node up to the layer
   index (ops, targets, shapes, dtypes, parameters, module paths, attrs, inputs, and the
   op names of the FX nodes that are not IR nodes); FX node names after the prefix are
   numbered consecutively per base name (``linear_7``, ``linear_8``: the counter FX uses).
4. *Expansion* (:func:`expand`): layers ``R .. L-1`` are copies of the last reduced instance
   of their kind with the layer index renamed in ``module_path``, ``layer`` and parameter
   FQNs, node names renumbered by continuing each base name's counter, inputs from the
   previous layer re-pointed; the suffix (final norm, lm_head) is renumbered and re-pointed
   at the last layer; ``Graph.params`` gets the missing layers' parameters in place.
"""

from __future__ import annotations

import copy
import inspect
import json
import os
import re
from collections import defaultdict
from dataclasses import fields

import torch

from shardc.frontends.torch_export import _LAYER_RE, _module_path, layer_of, trace_program
from shardc.ir.graph import Graph, Node, Param

FULL_TRACE_ENV = "SHARDC_FULL_TRACE"  # "1": never reduce (benchmarks, debugging)
INDEX_ATTRS = frozenset(("layer_idx", "layer_id", "layer_index", "layer_number", "idx",
                         "block_idx"))
_NAME_RE = re.compile(r"^(.*?)(?:_(\d+))?$")
_FX_PREFIX = "model."  # torch_export wraps the model as ``model``


class NotProvable(Exception):
    """The reduced trace does not prove that the expansion equals a full trace (the message
    says which check failed)."""


def enabled() -> bool:
    """False when ``SHARDC_FULL_TRACE`` is set to anything but ``""`` / ``"0"``."""
    return os.environ.get(FULL_TRACE_ENV, "") in ("", "0")


def accepts_num_layers(build_model) -> bool:
    """True if ``build_model`` takes a ``num_layers`` keyword (the opt-in)."""
    try:
        return "num_layers" in inspect.signature(build_model).parameters
    except (TypeError, ValueError):
        return False


def relayer(path: str, index) -> str:
    """``path`` with its layer component (the first numeric one) replaced by ``index``."""
    m = _LAYER_RE.search(path)
    if m is None:
        return path
    return path[:m.start(1)] + str(index) + path[m.end(1):]


def _plain(value) -> bool:
    if value is None or isinstance(value, (bool, int, float, str)):
        return True
    return isinstance(value, (list, tuple)) and all(_plain(v) for v in value)


def layer_signatures(model: torch.nn.Module, list_keys: list[str] | None = None) -> list[tuple]:
    """Per decoder layer ``0 .. L-1``, the structural signature of the module docstring.
    ``list_keys``: the config's per-layer lists (default: every list as long as the model is
    deep); a reduced model is read with the full model's, so a list that is not per layer
    (a list-valued ``eos_token_id`` of 3 ids) never joins a 3-layer model's signatures.
    Raises :class:`NotProvable` if the layer indices are not ``0 .. L-1``."""
    per: dict[int, list] = defaultdict(list)
    for name, mod in model.named_modules():
        j = layer_of(name)
        if j is None:
            continue
        attrs = tuple(sorted((k, repr(v)) for k, v in vars(mod).items()
                             if not k.startswith("_") and k not in INDEX_ATTRS and _plain(v)))
        per[j].append(("module", relayer(name, "#"), type(mod).__qualname__, attrs))
    for kind, items in (("param", model.named_parameters()), ("buffer", model.named_buffers())):
        for name, t in items:
            j = layer_of(name)
            if j is not None:
                per[j].append((kind, relayer(name, "#"), tuple(t.shape), str(t.dtype)))
    if sorted(per) != list(range(len(per))):
        raise NotProvable(f"layer indices {sorted(per)[:8]}... are not 0..L-1")
    config = getattr(model, "config", None)
    keys = per_layer_keys(model, len(per)) if list_keys is None else list_keys
    lists = {k: getattr(config, k, None) for k in keys}
    if any(not isinstance(v, (list, tuple)) or len(v) != len(per) for v in lists.values()):
        raise NotProvable(f"config lists {sorted(keys)} are not one entry per layer")
    return [tuple(per[j]) + tuple((k, repr(v[j])) for k, v in sorted(lists.items()))
            for j in range(len(per))]


def per_layer_keys(model: torch.nn.Module, depth: int) -> list[str]:
    """Config fields of ``model`` that are lists with one entry per decoder layer."""
    config = getattr(model, "config", None)
    return sorted(k for k, v in (vars(config).items() if config is not None else ())
                  if isinstance(v, (list, tuple)) and len(v) == depth and not k.startswith("_"))


def kinds_of(signatures: list[tuple]) -> list[int]:
    """Kind id per layer (0, 1, ... in order of first appearance; equal signature = same)."""
    ids: dict[tuple, int] = {}
    return [ids.setdefault(s, len(ids)) for s in signatures]


def choose_depth(kinds: list[int]) -> int | None:
    """The reduced depth ``R`` of the module docstring, or None if only ``R = L`` works."""
    full = len(kinds)
    for r in range(3, full):
        seen = kinds[1:r]
        later = set(kinds[r:])
        if any(seen.count(k) < 2 for k in later) or kinds[r - 1] != kinds[-1]:
            continue
        have = {(kinds[i - 1], kinds[i]) for i in range(1, r)}
        if all((kinds[j - 1], kinds[j]) in have for j in range(r, full)):
            return r
    return None


def _split_name(name: str) -> tuple[str, int]:
    m = _NAME_RE.match(name)
    return m.group(1), int(m.group(2) or 0)


def _fx_name(base: str, num: int) -> str:
    return base if num == 0 else f"{base}_{num}"


class _Segments:
    """The reduced trace cut into prefix / layer blocks / suffix, FX and IR side."""

    def __init__(self, graph: Graph, ep: torch.export.ExportedProgram, depth: int):
        fx_seq: list[tuple[str, int | None]] = []
        started = False
        for fx in ep.graph.nodes:
            if fx.op == "call_function":
                layer = layer_of(_module_path(fx, _FX_PREFIX))
                started = started or layer is not None
                fx_seq.append((fx.name, layer))
            elif fx.op in ("get_attr", "call_module", "call_method") and started:
                raise NotProvable(f"the traced graph has a {fx.op} node ({fx.name}) in its layers")
        self.fx_prefix, self.fx_blocks, self.fx_suffix = self._cut(fx_seq, depth, "FX node")
        ir_seq = [(n, n.layer) for n in graph.nodes if n.op not in ("input", "output")]
        pre, blocks, self.suffix = self._cut(ir_seq, depth, "IR node")
        self.prefix = [n for n in graph.nodes if n.op == "input"] + pre
        self.blocks = blocks
        outs = [n for n in graph.nodes if n.op == "output"]
        self.output = outs[0] if outs else None
        self.block_of = {n.name: j for j, b in enumerate(blocks) for n in b}
        self.index_in_block = {n.name: i for b in blocks for i, n in enumerate(b)}
        self.prefix_names = {n.name for n in self.prefix}
        self.suffix_index = {n.name: i for i, n in enumerate(self.suffix)}

    @staticmethod
    def _cut(seq: list, depth: int, what: str) -> tuple[list, list[list], list]:
        prefix, blocks, suffix = [], [[] for _ in range(depth)], []
        state = -1  # -1: prefix, j: in layer j, depth: suffix
        for item, layer in seq:
            if layer is None:
                if state == -1:
                    prefix.append(item)
                else:
                    state = depth
                    suffix.append(item)
            elif state < depth and layer in (state, state + 1) and 0 <= layer < depth:
                state = layer
                blocks[layer].append(item)
            else:
                raise NotProvable(f"{what}s of layer {layer} do not follow layer {state} "
                                  "contiguously (or follow the layers)")
        if any(not b for b in blocks):
            raise NotProvable(f"a layer of the reduced trace has no {what}s")
        return prefix, blocks, suffix


def _check_names(seg: _Segments) -> dict[str, int]:
    """Verify FX numbering after the prefix is consecutive per base name; return the counter
    state (base -> last number) after the last reduced layer."""
    last: dict[str, int] = {}
    for name in seg.fx_prefix:
        base, num = _split_name(name)
        last[base] = max(num, last.get(base, num))
    state_after_layers: dict[str, int] | None = None
    for j, names in enumerate(seg.fx_blocks + [seg.fx_suffix]):
        if j == len(seg.fx_blocks):
            state_after_layers = dict(last)
        for name in names:
            base, num = _split_name(name)
            if _fx_name(base, num) != name:
                raise NotProvable(f"FX node name {name!r} is not <base>_<number>")
            if base in last and num != last[base] + 1 and not (j == 0 and num > last[base]):
                raise NotProvable(f"FX node {name!r} is not numbered after {base}_{last[base]}")
            if base not in last and j == len(seg.fx_blocks) and num > 1:
                raise NotProvable(f"FX node {name!r} first appears after the layers at {num}")
            last[base] = num
    return state_after_layers or {}


def _block_form(seg: _Segments, j: int) -> tuple:
    """Layer ``j`` of the reduced trace with the layer index abstracted (the proof's unit)."""
    form: list = [tuple(_split_name(n)[0] for n in seg.fx_blocks[j])]
    for n in seg.blocks[j]:
        refs = []
        for i in n.inputs:
            if seg.block_of.get(i) == j:
                refs.append(("self", seg.index_in_block[i]))
            elif seg.block_of.get(i) == j - 1:
                refs.append(("prev", len(seg.blocks[j - 1]) - seg.index_in_block[i]))
            elif i in seg.prefix_names:
                refs.append(("global", i))
            else:
                raise NotProvable(f"node {n.name} of layer {j} reads {i}, outside its layer, "
                                  "the previous layer and the prefix")
        params = []
        for p in n.params:
            if layer_of(p.fqn) != j:
                raise NotProvable(f"node {n.name} of layer {j} reads parameter {p.fqn}")
            params.append((relayer(p.fqn, "#"), tuple(p.shape), p.dtype))
        form.append((n.op, n.target, tuple(refs), json.dumps(n.input_shapes),
                     json.dumps(n.output_shape), n.dtype, tuple(params),
                     relayer(n.module_path, "#"), json.dumps(n.attrs, sort_keys=True)))
    return tuple(form)


def _from_end(block: list[Node], offset: int) -> str:
    """Name of the node ``offset`` places from the end of ``block`` (1 = its last node)."""
    if not 1 <= offset <= len(block):
        raise NotProvable(f"a layer reads node -{offset} of a previous layer of {len(block)} nodes")
    return block[len(block) - offset].name


_ATOMIC = (str, int, float, bool, type(None))


def _copy_node(n: Node, **changes) -> Node:
    """A copy of ``n`` sharing no mutable value with it, ``changes`` applied (the fields
    changed are not copied first: deep-copying every node's Param records was most of a
    cold DeepSeek-V3 expansion)."""
    memo: dict = {}  # one memo: values shared inside ``n`` stay shared inside the copy
    kept = {f.name: getattr(n, f.name) for f in fields(Node) if f.name not in changes}
    return Node(**{k: v if isinstance(v, _ATOMIC) else copy.deepcopy(v, memo)
                   for k, v in kept.items()}, **changes)


def expand(graph: Graph, ep: torch.export.ExportedProgram, kinds: list[int]) -> Graph:
    """The raw IR of the full-depth model (``len(kinds)`` layers) from the raw IR ``graph``
    and exported program ``ep`` of its first ``R`` layers (module docstring, 3 and 4).
    ``kinds`` = kind id per full layer. Raises :class:`NotProvable`."""
    full = len(kinds)
    layers = sorted({n.layer for n in graph.nodes if n.layer is not None})
    depth = len(layers)
    if layers != list(range(depth)) or depth < 3 or depth > full:
        raise NotProvable(f"the reduced trace has layers {layers[:8]}")
    seg = _Segments(graph, ep, depth)
    counter = _check_names(seg)
    forms: dict[int, tuple] = {}
    template: dict[int, int] = {}
    for j in range(1, depth):
        form = _block_form(seg, j)
        k = kinds[j]
        if k in forms and forms[k] != form:
            raise NotProvable(f"layers {template[k]} and {j} have the same modules but trace "
                              "differently")
        forms[k], template[k] = form, j
    _block_form(seg, 0)  # layer 0 must read only itself and the prefix too
    for j in range(depth, full):
        if kinds[j] not in template:
            raise NotProvable(f"layer {j}'s kind is not in the reduced trace")
    params = _expand_params(graph.params, seg, kinds, template, depth)

    nodes = list(seg.prefix) + [n for b in seg.blocks for n in b]
    prev = seg.blocks[depth - 1]
    for j in range(depth, full):
        t = template[kinds[j]]
        rename = {}
        for name in seg.fx_blocks[t]:
            base, _ = _split_name(name)
            counter[base] = counter[base] + 1
            rename[name] = _fx_name(base, counter[base])
        block = []
        for n in seg.blocks[t]:
            inputs = []
            for i in n.inputs:
                if seg.block_of.get(i) == t:
                    inputs.append(rename[i])
                elif seg.block_of.get(i) == t - 1:
                    inputs.append(_from_end(prev, len(seg.blocks[t - 1]) - seg.index_in_block[i]))
                else:
                    inputs.append(i)
            block.append(_copy_node(n, name=rename[n.name], inputs=inputs, layer=j,
                                    module_path=relayer(n.module_path, j),
                                    params=[Param(relayer(p.fqn, j), list(p.shape), p.dtype)
                                            for p in n.params]))
        nodes += block
        prev = block
    rename = {}
    for name in seg.fx_suffix:
        base, num = _split_name(name)
        counter[base] = counter[base] + 1 if base in counter else num
        rename[name] = _fx_name(base, counter[base])
    last = seg.blocks[depth - 1]

    def point(i: str) -> str:
        if i in rename:
            return rename[i]
        if seg.block_of.get(i) == depth - 1:
            return _from_end(prev, len(last) - seg.index_in_block[i])
        if i in seg.prefix_names:
            return i
        raise NotProvable(f"the suffix reads {i}, which is not in the prefix or the last layer")

    for n in seg.suffix:
        nodes.append(_copy_node(n, name=rename[n.name], inputs=[point(i) for i in n.inputs]))
        if any(layer_of(p.fqn) is not None for p in n.params):
            raise NotProvable(f"suffix node {n.name} reads a layer's parameter")
    if seg.output is not None:
        nodes.append(_copy_node(seg.output, inputs=[point(i) for i in seg.output.inputs]))
    return Graph(name=graph.name, source=graph.source, nodes=nodes, params=params,
                 tokens=graph.tokens, warnings=list(graph.warnings), config=dict(graph.config))


def _expand_params(params: list[Param], seg: _Segments, kinds: list[int],
                   template: dict[int, int], depth: int) -> list[Param]:
    """``Graph.params`` of the full model: prefix, layers in order, suffix (named_parameters
    order); the layers ``>= depth`` copied from their kind's template with the index renamed."""
    prefix, by_layer, suffix = [], defaultdict(list), []
    phase, last = "prefix", -1
    for p in params:
        j = layer_of(p.fqn)
        if j is None:
            if phase != "prefix":
                phase = "suffix"
            (prefix if phase == "prefix" else suffix).append(p)
            continue
        if phase == "suffix" or j < last or j >= depth:
            raise NotProvable(f"parameter {p.fqn} is out of layer order")
        phase, last = "layers", j
        by_layer[j].append(p)
    forms = {}
    for j in range(1, depth):
        form = [(relayer(p.fqn, "#"), p.shape, p.dtype) for p in by_layer[j]]
        if forms.setdefault(kinds[j], form) != form:
            raise NotProvable(f"layer {j}'s parameters differ from its kind's")
    out = prefix + [p for j in range(depth) for p in by_layer[j]]
    for j in range(depth, len(kinds)):
        out += [Param(relayer(p.fqn, j), list(p.shape), p.dtype)
                for p in by_layer[template[kinds[j]]]]
    return out + suffix


def trace_reduced(source, full_model: torch.nn.Module, inputs: tuple) -> Graph | None:
    """Raw IR of ``full_model`` (built by ``source.build_model()``; ``source`` a
    :class:`~shardc.frontends.model_file.ModelSource` whose ``build_model`` takes
    ``num_layers``) from a reduced-depth trace, expanded. None when no depth below the full
    one proves the pattern (nothing to gain: trace all layers); raises :class:`NotProvable`
    when a check fails."""
    from shardc.errors import InputError
    from shardc.frontends.model_file import _call_user

    signatures = layer_signatures(full_model)
    list_keys = per_layer_keys(full_model, len(signatures))
    kinds = kinds_of(signatures)
    depth = choose_depth(kinds)
    if depth is None:
        return None
    def build_model():  # named: model_file's messages quote the function name
        return source.build_model(num_layers=depth)

    try:
        reduced = _call_user(build_model, source.source, f"building {depth} layers")
        if (not isinstance(reduced, torch.nn.Module)
                or layer_signatures(reduced, list_keys) != signatures[:depth]):
            raise NotProvable(f"build_model(num_layers={depth}) does not build the first "
                              f"{depth} layers of build_model()")
        graph, ep = trace_program(reduced, inputs, name=source.name, source=source.source)
    except InputError as e:  # the full trace reports the model's own errors
        raise NotProvable(str(e)) from e
    return expand(graph, ep, kinds)
