"""shardc.passes: IR -> IR functions. :func:`run_passes` applies the frontend-independent
pipeline (canonicalise -> no-work zeroing -> fused-op grouping -> layer grouping)."""

from __future__ import annotations

from shardc.ir.graph import Graph
from shardc.passes.canonicalise import canonicalise
from shardc.passes.constant_work import zero_no_work
from shardc.passes.fused import group_fused_ops
from shardc.passes.layers import group_layers

PIPELINE = (canonicalise, zero_no_work, group_fused_ops, group_layers)


def run_passes(graph: Graph) -> Graph:
    """Run canonicalise, no-work zeroing (constant subgraphs, same-dtype casts: see
    :mod:`shardc.passes.constant_work`), fused-op and layer grouping on ``graph`` (in place)."""
    for p in PIPELINE:
        graph = p(graph)
    return graph


__all__ = ["PIPELINE", "run_passes", "canonicalise", "zero_no_work", "group_fused_ops",
           "group_layers"]
