"""shardc.passes: IR -> IR functions. :func:`run_passes` applies the frontend-independent
pipeline (canonicalise -> fused-op grouping -> layer grouping)."""

from __future__ import annotations

from shardc.ir.graph import Graph
from shardc.passes.canonicalise import canonicalise
from shardc.passes.fused import group_fused_ops
from shardc.passes.layers import group_layers

PIPELINE = (canonicalise, group_fused_ops, group_layers)


def run_passes(graph: Graph) -> Graph:
    """Run canonicalise, fused-op grouping and layer grouping on ``graph`` (in place)."""
    for p in PIPELINE:
        graph = p(graph)
    return graph


__all__ = ["PIPELINE", "run_passes", "canonicalise", "group_fused_ops", "group_layers"]
