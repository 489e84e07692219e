"""torch.export frontend: an ``nn.Module`` + example inputs -> raw IR :class:`Graph`.

The model is wrapped (``input_ids -> logits``, ``use_cache=False`` for HF models) and
exported with non-strict ``torch.export`` under ``torch.no_grad()`` (so HF's rotary
``no_grad`` / autocast contexts do not become higher-order ops). Full-size models are traced
on the ``meta`` device: nothing is allocated.

Raw IR produced here (canonicalise turns it into op kinds, FLOPs and bytes):

* one :class:`Node` per ``call_function`` with an output, ``op = "other"`` until
  canonicalised, ``target`` = the op's string (``aten.linear.default``);
* graph inputs -> ``op = "input"`` nodes (``input_ids``, ``input_1`` ...), the graph output ->
  one ``op = "output"`` node;
* parameters are not nodes: a parameter placeholder, and any pure view/cast of it
  (``transpose``, ``t``, ``view``, ``to`` ...), is an *alias* of the parameter, and the
  :class:`Param` record is attached to the node that consumes it;
* buffers and constants (e.g. rotary ``inv_freq``) are neither nodes nor params;
* ``module_path`` = innermost ``nn_module_stack`` entry (wrapper prefix removed), ``layer``
  = the first numeric component of that path (``model.layers.12.mlp`` -> 12);
* ``attrs["attention_window"]`` on the nodes of a sliding-window layer: its window in tokens
  (:mod:`shardc.frontends.attention_window`).

``Graph.params`` holds every parameter of the module once (tied weights once), in
``named_parameters`` order, so ``Graph.num_params == sum(p.numel() for p in module.parameters())``.
"""

from __future__ import annotations

import re
from typing import Any

import torch
from torch import nn

from shardc.errors import InputError
from shardc.frontends.attention_window import record_windows
from shardc.frontends.imports import user_code
from shardc.ir.graph import Graph, Node, Param

# Ops that only reinterpret a tensor; applied to a parameter they yield an alias of it.
_PARAM_VIEW_OPS = {
    "transpose", "t", "view", "reshape", "permute", "expand", "unsqueeze", "squeeze",
    "to", "_to_copy", "contiguous", "alias", "clone", "detach", "type_as", "_unsafe_view",
    "numpy_T", "mT", "flatten",
}
# Ops with no tensor output that are dropped.
_DROPPED_OPS = {"_assert_tensor_metadata", "_assert_scalar", "sym_constrain_range_for_size",
                "_assert_async", "sym_size", "sym_numel", "sym_stride"}

_LAYER_RE = re.compile(r"(?:^|\.)(\d+)(?:\.|$)")


class _LogitsWrapper(nn.Module):
    """``input_ids -> logits``: drops HF output objects and the KV cache."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model
        config = getattr(model, "config", None)
        self._hf = config is not None and hasattr(config, "use_cache")

    def forward(self, *args):
        out = self.model(*args, use_cache=False) if self._hf else self.model(*args)
        if hasattr(out, "logits"):
            return out.logits
        if isinstance(out, (tuple, list)):
            return out[0]
        return out


def dtype_name(dtype: Any) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"``."""
    return str(dtype).replace("torch.", "")


def target_name(target: Any) -> str:
    """Stable string for an FX target: ``aten.mm.default``, ``getitem``, ``wrap_with_...``."""
    if isinstance(target, torch._ops.OpOverload):
        ns = target.namespace
        return f"{ns}.{target._schema.name.split('::')[-1]}.{target._overloadname}"
    if isinstance(target, torch._ops.HigherOrderOperator):
        return target.name()
    name = getattr(target, "__name__", None) or str(target)
    return name


def _op_base(target_str: str) -> str:
    parts = target_str.split(".")
    return parts[1] if len(parts) >= 3 and parts[0] == "aten" else parts[-1]


def _tensor_meta(val: Any) -> tuple[list[int], str] | None:
    if isinstance(val, torch.Tensor):
        return [int(s) for s in val.shape], dtype_name(val.dtype)
    return None


