"""Contraction analysis: how does each attention consumer contract K and V?

For every attention consumer (``scaled_dot_product_attention``; matmul/bmm/einsum ->
softmax -> matmul/bmm/einsum) this pass identifies the key and value operands *by their
role in the computation* (the key is contracted with the query into the scores that are
softmax-normalised; the value is contracted with the probabilities), walks each operand
back through layout ops (view, transpose, expand for GQA, split of a fused qkv, casts,
index_put into a preallocated buffer ...) to the tensor that would be cached, and names
which dim of that tensor the consumer sums over.

Whether that dim is tokens or channels is read from the *symbolic shape*: the token dim is
dynamic (a sympy symbol under ``torch.export`` with a dynamic sequence length), the
channel dim is a static integer. Tensor, module and parameter names are never consulted
(docs/design.md §1).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import networkx as nx
import sympy
from torch import fx

from ..errors import AnalysisError
from .facts import Contracted
from .fx_graph import (
    LAYOUT_OPS,
    fx_digraph,
    in_graph_order,
    is_symbolic,
    is_tensor,
    op_name,
    restrict,
    shape_of,
    sym_expr,
)

__all__ = [
    "Consumer",
    "CachePoint",
    "describe_contraction",
    "find_consumers",
    "walk_to_cache_point",
]

log = logging.getLogger(__name__)

_MATMULS = frozenset({"matmul", "bmm", "einsum", "mm", "baddbmm"})
_SOFTMAX = frozenset({"softmax", "_softmax", "_safe_softmax"})
_SDPA = frozenset({
    "scaled_dot_product_attention",
    "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_flash_attention_for_cpu",
    "_scaled_dot_product_cudnn_attention",
})
# Elementwise ops allowed between the scores and the softmax, and between the softmax and
# the value contraction (scaling, masking, casts, dropout).
_ELEMENTWISE = frozenset({
    "mul", "div", "add", "sub", "masked_fill", "where", "_to_copy", "to", "dropout",
    "native_dropout", "clone", "contiguous", "type_as", "tanh", "alias", "getitem",
})


def _norm_dim(d: int, rank: int) -> int:
    return d + rank if d < 0 else d


# ---------------------------------------------------------------------------------------
# Consumers
# ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Consumer:
    """One attention consumer and its operands.

    ``key_token_dim``/``key_channel_dim`` etc. are dims of the *operand* nodes as they
    enter the consumer (before any walk back).
    """

    node: fx.Node  # the SDPA node, or the value contraction of a matmul-softmax-matmul
    kind: str  # "scaled_dot_product_attention" | "matmul-softmax-matmul" | "einsum" ...
    query: fx.Node
    key: fx.Node
    value: fx.Node
    key_channel_dim: int  # contracted with the query
    key_token_dim: int  # normalised by the softmax
    value_token_dim: int  # contracted with the probabilities
    value_channel_dim: int  # kept in the output
    softmax: fx.Node | None = None
    scores: fx.Node | None = None


def _einsum_labels(node: fx.Node) -> tuple[list[str], str, list[fx.Node]]:
    """Operand label strings, output labels, operands of a contraction node."""
    name = op_name(node)
    if name == "einsum":
        eq = node.args[0].replace(" ", "")
        lhs, out = eq.split("->") if "->" in eq else (eq, None)
        ins = lhs.split(",")
        if any("." in s for s in ins):
            raise AnalysisError(f"einsum with ellipsis is not supported: {node.format_node()}")
        operands = list(node.args[1])
        if out is None:  # implicit output: labels that appear once, sorted
            counts = {c: lhs.count(c) for c in set(lhs.replace(",", ""))}
            out = "".join(sorted(c for c, n in counts.items() if n == 1))
        return ins, out, operands
    # matmul / bmm: batch dims broadcast, contract a's last with b's second to last.
    a, b = node.args[0], node.args[1]
    ra, rb = len(shape_of(a)), len(shape_of(b))
    if ra < 2 or rb < 2:
        raise AnalysisError(f"matmul with a vector operand is not attention: {node.format_node()}")
    nb = max(ra, rb) - 2
    batch = "".join(chr(ord("A") + i) for i in range(nb))
    la = batch[nb - (ra - 2):] + "ij"
    lb = batch[nb - (rb - 2):] + "jk"
    return [la, lb], batch + "ik", [a, b]


def _through(
    g: nx.DiGraph, node: fx.Node, allowed: frozenset[str], direction: str
) -> list[fx.Node]:
    """``node`` and the nodes reached from it through ``allowed`` ops (following users or
    inputs), nearest first: graph order going down, reverse graph order going up."""

    def keep(n: fx.Node) -> bool:
        return n is node or (n.op == "call_function" and op_name(n) in allowed)

    view = restrict(g, keep)
    found = nx.descendants(view, node) if direction == "down" else nx.ancestors(view, node)
    return [node, *in_graph_order(g, found, reverse=direction == "up")]


def _matmul_consumer(g: nx.DiGraph, softmax: fx.Node) -> Consumer | None:
    rank = len(shape_of(softmax))
    sm_dim = _norm_dim(int(softmax.args[1]), rank)
    # scores: the contraction feeding the softmax through elementwise ops
    ups = _through(g, softmax.args[0], _ELEMENTWISE | LAYOUT_OPS, "up")
    scores = [a for n in ups for a in [n, *n.all_input_nodes] if op_name(a) in _MATMULS]
    # probabilities: the contraction reading the softmax output through elementwise ops
    downs = _through(g, softmax, _ELEMENTWISE | LAYOUT_OPS, "down")
    pv = [u for n in downs for u in n.users if op_name(u) in _MATMULS]
    if not scores or not pv:
        log.debug("softmax %s is not between two contractions; skipped", softmax.name)
        return None
    sc, out = scores[0], pv[0]
    # Scores: which operand provides the softmax-normalised label? That one is the key.
    ins, outl, ops = _einsum_labels(sc)
    if len(ops) != 2:
        raise AnalysisError(f"score contraction with {len(ops)} operands: {sc.format_node()}")
    # The softmax dim of the scores, through the elementwise chain (ranks are kept).
    tok = outl[_norm_dim(sm_dim, len(outl))]
    k_idx = [i for i, labels in enumerate(ins) if tok in labels]
    if len(k_idx) != 1:
        raise AnalysisError(
            f"cannot tell the key from the query in {sc.format_node()}: the softmax dim "
            f"appears in {len(k_idx)} operands"
        )
    ki, qi = k_idx[0], 1 - k_idx[0]
    contracted = [c for c in ins[ki] if c in ins[qi] and c not in outl]
    if len(contracted) != 1:
        raise AnalysisError(f"score contraction sums over {contracted}: {sc.format_node()}")
    key, query = ops[ki], ops[qi]
    key_channel_dim = ins[ki].index(contracted[0])
    key_token_dim = ins[ki].index(tok)
    # Value: the operand of the output contraction that is not the probabilities.
    ins2, outl2, ops2 = _einsum_labels(out)
    prob_set = set(downs)
    p_idx = [i for i, o in enumerate(ops2) if o in prob_set]
    if len(p_idx) != 1 or len(ops2) != 2:
        raise AnalysisError(
            f"cannot find the probabilities among the operands of {out.format_node()}"
        )
    pi, vi = p_idx[0], 1 - p_idx[0]
    summed = [c for c in ins2[vi] if c in ins2[pi] and c not in outl2]
    if len(summed) != 1:
        raise AnalysisError(f"value contraction sums over {summed}: {out.format_node()}")
    kept = [c for c in ins2[vi] if c in outl2 and c not in ins2[pi]]
    if len(kept) != 1:
        raise AnalysisError(f"value contraction keeps {kept} of the value: {out.format_node()}")
    kind = "einsum" if op_name(sc) == "einsum" else "matmul-softmax-matmul"
    return Consumer(
        node=out, kind=kind, query=query, key=key, value=ops2[vi],
        key_channel_dim=key_channel_dim, key_token_dim=key_token_dim,
        value_token_dim=ins2[vi].index(summed[0]), value_channel_dim=ins2[vi].index(kept[0]),
        softmax=softmax, scores=sc,
    )


def find_consumers(gm: fx.GraphModule) -> list[Consumer]:
    """Every attention consumer of the graph, in graph order."""
    found: list[Consumer] = []
    g: nx.DiGraph | None = None  # built on the first softmax: SDPA blocks need no walk
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        name = op_name(node)
        if name in _SDPA:
            q, k, v = node.args[:3]
            found.append(Consumer(
                node=node, kind="scaled_dot_product_attention", query=q, key=k, value=v,
                key_channel_dim=len(shape_of(k)) - 1, key_token_dim=len(shape_of(k)) - 2,
                value_token_dim=len(shape_of(v)) - 2, value_channel_dim=len(shape_of(v)) - 1,
            ))
        elif name in _SOFTMAX:
            g = g if g is not None else fx_digraph(gm.graph)
            c = _matmul_consumer(g, node)
            if c is not None:
                found.append(c)
    return found


# ---------------------------------------------------------------------------------------
# Walking an operand back to the tensor that would be cached
# ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class CachePoint:
    """The tensor that would be cached, and where the consumer's two dims are in it."""

    node: fx.Node
    contracted_dim: int  # the dim the consumer sums over
    free_dim: int  # the other dim the consumer indexes (kept in scores or output)
    shape: tuple  # symbolic sizes
    chain: tuple[str, ...]  # node names walked, consumer side first
    # The block's own cache buffer the consumer reads, when the tensor is written into one
    # at its positions (gpt-fast's ``k_cache[:, :, input_pos] = k``); None otherwise. The
    # consumer's mask then has one column per buffer slot, i.e. per absolute position.
    buffer: str | None = None
    buffer_index: str | None = None  # the positions tensor it is written at (node name)

    @property
    def contracted(self) -> Contracted:
        """Tokens or channels, read from the symbolic shape alone: tokens are dynamic."""
        c, f = (is_symbolic(self.shape[d]) for d in (self.contracted_dim, self.free_dim))
        if c == f:
            raise AnalysisError(
                f"cannot tell tokens from channels at {self.node.format_node()}: the summed "
                f"dim ({self.shape[self.contracted_dim]}) and the other attention dim "
                f"({self.shape[self.free_dim]}) are both {'dynamic' if c else 'static'}; "
                "the sequence length must be a dynamic dim of the block's inputs"
            )
        return Contracted.TOKEN if c else Contracted.CHANNEL

    @property
    def token_dim(self) -> int:
        return self.contracted_dim if self.contracted is Contracted.TOKEN else self.free_dim

    @property
    def channel_dim(self) -> int:
        return self.free_dim if self.contracted is Contracted.TOKEN else self.contracted_dim

    @property
    def head_dim(self) -> int:
        return int(self.shape[self.channel_dim])

    @property
    def num_heads(self) -> int:
        """Product of the static dims other than tokens and channels (1 when absent)."""
        n = 1
        for d, s in enumerate(self.shape):
            if d not in (self.token_dim, self.channel_dim) and not is_symbolic(s):
                n *= int(s)
        return n


