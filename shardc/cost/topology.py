"""Where the ranks of a communicator sit: inside one NVLink domain, or across nodes.

The logical mesh is ordered ``pp, dp, ep, tp`` (outermost -> innermost), so global rank
``r = ((pp_i * DP + dp_i) * EP + ep_i) * TP + tp_i``. A communicator over mesh dim X has
``size`` ranks spaced ``stride`` apart, stride = product of the dims inside X
(tp: 1, ep: tp, dp: tp*ep, pp: tp*ep*dp). With G GPUs per node (one NVLink domain each):

* ``stride * size <= G`` and ``G % (stride * size) == 0``: the whole group sits in one node
  (ranks_per_node = size, nodes = 1);
* otherwise it crosses nodes: ``ranks_per_node = G // stride`` when ``stride < G`` and
  ``G % stride == 0`` (several ranks per node, hierarchical algorithms apply), else 1;
  ``nodes = ceil(size / ranks_per_node)``. Groups that straddle a node boundary without
  alignment are treated pessimistically as one rank per node.

Everything is vectorised: sizes/strides are numpy int arrays over a batch of strategies.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from shardc.ir.strategy import MESH_DIM_ORDER


@dataclass
class CommGroup:
    """A batch of communicators: ``size`` ranks, ``per_node`` of them per node over
    ``nodes`` nodes (arrays of equal shape; size 1 = no communication)."""

    size: np.ndarray
    per_node: np.ndarray
    nodes: np.ndarray

    @property
    def crosses_nodes(self) -> np.ndarray:
        return self.nodes > 1

    def take(self, i) -> CommGroup:
        return CommGroup(self.size[i], self.per_node[i], self.nodes[i])


def comm_group(size, stride, gpus_per_node: int) -> CommGroup:
    """Placement of communicators of ``size`` ranks spaced ``stride`` apart (vectorised)."""
    size = np.maximum(np.asarray(size, dtype=np.int64), 1)
    stride = np.maximum(np.asarray(stride, dtype=np.int64), 1)
    g = int(gpus_per_node)
    span = stride * size
    inside = (span <= g) & (g % span == 0)
    per_node_x = np.where((stride < g) & (g % stride == 0), g // stride, 1)
    per_node_x = np.clip(per_node_x, 1, size)
    per_node = np.where(inside, size, per_node_x)
    nodes = np.where(inside, 1, -(-size // per_node))
    return CommGroup(size=size, per_node=per_node, nodes=nodes)


def mesh_groups(tp, ep, dp, pp, gpus_per_node: int) -> dict[str, CommGroup]:
    """The communicator of every logical mesh dim, for arrays of degrees. Strides follow
    :data:`shardc.ir.strategy.MESH_DIM_ORDER` (a dim's stride is the product of the dims
    inside it), the order the backend builds its device mesh in."""
    sizes = {"tp": tp, "ep": ep, "dp": np.maximum(dp, 1), "pp": pp}
    groups, stride = {}, np.int64(1)
    for name in reversed(MESH_DIM_ORDER):  # innermost first
        size = np.asarray(sizes[name], dtype=np.int64)
        groups[name] = comm_group(size, stride, gpus_per_node)
        stride = stride * size
    return groups
