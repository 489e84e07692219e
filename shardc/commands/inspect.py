"""``shardc inspect FILE [--layer N] [--op KIND] [--format table|json|dot]``: the IR as a
table, JSON (``model``, ``layer_kinds``, ``nodes``; SPEC section 3/4 keys) or Graphviz dot.

The table stays readable for huge graphs: without ``--layer`` it lists the nodes outside
the decoder layers plus the *first* layer of each layer kind (the others are identical by
construction) and hides ``view`` nodes; ``--all`` lists everything. JSON and dot contain
every node that passes the ``--layer`` / ``--op`` filters.
"""

from __future__ import annotations

import sys
from pathlib import Path

from tabulate import tabulate

from shardc.errors import InputError
from shardc.ir.graph import FUSED_OP_NAMES, OP_KINDS, Graph, Node, Param
from shardc.ir.token_dims import shape_text, token_dims, traced_batch_seq
from shardc.validate import MAX_COUNT, dumps_strict_json, int_arg

HELP = "Show the operator graph of a model: nodes, op kinds, shapes, fused ops, layer kinds."


def add_arguments(p) -> None:
    p.add_argument("model", help="model file (.py), .onnx, HF config.json, or a plan.json")
    p.add_argument("--layer", type=int_arg(0, MAX_COUNT), default=None,
                   help="only nodes of decoder layer N")
    p.add_argument("--op", default=None,
                   help="only nodes of this op kind (linear, attention, ...) or fused op (qkv, ...)")
    p.add_argument("--format", default="table", choices=["table", "json", "dot"])
    p.add_argument("--all", action="store_true", help="table: every node, views included")
    p.add_argument("--tiny", action="store_true", help="trace the file's tiny_model()")
    p.add_argument("--out", default=None, help="write to this file instead of stdout")
    p.add_argument("--mesh", default=None,
                   help="GxN: also report the size of the strategy space on this mesh")
    p.add_argument("--phase", default="decode", choices=["decode", "prefill"],
                   help="workload phase for --mesh (its batch grid)")


def select_nodes(graph: Graph, layer: int | None = None, op: str | None = None) -> list[Node]:
    """Nodes matching ``layer`` (decoder-layer index) and ``op`` (kind or fused-op name)."""
    if op is not None and op not in OP_KINDS and op not in FUSED_OP_NAMES and op != "norm":
        raise InputError(f"--op {op!r}: not an op kind ({', '.join(OP_KINDS)}) "
                         f"nor a fused op ({', '.join(FUSED_OP_NAMES)})")
    if layer is not None:
        known = sorted({n.layer for n in graph.nodes if n.layer is not None})
        if layer not in known:
            span = f"0..{known[-1]}" if known else "none"
            raise InputError(f"--layer {layer}: the model has no such decoder layer (layers {span})")
    out = []
    for n in graph.nodes:
        if layer is not None and n.layer != layer:
            continue
        if op is not None and n.op != op and n.fused_op != op:
            continue
        out.append(n)
    return out


def _shape(n: Node) -> str:
    """The node's shape with its token dims tagged (``attrs["token_dims"]``)."""
    return shape_text(n.output_shape, n.attrs.get("token_dims"))


def _placements(n: Node) -> str:
    return " ".join(n.placements) if n.placements else ""


def graph_json(graph: Graph, nodes: list[Node]) -> dict:
    """The ``inspect --format json`` document."""
    return {
        "model": {"name": graph.name, "params": graph.num_params, "layers": graph.num_layers,
                  "source": graph.source},
        "layer_kinds": [{"name": k.name, "count": k.count, "layers": k.layers}
                        for k in graph.layer_kinds],
        "config": graph.config,
        "warnings": graph.warnings,
        "nodes": [{"name": n.name, "op": n.op, "target": n.target, "shape": n.output_shape,
                   "dtype": n.dtype, "inputs": n.inputs, "params": [p.fqn for p in n.params],
                   "flops": n.flops, "bytes": n.bytes, "module_path": n.module_path,
                   "layer": n.layer, "fused_op": n.fused_op, "layer_kind": n.layer_kind,
                   "placements": n.placements, "redistribute": n.redistribute,
                   "token_dims": n.attrs.get("token_dims")}
                  for n in nodes],
    }


