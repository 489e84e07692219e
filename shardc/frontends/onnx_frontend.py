"""ONNX frontend: an ``.onnx`` file -> the same IR :class:`Graph` the torch.export frontend makes.

``trace_onnx(path)`` loads the file (:mod:`shardc.frontends.onnx_load`: checks, external
data, shape inference; weights are never read) and maps it to *raw* IR nodes;
:func:`shardc.frontends.load_graph` then runs the same passes as for the torch path
(:func:`shardc.passes.run_passes`), so op kinds, FLOPs (floating-point operations), bytes
and layer kinds come from one set of formulas.

Raw IR, matching :mod:`shardc.frontends.torch_export`:

* Files from the torch dynamo exporter record, per ONNX node, the FX node it was lowered
  from (``pkg.torch.onnx.fx_node``) and its module scopes (``pkg.torch.onnx.name_scopes``).
  ONNX nodes are grouped back per FX node: one IR node per FX op, named as in torch.export,
  ``target`` = the aten op (``aten.linear.default``), ``attrs["onnx_ops"]`` = the ONNX op
  types it became, ``module_path`` = the innermost module, ``layer`` = its first numeric
  component. Shapes are the ONNX-inferred ones.
* Other files: one IR node per ONNX node, ``target = "onnx.<OpType>"`` and the op kind from
  :data:`shardc.frontends.onnx_ops.ONNX_KIND` (``MatMul``/``Gemm`` reading a parameter ->
  ``linear``); unknown ops become ``other`` with a warning. Module paths come from scoped
  node names (``/model/layers.0/mlp/up_proj/MatMul``) when present.
* Parameters: the exporter's graph signature (``placeholder -> FQN``) names every parameter.
  An initializer named by its FQN is that parameter; one the exporter's optimiser produced
  by constant-folding a parameter (``val_123`` = ``W^T`` for a linear) is matched to the
  parameter its consuming FX node reads (``%p_model_..._weight``), with the torch shape
  restored (``[in, out]`` -> ``[out, in]``). So ``Graph.num_params`` is exact. Without a
  signature, floating-point initializers used as a weight (``MatMul``/``Gemm`` B input,
  ``Gather*`` table) or named like a parameter (contains a ``.``, ``weight`` or ``bias``) are
  taken as parameters and a warning says so (identical tensors an optimiser merged into one
  initializer are then counted once).
  Pure views/casts of a parameter are aliases; the :class:`Param` is attached to the node
  that consumes it. ``Identity`` nodes (what an unoptimised export makes of ``clone``) are
  read through, as the exporter's optimiser would remove them. Non-parameter constants (folded rotary tables, masks) are not inputs.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from shardc.errors import InputError
from shardc.frontends.onnx_load import (
    OnnxModel,
    Provenance,
    dtype_name,
    literal_or,
    load_onnx,
)
from shardc.frontends.onnx_ops import PARAM_VIEW_OPS, onnx_kind
from shardc.frontends.torch_export import _PARAM_VIEW_OPS as _ATEN_VIEW_OPS
from shardc.frontends.torch_export import layer_of
from shardc.ir.graph import Graph, Node, Param

# What ``shardc compile`` can and cannot emit for an ONNX model (for the integrator).
ONNX_PARALLELIZE_NOTE = (
    "ONNX input: plan.json, graph.txt, graph.dot, trace.json and search.png are written; "
    "parallelize.py is not, because DTensor placement needs the torch nn.Module (compile the "
    "model's .py file or HF config.json to get runnable parallelize.py code)."
)

_PLACEHOLDER_REF = re.compile(r"%(p_\w+)")
_FX_REF = re.compile(r"%(\w+)")
_LINEAR_LIKE = ("aten.linear", "aten.mm", "aten.addmm", "aten.matmul", "aten.t.", "aten.permute",
                "aten.transpose")


class _Group:
    """ONNX nodes lowered from one FX node (or a single ONNX node without provenance)."""

    def __init__(self, key: str, prov: Provenance):
        self.key = key
        self.prov = prov
        self.nodes: list = []
        self.outputs: list[str] = []


def _aten_base(target: str) -> str:
    parts = target.split(".")
    return parts[1] if len(parts) >= 3 and parts[0] == "aten" else parts[-1]


def _parse_fx_args(text: str) -> tuple[list, dict]:
    """Scalars and scalar kwargs of an FX node from its text ``(args = (...), kwargs = {...})``."""
    m = re.match(r"^\s*\(args = (.*), kwargs = (\{.*\})\)\s*$", text, re.S)
    if not m:
        return [], {}
    quoted = _FX_REF.sub(lambda r: repr("%" + r.group(1)), m.group(1))
    quoted_kw = _FX_REF.sub(lambda r: repr("%" + r.group(1)), m.group(2))
    args = literal_or(quoted, ())
    kwargs = literal_or(quoted_kw, {})
    args = args if isinstance(args, tuple) else (args,)
    scalars = [a for a in args if isinstance(a, (int, float, bool))]
    kw = {k: v for k, v in kwargs.items() if isinstance(v, (int, float, bool))
          or (isinstance(v, str) and not v.startswith("%"))} if isinstance(kwargs, dict) else {}
    return scalars, kw


class _ParamResolver:
    """Initializer name -> :class:`Param` (or None for a non-parameter constant)."""

    def __init__(self, model: OnnxModel):
        self.model = model
        self.targets = model.param_targets  # placeholder -> FQN
        self.fqns = list(dict.fromkeys(self.targets.values()))
        self.fqn_set = set(self.fqns)
        self.by_fqn: dict[str, Param] = {}
        self.cache: dict[tuple[str, str], Param | None] = {}
        self.guessed = False

    def _make(self, fqn: str, shape: list[int], elem_type: int) -> Param:
        if fqn not in self.by_fqn:
            self.by_fqn[fqn] = Param(fqn=fqn, shape=shape, dtype=dtype_name(elem_type))
        return self.by_fqn[fqn]

    def resolve(self, name: str, consumer, index: int, prov: Provenance,
                group_inits: set[str]) -> Param | None:
        """The parameter that initializer ``name``, read by ONNX node ``consumer`` (input
        ``index``) of the FX node ``prov`` (whose ONNX nodes read ``group_inits``), stands
        for; None for a plain constant."""
        key = (name, prov.fx_name)
        if key in self.cache:
            return self.cache[key]
        init = self.model.initializers[name]
        param = None
        refs = [self.targets[p] for p in _PLACEHOLDER_REF.findall(prov.fx_args)
                if p in self.targets]
        if not self.targets:  # no exporter signature: guess from the name and the use
            low = name.lower()
            weight_use = ((consumer.op_type in ("MatMul", "Gemm") and index == 1)
                          or (consumer.op_type.startswith("Gather") and index == 0))
            if init.is_float and init.numel > 1 and (
                    weight_use or "." in name or "weight" in low or "bias" in low):
                self.guessed = True
                param = self._make(name, list(init.shape), init.elem_type)
        elif name in refs or (name in self.fqn_set and not refs):
            param = self._make(name, list(init.shape), init.elem_type)
        elif init.is_float and refs:
            # folded (val_123 = W^T) or de-duplicated (identical norm weights share one
            # initializer named after the first): the FX node says which parameter it reads
            direct = {r for r in refs if r in group_inits and r != name}
            free = [f for f in refs if f not in direct]
            matches = [f for f in free if self._numel_ok(f, init.numel, refs)] or free
            if matches:
                shape = list(init.shape)
                folded_transpose = (len(shape) == 2 and prov.fx_target.startswith(_LINEAR_LIKE)
                                    and consumer.op_type in ("MatMul", "Gemm") and index == 1
                                    and not _gemm_trans_b(consumer))
                if folded_transpose:
                    shape = shape[::-1]
                unused = [f for f in matches if f not in self.by_fqn]
                param = self._make((unused or matches)[0], shape, init.elem_type)
        self.cache[key] = param
        return param

    def _numel_ok(self, fqn: str, numel: int, refs: list[str]) -> bool:
        # a bias has one dimension: tell it from a weight of the same op by size when possible
        return not (fqn.endswith("bias") and numel > 1 and len(refs) > 1
                    and any(r.endswith("weight") for r in refs))

    def params(self) -> list[Param]:
        order = {f: i for i, f in enumerate(self.fqns)}
        return sorted(self.by_fqn.values(), key=lambda p: (order.get(p.fqn, len(order)), p.fqn))


def _gemm_trans_b(node) -> bool:
    return node.op_type == "Gemm" and any(a.name == "transB" and a.i for a in node.attribute)


def _groups(model: OnnxModel) -> list[_Group]:
    """Group ONNX nodes per originating FX node; order groups topologically (stable)."""
    by_key: dict[str, _Group] = {}
    for i, node in enumerate(model.graph.node):
        prov = model.provenance(node)
        key = prov.fx_name or f"{node.name or node.op_type}#{i}"
        grp = by_key.get(key)
        if grp is None:
            grp = by_key[key] = _Group(key, prov)
        grp.nodes.append(node)
        grp.outputs.extend(o for o in node.output if o)
    groups = list(by_key.values())
    owner = {v: g.key for g in groups for v in g.outputs}
    deps = {g.key: {owner[v] for n in g.nodes for v in n.input if v in owner} - {g.key}
            for g in groups}
    done: set[str] = set()
    ordered: list[_Group] = []
    pending = groups
    while pending:
        rest = []
        for g in pending:
            if deps[g.key] <= done:
                ordered.append(g)
                done.add(g.key)
            else:
                rest.append(g)
        if len(rest) == len(pending):  # a cycle between groups: keep file order
            ordered.extend(rest)
            break
        pending = rest
    return ordered


def onnx_to_raw_graph(model: OnnxModel, name: str = "") -> Graph:
    """Map a loaded ONNX model to raw IR (see module doc); ``op`` is final only for nodes
    without provenance (``target = "onnx.<OpType>"``); canonicalise classifies the rest."""
    g = model.graph
    resolver = _ParamResolver(model)
    init_names = set(model.initializers)
    consts = {n.output[0] for n in g.node if n.op_type == "Constant" and n.output}
    producer: dict[str, str] = {}  # ONNX value -> IR node name
    alias: dict[str, list[Param]] = {}  # ONNX value -> params it is a view of
    nodes: list[Node] = []
    warnings = list(model.warnings)
    used_names: set[str] = set()

    for inp in g.input:
        if inp.name in init_names:
            continue
        nodes.append(Node(name=inp.name, op="input", target="input",
                          output_shape=model.shapes.get(inp.name, []),
                          dtype=dtype_name(model.elem_types.get(inp.name, 0))))
        producer[inp.name] = inp.name
        used_names.add(inp.name)

    unknown: set[str] = set()
    by_name: dict[str, Node] = {n.name: n for n in nodes}
    for grp in _groups(model):
        if all(n.op_type == "Constant" for n in grp.nodes):
            consts.update(grp.outputs)
            continue
        internal = set(grp.outputs)
        external: list[str] = []  # values read from other IR nodes, in reading order
        group_inits = {v for n in grp.nodes for v in n.input if v in init_names}
        params: list[Param] = []
        for node in grp.nodes:
            for idx, v in enumerate(node.input):
                if not v or v in internal:
                    continue
                if v in alias:
                    params.extend(p for p in alias[v] if p not in params)
                elif v in init_names:
                    p = resolver.resolve(v, node, idx, grp.prov, group_inits)
                    if p is not None and p not in params:
                        params.append(p)
                elif v in producer and v not in external:
                    external.append(v)
        prov = grp.prov
        op_types = [n.op_type for n in grp.nodes if n.op_type != "Constant"]
        if prov.fx_target:
            is_view = _aten_base(prov.fx_target) in _ATEN_VIEW_OPS or prov.fx_target == "getitem"
        else:
            is_view = len(op_types) == 1 and op_types[0] in PARAM_VIEW_OPS
        if params and not external and is_view:
            for v in grp.outputs:
                alias[v] = list(params)
            continue
        if op_types and set(op_types) == {"Identity"} and len(external) == 1 and not params:
            for v in grp.outputs:  # a no-op (e.g. a decomposed clone): read through it
                producer[v] = producer[external[0]]
            continue
        values = _order_by_fx_args(external, prov.fx_args)
        inputs: list[str] = []
        in_shapes: list[list[int]] = []
        for v in values:
            if producer[v] not in inputs:
                inputs.append(producer[v])
                in_shapes.append(model.shapes.get(v, []))
        main = prov.fx_name if prov.fx_name in internal else _main_output(grp)
        node_name = _unique(prov.fx_name or grp.nodes[-1].name or main, used_names)
        used_names.add(node_name)
        out_values = [v for v in grp.nodes[-1].output if v]
        module_path = prov.module_path or _scope_path(grp.nodes[-1].name)
        if not module_path and not prov.fx_target and inputs and inputs[0] in by_name:
            module_path = by_name[inputs[0]].module_path  # e.g. a Split the optimiser made
        node = Node(name=node_name, op="other", inputs=inputs, input_shapes=in_shapes,
                    output_shape=model.shapes.get(main, []),
                    dtype=dtype_name(model.elem_types.get(main, 0)), params=params,
                    module_path=module_path, layer=layer_of(module_path))
        node.attrs["onnx_ops"] = op_types
        if prov.fx_target:
            node.target = prov.fx_target
            node.op = _group_kind(grp.nodes, bool(params))  # kept only if canonicalise
            scalars, kw = _parse_fx_args(prov.fx_args)     # does not know the aten op
            if scalars:
                node.attrs["scalars"] = scalars
            if kw:
                node.attrs["kwargs"] = kw
        else:
            only = grp.nodes[-1]
            node.target = f"onnx.{only.op_type}"
            node.op = onnx_kind(only.op_type, only.domain)
            if node.op == "matmul" and params:
                node.op = "linear"
            if node.op == "other":
                unknown.add(only.op_type)
        if len(out_values) > 1:
            node.attrs["output_shapes"] = [model.shapes.get(v, []) for v in out_values]
        nodes.append(node)
        by_name[node_name] = node
        for v in grp.outputs:
            producer[v] = node_name
        if prov.fx_target and len(out_values) > 1:
            # a multi-output FX op (topk, split): torch.export reads it through getitem nodes,
            # which the exporter named after its outputs
            for v in out_values:
                if v != main and not v.startswith("val_") and v not in used_names:
                    item = Node(name=v, op="other", target="getitem", inputs=[node_name],
                                input_shapes=[node.output_shape],
                                output_shape=model.shapes.get(v, []),
                                dtype=dtype_name(model.elem_types.get(v, 0)),
                                module_path=module_path, layer=node.layer)
                    nodes.append(item)
                    by_name[v] = item
                    used_names.add(v)
                    producer[v] = v

    _hoist_shared_views(nodes)
    outs = [producer[o.name] for o in g.output if o.name in producer]
    shapes = [model.shapes.get(o.name, []) for o in g.output if o.name in producer]
    nodes.append(Node(name="output", op="output", target="output", inputs=outs, input_shapes=shapes,
                      output_shape=shapes[0] if shapes else [],
                      dtype=nodes[-1].dtype if nodes else ""))
    if unknown:
        warnings.append(f"unknown ONNX ops mapped to 'other' (no FLOPs counted): {sorted(unknown)}")
    if resolver.guessed:
        warnings.append("no torch exporter signature: parameters are the floating-point "
                        "initializers named like parameters")
    missing = [f for f in resolver.fqns if f not in resolver.by_fqn]
    if missing:
        warnings.append(f"{len(missing)} parameters of the exporter's signature are not read "
                        f"by the ONNX graph (tied to another or unused; not counted), e.g. "
                        f"{missing[0]}")
    graph = Graph(name=name or Path(model.path).stem, source=model.path, nodes=nodes,
                  params=resolver.params(), warnings=warnings)
    graph.tokens = _tokens(graph)
    return graph


def _hoist_shared_views(nodes: list[Node]) -> None:
    """A view the exporter's optimiser de-duplicated across layers (e.g. the rotary
    ``cos.unsqueeze(1)`` of layer 0 reused by every layer) belongs to no single layer:
    ``layer = None``, ``attrs["shared_by_layers"]`` lists the layers reading it."""
    readers: dict[str, set[int]] = {}
    for n in nodes:
        if n.layer is not None:
            for i in n.inputs:
                readers.setdefault(i, set()).add(n.layer)
    for n in nodes:
        layers = readers.get(n.name, set())
        ops = n.attrs.get("onnx_ops", [])
        if n.layer is not None and len(layers) > 1 and ops and all(onnx_kind(o) == "view"
                                                                    for o in ops):
            n.attrs["shared_by_layers"] = sorted(layers)
            n.layer = None


def _main_output(grp: _Group) -> str:
    last = grp.nodes[-1]
    return next((o for o in last.output if o), grp.outputs[-1] if grp.outputs else "")


def _order_by_fx_args(values: list[str], fx_args: str) -> list[str]:
    """Put the values an FX node reads in its argument order: a value named like an argument
    takes that slot; an argument with no such value (merged away by the exporter's optimiser)
    takes the next unnamed value; the rest follow in reading order."""
    if not fx_args:
        return values
    refs = [r for r in _FX_REF.findall(fx_args) if not r.startswith(("p_", "b_", "c_"))]
    named = [v for v in values if v in refs]
    spare = [v for v in values if v not in refs]
    out: list[str] = []
    for r in refs:
        if r in named and r not in out:
            out.append(r)
        elif r not in values and spare:
            out.append(spare.pop(0))
    return out + [v for v in values if v not in out]


_KIND_PRIORITY = ("attention", "grouped_matmul", "matmul", "norm", "router", "activation",
                  "reduction", "gather_scatter", "elementwise", "view")


def _group_kind(onnx_nodes: list, has_params: bool) -> str:
    """Kind of a group of ONNX nodes lowered from one FX op: its most significant member
    (two activation matmuls around a softmax = attention; a matmul with a weight = linear)."""
    kinds = [onnx_kind(n.op_type, n.domain) for n in onnx_nodes if n.op_type != "Constant"]
    if kinds.count("matmul") >= 2 and any(n.op_type == "Softmax" for n in onnx_nodes):
        return "attention"
    for kind in _KIND_PRIORITY:
        if kind in kinds:
            return "linear" if kind == "matmul" and has_params else kind
    return "other"


def _scope_path(onnx_name: str) -> str:
    """Module path from a scoped node name (TorchScript exporter):
    ``/model/layers.0/self_attn/q_proj/MatMul`` -> ``model.layers.0.self_attn.q_proj``."""
    if not onnx_name.startswith("/"):
        return ""
    parts = [p for p in onnx_name.split("/")[1:-1] if p]
    return ".".join(parts)


def _unique(name: str, used: set[str]) -> str:
    base, i = name, 1
    while name in used:
        name, i = f"{base}_{i}", i + 1
    return name


def _tokens(graph: Graph) -> int:
    """Tokens in the traced example = elements of the first integer graph input (token ids)."""
    for n in graph.nodes:
        if n.op == "input" and n.dtype.startswith("int") and n.output_shape:
            t = 1
            for s in n.output_shape:
                t *= int(s)
            return t
    return 0


def trace_onnx(path: str | os.PathLike, name: str = "") -> Graph:
    """Load ``path`` into *raw* IR (see module doc); :func:`shardc.frontends.load_graph`
    then runs :func:`shardc.passes.run_passes` on it, exactly as for a torch.export graph.

    Raises :class:`InputError` (one line) for a file that cannot be read."""
    model = load_onnx(path)
    graph = onnx_to_raw_graph(model, name=name)
    if not any(n.op not in ("input", "output") for n in graph.nodes):
        raise InputError(f"{os.fspath(path)}: the ONNX graph has no operators")
    return graph


def load_onnx_graph(path: str | os.PathLike, name: str = "") -> Graph:
    """:func:`trace_onnx` + the shared passes: the complete IR of an ONNX file."""
    from shardc.passes import run_passes

    return run_passes(trace_onnx(path, name=name))
