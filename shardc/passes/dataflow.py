"""The IR's dataflow as a networkx graph, for the passes' reachability questions.

The fused-op and layer passes ask questions like "which nodes does this linear's output
reach before the next matmul?" or "which nodes feed the attention core's value input,
back to the projection that made it?". Each is a reachability query on the producer ->
consumer graph where the walk does not continue *through* certain nodes (they are reported,
not expanded), optionally inside one layer: a ``networkx.subgraph_view`` that drops the
edges leaving a stop node -- of the layer's own subgraph (built once per layer, so a query
costs the layer's size, not the model's) -- then ``descendants`` / ``ancestors``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import networkx as nx

from shardc.ir.graph import Node

Predicate = Callable[[str], bool]


class Dataflow:
    """Producer -> consumer edges of ``nodes`` (inputs that are not among them are ignored);
    node attributes ``op`` and ``layer``."""

    def __init__(self, nodes: Iterable[Node]):
        self.graph = nx.DiGraph()
        self._layers: dict[object, nx.DiGraph] | None = None
        nodes = list(nodes)
        for n in nodes:
            self.graph.add_node(n.name, op=n.op, layer=n.layer)
        for n in nodes:
            for i in n.inputs:
                if i in self.graph:
                    self.graph.add_edge(i, n.name)

    def op(self, name: str) -> str:
        return self.graph.nodes[name]["op"]

    def layer_graph(self, name: str) -> nx.DiGraph:
        """The subgraph of the nodes in ``name``'s layer (views of every layer built once)."""
        if self._layers is None:
            members: dict[object, list[str]] = {}
            for n, layer in self.graph.nodes(data="layer"):
                members.setdefault(layer, []).append(n)
            self._layers = {layer: self.graph.subgraph(ns) for layer, ns in members.items()}
        return self._layers[self.graph.nodes[name]["layer"]]

    def downstream(self, start: str, stop: Predicate, same_layer: bool = False) -> set[str]:
        """Nodes reachable from ``start`` (exclusive), inside ``start``'s layer when
        ``same_layer``; the walk reports a node for which ``stop`` holds but does not
        continue past it."""
        if start not in self.graph:
            return set()
        graph = self.layer_graph(start) if same_layer else self.graph
        view = nx.subgraph_view(graph, filter_edge=lambda u, v: u == start or not stop(u))
        return nx.descendants(view, start)

    def upstream(self, start: str, stop: Predicate) -> set[str]:
        """``start`` and the nodes whose output reaches it, walking backwards and not past a
        node for which ``stop`` holds (it is included)."""
        if start not in self.graph:
            return set()
        view = nx.subgraph_view(self.graph, filter_edge=lambda u, v: v == start or not stop(v))
        return nx.ancestors(view, start) | {start}
