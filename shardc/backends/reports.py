"""The files ``shardc compile`` writes, all written atomically into ``--out``.

The writing itself (the whole set appears at once or not at all; a failure or SIGTERM leaves
the previous outputs whole) is :func:`shardc.backends.atomic.write_outputs`, re-exported here.
"""

from __future__ import annotations

from tabulate import tabulate

from shardc.backends.atomic import write_outputs

__all__ = ["graph_dot", "graph_table", "write_outputs"]


def graph_table(nodes: list[dict]) -> str:
    """graph.txt: one row per IR node: node, op, shape, placements, collective inserted."""
    rows = []
    for n in nodes:
        red = n.get("redistribute") or {}
        coll = ""
        if red:
            coll = f"{red.get('collective')}@{red.get('mesh_dim')} {int(red.get('bytes', 0))} B"
        rows.append([n["name"], n["op"], "x".join(str(s) for s in n.get("shape") or []),
                     " ".join(n.get("placements") or []), coll])
    return tabulate(rows, headers=["node", "op", "shape", "placements", "collective inserted"],
                    tablefmt="plain") + "\n"


def graph_dot(graph) -> str:
    """graph.dot: nodes labelled with op and placements; edges red where a collective is inserted."""
    lines = ["digraph shardc {", "  rankdir=TB;", '  node [shape=box, fontname="monospace"];']
    for n in graph.nodes:
        label = f"{n.name}\\n{n.op}"
        if n.placements:
            label += "\\n" + " ".join(n.placements)
        lines.append(f'  "{n.name}" [label="{label}"];')
    for n in graph.nodes:
        color = ' [color=red, label="%s"]' % n.redistribute["collective"] if n.redistribute else ""
        for i in n.inputs:
            lines.append(f'  "{i}" -> "{n.name}"{color};')
    lines.append("}")
    return "\n".join(lines) + "\n"
