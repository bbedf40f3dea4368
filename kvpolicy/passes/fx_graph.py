"""FX helpers shared by the analysis and the rewrite: op names and symbolic shapes of nodes,
and a ``networkx`` view of an FX graph for the graph walks (reachability, ancestor sets,
dominators) the passes need.

The view (``fx_digraph``) has the ``fx.Node`` objects themselves as its nodes, an edge
``input -> user`` for every data dependency, and each node's position in the graph as the
node attribute ``index``, so that sets returned by ``networkx`` can be put back in graph
order (``in_graph_order``) wherever a caller takes the first of several candidates.
"""

from __future__ import annotations

import copy
import operator
from collections.abc import Callable, Iterable

import networkx as nx
import sympy
import torch
from torch import fx

from ..errors import AnalysisError

__all__ = [
    "LAYOUT_OPS",
    "copy_graph",
    "dominators",
    "fx_digraph",
    "in_graph_order",
    "is_symbolic",
    "is_tensor",
    "op_name",
    "restrict",
    "shape_of",
    "sym_expr",
]

# Ops that move or copy elements without mixing them: the walks pass through these.
LAYOUT_OPS = frozenset({
    "view", "_unsafe_view", "reshape", "transpose", "t", "permute", "expand", "unsqueeze",
    "squeeze", "contiguous", "clone", "_to_copy", "to", "alias", "detach", "slice", "split",
    "split_with_sizes", "chunk", "unbind", "getitem", "repeat_interleave", "repeat",
    "index_put", "index_put_", "flatten", "unflatten", "type_as", "lift_fresh_copy",
})


def op_name(node: fx.Node) -> str:
    """The ATen op name of a call_function node (``"view"``), ``"getitem"`` etc."""
    if node.op != "call_function":
        return node.op
    if node.target is operator.getitem:
        return "getitem"
    name = getattr(node.target, "_opname", None) or getattr(node.target, "__name__", "")
    return name.rstrip("_") if name.endswith("_") and name not in ("index_put_",) else name


def is_tensor(node: fx.Node) -> bool:
    """The node produces one tensor (its ``meta["val"]``), not a size, a tuple or nothing."""
    return isinstance(node.meta.get("val"), torch.Tensor)


def shape_of(node: fx.Node) -> tuple:
    """The (symbolic) shape of a tensor node, from the ``meta["val"]`` export recorded."""
    val = node.meta.get("val")
    if not isinstance(val, torch.Tensor):
        raise AnalysisError(f"node {node.format_node()} carries no tensor metadata")
    return tuple(val.shape)


def sym_expr(size) -> sympy.Expr:
    """A size as a sympy expression: the symbol of a dynamic dim, an integer otherwise."""
    return size.node.expr if isinstance(size, torch.SymInt) else sympy.Integer(int(size))


def is_symbolic(size) -> bool:
    """True when a size is a dynamic (symbolic) dimension, e.g. the sequence length."""
    return bool(sym_expr(size).free_symbols)


def copy_graph(graph: fx.Graph) -> tuple[fx.Graph, dict[fx.Node, fx.Node]]:
    """A copy of ``graph`` with new nodes, and the map from its nodes to theirs.

    What ``copy.deepcopy(graph)`` makes, except that the codegen (an exported graph's
    pytree in/out specs) is copied shallowly: the specs are frozen, so sharing them is safe,
    and deep-copying them rebuilds each ``LeafSpec`` through its constructor, which torch
    2.13 deprecates with a ``FutureWarning`` per copy (``Graph.__deepcopy__`` does that).
    """
    new = fx.Graph(tracer_cls=graph._tracer_cls)
    env: dict[fx.Node, fx.Node] = {}
    out = new.graph_copy(graph, env, return_output_node=True)
    new._codegen = copy.copy(graph._codegen)
    if out is not None:
        value, old_output = out
        new_output = new.output(value, type_expr=getattr(old_output, "type", None))
        new_output.meta = copy.copy(old_output.meta)
    return new, env


# ---------------------------------------------------------------------------------------
# The networkx view
# ---------------------------------------------------------------------------------------


def fx_digraph(graph: fx.Graph, keep: Callable[[fx.Node], bool] | None = None) -> nx.DiGraph:
    """A ``networkx.DiGraph`` of ``graph``: its fx.Nodes, an edge input -> user for each
    data dependency, and each node's graph position as the attribute ``index``.

    With ``keep``, only the nodes for which ``keep(node)`` and the edges between them
    (positions stay those in ``graph``). The view is a snapshot: build it again after
    changing the graph.
    """
    nodes = [(n, i) for i, n in enumerate(graph.nodes) if keep is None or keep(n)]
    g = nx.DiGraph()
    g.add_nodes_from((n, {"index": i}) for n, i in nodes)
    g.add_edges_from((a, n) for n, _ in nodes for a in n.all_input_nodes if a in g)
    return g


def restrict(g: nx.DiGraph, keep: Callable[[fx.Node], bool]) -> nx.DiGraph:
    """The nodes of ``g`` for which ``keep(node)``, and the edges between them (a read-only
    view, nothing is copied)."""
    return nx.subgraph_view(g, filter_node=keep)


def in_graph_order(
    g: nx.DiGraph, nodes: Iterable[fx.Node], *, reverse: bool = False
) -> list[fx.Node]:
    """``nodes`` sorted by their position in the graph (latest first when ``reverse``)."""
    index = g.nodes
    return sorted(nodes, key=lambda n: index[n]["index"], reverse=reverse)


_ROOT = "kvpolicy.root"  # the virtual start node of ``dominators`` (not an fx.Node)


def dominators(g: nx.DiGraph, sources: Iterable[fx.Node], target: fx.Node) -> set[fx.Node]:
    """The nodes every path from any of ``sources`` to ``target`` passes through
    (``target`` included); empty when no source reaches ``target``."""
    h = nx.DiGraph(g.edges)  # a plain copy: the virtual root must not leak into g
    h.add_edges_from((_ROOT, s) for s in sources if s in g)
    if _ROOT not in h:
        return set()
    idom = nx.immediate_dominators(h, _ROOT)
    if target not in idom:
        return set()
    out, n = set(), target
    while n != _ROOT:
        out.add(n)
        n = idom[n]
    return out
