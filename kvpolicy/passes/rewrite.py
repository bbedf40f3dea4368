"""Rewrite an analysed attention block onto the packed cache (docs/design.md §4, *rewrite*).

The attention consumer (SDPA, or the matmul -> softmax -> matmul chain) is replaced by one
``call_module`` node, ``KVAttend``, that appends the new keys and values to the layer's
packed cache and attends over everything cached. For pre-RoPE keys it reads the key *in
front of* the rotation (docs/design.md §2); the rotation of the key is then dead code and
is eliminated, while the query keeps its own. The cos/sin the block multiplied the key with
are handed over so the cache can rotate each key at its own position after dequantization.

The pass reads what the analysis recorded in ``node.meta`` (``analysis.analyse.*_META``)
and the one policy decision it needs (``pre_rope``); it works on a copy of the graph and
runs ``graph.lint()`` after the rewrite.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

import networkx as nx
import torch
from torch import fx

from ..errors import AnalysisError, KVPolicyError
from ..runtime.attend import KVAttend, Layout, PosLayout
from .analyse import CONSUMER_META, KEY_META, ROPE_META, VALUE_META
from .contraction import CachePoint, Consumer
from .facts import RopeStyle
from .fx_graph import (
    copy_graph,
    fx_digraph,
    is_symbolic,
    is_tensor,
    op_name,
    restrict,
    shape_of,
    sym_expr,
)
from .rope import RopeMatch

__all__ = ["RewriteResult", "rewrite_block", "rw_keep"]

log = logging.getLogger(__name__)


_ASSERTS = frozenset({
    "_assert_scalar", "sym_constrain_range_for_size", "sym_constrain_range",
    "_assert_tensor_metadata", "_assert_async",
})


def _layout(shape: tuple, token_dim: int, channel_dim: int) -> Layout:
    others = [d for d in range(len(shape)) if d not in (token_dim, channel_dim)]
    batch = [d for d in others if is_symbolic(shape[d])]
    if len(batch) != 1:
        raise AnalysisError(
            f"cannot find the batch dim of a cached tensor of shape {shape}: expected exactly "
            "one dynamic dim besides the tokens"
        )
    heads = [d for d in others if d != batch[0]]
    return Layout(tuple([batch[0], *heads, token_dim, channel_dim]), len(heads))


def _pos_layout(pos: fx.Node, key_like: fx.Node, token_size) -> PosLayout:
    ps, ks = shape_of(pos), shape_of(key_like)
    tok = [d for d, s in enumerate(ps) if sym_expr(s) == sym_expr(token_size)]
    if len(tok) != 1:
        raise AnalysisError(f"cannot find the token dim of the RoPE table {pos.format_node()}")
    # Right-aligned broadcasting against the key: the key's batch dim is its dynamic dim
    # that is not tokens.
    off = len(ks) - len(ps)
    kb = [d for d, s in enumerate(ks) if is_symbolic(s) and sym_expr(s) != sym_expr(token_size)]
    batch = kb[0] - off if kb and 0 <= kb[0] - off < len(ps) else None
    return PosLayout(batch, tok[0])


@dataclass
class RewriteResult:
    """What the pass produced: the rewritten graph (a new one; the input is unchanged) and
    the ``KVAttend`` module its ``call_module`` node calls."""

    graph: fx.Graph
    attend: KVAttend


def _sdpa_args(node: fx.Node) -> tuple[fx.Node | None, bool, float | None]:
    names = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale")
    vals = dict(zip(names, node.args, strict=False))
    vals.update(node.kwargs)
    return vals.get("attn_mask"), bool(vals.get("is_causal", False)), vals.get("scale")


@dataclass(frozen=True)
class ScoreOps:
    """What an explicit chain does between ``q @ kᵀ`` and the softmax, as the kernels take
    it: ``s = scale * q·kᵀ``, then ``softcap * tanh(s / softcap)`` when ``softcap`` is set,
    then the mask."""

    scale: float
    mask: fx.Node | None
    mask_kind: str | None  # "additive" or "fill" (masked_fill: the mask is True where hidden)
    softcap: float | None


def _matmul_scale_mask(g: nx.DiGraph, softmax: fx.Node, scores: fx.Node) -> ScoreOps:
    """Scale, soft-cap and mask applied between the scores and the softmax of an explicit
    chain, read walking back from the softmax.

    A ``tanh`` is taken as logit soft-capping when it has the form ``s2 * tanh(s1 * x)``
    with constants (Gemma2: ``tanh(x * scaling / cap) * cap``): ``softcap = s2`` and
    ``scale = s1 * s2``, so that ``softcap * tanh(scale * x / softcap)`` is the same. The
    walk multiplies every constant into ``scale``; the product seen before it reaches the
    tanh is ``s2``.
    """
    scale = 1.0
    scaled = False  # a constant multiplied the path since the softmax (or the tanh)
    mask = None
    kind = None
    softcap = None
    score_side = nx.descendants(g, scores) | {scores}  # computed from the scores
    node = softmax.args[0]
    while node is not scores:
        name = op_name(node)
        on_path = [a for a in node.all_input_nodes if a in score_side]
        if not on_path:
            raise KVPolicyError(f"lost the score path at {node.format_node()}")
        x = on_path[0]
        others = [a for a in node.args if a is not x]
        if name in ("_to_copy", "to", "clone", "contiguous", "alias", "type_as"):
            pass
        elif name in ("mul", "div") and all(isinstance(o, (int, float)) for o in others):
            c = float(others[0])
            scale = scale * c if name == "mul" else scale / c
            scaled = True
        elif name in ("add", "sub") and len(others) == 1 and isinstance(others[0], fx.Node):
            if mask is not None or name == "sub":
                raise KVPolicyError(f"two masks on the scores at {node.format_node()}")
            _no_mask_under_tanh(softcap, node)
            mask, kind = others[0], "additive"
        elif name == "masked_fill" and node.args[0] is x:
            value = node.args[2]
            if not (isinstance(value, float) and (math.isinf(value) or value < -1e30)):
                raise KVPolicyError(f"masked_fill with {value} is not a mask: {node.format_node()}")
            if mask is not None:
                raise KVPolicyError(f"two masks on the scores at {node.format_node()}")
            _no_mask_under_tanh(softcap, node)
            mask, kind = node.args[1], "fill"
        elif name == "tanh":
            if softcap is not None:
                raise KVPolicyError(f"a second tanh on the scores: {node.format_node()}")
            if not scaled or not scale > 0:
                got = "no constant multiplies it" if not scaled else f"it is multiplied by {scale}"
                raise KVPolicyError(
                    f"kvpolicy reads a tanh between the scores and the softmax as logit "
                    f"soft-capping, cap * tanh(scores / cap) with a constant cap > 0, but "
                    f"{got}: {node.format_node()}"
                )
            softcap = scale
        else:
            raise KVPolicyError(
                f"kvpolicy cannot rewrite an op between the scores and the softmax: "
                f"{node.format_node()} (supported: scaling by constants, an additive mask, "
                "masked_fill with -inf, casts, soft-capping cap * tanh(scores / cap))"
            )
        node = x
    return ScoreOps(scale, mask, kind, softcap)


def _no_mask_under_tanh(softcap: float | None, node: fx.Node) -> None:
    """Refuse a mask applied before the soft-capping tanh (walking back: after it), which
    would squash -inf to -cap and stop hiding keys."""
    if softcap is not None:
        raise KVPolicyError(
            f"a mask on the scores inside the soft-capping tanh ({node.format_node()}); "
            "kvpolicy supports masks added after cap * tanh(scores / cap)"
        )


def _recorded(graph: fx.Graph, key: str, required: bool = True):
    """The node carrying the analysis record ``key`` and the record, or (None, None)."""
    hosts = [n for n in graph.nodes if key in n.meta]
    if len(hosts) > 1:
        raise KVPolicyError(
            f"{len(hosts)} nodes carry node.meta[{key!r}] ({', '.join(n.name for n in hosts)});"
            " the rewrite expects one analysed attention block per graph"
        )
    if not hosts:
        if required:
            raise KVPolicyError(
                f"no node of the graph carries node.meta[{key!r}]: run "
                "kvpolicy.passes.analyse.analyse_block on the exported block first, and "
                "rewrite a copy of its graph taken afterwards (ExportedProgram.module())"
            )
        return None, None
    return hosts[0], hosts[0].meta[key]


def rewrite_block(
    gm: fx.GraphModule | fx.Graph,
    *,
    pre_rope: bool,
    module_name: str = "kvpolicy_attend",
) -> RewriteResult:
    """Replace the attention consumer of a *copy* of ``gm``'s graph by a ``KVAttend`` call.

    Args:
        gm: an analysed block (``analyse_block`` wrote its records into ``node.meta``),
            typically the unlifted module ``traced.exported.module()``.
        pre_rope: cache the key in front of its rotation (the policy's choice); ignored
            when the key path has no rotation.
        module_name: the target of the new ``call_module`` node.

    The records' node fields may belong to another copy of the same graph (the lifted
    export the analysis ran on); they are matched by name, which unlifting preserves.
    """
    graph = gm.graph if isinstance(gm, fx.GraphModule) else gm
    consumer: Consumer
    key_point: CachePoint
    value_point: CachePoint
    rope: RopeMatch | None
    target, consumer = _recorded(graph, CONSUMER_META)
    key_node, key_point = _recorded(graph, KEY_META)
    value_node, value_point = _recorded(graph, VALUE_META)
    pre_node, rope = _recorded(graph, ROPE_META, required=False)
    by_name = {n.name: n for n in graph.nodes}

    def here(n: fx.Node | str | None) -> fx.Node | None:
        """A node of a record (or its name), as the node of the same name in ``graph``."""
        if n is None:
            return None
        name = n if isinstance(n, str) else n.name
        if name not in by_name:
            raise AnalysisError(f"node {name} is missing from the graph being rewritten")
        return by_name[name]

    for point in (key_point, value_point):
        # Names missing here are lifted parameters and buffers (renamed by unlifting),
        # never a repeat.
        tiled = [by_name[x] for x in point.chain
                 if x in by_name and op_name(by_name[x]) == "repeat"]
        if tiled:
            # repeat() tiles heads (query head h reads kv head h % Hkv); the cache groups
            # them (h // (Hq // Hkv)) like expand/repeat_interleave.
            raise KVPolicyError(
                f"the attention operand is tiled by {tiled[0].format_node()}; kvpolicy "
                "supports grouped-query heads made by expand or repeat_interleave"
            )
    q = here(consumer.query)
    if len(shape_of(q)) != 4:
        raise KVPolicyError(f"the query {q.format_node()} is not [batch, heads, tokens, dim]")
    if rope is not None and pre_rope:
        kp = pre_node
        key_layout = _layout(shape_of(kp), rope.token_dim, rope.channel_dim)
        cos_node, sin_node = here(rope.cos_node), here(rope.sin_node)
        token_size = key_point.shape[key_point.token_dim]
        cos_l = _pos_layout(cos_node, _mul_partner(cos_node), token_size)
        sin_l = None
        if sin_node is not None:
            sin_l = _pos_layout(sin_node, _mul_partner(sin_node), token_size)
        style = "interleaved" if rope.facts.style in (RopeStyle.INTERLEAVED, RopeStyle.COMPLEX) \
            else "rotate_half"
        complex_rope = rope.facts.style is RopeStyle.COMPLEX
    else:
        kp = key_node
        key_layout = _layout(key_point.shape, key_point.token_dim, key_point.channel_dim)
        cos_l = sin_l = None
        style, complex_rope, cos_node, sin_node = None, False, None, None
    value_layout = _layout(value_point.shape, value_point.token_dim, value_point.channel_dim)

    softmax = here(consumer.softmax)
    softcap = None  # SDPA has no soft-capping
    if consumer.kind == "scaled_dot_product_attention":
        mask, causal, scale = _sdpa_args(target)
        mask_kind = None if mask is None else "sdpa"
        if mask is not None:
            causal = False
    else:
        ops = _matmul_scale_mask(fx_digraph(graph), softmax, here(consumer.scores))
        scale, mask, mask_kind, softcap = ops.scale, ops.mask, ops.mask_kind, ops.softcap
        causal = False
    attend = KVAttend(
        key_layout=key_layout, value_layout=value_layout, scale=scale, causal=causal,
        mask_kind=mask_kind, rope_style=style, complex_rope=complex_rope,
        cos_layout=cos_l, sin_layout=sin_l, softcap=softcap,
    )
    # A block that writes K/V into its own buffer (gpt-fast) masks by buffer slot: the
    # mask's columns are absolute positions, of which the packed cache holds a range.
    attend.mask_by_position = key_point.buffer is not None or value_point.buffer is not None
    val = target.meta.get("val")
    if isinstance(val, torch.Tensor) and not val.is_contiguous():
        attend.tokens_major = val.transpose(1, 2).is_contiguous()
    if shape_of(target) != shape_of(q)[:3] + (shape_of(here(consumer.value))[-1],):
        raise KVPolicyError(
            f"the attention output {target.format_node()} is not laid out like the "
            "query ([batch, heads, tokens, dim]); kvpolicy cannot rewrite this consumer"
        )

    new, env = copy_graph(graph)

    def m(n: fx.Node | None) -> fx.Node | None:  # a node of ``graph`` in the copy
        return None if n is None else env[n]

    new_target = m(target)
    with new.inserting_before(new_target):
        index = here(key_point.buffer_index)
        call = new.call_module(module_name, (m(q), m(kp), m(value_node), m(mask),
                                             m(cos_node), m(sin_node), m(index)))
        call.meta = dict(new_target.meta)
    new_target.replace_all_uses_with(call)
    new.erase_node(new_target)  # SDPA counts as impure (dropout RNG): dead-code elim. keeps it
    # Attention weights returned by eager implementations are not available any more.
    if softmax is not None:
        out = next(n for n in new.nodes if n.op == "output")
        drop = {m(softmax)} | {u for u in m(softmax).users if u is not call}
        out.args = _replace_in(out.args, drop)
    if mask is not None:
        _unbind_mask_sizes(new, m(mask))
    for n in list(new.nodes):
        if n.op == "call_function" and op_name(n) in _ASSERTS and not n.users:
            new.erase_node(n)
        elif attend.mask_by_position and _writes_a_buffer(n):
            new.erase_node(n)  # the packed cache stands in for the block's own buffers
    new.eliminate_dead_code(is_impure_node=rw_keep)
    new.lint()
    return RewriteResult(new, attend)


def _writes_a_buffer(node: fx.Node) -> bool:
    """An in-place write (``index_put_``, ``copy_``) into a view of a module buffer whose
    result nothing reads: the block's own K/V cache write (gpt-fast)."""
    if node.op != "call_function" or op_name(node).rstrip("_") not in ("index_put", "copy") \
            or node.users:
        return False
    base = node.args[0]
    while isinstance(base, fx.Node) and op_name(base) in ("slice", "view", "alias", "select"):
        base = base.args[0]
    return isinstance(base, fx.Node) and base.op == "get_attr"


