"""Read an ``.onnx`` file into a checked, shape-inferred :class:`OnnxModel` (no weights read).

Weights are never loaded: the protobuf is read with ``load_external_data=False`` and each
external-data reference is only checked to exist and to be long enough. Then local
functions are inlined and ONNX shape inference runs (``data_prop=True`` so that shapes
computed by ``Shape``/``Concat``/``Reshape`` chains resolve). What the torch dynamo
exporter leaves behind is parsed too: the exported program's graph signature
(placeholder -> parameter FQN) and per-node provenance (FX node, module name scopes).

Every failure is a one-line :class:`~shardc.errors.InputError` naming the file.
Shapes are in elements; dtypes are spelled as torch spells them (``"bfloat16"``).
"""

from __future__ import annotations

import ast
import math
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

import onnx
import onnx.inliner  # a submodule: "import onnx" alone does not load it
from onnx import TensorProto, shape_inference

from shardc.errors import InputError

# Oldest default-domain opset whose operators this frontend maps (opset 7 = ONNX 1.2).
MIN_OPSET = 7

_DTYPE_NAMES = {
    TensorProto.FLOAT: "float32", TensorProto.DOUBLE: "float64", TensorProto.FLOAT16: "float16",
    TensorProto.BFLOAT16: "bfloat16", TensorProto.INT64: "int64", TensorProto.INT32: "int32",
    TensorProto.INT16: "int16", TensorProto.INT8: "int8", TensorProto.UINT8: "uint8",
    TensorProto.BOOL: "bool", TensorProto.FLOAT8E4M3FN: "float8_e4m3fn",
    TensorProto.FLOAT8E5M2: "float8_e5m2",
}
_FLOAT_TYPES = {TensorProto.FLOAT, TensorProto.DOUBLE, TensorProto.FLOAT16, TensorProto.BFLOAT16,
                TensorProto.FLOAT8E4M3FN, TensorProto.FLOAT8E5M2}

_SIGNATURE_KEY = "pkg.torch.export.ExportedProgram.graph_signature"
_SIGNATURE_LINE = re.compile(r"^\s*(\S+):\s*PARAMETER\s+target='([^']+)'")
_FX_HEAD = re.compile(r"^%(\S+)\s*:.*?target=([^\]]+)\]")


def dtype_name(elem_type: int) -> str:
    """ONNX element type -> torch's dtype name (``TensorProto.BFLOAT16`` -> ``"bfloat16"``);
    ``""`` when unknown (0: the output of a custom-domain op shape inference cannot type)."""
    if elem_type in _DTYPE_NAMES:
        return _DTYPE_NAMES[elem_type]
    try:
        return onnx.helper.tensor_dtype_to_string(elem_type).replace("TensorProto.", "").lower()
    except (KeyError, ValueError):
        return ""


@dataclass
class Initializer:
    """A constant tensor of the graph: shape (elements) and element type; data not read."""

    name: str
    shape: list[int]
    elem_type: int

    @property
    def is_float(self) -> bool:
        return self.elem_type in _FLOAT_TYPES

    @property
    def numel(self) -> int:
        return math.prod(int(s) for s in self.shape)


@dataclass
class Provenance:
    """What the torch exporter recorded for one ONNX node (empty strings when absent)."""

    fx_name: str = ""  # the FX node this ONNX node was lowered from
    fx_target: str = ""  # its op, e.g. "aten.linear.default"
    fx_args: str = ""  # the FX node's argument text (names placeholders such as %p_...)
    module_path: str = ""  # innermost module scope, e.g. "model.layers.0.mlp.up_proj"


@dataclass
class OnnxModel:
    """A loaded, checked and shape-inferred ONNX model (see module doc)."""

    path: str
    proto: onnx.ModelProto
    opset: int
    shapes: dict[str, list[int]] = field(default_factory=dict)  # value -> static shape
    elem_types: dict[str, int] = field(default_factory=dict)  # value -> ONNX element type
    initializers: dict[str, Initializer] = field(default_factory=dict)
    param_targets: dict[str, str] = field(default_factory=dict)  # placeholder -> parameter FQN
    warnings: list[str] = field(default_factory=list)

    @property
    def graph(self) -> onnx.GraphProto:
        return self.proto.graph

    def provenance(self, node: onnx.NodeProto) -> Provenance:
        meta = {p.key: p.value for p in node.metadata_props}
        prov = Provenance()
        fx = meta.get("pkg.torch.onnx.fx_node", "")
        m = _FX_HEAD.match(fx)
        if m:
            prov.fx_name, prov.fx_target = m.group(1), m.group(2).replace("torch.ops.", "")
            prov.fx_args = fx[m.end():]
        scopes = meta.get("pkg.torch.onnx.name_scopes", "")
        if scopes:
            names = literal_or(scopes, [])
            if not isinstance(names, (list, tuple)):
                names = []
            # the last scope is the FX node itself; the one before is its innermost module
            modules = [s for s in names[:-1] if isinstance(s, str) and s]
            prov.module_path = modules[-1] if modules else ""
        return prov