def _reshape_map(in_shape: tuple, out_shape: tuple, out_dim: int) -> int | None:
    """The input dim that output dim ``out_dim`` of a reshape is a copy of, else None.

    Dims are aligned into groups by running products (sympy, so symbolic sizes compare
    exactly); an output dim maps back only when it is alone in its group, ignoring
    size-1 dims. A split (``[B, T, H*D] -> [B, T, H, D]``) or merge maps to None.
    """
    sides = ([sym_expr(x) for x in in_shape], [sym_expr(x) for x in out_shape])
    pos = [0, 0]  # next unconsumed dim of each side

    def take(side: int, group: list[int], prod: sympy.Expr) -> sympy.Expr:
        group.append(pos[side])
        pos[side] += 1
        return prod * sides[side][group[-1]]

    def left(side: int) -> bool:
        return pos[side] < len(sides[side])

    ins, outs = sides
    while left(0) or left(1):
        gi: list[int] = []
        gj: list[int] = []
        pi = pj = sympy.Integer(1)
        if left(0):
            pi = take(0, gi, pi)
        if left(1):
            pj = take(1, gj, pj)
        while sympy.simplify(pi - pj) != 0:
            if _lt(pi, pj) and left(0):
                pi = take(0, gi, pi)
            elif left(1):
                pj = take(1, gj, pj)
            elif left(0):
                pi = take(0, gi, pi)
            else:
                return None
        if out_dim in gj:
            core_in = [d for d in gi if ins[d] != 1]
            core_out = [d for d in gj if outs[d] != 1]
            return core_in[0] if core_out == [out_dim] and len(core_in) == 1 else None
    return None