def _unbind_mask_sizes(graph: fx.Graph, mask: fx.Node) -> None:
    """Stop sizes from being read off the attention mask.

    The block was traced without a past, where the mask's key length equals the query
    length, so export may read the sequence length off the mask. With a cache the mask
    spans every cached token; such reads are redirected to an input that carries the same
    symbol (the hidden states).
    """
    # The mask and the tensors it is computed from (sym_size nodes would drag in every
    # input sharing a dim size).
    tensors = restrict(fx_digraph(graph), lambda n: n is mask or is_tensor(n))
    sources = nx.ancestors(tensors, mask) | {mask}
    phs = [n for n in graph.nodes if n.op == "placeholder" and is_tensor(n)]
    for node in list(graph.nodes):
        if not (node.op == "call_function" and op_name(node) == "sym_size"):
            continue
        src, dim = node.args[0], node.args[1]
        if src not in sources:
            continue
        expr = sym_expr(shape_of(src)[dim])
        alt = next(
            ((p, d) for p in phs if p not in sources
             for d, size in enumerate(shape_of(p)) if sym_expr(size) == expr),
            None,
        )
        if alt is None:
            continue
        with graph.inserting_before(node):
            repl = graph.call_function(node.target, alt)
            repl.meta = dict(node.meta)
        node.replace_all_uses_with(repl)
        graph.erase_node(node)


def rw_keep(node: fx.Node) -> bool:
    """Nodes dead-code elimination must keep: the cache op and in-place writes."""
    if node.op in ("call_module", "placeholder", "output"):
        return True
    # Random ops (dropout) in eval-mode attention are dead once the consumer is replaced.
    return node.op == "call_function" and node.is_impure(impure_random=False)


def _mul_partner(pos: fx.Node) -> fx.Node:
    """The key-side operand of the multiplication that consumes a cos/sin operand."""
    for u in pos.users:
        if op_name(u) == "mul":
            other = [a for a in u.args if isinstance(a, fx.Node) and a is not pos]
            if other:
                return other[0]
    raise AnalysisError(f"{pos.format_node()} is not multiplied with the key")


def _replace_in(args, drop: set[fx.Node]):
    if isinstance(args, fx.Node):
        return None if args in drop else args
    if isinstance(args, (list, tuple)):
        return type(args)(_replace_in(a, drop) for a in args)
    if isinstance(args, dict):
        return {k: _replace_in(v, drop) for k, v in args.items()}
    return args