def literal_or(text: str, default):
    """``ast.literal_eval(text)``, or ``default`` when the text is not a Python literal:
    metadata an exporter wrote is data, never evaluated as code."""
    try:
        return ast.literal_eval(text)
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        return default


def _fail(path: str, what: str) -> InputError:
    return InputError(f"{path}: {what}")


def _external_data_file(path: str, base: Path, tensor_name: str, location: str) -> Path:
    """The file an external-data ``location`` names; it must be a relative path that, with
    symlinks resolved, stays inside the model's folder ``base`` (resolved) -- a model file
    must not make shardc read (or report the size of) any other file on the machine."""
    refused = _fail(path, f"initializer {tensor_name!r} has external data at {location!r}, "
                          f"outside the model's folder {str(base)!r} (refused)")
    if "\0" in location or Path(location).is_absolute():
        raise refused
    try:
        target = (base / location).resolve()
    except (OSError, RuntimeError):  # a symlink loop
        raise refused from None
    if not target.is_relative_to(base):
        raise refused
    return target


def _byte_count(path: str, tensor_name: str, info: dict, key: str) -> int:
    """External-data ``offset`` / ``length`` (bytes) as a non-negative int (0 when absent)."""
    text = info.get(key, "") or "0"
    if not (text.isascii() and text.isdigit()):
        raise _fail(path, f"initializer {tensor_name!r} has external-data {key} {text!r} "
                          "(expected a non-negative integer)")
    return int(text)


def _check_external_data(path: str, proto: onnx.ModelProto) -> None:
    """Every external-data reference must name a file inside the model's folder, existing
    and long enough for it."""
    base = Path(path).resolve().parent
    sizes: dict[str, int] = {}
    for tensor in onnx.external_data_helper._get_all_tensors(proto):
        if tensor.data_location != TensorProto.EXTERNAL:
            continue
        info = {e.key: e.value for e in tensor.external_data}
        location = info.get("location", "")
        if not location:
            raise _fail(path, f"initializer {tensor.name!r} has external data with no location")
        target = _external_data_file(path, base, tensor.name, location)
        if location not in sizes:
            if not target.is_file():
                raise _fail(path, f"external data file {location!r} is missing (needed by "
                                  f"initializer {tensor.name!r}; looked in {base})")
            sizes[location] = target.stat().st_size
        end = (_byte_count(path, tensor.name, info, "offset")
               + _byte_count(path, tensor.name, info, "length"))
        if end > sizes[location]:
            raise _fail(path, f"external data file {location!r} is truncated: initializer "
                              f"{tensor.name!r} needs bytes up to {end}, file has {sizes[location]}")


def _read_proto(path: str) -> onnx.ModelProto:
    p = Path(path)
    if not p.exists():
        raise _fail(path, "no such file")
    if not p.is_file():
        raise _fail(path, "not a file")
    try:
        proto = onnx.load_model(os.fspath(p), load_external_data=False)
    except Exception as e:  # protobuf DecodeError and friends: one line
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise _fail(path, f"not a readable ONNX model ({type(e).__name__}: {reason[:160]})") from e
    if not proto.HasField("graph") or not proto.graph.node:
        raise _fail(path, "not a readable ONNX model (no graph or an empty graph)")
    return proto


def _default_opset(path: str, proto: onnx.ModelProto) -> int:
    versions = {o.domain: o.version for o in proto.opset_import}
    if "" not in versions and "ai.onnx" not in versions:
        raise _fail(path, "model imports no default-domain ONNX opset")
    version = versions.get("", versions.get("ai.onnx", 0))
    newest = onnx.defs.onnx_opset_version()
    if version < MIN_OPSET or version > newest:
        raise _fail(path, f"ONNX opset {version} is not supported (this frontend reads "
                          f"opsets {MIN_OPSET}..{newest}; onnx {onnx.__version__})")
    return version


def _record_value(info: onnx.ValueInfoProto, shapes: dict, types: dict) -> None:
    t = info.type.tensor_type
    if not info.type.HasField("tensor_type"):
        return
    types[info.name] = t.elem_type
    if t.HasField("shape") and all(d.HasField("dim_value") for d in t.shape.dim):
        shapes[info.name] = [int(d.dim_value) for d in t.shape.dim]


def _fix_symbolic_inputs(proto: onnx.ModelProto, batch: int, seq: int) -> dict[str, int]:
    """Give symbolic graph-input dims concrete sizes (in place): a symbol first seen as dim 0
    is the batch, one whose name mentions ``past`` is an empty KV cache (0), any other is the
    sequence. Returns ``{symbol: size}``; clears value_info that may hold symbolic shapes."""
    g = proto.graph
    inits = {i.name for i in g.initializer}
    sizes: dict[str, int] = {}
    for inp in g.input:
        if inp.name in inits or not inp.type.HasField("tensor_type"):
            continue
        for i, d in enumerate(inp.type.tensor_type.shape.dim):
            if d.HasField("dim_value"):
                continue
            sym = d.dim_param or f"{inp.name}[{i}]"
            if sym not in sizes:
                sizes[sym] = 0 if "past" in sym.lower() else batch if i == 0 else seq
            d.dim_value = sizes[sym]
    return sizes


