"""The files ``shardc compile`` writes, all written atomically into ``--out``.

The writing itself (the whole set appears at once or not at all; a failure or SIGTERM leaves
the previous outputs whole) is :func:`shardc.backends.atomic.write_outputs`, re-exported here.
"""

from __future__ import annotations

from pathlib import Path

from shardc.backends.atomic import write_outputs  # re-exported: the writer compile uses

__all__ = ["COMPILE_OUTPUTS", "graph_dot", "graph_table", "write_outputs"]

# Every name a ``shardc compile`` output set may hold (any phase, mode, engine): a compile
# into a folder removes those of an earlier compile that its own set does not have.
COMPILE_OUTPUTS = ("plan.json", "graph.txt", "graph.dot", "trace.json", "search.png",
                   "pareto.png", "parallelize.py", "parallelize_*.py", "launch/vllm_*.sh",
                   "launch/sglang_*.sh", "launch/trtllm_*.sh")

GRAPH_TABLE_HEADERS = ("node", "op", "shape", "placements", "collective inserted")


def graph_table(nodes: list[dict], note: str = "") -> str:
    """graph.txt: one row per IR node (plan.json ``nodes``): node, op, shape (token dims
    tagged, see :func:`shardc.ir.token_dims.shape_text`), placements, collective inserted;
    ``note`` (e.g. which workload the shapes are at) goes first, as a ``#`` line. The table
    is ``tabulate``'s ``plain`` format (:func:`plain_table`)."""
    from shardc.ir.token_dims import shape_text
    from shardc.text import clean_text

    rows = []
    for n in nodes:
        red = n.get("redistribute") or {}
        coll = ""
        if red:
            coll = f"{red.get('collective')}@{red.get('mesh_dim')} {int(red.get('bytes', 0))} B"
        rows.append([clean_text(n["name"]), clean_text(n["op"]),
                     shape_text(n.get("shape"), n.get("token_dims")),
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


def plan_note(plan) -> str:
    """The ``#`` header of graph.txt / graph.dot: the workload the shapes are at and, when a
    layer kind has a sliding window, every kind's attention variant."""
    kinds = layer_kinds_note(plan.layer_kinds)
    return workload_note(plan.workload) + (f"\n{kinds}" if kinds else "")


def layer_kinds_note(layer_kinds: list[dict]) -> str:
    """One line per layer kind of plan.json ``layer_kinds`` with its attention variant
    (sliding window, full, Gated DeltaNet / Mamba with its state) -- the per-layer pattern
    graph.txt / graph.dot show in their header; "" when every kind is full attention."""
    from shardc.ir.windows import variant_text
    from shardc.text import one_line

    lines = []
    for k in layer_kinds:
        text = variant_text(k)
        if text:
            layers = ", ".join(str(i) for i in k["layers"][:8]) + \
                (", ..." if len(k["layers"]) > 8 else "")
            lines.append(f"layer kind {one_line(k['name'])} x {k['count']} (layers {layers}): "
                         f"{text}")
    shown = any(k.get("attention") not in (None, "full") for k in layer_kinds)  # sliding,
    return "\n".join(lines) if shown else ""  # or linear-attention / Mamba kinds


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


def print_backend_refusal(out: Path, plan, written: list) -> None:
    """When the DTensor backend cannot run the plan's model: say so (plan.json ``backend``)
    and remove a ``parallelize*.py`` an earlier compile left in ``out`` (it would be read
    as this plan's)."""
    if plan.backend_runs:
        return
    from shardc.text import one_line

    for stale in sorted(out.glob("parallelize*.py")):
        if stale not in written:
            stale.unlink()
    print(f"no parallelize.py: {one_line(plan.backend.get('reason'))}; plan.json and the "
          "engine launch scripts do not need it")


def launch_files(plan) -> dict:
    """``launch/{vllm,sglang}_<role>.sh`` of every pool in plan.json ``launch``: each the
    best configuration its engine expresses (:mod:`shardc.launch_plan`); none for an engine
    whose entry has no pools (its ``reason`` says why)."""
    from shardc.backends.launch import launch_scripts

    return launch_scripts(plan.launch or {}, plan.model.get("hf_id"),
                          int(plan.mesh["gpus_per_node"]))


def launch_summary_lines(plan) -> list[str]:
    """The summary's per-engine lines (:func:`shardc.launch_plan.launch_summary_lines`)."""
    from shardc.launch_plan import launch_summary_lines as lines

    return lines(plan)