def _lt(a: sympy.Expr, b: sympy.Expr) -> bool:
    """a < b for positive sizes, with symbols taken at a large hint (sequence lengths)."""
    subs = {s: 1_000_003 for s in (a.free_symbols | b.free_symbols)}
    return float(a.subs(subs)) < float(b.subs(subs))


def _step_back(node: fx.Node, dims: dict[str, int | None]) -> tuple[fx.Node, dict] | None:
    """One layout op back: the input node and where the tracked dims are in it."""
    name = op_name(node)
    args = node.args
    out_rank = len(shape_of(node))

    def moved(fn):
        return {k: (None if v is None else fn(v)) for k, v in dims.items()}

    if name in ("view", "_unsafe_view", "reshape", "flatten", "unflatten"):
        src = args[0]
        return src, moved(lambda d: _reshape_map(shape_of(src), shape_of(node), d))
    if name in ("transpose",):
        a, b = (_norm_dim(int(x), out_rank) for x in args[1:3])
        return args[0], moved(lambda d: b if d == a else a if d == b else d)
    if name == "t":
        return args[0], moved(lambda d: 1 - d)
    if name == "permute":
        perm = [_norm_dim(int(p), out_rank) for p in args[1]]
        return args[0], moved(lambda d: perm[d])
    if name == "unsqueeze":
        u = _norm_dim(int(args[1]), out_rank)
        return args[0], moved(lambda d: None if d == u else d - (d > u))
    if name == "squeeze":
        src = args[0]
        in_shape = shape_of(src)
        if len(args) > 1:
            given = args[1] if isinstance(args[1], (list, tuple)) else [args[1]]
            sq = [_norm_dim(int(x), len(in_shape)) for x in given]
        else:
            sq = [i for i, s in enumerate(in_shape) if sym_expr(s) == 1]
        sq = [i for i in sq if sym_expr(in_shape[i]) == 1]
        keep = [i for i in range(len(in_shape)) if i not in sq]
        return src, moved(lambda d: keep[d])
    if name in ("expand", "contiguous", "clone", "_to_copy", "to", "alias", "detach",
                "type_as", "lift_fresh_copy", "slice", "repeat"):
        src = args[0]
        if len(shape_of(src)) != out_rank:  # expand may add leading dims
            extra = out_rank - len(shape_of(src))
            return src, moved(lambda d: None if d < extra else d - extra)
        return src, dict(dims)
    if name == "repeat_interleave":
        return args[0], dict(dims)
    if name == "getitem":
        parent = args[0]
        pname = op_name(parent)
        if pname in ("split", "split_with_sizes", "chunk", "unbind"):
            src = parent.args[0]
            if pname == "unbind":
                ud = int(parent.args[1]) if len(parent.args) > 1 else 0
                ud = _norm_dim(ud, len(shape_of(src)))
                return src, moved(lambda d: d + (d >= ud))
            return src, dict(dims)
        return None
    if name in ("index_put", "index_put_"):
        # Writing new keys into a preallocated buffer: follow the written values.
        values = args[2]
        if len(shape_of(values)) != out_rank:
            return None
        return values, dict(dims)
    return None