def _symbolic_shapes(proto: onnx.ModelProto) -> dict[str, list[int | str]]:
    """value -> dims as recorded by the exporter (``dim_param`` strings such as ``"seq + 1"``)."""
    out: dict[str, list[int | str]] = {}
    for info in list(proto.graph.value_info) + list(proto.graph.output):
        t = info.type.tensor_type
        if info.type.HasField("tensor_type") and t.HasField("shape"):
            out[info.name] = [d.dim_value if d.HasField("dim_value") else d.dim_param
                              for d in t.shape.dim]
    return out


_BINOPS = {ast.Add: lambda a, b: a + b, ast.Sub: lambda a, b: a - b,
           ast.Mult: lambda a, b: a * b, ast.FloorDiv: lambda a, b: a // b,
           ast.Mod: lambda a, b: a % b}


def eval_dim(expr: int | str, sizes: dict[str, int]) -> int | None:
    """Size of a symbolic dim (``"seq + 1"``, ``"2*batch"``, ``"Max(1, seq)"``) given symbol
    sizes; None if it is not an integer expression of known symbols."""
    if isinstance(expr, int):
        return expr
    if not expr:
        return None

    def ev(n):
        if isinstance(n, ast.Expression):
            return ev(n.body)
        if isinstance(n, ast.Constant) and isinstance(n.value, int):
            return n.value
        if isinstance(n, ast.Name):
            return sizes[n.id]
        if isinstance(n, ast.UnaryOp) and isinstance(n.op, ast.USub):
            return -ev(n.operand)
        if isinstance(n, ast.BinOp) and type(n.op) in _BINOPS:
            return _BINOPS[type(n.op)](ev(n.left), ev(n.right))
        if isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id in ("Max", "Min"):
            vals = [ev(a) for a in n.args]
            return max(vals) if n.func.id == "Max" else min(vals)
        raise ValueError(expr)

    try:
        value = ev(ast.parse(expr, mode="eval"))
    except (ValueError, KeyError, SyntaxError, ZeroDivisionError):
        return None
    return int(value) if isinstance(value, int) else None


def load_onnx(path: str | os.PathLike, batch: int = 1, seq: int = 16) -> OnnxModel:
    """Read, check and shape-infer ``path`` (see module doc); raises one-line InputError.

    Symbolic (dynamic) input dims are traced at ``batch`` x ``seq`` tokens (the torch
    frontend's example is 1 x 16) and a warning records the sizes chosen."""
    path = os.fspath(path)
    proto = _read_proto(path)
    opset = _default_opset(path, proto)
    _check_external_data(path, proto)
    if proto.functions:
        try:
            proto = onnx.inliner.inline_local_functions(proto)
        except Exception as e:
            raise _fail(path, f"cannot inline the model's local functions: {e}") from e
    recorded = _symbolic_shapes(proto)
    symbols = _fix_symbolic_inputs(proto, batch, seq)
    try:
        proto = shape_inference.infer_shapes(proto, strict_mode=False, data_prop=True)
    except Exception as e:
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise _fail(path, f"ONNX shape inference failed: {reason[:200]}") from e

    model = OnnxModel(path=path, proto=proto, opset=opset)
    g = proto.graph
    for init in g.initializer:
        model.initializers[init.name] = Initializer(init.name, [int(d) for d in init.dims],
                                                    init.data_type)
        model.shapes[init.name] = [int(d) for d in init.dims]
        model.elem_types[init.name] = init.data_type
    for node in g.node:  # Constant nodes carry their tensor inline
        if node.op_type == "Constant" and node.output:
            for a in node.attribute:
                if a.name == "value" and a.HasField("t"):
                    model.shapes[node.output[0]] = [int(d) for d in a.t.dims]
                    model.elem_types[node.output[0]] = a.t.data_type
    for info in list(g.input) + list(g.value_info) + list(g.output):
        _record_value(info, model.shapes, model.elem_types)
    if symbols:  # shapes inference could not resolve (e.g. after Range): the exporter's own
        for name, dims in recorded.items():
            if name not in model.shapes:
                sized = [eval_dim(d, symbols) for d in dims]
                if all(d is not None for d in sized):
                    model.shapes[name] = sized

    meta = {p.key: p.value for p in list(proto.metadata_props) + list(g.metadata_props)}
    for line in meta.get(_SIGNATURE_KEY, "").splitlines():
        m = _SIGNATURE_LINE.match(line)
        if m:
            model.param_targets[m.group(1)] = m.group(2)
    if symbols:
        model.warnings.append("symbolic input dims set to " + ", ".join(
            f"{k}={v}" for k, v in symbols.items()) + " (batch, sequence; 'past' = empty cache)")
    unknown_domains = sorted({n.domain for n in g.node if n.domain not in ("", "ai.onnx")})
    if unknown_domains:
        model.warnings.append(f"operators from non-standard domains {unknown_domains} are "
                              "mapped to op kind 'other'")
    return model
