"""Find a rotary embedding on the key path and the pre-RoPE point in front of it
(docs/design.md §2).

A rotation is recognised by what it does, not by a name: starting from the key as the
attention consumer reads it, the pass collects the key-dependent nodes up to the nearest
*dominator* of the key (a node every key path passes through) that lies above every
multiplication by a position-only tensor (cos/sin tables, ``freqs_cis``). Such a region
that is linear in the key — multiplications only by position tensors, plus slices, negation,
concatenation, stacking, complex views and adds — is a rotary embedding. Its style comes
from how channels are paired inside it: halves (rotate-half), even/odd strides or
``stack`` (interleaved, GPT-J) or ``view_as_complex`` (complex multiply). Its width is the
channel count of the position multiplications (partial rotary when fewer than head_dim).

Key-dependent means "has a model parameter among its ancestors": hidden states reach the
key through a projection weight; positions never touch a weight.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import networkx as nx
import torch
from torch import fx

from ..errors import AnalysisError
from .facts import RopeFacts, RopeStyle
from .fx_graph import (
    LAYOUT_OPS,
    dominators,
    fx_digraph,
    in_graph_order,
    is_tensor,
    op_name,
    restrict,
    shape_of,
    sym_expr,
)

__all__ = [
    "RopeMatch", "find_rope", "find_rope_in_place", "key_dependent_nodes", "precedes_projection",
]

log = logging.getLogger(__name__)

_PROJECTIONS = frozenset({"linear", "addmm", "mm", "matmul", "bmm", "baddbmm", "conv1d"})
# Ops a rotary embedding may consist of (besides layout ops).
_ROPE_OPS = frozenset({
    "mul", "add", "sub", "neg", "cat", "stack", "view_as_complex", "view_as_real",
    "select", "_to_copy", "to", "type_as", "slice", "getitem", "split", "chunk", "unbind",
}) | LAYOUT_OPS


# How RopeFacts.description names each style.
_STYLE_TEXT = {
    RopeStyle.ROTATE_HALF: "rotate-half",
    RopeStyle.INTERLEAVED: "interleaved-pair",
    RopeStyle.COMPLEX: "complex-multiply (interleaved pairs)",
}


@dataclass(frozen=True)
class RopeMatch:
    facts: RopeFacts
    pre_rope: fx.Node  # the key right before the rotation
    token_dim: int  # of pre_rope
    channel_dim: int  # of pre_rope (the last dim: RoPE rotates the innermost dim)
    region: tuple[str, ...]  # names of the nodes that make up the rotation, in graph order
    # The position tensors as the rotation multiplies them (broadcast against the key):
    # cos (or the complex freqs_cis) and sin (None for the complex style).
    cos_node: fx.Node | None = None
    sin_node: fx.Node | None = None


def key_dependent_nodes(g: nx.DiGraph, parameter_names: set[str]) -> set[fx.Node]:
    """Nodes of the graph view ``g`` (``fx_graph.fx_digraph``) with a model parameter
    among their ancestors, the parameters included."""
    params = [n for n in g if n.op == "placeholder" and n.name in parameter_names]
    return set(params).union(*(nx.descendants(g, p) for p in params))


def _placeholder_sources(g: nx.DiGraph, node: fx.Node, names: dict[str, str]) -> list[str]:
    """Names (input paths / buffer names) of the placeholders a position tensor comes from."""
    # Only tensor inputs: sym_size nodes would drag in every input sharing a dim size.
    tensors = restrict(g, lambda n: n is node or is_tensor(n))
    found = nx.ancestors(tensors, node) | {node}
    return sorted({names.get(n.name, n.name) for n in found if n.op == "placeholder"})


def find_rope(
    gm: fx.GraphModule,
    key_end: fx.Node,
    token_size,
    head_dim: int,
    parameter_names: set[str],
    placeholder_names: dict[str, str],
) -> RopeMatch | None:
    """Find the rotary embedding that produces ``key_end``, if any.

    Args:
        key_end: the key as the attention consumer reads it, before any GQA expansion
            (the cache point of the post-RoPE key).
        token_size: the symbolic size of the token dim (to locate it in the pre-RoPE node).
        head_dim: channels per head of the cached key.
        parameter_names: placeholder names of the block's parameters.
        placeholder_names: placeholder name -> readable source ("kwargs['position_embeddings'][0]").
    """
    g = fx_digraph(gm.graph)
    dep = key_dependent_nodes(g, parameter_names)
    if key_end not in dep:
        return None
    # The key-dependent part of the graph, built once rather than a filtered view: the
    # walks below run on it a few times per position multiplication.
    # NOTE: find_rope on tiny Llama (CPU) takes 0.9 ms this way, 1.07 ms with a view.
    kdep = fx_digraph(gm.graph, keep=dep.__contains__)

    def down(n: fx.Node) -> set[fx.Node]:  # n and its key-dependent descendants
        return nx.descendants(kdep, n) | {n}

    region = in_graph_order(g, nx.ancestors(kdep, key_end) | {key_end})
    pos_muls = [
        n for n in region
        if op_name(n) == "mul" and sum(a in dep for a in n.all_input_nodes) == 1
        and any(a not in dep for a in n.all_input_nodes)
    ]
    if not pos_muls:
        log.debug("no multiplication by a position tensor on the key path; no RoPE")
        return None
    # The nearest dominator of key_end above every position multiplication: a node every
    # key-dependent path from a parameter into key_end passes through.
    below = set().union(*(down(m) for m in pos_muls))
    cands = in_graph_order(g, (n for n in region if n not in below), reverse=True)
    params = [n for n in dep if n.op == "placeholder"]
    doms = dominators(kdep, params, key_end)

    def whole_key(d: fx.Node) -> bool:
        # A tensor that still holds whole keys: head_dim innermost, the token dim present.
        shape = shape_of(d)
        return (
            bool(shape) and sym_expr(shape[-1]) == head_dim
            and any(sym_expr(x) == sym_expr(token_size) for x in shape)
        )

    pre = next((d for d in cands if whole_key(d) and d in doms), None)
    if pre is None:
        raise AnalysisError(
            f"the key path into {key_end.format_node()} multiplies by position tensors but "
            "has no single tensor in front of the rotation"
        )
    after_pre = down(pre)
    rotation = [n for n in region if n in after_pre and n is not pre]
    names = {op_name(n) for n in rotation}
    if not names <= _ROPE_OPS:
        log.debug("key path region has non-rotation ops %s; not RoPE", sorted(names - _ROPE_OPS))
        return None
    # Style from the channel pairing inside the rotation.
    if "view_as_complex" in names:
        style = RopeStyle.COMPLEX
    elif "stack" in names or any(
        op_name(n) == "slice" and len(n.args) > 4 and n.args[4] not in (None, 1) for n in rotation
    ):
        style = RopeStyle.INTERLEAVED
    elif "cat" in names and "neg" in names:
        style = RopeStyle.ROTATE_HALF
    else:
        log.debug("position multiplications without a recognisable channel pairing; not RoPE")
        return None
    widths = {_rotated_width(m, dep) for m in pos_muls if not _is_complex(m)}
    cwidths = {2 * int(shape_of(m)[-1]) for m in pos_muls if _is_complex(m)}
    widths |= cwidths
    if len(widths) != 1:
        raise AnalysisError(
            f"rotation on the key path multiplies {sorted(widths)} channels in different "
            f"places; expected one rotary width (at {key_end.format_node()})"
        )
    rotary_dim = widths.pop()
    pre_shape = shape_of(pre)
    if int(sym_expr(pre_shape[-1])) != head_dim:
        raise AnalysisError(
            f"the key in front of the rotation {pre.format_node()} has last dim "
            f"{pre_shape[-1]}, expected head_dim={head_dim}"
        )
    tok = [d for d, s in enumerate(pre_shape) if sym_expr(s) == sym_expr(token_size)]
    if len(tok) != 1:
        raise AnalysisError(
            f"cannot locate the token dim (size {token_size}) in the pre-RoPE key "
            f"{pre.format_node()} of shape {pre_shape}"
        )
    # cos multiplies the key itself; sin multiplies the rotated copy.
    cos_src = sin_src = None
    cos_node = sin_node = None
    for m in pos_muls:
        key_in = next(a for a in m.all_input_nodes if a in dep)
        pos_in = next(a for a in m.all_input_nodes if a not in dep)
        src = ", ".join(_placeholder_sources(g, pos_in, placeholder_names)) or "<constant>"
        # Does the key reach this multiplication through the rotated copy (neg/cat/stack
        # after the pre-RoPE node)?
        rotated = any(
            op_name(n) in ("neg", "cat", "stack")
            for n in nx.ancestors(kdep, key_in) | {key_in} if n in after_pre or n is key_in
        )
        if style is RopeStyle.COMPLEX:
            cos_src, cos_node = src, pos_in
        elif rotated:
            sin_src = sin_src or src
            sin_node = sin_node or pos_in
        else:
            cos_src = cos_src or src
            cos_node = cos_node or pos_in
    partial = rotary_dim < head_dim
    desc = _STYLE_TEXT[style]
    span = (
        f"channels 0-{rotary_dim - 1} of {head_dim} (partial)"
        if partial else f"all {head_dim} channels"
    )
    facts = RopeFacts(
        style=style, rotary_dim=rotary_dim, head_dim=head_dim,
        cos_source=cos_src or "<unknown>",
        sin_source=None if style is RopeStyle.COMPLEX else (sin_src or "<unknown>"),
        pre_rope_node=pre.name, description=f"{desc} RoPE on {span}",
    )
    return RopeMatch(
        facts=facts, pre_rope=pre, token_dim=tok[0], channel_dim=len(pre_shape) - 1,
        region=tuple(n.name for n in rotation), cos_node=cos_node, sin_node=sin_node,
    )


def _rotated_width(mul: fx.Node, dep: set[fx.Node]) -> int:
    """Channels one position multiplication rotates: its width, twice that when it
    multiplies the even or odd channels alone (``x[..., ::2] * cos``, DeepSeek's
    interleaved form) rather than a whole key."""
    width = int(shape_of(mul)[-1])
    key_in = next(a for a in mul.all_input_nodes if a in dep)
    if op_name(key_in) == "slice" and len(key_in.args) > 4 and key_in.args[4] == 2:
        return 2 * width
    return width


# Ops that allocate a tensor the block then fills slice by slice with ``copy_``.
_ALLOCATIONS = frozenset({"new_empty", "empty", "empty_like", "new_zeros", "zeros", "zeros_like"})


def _in_place_parts(key_end: fx.Node, head_dim: int) -> list[tuple[int, int, fx.Node]] | None:
    """``[(first, end, source)]`` when ``key_end`` is a buffer allocated in the block and
    filled by ``copy_`` into slices of its last dim that cover every channel once (MLA:
    ``k = k_nope.new_empty(...); k[..., :d] = k_nope; k[..., d:] = k_rot``); else None."""
    if op_name(key_end) not in _ALLOCATIONS:
        return None
    rank = len(shape_of(key_end))
    parts = []
    for user in key_end.users:
        if op_name(user) != "slice" or user.args[0] is not key_end:
            continue
        dim = user.args[1] % rank if len(user.args) > 1 else 0
        step = user.args[4] if len(user.args) > 4 else 1
        if dim != rank - 1 or step != 1:
            return None
        first = user.args[2] if len(user.args) > 2 and user.args[2] is not None else 0
        end = min(user.args[3] if len(user.args) > 3 and user.args[3] is not None
                  else head_dim, head_dim)
        writes = [u for u in user.users if op_name(u) == "copy" and u.args[0] is user]
        if len(writes) != 1 or not isinstance(writes[0].args[1], fx.Node):
            return None
        parts.append((int(first), int(end), writes[0].args[1]))
    parts.sort(key=lambda p: p[0])
    covered = [(a, b) for a, b, _ in parts]
    if not parts or covered[0][0] != 0 or covered[-1][1] != head_dim or any(
        b != a2 for (_, b), (a2, _) in zip(covered, covered[1:], strict=False)
    ):
        return None
    return parts


def find_rope_in_place(
    gm: fx.GraphModule,
    key_end: fx.Node,
    token_size,
    head_dim: int,
    parameter_names: set[str],
    placeholder_names: dict[str, str],
) -> RopeFacts | None:
    """The rotation on one slice of a key the block assembles in place, if any.

    MLA (DeepSeek-V2/V3) builds each head's key as ``[k_nope | k_rope]`` in a buffer it
    allocates and fills with ``copy_``: only the trailing ``qk_rope_head_dim`` channels are
    rotated, and that part is one tensor shared by every head. Each part written is searched
    for a rotation (``find_rope`` on the part); the facts returned describe it on the
    channels of the whole key, with ``first_channel`` set. Such a key is cached after its
    rotation (``RopeFacts.reapplicable`` is False).
    """
    parts = _in_place_parts(key_end, head_dim)
    if parts is None:
        return None
    found = []
    for first, end, src in parts:
        match = find_rope(gm, src, token_size, end - first, parameter_names, placeholder_names)
        if match is not None:
            found.append((first, end, match))
    if len(found) != 1:
        if len(found) > 1:
            log.debug("rotations on %d slices of an in-place key; not described", len(found))
        return None
    first, end, match = found[0]
    inner = match.facts
    span = f"channels {first}-{end - 1} of {head_dim}"
    style = _STYLE_TEXT[inner.style]
    return RopeFacts(
        style=inner.style, rotary_dim=inner.rotary_dim, head_dim=head_dim,
        cos_source=inner.cos_source, sin_source=inner.sin_source,
        pre_rope_node=inner.pre_rope_node, first_channel=first,
        description=(
            f"{style} RoPE on {span}: the rotary slice of a key assembled in place from "
            f"{len(parts)} parts ({', '.join(src.name for _, _, src in parts)}; "
            "decoupled RoPE, as in MLA)"
        ),
    )


def _is_complex(node: fx.Node) -> bool:
    val = node.meta.get("val")
    return isinstance(val, torch.Tensor) and val.is_complex()


def precedes_projection(node: fx.Node) -> tuple[bool, str]:
    """Walk up through layout ops: is the first computing op a projection?

    Returns ``(True, op)`` for a projection (linear/addmm/...), ``(False, op)`` when some
    other op (a per-head key norm, Qwen3/OLMo2) sits between the projection and ``node``.
    """
    # A walk along one argument (the data input of each layout op), not a reachability
    # question: it stays hand-written.
    n = node
    while n.op == "call_function" and op_name(n) in LAYOUT_OPS:
        n = n.args[0] if op_name(n) != "getitem" else n.args[0].args[0]
    return (op_name(n) in _PROJECTIONS, op_name(n))