def _buffer_write(node: fx.Node) -> tuple[fx.Node, fx.Node | None] | None:
    """For a buffer the block writes new keys into in place (a cache it preallocates,
    gpt-fast style): ``(tensor written, index tensor of its positions or None)``; else
    None."""
    if node.op != "placeholder" or not is_tensor(node):
        return None
    rank = len(shape_of(node))
    # The write may go through a view of the buffer (``cache[:B, :, pos] = k``).
    # Kept hand-written: the alias closure is one or two users of a single placeholder,
    # walked only for placeholders on an operand's path, where the caller has no graph
    # view at hand; building one for the whole graph would cost more than the walk.
    aliases, frontier = {node}, [node]
    while frontier:
        for user in frontier.pop().users:
            if op_name(user) in ("slice", "view", "alias", "select") and user not in aliases:
                aliases.add(user)
                frontier.append(user)
    for alias in aliases:
        for user in alias.users:
            name = op_name(user)
            if name in ("index_put", "index_put_", "copy") and user.args[0] is alias:
                values = user.args[1] if name == "copy" else user.args[2]
                if isinstance(values, fx.Node) and len(shape_of(values)) == rank:
                    index = None
                    if name != "copy":
                        index = next((i for i in user.args[1] if isinstance(i, fx.Node)), None)
                    return values, index
    return None


