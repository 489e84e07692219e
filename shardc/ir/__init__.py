"""The IR: operator graph (graph.py), strategy vocabulary (strategy.py), search space (space.py)."""

from shardc.ir.graph import FUSED_OP_NAMES, OP_KINDS, FusedOp, Graph, LayerKind, Node, Param
from shardc.ir.space import StrategySpace
from shardc.ir.strategy import Degrees, Mesh, Strategy, Workload

__all__ = [
    "FUSED_OP_NAMES", "OP_KINDS", "FusedOp", "Graph", "LayerKind", "Node", "Param",
    "StrategySpace", "Degrees", "Mesh", "Strategy", "Workload",
]