def _output_meta(val: Any) -> tuple[list[int], str, list[list[int]]]:
    """(first output shape, its dtype, all output shapes) of an FX node's ``meta['val']``."""
    if isinstance(val, (tuple, list)):
        metas = [_tensor_meta(v) for v in val]
        shapes = [m[0] for m in metas if m]
        first = next((m for m in metas if m), None)
        return (first[0], first[1], shapes) if first else ([], "", [])
    m = _tensor_meta(val)
    return (m[0], m[1], [m[0]]) if m else ([], "", [])


def _module_path(fx_node: torch.fx.Node, prefix: str) -> str:
    stack = fx_node.meta.get("nn_module_stack") or {}
    if not stack:
        return ""
    path = list(stack.values())[-1][0]
    path = path.replace("L['self'].", "").replace("L__self___", "")
    if path == prefix.rstrip("."):
        return ""
    return path[len(prefix):] if path.startswith(prefix) else path


def layer_of(module_path: str) -> int | None:
    """Decoder-layer index: the first numeric component of a module path, else None."""
    m = _LAYER_RE.search(module_path)
    return int(m.group(1)) if m else None


def _flat_args(args: Any) -> list[Any]:
    out: list[Any] = []
    stack = [args]
    while stack:
        a = stack.pop(0)
        if isinstance(a, (list, tuple)):
            stack[0:0] = list(a)
        elif isinstance(a, dict):
            stack[0:0] = list(a.values())
        else:
            out.append(a)
    return out


def export_program(model: nn.Module, example_inputs: tuple) -> torch.export.ExportedProgram:
    """Non-strict ``torch.export`` of ``model`` wrapped as ``input_ids -> logits``."""
    wrapper = _LogitsWrapper(model)
    # Per-node Python stack traces are not needed by shardc and cost ~10% of the trace time.
    saved = torch.fx.config.do_not_emit_stack_traces
    torch.fx.config.do_not_emit_stack_traces = True
    from shardc.frontends.hf_build import static_rope
    from shardc.frontends.recurrent_kernels import recurrent_kernels

    ids = next((a for a in example_inputs if isinstance(a, torch.Tensor)), None)
    seq = int(ids.shape[-1]) if ids is not None and ids.ndim else 1
    try:
        with torch.no_grad(), static_rope(model, seq), recurrent_kernels(model), \
                user_code(type(model).__name__, "tracing the forward pass"):
            return torch.export.export(wrapper, tuple(example_inputs), strict=False)
    except InputError:
        raise
    except Exception as e:
        msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        why = ""
        if type(e).__name__ == "GuardOnDataDependentSymNode":
            why = ("; the forward branches on the values of its data (e.g. an expert loop "
                   "over the experts the router hit), which no trace can represent -- not "
                   "supported")
        raise InputError(f"torch.export failed for {type(model).__name__}: "
                         f"{type(e).__name__}: {msg}{why}") from e
    finally:
        torch.fx.config.do_not_emit_stack_traces = saved


def trace_module(model: nn.Module, example_inputs: tuple, name: str = "", source: str = "") -> Graph:
    """Trace ``model`` at ``example_inputs`` into a raw IR :class:`Graph` (see module doc).

    Inputs are moved to the model's device (``meta`` for full-size models)."""
    return trace_program(model, example_inputs, name=name, source=source)[0]


def trace_program(model: nn.Module, example_inputs: tuple, name: str = "",
                  source: str = "") -> tuple[Graph, torch.export.ExportedProgram]:
    """:func:`trace_module` that also returns the exported program it converted (the
    reduced-depth frontend reads the FX node names and module stacks of it)."""
    first = next(iter(model.parameters()), None)
    device = first.device if first is not None else torch.device("cpu")
    example_inputs = tuple(a.to(device) if isinstance(a, torch.Tensor) else a for a in example_inputs)
    from shardc.frontends.fused_experts import fused_experts

    with fused_experts(model):  # DBRX's [E * f, h] experts, seen as [E, f, h] grouped matmuls
        ep = export_program(model, example_inputs)
        graph = program_to_graph(ep, model, name=name or type(model).__name__, source=source)
    ids = next((a for a in example_inputs if isinstance(a, torch.Tensor)), None)
    graph.tokens = int(ids.numel()) if ids is not None else 0
    max_pos = max_positions(model)
    if max_pos:
        graph.config["max_position_embeddings"] = max_pos
    graph.config.update(state_dtype_facts(model))
    return graph, ep


