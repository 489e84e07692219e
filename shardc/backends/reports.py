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

from shardc.errors import InputError

GRAPH_TABLE_HEADERS = ("node", "op", "shape", "placements", "collective inserted")


def graph_table(nodes: list[dict], note: str = "") -> str:
    """graph.txt: one row per IR node (plan.json ``nodes``): node, op, shape (token dims
    tagged, see :func:`shardc.ir.token_dims.shape_text`), placements, collective inserted;
    ``note`` (e.g. which workload the shapes are at) goes first, as a ``#`` line. The table
    is ``tabulate``'s ``plain`` format (:func:`plain_table`)."""
    from shardc.ir.token_dims import shape_text

    rows = []
    for n in nodes:
        red = n.get("redistribute") or {}
        coll = ""
        if red:
            coll = f"{red.get('collective')}@{red.get('mesh_dim')} {int(red.get('bytes', 0))} B"
        rows.append([n["name"], n["op"], shape_text(n.get("shape"), n.get("token_dims")),
                     " ".join(n.get("placements") or []), coll])
    head = "".join(f"# {line}\n" for line in note.splitlines())
    return head + plain_table(rows, GRAPH_TABLE_HEADERS) + "\n"


# Characters that may occur in a cell tabulate reads as a number or a bool ("1,024",
# "-1e5", "inf", "NaN", "True"): a cell with any other character is text for certain.
_MAYBE_NUMBER_CHARS = frozenset("0123456789+-._, eEinfatyINFATYrulsRULS")
_HEADER_PADDING = 2  # tabulate's MIN_PADDING: a column is at least its header + 2 wide


def _printable_ascii(text: str) -> bool:
    return text.isascii() and text.isprintable()


def plain_table(rows: list[list[str]], headers) -> str:
    """``tabulate(rows, headers, tablefmt="plain")`` for string cells, character for
    character, in a fraction of its time on 10k rows (graph.txt). Each column is left-aligned
    to its widest cell (at least its header + 2), cells stripped of surrounding whitespace,
    columns joined by two spaces, trailing spaces of each line dropped; no trailing newline.

    That layout is tabulate's for text columns. Any table where tabulate could do something
    else -- a column whose every cell could be a number or a bool (tabulate aligns and
    reformats those), or a cell that is not printable ASCII (wide characters, ANSI codes,
    line breaks) -- is handed to tabulate itself."""
    headers = [str(h) for h in headers]
    cols = list(zip(*rows)) if rows else [()] * len(headers)
    plain = len(cols) == len(headers) and all(len(r) == len(headers) for r in rows)
    plain = plain and all(_printable_ascii(h) for h in headers)
    for col in cols:
        if not plain:
            break
        plain = all(isinstance(c, str) and _printable_ascii(c) for c in col) and any(
            not _MAYBE_NUMBER_CHARS.issuperset(c) for c in col)
    if not plain:
        from tabulate import tabulate

        return tabulate(rows, headers=headers, tablefmt="plain")
    cols = [[c.strip() for c in col] for col in cols]
    widths = [max([len(h) + _HEADER_PADDING, *map(len, col)]) for h, col in zip(headers, cols)]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths)
    lines = [fmt.format(*headers).rstrip()]
    lines.extend(fmt.format(*cells).rstrip() for cells in zip(*cols))
    return "\n".join(lines)


def workload_note(workload: dict) -> str:
    """Which shapes graph.txt / graph.dot show, for plan.json's ``workload``."""
    if workload.get("phase") == "prefill":
        at = (f"one prefill pass: batch {workload.get('batch')} x prompt "
              f"{workload.get('prompt')} tokens")
    else:
        at = (f"one decode step: batch {workload.get('batch')} x 1 new token, KV context "
              f"{workload.get('context')} tokens")
    return (f"shapes at the plan's workload per model replica, {at}; token dims are tagged: "
            "(b) batch, (s) tokens per sequence, (t) flattened tokens, (kv) key positions")


def dot_text(text: object) -> str:
    """``text`` as the inside of a DOT quoted string, whatever it contains: quotes,
    backslashes, ``&`` and control characters become HTML entities (which Graphviz decodes
    in labels), so no input can end the string or inject attributes; a newline becomes a
    DOT line break."""
    out = []
    for ch in str(text):
        if ch == "\n":
            out.append("\\n")
        elif ch in '"\\&<>' or ord(ch) < 32 or ord(ch) == 127:
            out.append(f"&#{ord(ch)};")
        else:
            out.append(ch)
    return "".join(out)


def graph_dot(name: str, nodes: list[dict], note: str = "") -> str:
    """graph.dot / ``inspect --format dot``: one box per node (name, op [fused op], shape,
    placements), an edge from each listed input; red edges where a collective is inserted.
    ``nodes`` are plan.json-style dicts (``name``, ``op``, ``shape``, ``token_dims``,
    ``inputs``, ``placements``, ``redistribute``, ``fused_op``). Node IDs are ``n<index>``
    and every label (the graph's ``name``, ``note`` as its caption) goes through
    :func:`dot_text`."""
    from shardc.ir.token_dims import shape_text

    ids = {n["name"]: f"n{i}" for i, n in enumerate(nodes)}
    lines = [f'digraph "{dot_text(name)}" {{', "  rankdir=TB;",
             '  node [shape=box, fontname="monospace", fontsize=10];']
    if note:
        lines.insert(1, f'  label="{dot_text(note)}"; labelloc=t;')
    for n in nodes:
        parts = [n["name"], n["op"] + (f" [{n['fused_op']}]" if n.get("fused_op") else ""),
                 shape_text(n.get("shape"), n.get("token_dims"))]
        if n.get("placements"):
            parts.append(" ".join(n["placements"]))
        label = "\\n".join(dot_text(p) for p in parts)
        lines.append(f'  {ids[n["name"]]} [label="{label}"];')
    for n in nodes:
        red = n.get("redistribute")
        attrs = (f' [color=red, label="{dot_text(red.get("collective", ""))}"]' if red else "")
        for i in n.get("inputs") or []:
            if i in ids:
                lines.append(f"  {ids[i]} -> {ids[n['name']]}{attrs};")
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
