"""The ExpertParallel entry of ``parallelize.py`` for experts stored fused (DBRX's
``DbrxExperts``: one ``[E * f, h]`` parameter per projection, :mod:`shardc.frontends.fused_experts`),
the pairs of choices it runs (:data:`FUSED_PAIRS`; another pair is refused per plan:
:func:`shardc.backends.support.fused_experts_verdict`)."""

from __future__ import annotations

from shardc.backends.emit_text import _literal
from shardc.backends.style_entry import Entry, NotCovered
from shardc.ir.contract import CHOICE_NAMES

FUSED_PAIRS = ((0, 1), (2, 2))  # col/row, rep/rep: the pairs fused experts run


def fused_experts_entry(kind: str, mod: str, rows, pair, deg, res) -> Entry | None:
    """The ExpertParallel entry of experts stored fused (DBRX: ``experts.mlp.{w1, v1, w2}``,
    ``[E * f, h]`` each; the rows list their ``[E, f, h]`` views, gate / up / down): placed
    as those views on the experts module (the GLU's parent), ``Shard(0)`` over ep and the
    ``f`` dim over tp for col/row (each expert's rows cut: a per-expert chunk)."""
    if deg.tp > 1 and pair not in FUSED_PAIRS:
        raise NotCovered(f"{kind}: experts stored fused run col/row or rep/rep over tp "
                         f"(not {'/'.join(CHOICE_NAMES[o][c] for o, c in zip(('expert_ffn1', 'expert_ffn2'), pair))})")
    if any(r.get("expert_dim") != 0 or len(r["shape"]) != 3 for _, r in rows) or "." not in mod:
        raise NotCovered(f"{kind}: fused experts in {mod!r} not viewed [E, f, h]")
    parent, glu = mod.rsplit(".", 1)
    _, f, h = (int(d) for d in rows[0][1]["shape"])
    split = deg.tp > 1 and pair == (0, 1)
    dims = [int(rows[0][1]["split_dims"][0]), int(rows[1][1]["split_dims"][0]),
            int(rows[2][1]["split_dims"][1])]
    if split and dims != [1, 1, 1]:
        raise NotCovered(f"{kind}: fused experts cut on dims {dims} (covered: f, dim 1)")
    items = ", ".join(f"{_literal(str(n))}: (1, ())" for n, _ in rows)
    args = [f"tp_split={split}", f"weights={{{items}}}", f"fused=({_literal(glu)}, {f}, {h})"]
    if split and res != "R":
        args.append("token_rows=True")
    what = ("counts exchanged, then uneven all_to_all_single dispatch + combine "
            f"over ep={deg.ep}") if deg.ep > 1 else "no ep exchange"
    what += "; [E, f, h] views of the fused [E * f, h] weights"
    if split:
        what += ", each expert's f rows over tp; all_reduce P->R of the outputs" if res == "R" \
            else ", each expert's f rows over tp; all_gather / reduce_scatter over tp"
    if deg.ep > 1 or deg.tp > 1:
        return Entry(parent, f"ExpertParallel({', '.join(args)})", what)
    return None