def state_dtype_facts(model: nn.Module) -> dict:
    """The config facts the recurrent state's dtype rule reads
    (:func:`shardc.ir.recurrent.ssm_state_bytes`): ``model_type`` and, when the config names
    one, ``mamba_ssm_cache_dtype`` (strings, data only)."""
    config = getattr(model, "config", None)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    out = {}
    for key in ("model_type", "mamba_ssm_cache_dtype"):
        value = getattr(text, key, None)
        if isinstance(value, str) and value:
            out[key] = value
    return out


def max_positions(model: nn.Module) -> int | None:
    """The longest sequence the model's config allows (``max_position_embeddings`` of its
    text config; GPT-2's ``n_positions``), or None when the model has no such config."""
    config = getattr(model, "config", None)
    if config is None:
        return None
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    value = getattr(text, "max_position_embeddings", None)
    return int(value) if isinstance(value, int) and value > 0 else None


def program_to_graph(ep: torch.export.ExportedProgram, model: nn.Module, name: str,
                     source: str = "") -> Graph:
    """Convert an exported program of :class:`_LogitsWrapper` (``model``) into raw IR."""
    prefix = "model."
    sig = ep.graph_signature
    param_of_placeholder = {k: v[len(prefix):] if v.startswith(prefix) else v
                            for k, v in sig.inputs_to_parameters.items()}
    user_inputs = set(sig.user_inputs)

    params: dict[str, Param] = {}
    for fqn, p in model.named_parameters():
        params[fqn] = Param(fqn=fqn, shape=[int(s) for s in p.shape], dtype=dtype_name(p.dtype))
    graph = Graph(name=name, source=source, params=list(params.values()))
    # a tied weight reached under another name (GPT-2's lm_head.weight) is the one Param
    canonical = {id(p): fqn for fqn, p in model.named_parameters()}
    for fqn, p in model.named_parameters(remove_duplicate=False):
        if fqn not in params and id(p) in canonical:
            params[fqn] = params[canonical[id(p)]]
    alias: dict[str, list[Param]] = {}  # fx name -> params it is a view of
    # fx name -> the parameter's dims in the order the view shows them (None: reshaped)
    dim_order: dict[str, tuple[int, ...] | None] = {}
    produced: set[str] = set()  # fx names that are IR nodes (valid inputs)
    rename: dict[str, str] = {}  # graph inputs: args_0 -> input_ids
    nodes: list[Node] = []

    for fx in ep.graph.nodes:
        if fx.op == "placeholder":
            if fx.name in param_of_placeholder:
                fqn = param_of_placeholder[fx.name]
                p = params.get(fqn)
                if p is None:
                    val = fx.meta.get("val")
                    p = Param(fqn=fqn, shape=list(val.shape), dtype=dtype_name(val.dtype))
                alias[fx.name] = [p]
                dim_order[fx.name] = tuple(range(len(p.shape)))
            elif fx.name in user_inputs:
                shape, dt, _ = _output_meta(fx.meta.get("val"))
                count = sum(1 for n in nodes if n.op == "input")
                rename[fx.name] = "input_ids" if count == 0 else f"input_{count}"
                nodes.append(Node(name=rename[fx.name], op="input", target="input",
                                  output_shape=shape, dtype=dt))
                produced.add(fx.name)
            continue
        if fx.op == "output":
            outs = [rename.get(a.name, a.name) for a in _flat_args(fx.args)
                    if isinstance(a, torch.fx.Node) and a.name in produced]
            shapes = [nodes_by_name_shape(nodes, o) for o in outs]
            nodes.append(Node(name="output", op="output", target="output", inputs=outs,
                              input_shapes=shapes, output_shape=shapes[0] if shapes else [],
                              dtype=nodes[-1].dtype if nodes else ""))
            continue
        if fx.op != "call_function":
            continue  # get_attr (constants, HOP sub-graphs)
        tname = target_name(fx.target)
        base = _op_base(tname)
        if base in _DROPPED_OPS:
            continue
        arg_nodes = [a for a in _flat_args((fx.args, fx.kwargs)) if isinstance(a, torch.fx.Node)]
        shape, dt, shapes = _output_meta(fx.meta.get("val"))
        if not shapes and fx.meta.get("val") is None and not fx.users:
            continue  # no output, no users: an assertion-like op
        tensor_args = [a for a in arg_nodes if a.name in alias or a.name in produced]
        if (tensor_args and all(a.name in alias for a in tensor_args)
                and (base in _PARAM_VIEW_OPS or tname == "getitem")):
            alias[fx.name] = [p for a in tensor_args for p in alias[a.name]]
            dim_order[fx.name] = _view_dims(base, fx, dim_order.get(tensor_args[0].name))
            continue
        node_params: list[Param] = []
        inputs: list[str] = []
        in_shapes: list[list[int]] = []
        param_dims: dict[str, list[int] | None] = {}
        for a in arg_nodes:
            if a.name in alias:
                for p in alias[a.name]:
                    if p not in node_params:
                        node_params.append(p)
                    order = dim_order.get(a.name)
                    if order != tuple(range(len(p.shape))) and p.fqn not in param_dims:
                        param_dims[p.fqn] = None if order is None else list(order)
            elif a.name in produced:
                inputs.append(rename.get(a.name, a.name))
                in_shapes.append(_output_meta(a.meta.get("val"))[0])
        mpath = _module_path(fx, prefix)
        node = Node(name=fx.name, op="other", target=tname, inputs=inputs, input_shapes=in_shapes,
                    output_shape=shape, dtype=dt, params=node_params, module_path=mpath,
                    layer=layer_of(mpath))
        if len(shapes) > 1:
            node.attrs["output_shapes"] = shapes
        if param_dims:  # per parameter (node.params order) the dims as the op sees them
            node.attrs["param_dims"] = [param_dims.get(p.fqn, list(range(len(p.shape))))
                                        for p in node_params]
        scalars = [a for a in fx.args if isinstance(a, (int, float, bool)) and not isinstance(a, torch.fx.Node)]
        if scalars:
            node.attrs["scalars"] = scalars
        if fx.kwargs:
            kw = {k: v for k, v in fx.kwargs.items() if isinstance(v, (int, float, bool, str))}
            if kw:
                node.attrs["kwargs"] = kw
        nodes.append(node)
        produced.add(fx.name)
    record_windows(nodes, model, layer_of)
    graph.nodes = nodes
    return graph