def graph_dot(graph: Graph, nodes: list[Node], note: str = "") -> str:
    """Graphviz text of ``nodes`` (see :func:`shardc.commands.reports.graph_dot`): one box
    per node, edges between listed nodes, labels escaped."""
    from shardc.commands.reports import graph_dot as dot

    return dot(graph.name, [{"name": n.name, "op": n.op, "shape": n.output_shape,
                             "token_dims": n.attrs.get("token_dims"), "inputs": n.inputs,
                             "placements": n.placements, "redistribute": n.redistribute,
                             "fused_op": n.fused_op} for n in nodes], note)


def graph_table(graph: Graph, nodes: list[Node], condensed: bool, note: str = "") -> str:
    """Header (model, params, layer kinds) + node table; ``condensed`` hides views and all
    but the first layer of each layer kind."""
    from shardc.text import clean_text

    head = [f"model {clean_text(graph.name)}: {graph.num_params:,} parameters "
            f"({graph.num_params:.4g}), {graph.num_layers} layers, {len(graph.nodes)} nodes"]
    for k in graph.layer_kinds:
        head.append(f"  {clean_text(k.name)} x{k.count}: layers {_ranges(k.layers)}")
    if note:
        head.append(f"  {note}")
    for w in graph.warnings:
        head.append(f"  warning: {clean_text(w, 400)}")
    if condensed:
        firsts = {k.layers[0] for k in graph.layer_kinds if k.layers}
        nodes = [n for n in nodes if n.op != "view" and (n.layer is None or n.layer in firsts)]
        head.append("  (showing non-view nodes outside the layers and the first layer of each "
                    "kind; --layer N for one layer, --all for every node)")
    rows = [[clean_text(n.name), clean_text(n.op), _shape(n), n.fused_op or "",
             clean_text(n.layer_kind or ""), "" if n.layer is None else n.layer,
             _placements(n)] for n in nodes]  # names from an ONNX file: one line each
    table = tabulate(rows, headers=["node", "op", "shape", "fused op", "layer kind", "layer",
                                    "placements"], tablefmt="simple")
    return "\n".join(head) + "\n\n" + table + "\n"


def _ranges(xs: list[int]) -> str:
    out, start, prev = [], None, None
    for x in xs:
        if start is None:
            start = prev = x
        elif x == prev + 1:
            prev = x
        else:
            out.append(f"{start}" if start == prev else f"{start}-{prev}")
            start = prev = x
    if start is not None:
        out.append(f"{start}" if start == prev else f"{start}-{prev}")
    return ",".join(out)


def space_summary(graph: Graph, mesh_text: str, phase: str = "decode") -> dict:
    """Size of the search space of SPEC section 7 on a mesh: candidate values per degree,
    per-op slots, and joint configurations before / after masking illegal op choices."""
    import numpy as np

    from shardc.ir.space import DEGREE_COMPONENTS, StrategySpace
    from shardc.ir.strategy import Mesh, Workload

    space = StrategySpace(graph, Mesh.parse(mesh_text), Workload(phase=phase))
    legal = 0
    others = 1
    for c in DEGREE_COMPONENTS:
        if c != "tp":
            others *= len(space.values[c])
    for tp_idx in range(len(space.values["tp"])):
        per_op = space.op_masks(np.array([tp_idx]))[0].sum(axis=1)
        legal += others * int(np.prod(per_op.astype(object)))
    return {"mesh": mesh_text, "degrees": {c: space.values[c] for c in DEGREE_COMPONENTS},
            "op_slots": space.op_slots, "configurations": space.size,
            "legal_configurations": legal}