def _is_source_op(node: fx.Node) -> bool:
    return node.op == "placeholder" or op_name(node) not in LAYOUT_OPS


def _numel(shape: tuple) -> sympy.Expr:
    n = sympy.Integer(1)
    for s in shape:
        n *= sym_expr(s)
    return n


def _hinted_numel(node: fx.Node) -> float:
    e = _numel(shape_of(node))
    return float(e.subs({s: 1_000_003 for s in e.free_symbols}))


def walk_to_cache_point(operand: fx.Node, contracted_dim: int, free_dim: int) -> CachePoint:
    """Walk ``operand`` back through layout ops to the tensor that would be cached.

    The walk stops at the first op that computes (a projection, a norm, a rotation, a
    placeholder). The cache point is, among the nodes walked, the one furthest from the
    consumer that holds each element once (no GQA expansion or repeat: smallest element
    count) and in which the two tracked dims are still separate.
    """
    dims: dict[str, int | None] = {"contracted": contracted_dim, "free": free_dim}
    chain: list[tuple[fx.Node, dict]] = [(operand, dims)]
    node = operand
    buffer = buffer_index = None
    while True:
        written = _buffer_write(node)
        if written is not None:  # through the buffer to the tensor written into it
            buffer = node.name
            buffer_index = written[1].name if written[1] is not None else None
            step = (written[0], dict(dims))
        elif _is_source_op(node):
            break
        else:
            step = _step_back(node, dims)
        if step is None:
            raise AnalysisError(
                f"cannot follow the attention operand back through {node.format_node()}: "
                f"expected one of the layout ops {', '.join(sorted(LAYOUT_OPS))}"
            )
        node, dims = step
        chain.append((node, dims))
    candidates = [
        (n, d) for n, d in chain
        if d["contracted"] is not None and d["free"] is not None
        and n.op != "placeholder" and op_name(n) != "getitem" or n is operand
    ]
    candidates = [(n, d) for n, d in candidates if None not in d.values()]
    if not candidates:
        raise AnalysisError(
            f"the attention operand {operand.format_node()} has no node on its path where "
            "tokens and channels are separate dims"
        )
    # Where the token dim is dynamic somewhere on the path (it is not when the consumer
    # reads a preallocated buffer of static length), only such nodes qualify.
    dynamic = [
        (n, d) for n, d in candidates
        if is_symbolic(shape_of(n)[d["contracted"]]) != is_symbolic(shape_of(n)[d["free"]])
    ]
    candidates = dynamic or candidates
    # Of the nodes that hold each element once, the one furthest from the consumer: the
    # tensor as the block produced it, before layout ops that only serve the consumer.
    smallest = min(_hinted_numel(n) for n, _ in candidates)
    node, dims = [(n, d) for n, d in candidates if _hinted_numel(n) == smallest][-1]
    return CachePoint(
        node=node, contracted_dim=dims["contracted"], free_dim=dims["free"],
        shape=shape_of(node), chain=tuple(n.name for n, _ in chain), buffer=buffer,
        buffer_index=buffer_index,
    )


def describe_contraction(consumer: Consumer, tensor: str, point: CachePoint) -> str:
    """Human text, e.g. ``q·kᵀ over head_dim=64 (scaled_dot_product_attention)``."""
    over = (
        f"head_dim={point.head_dim}" if point.contracted is Contracted.CHANNEL else "tokens"
    )
    op = "q·kᵀ" if tensor == "key" else "softmax·V"
    return f"{op} over {over} ({consumer.kind})"