_KEEP_DIMS = {"to", "_to_copy", "contiguous", "alias", "clone", "detach", "type_as"}


def _view_dims(base: str, fx: torch.fx.Node, order: tuple[int, ...] | None
               ) -> tuple[int, ...] | None:
    """The parameter dims in the order view ``fx`` (op ``base``) of a parameter view shows
    them, given ``order`` for its input: a transpose / permute reorders them, a cast keeps
    them, any other view (reshape, expand, ...) loses the correspondence (None)."""
    if order is None or base in _KEEP_DIMS:
        return order
    n = len(order)
    if base in ("t", "numpy_T", "mT") and n >= 2:
        return (*order[:-2], order[-1], order[-2])
    args = [a for a in fx.args[1:] if isinstance(a, int)]
    if base == "transpose" and len(args) == 2:
        i, j = (a % n for a in args)
        out = list(order)
        out[i], out[j] = out[j], out[i]
        return tuple(out)
    if base == "permute" and len(fx.args) > 1 and isinstance(fx.args[1], (list, tuple)):
        return tuple(order[int(d) % n] for d in fx.args[1])
    return None


def nodes_by_name_shape(nodes: list[Node], name: str) -> list[int]:
    for n in reversed(nodes):
        if n.name == name:
            return n.output_shape
    return []
