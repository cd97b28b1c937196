"""Drawing of reasoning graphs (matplotlib, imported only when drawing)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import networkx as nx

from lightning_llm.evaluation.reasoning_graph.graph import QUESTION_NODE

if TYPE_CHECKING:
    from matplotlib.axes import Axes

__all__ = ["draw_reasoning_graph"]

_COLOURS = {"root": "#bdbdbd", "true": "#4daf4a", "false": "#e41a1c", "dead_end": "#ff9f1c"}


def draw_reasoning_graph(graph: nx.DiGraph, ax: Axes | None = None, *, labels: bool = True) -> Axes:
    """Draw a reasoning graph layer by layer (layer = longest dependency chain from the root).

    Colours: grey root, green true claims in the minimal set, orange true dead ends, red false claims (dead or
    not); unsupported claims get a black outline; answer claims are squares. Returns the axes.
    """
    import matplotlib.pyplot as plt  # only here: the module itself must import without matplotlib

    if ax is None:
        _, ax = plt.subplots(figsize=(8, 5))
    layer: dict[Any, int] = {}
    for node in nx.topological_sort(graph):
        preds = list(graph.predecessors(node))
        layer[node] = 1 + max(layer[p] for p in preds) if preds else 0
    layered = graph.copy()
    nx.set_node_attributes(layered, layer, "layer")
    pos = nx.multipartite_layout(layered, subset_key="layer", align="horizontal")
    pos = {n: (x, -y) for n, (x, y) in pos.items()}  # root on top

    def colour(n: Any) -> str:
        d = graph.nodes[n]
        if n == QUESTION_NODE:
            return _COLOURS["root"]
        if not d["correct"]:
            return _COLOURS["false"]
        return _COLOURS["dead_end"] if d["dead_end"] else _COLOURS["true"]

    nx.draw_networkx_edges(graph, pos, ax=ax, arrows=True, arrowsize=8, width=0.8, edge_color="#777777")
    for shape, nodes in (
        ("o", [n for n in graph if n == QUESTION_NODE or not graph.nodes[n]["answer"]]),
        ("s", [n for n in graph if n != QUESTION_NODE and graph.nodes[n]["answer"]]),
    ):
        nx.draw_networkx_nodes(
            graph,
            pos,
            nodelist=nodes,
            node_shape=shape,
            node_color=[colour(n) for n in nodes],
            edgecolors=[
                "black" if n != QUESTION_NODE and graph.nodes[n]["unsupported"] else "none" for n in nodes
            ],
            node_size=260,
            ax=ax,
        )
    if labels:
        nx.draw_networkx_labels(
            graph, pos, labels={n: graph.nodes[n]["label"] for n in graph}, font_size=5, ax=ax
        )
    ax.set_axis_off()
    return ax
