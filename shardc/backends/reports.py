"""The files ``shardc compile`` writes, all written atomically into ``--out``.

Every file is first written into a temporary directory beside the output directory and then
moved into place with ``os.replace`` (atomic per file), after all of them were produced: a
crash while producing any file leaves the previous outputs untouched and no partial file.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

from tabulate import tabulate

from shardc.errors import InputError


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


def write_outputs(out_dir: str | Path, files: dict[str, object]) -> list[Path]:
    """Write ``{filename: str | bytes | dict | callable(path)}`` atomically into ``out_dir``.

    A dict is written as JSON; a callable is called with the temp path to write the file
    itself (e.g. matplotlib's savefig). Returns the final paths. An output folder that cannot
    be created or written is bad input (:class:`~shardc.errors.InputError`, exit 2).
    """
    out = Path(out_dir)
    try:
        out.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=".shardc-tmp-", dir=out))
    except OSError as e:
        raise InputError(f"{out}: cannot write outputs there ({e.strerror or e})") from None
    try:
        for name, content in files.items():
            p = tmp / name
            if callable(content):
                content(p)
            elif isinstance(content, bytes):
                p.write_bytes(content)
            elif isinstance(content, (dict, list)):
                p.write_text(json.dumps(content, indent=2, sort_keys=False) + "\n")
            else:
                p.write_text(str(content))
        final = []
        for name in files:
            os.replace(tmp / name, out / name)
            final.append(out / name)
        return final
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