def graph_from_plan(path: str) -> Graph:
    """An annotated graph dump: plan.json (validated, schema_version 1 or 2) -> Graph whose nodes
    carry the plan's placements and redistributions."""
    from shardc.ir.graph import LayerKind
    from shardc.plan import load_plan

    plan = load_plan(path)
    nodes = [Node(name=n["name"], op=n["op"], output_shape=list(n.get("shape") or []),
                  placements=list(n.get("placements") or []), redistribute=n.get("redistribute"),
                  stage=n.get("stage"), layer=n.get("layer"), fused_op=n.get("fused_op"),
                  layer_kind=n.get("layer_kind"), inputs=list(n.get("inputs") or []),
                  attrs={"token_dims": n.get("token_dims")}) for n in plan.nodes]
    kinds = [LayerKind(name=k["name"], count=int(k["count"]), layers=list(k.get("layers", [])))
             for k in plan.layer_kinds]
    params = [Param(fqn=p["fqn"], shape=list(p["shape"])) for p in plan.params]
    return Graph(name=plan.model["name"], source=plan.model.get("source", ""), nodes=nodes,
                 params=params, layer_kinds=kinds)


def _is_plan_file(path: str) -> bool:
    """A ``.json`` that is not an HF config (no ``model_type``) is read as a plan.json."""
    if not path.endswith(".json"):
        return False
    try:
        with open(path, "rb") as f:
            return b'"model_type"' not in f.read()
    except OSError:
        return False  # let the model loader say the file is missing


def run(args) -> int:
    from shardc.backends.atomic import check_single_file_target
    from shardc.frontends import load_graph

    if args.out:  # before any work: a symlink / device / FIFO is refused, never replaced
        check_single_file_target(Path(args.out), f"--out {args.out}")
    if _is_plan_file(args.model):  # shapes at the plan's workload (plan.json nodes)
        for flag, given in (("--mesh", args.mesh), ("--tiny", args.tiny)):
            if given:
                raise InputError(f"{flag}: not used with a plan.json (its graph, mesh and "
                                 "sizes are the plan's); give the model instead")
        from shardc.commands.reports import plan_note
        from shardc.plan import load_plan

        graph = graph_from_plan(args.model)
        note = plan_note(load_plan(args.model))
    else:  # shapes of the traced example, token dims tagged
        graph = load_graph(args.model, tiny=args.tiny)
        tags = token_dims(graph)
        for n in graph.nodes:
            n.attrs["token_dims"] = tags.get(n.name)
        batch, seq = traced_batch_seq(graph)
        note = (f"shapes of the traced example, batch {batch} x {seq} tokens; token dims are "
                "tagged: (b) batch, (s) tokens per sequence, (t) flattened tokens, (kv) key "
                "positions")
    nodes = select_nodes(graph, args.layer, args.op)
    space = space_summary(graph, args.mesh, args.phase) if args.mesh else None
    if args.format == "json":
        doc = graph_json(graph, nodes)
        if space:
            doc["space"] = space
        text = dumps_strict_json(doc, indent=1, sort_keys=True) + "\n"
    elif args.format == "dot":
        text = graph_dot(graph, nodes, note)
    else:
        condensed = not args.all and args.layer is None and args.op is None
        text = graph_table(graph, nodes, condensed, note)
        if space:
            deg = " ".join(f"{k}{v}" for k, v in space["degrees"].items())
            text = (f"strategy space on {space['mesh']}: {deg} x 3^{len(space['op_slots'])} op "
                    f"choices = {space['configurations']:.3g} configurations "
                    f"({space['legal_configurations']:.3g} legal)\n") + text
    if args.out:
        from shardc.backends.atomic import write_file_atomic

        write_file_atomic(args.out, text, f"--out {args.out}")
    else:
        sys.stdout.write(text)
    return 0
