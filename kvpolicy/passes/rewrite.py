"""Rewrite an analysed attention block onto the packed cache.

The attention consumer (SDPA, or the matmul -> softmax -> matmul chain) is replaced by one
``call_module`` node, ``KVAttend``, that appends the new keys and values to the layer's
packed cache and attends over everything cached. For pre-RoPE keys it reads the key *in
front of* the rotation; the rotation of the key is then dead code and is eliminated, while
the query keeps its own. The cos/sin the block multiplied the key with are handed over so
the cache can rotate each key at its own position after dequantization.

The pass works on a copy of the exported graph; ``graph.lint()`` runs after the rewrite.
"""

from __future__ import annotations

import contextvars
import copy
import logging
import math
from dataclasses import dataclass

import torch
from torch import fx, nn

from ..errors import AnalysisError, KVPolicyError
from ..facts import RopeStyle
from .contraction import CachePoint, Consumer, _expr, _shape, is_symbolic, op_name
from .rope import RopeMatch

__all__ = ["AttendContext", "KVAttend", "RewriteResult", "rewrite_block", "CURRENT"]

log = logging.getLogger(__name__)


@dataclass
class AttendContext:
    """What a compiled block needs at run time, set by the caller around each call."""

    layer: object  # model_cache.KVPolicyLayer (or a temporary one)
    cache: object | None  # model_cache.KVPolicyCache, None for a temporary layer


CURRENT: contextvars.ContextVar[AttendContext | None] = contextvars.ContextVar(
    "kvpolicy_attend", default=None
)

_ASSERTS = frozenset({
    "_assert_scalar", "sym_constrain_range_for_size", "sym_constrain_range",
    "_assert_tensor_metadata", "_assert_async",
})


@dataclass(frozen=True)
class _Layout:
    """How to bring a cached tensor to ``[B, H, T, D]``: permute, then reshape."""

    perm: tuple[int, ...]  # batch, head dims..., token, channel
    n_head_dims: int

    def apply(self, x: torch.Tensor) -> torch.Tensor:
        x = x.permute(self.perm)
        if self.n_head_dims == 1:
            return x
        b, *rest = x.shape
        t, d = rest[-2], rest[-1]
        return x.reshape(b, -1, t, d)


def _layout(shape: tuple, token_dim: int, channel_dim: int) -> _Layout:
    others = [d for d in range(len(shape)) if d not in (token_dim, channel_dim)]
    batch = [d for d in others if is_symbolic(shape[d])]
    if len(batch) != 1:
        raise AnalysisError(
            f"cannot find the batch dim of a cached tensor of shape {shape}: expected exactly "
            "one dynamic dim besides the tokens"
        )
    heads = [d for d in others if d != batch[0]]
    return _Layout(tuple([batch[0], *heads, token_dim, channel_dim]), len(heads))


@dataclass(frozen=True)
class _PosLayout:
    """Where tokens and batch rows sit in a cos/sin operand."""

    batch_dim: int | None
    token_dim: int

    def rows(self, x: torch.Tensor) -> torch.Tensor:
        """``[b_rows, T, r]`` (b_rows is 1 when positions are shared by the batch)."""
        if self.batch_dim is None:
            x = x.unsqueeze(0)
            bd, td = 0, self.token_dim + 1
        else:
            bd, td = self.batch_dim, self.token_dim
        x = x.movedim((bd, td), (0, 1))
        return x.reshape(x.shape[0], x.shape[1], x.shape[-1])


def _pos_layout(pos: fx.Node, key_like: fx.Node, token_size) -> _PosLayout:
    ps, ks = _shape(pos), _shape(key_like)
    tok = [d for d, s in enumerate(ps) if _expr(s) == _expr(token_size)]
    if len(tok) != 1:
        raise AnalysisError(f"cannot find the token dim of the RoPE table {pos.format_node()}")
    # Right-aligned broadcasting against the key: the key's batch dim is its dynamic dim
    # that is not tokens.
    off = len(ks) - len(ps)
    kb = [d for d, s in enumerate(ks) if is_symbolic(s) and _expr(s) != _expr(token_size)]
    batch = kb[0] - off if kb and 0 <= kb[0] - off < len(ps) else None
    return _PosLayout(batch, tok[0])


class KVAttend(nn.Module):
    """Append the new K/V of one block call to its packed layer and attend over it.

    Inputs: query ``[B, Hq, Tq, D]`` (rotated), key and value in the layout the block
    produced them (pre-RoPE key), the consumer's mask (or None), and the cos/sin operands
    of the key rotation (or None).
    """

    def __init__(
        self, *, key_layout: _Layout, value_layout: _Layout, scale: float | None,
        causal: bool, mask_kind: str | None, rope_style: str | None, complex_rope: bool,
        cos_layout: _PosLayout | None, sin_layout: _PosLayout | None,
    ) -> None:
        super().__init__()
        self.key_layout, self.value_layout = key_layout, value_layout
        self.scale, self.causal, self.mask_kind = scale, causal, mask_kind
        self.rope_style, self.complex_rope = rope_style, complex_rope
        self.cos_layout, self.sin_layout = cos_layout, sin_layout
        # The replaced consumer's output memory layout: later views in the graph were
        # traced against it (SDPA on CPU returns [B, T, H, D]-major storage).
        self.tokens_major = False

    def extra_repr(self) -> str:
        return (
            f"scale={self.scale}, causal={self.causal}, mask={self.mask_kind}, "
            f"rope={self.rope_style}{' (complex)' if self.complex_rope else ''}"
        )

    def _rope_rows(self, cos, sin) -> tuple[torch.Tensor, torch.Tensor]:
        if self.complex_rope:
            rows = self.cos_layout.rows(cos)
            return (
                rows.real.repeat_interleave(2, dim=-1).contiguous(),
                rows.imag.repeat_interleave(2, dim=-1).contiguous(),
            )
        return self.cos_layout.rows(cos), self.sin_layout.rows(sin)

    def forward(self, q, k, v, mask, cos, sin):
        ctx = CURRENT.get()
        if ctx is None:
            raise KVPolicyError(
                "a kvpolicy-compiled attention block was called outside its model wrapper"
            )
        layer, cache = ctx.layer, ctx.cache
        packed = layer.packed
        k = self.key_layout.apply(k)
        v = self.value_layout.apply(v)
        start = packed.seq_len
        positions = rope = None
        if self.rope_style is not None:
            c, s = self._rope_rows(cos, sin)
            ptr = cos.untyped_storage().data_ptr()
            table = cache.rope_rows(layer, c, s, start, self.rope_style, ptr)
            rope = table.spec()
            positions = table.indices(start, k.shape[2], k.shape[0], k.device)
        attn_mask = None
        if mask is not None:
            attn_mask = mask if self.mask_kind != "fill" else ~mask
            while attn_mask.dim() < 4:
                attn_mask = attn_mask.unsqueeze(0)
        scale = self.scale if self.scale is not None else 1.0 / math.sqrt(q.shape[-1])
        if start == 0 and q.shape[2] > 1:
            # A prefill attends over its own keys and values in full precision (KIVI): the
            # cache stores them quantized for the steps that follow.
            out = _prefill_attention(q, k, v, attn_mask, self.causal, scale, rope, positions)
            packed.append(k, v, positions)
        else:
            packed.append(k, v, positions)
            out = packed.attend(
                q, scale=scale, attn_mask=attn_mask, causal=self.causal, rope=rope
            )
        if self.tokens_major:
            out = out.transpose(1, 2).contiguous().transpose(1, 2)
        return out


def _prefill_attention(q, k, v, attn_mask, causal, scale, rope, positions) -> torch.Tensor:
    """Full-precision attention of a prefill over its own tokens ``[B, H, T, D]``."""
    from ..kernels import reference as ref
    from ..kernels import torch_backend

    if rope is not None:
        k = ref.apply_rope(k, positions, rope)
    t = q.shape[2]
    if attn_mask is not None:
        add = attn_mask
        if attn_mask.dtype == torch.bool:
            add = torch.zeros(attn_mask.shape, device=q.device).masked_fill_(
                ~attn_mask, float("-inf")
            )
        add = add.float()
    elif causal:
        add = torch.full((t, t), float("-inf"), device=q.device).triu_(1)[None, None]
    else:
        add = None
    out, _ = torch_backend.attention_partial(q.float(), k.float(), v.float(), scale=scale,
                                             mask=add)
    return out.to(q.dtype)


@dataclass
class RewriteResult:
    graph: fx.Graph
    attend: KVAttend
    modified: bool = True


def _sdpa_args(node: fx.Node) -> tuple[fx.Node | None, bool, float | None]:
    names = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale")
    vals = dict(zip(names, node.args, strict=False))
    vals.update(node.kwargs)
    return vals.get("attn_mask"), bool(vals.get("is_causal", False)), vals.get("scale")


def _matmul_scale_mask(consumer: Consumer):
    """Scale and mask applied between the scores and the softmax of an explicit chain."""
    scale = 1.0
    mask = None
    kind = None
    node = consumer.softmax.args[0]
    while node is not consumer.scores:
        name = op_name(node)
        on_path = [a for a in node.all_input_nodes if a is consumer.scores or a in _upstream(
            consumer.scores, node)]
        if not on_path:
            raise KVPolicyError(f"lost the score path at {node.format_node()}")
        x = on_path[0]
        others = [a for a in node.args if a is not x]
        if name in ("_to_copy", "to", "clone", "contiguous", "alias", "type_as"):
            pass
        elif name in ("mul", "div") and all(isinstance(o, (int, float)) for o in others):
            c = float(others[0])
            scale = scale * c if name == "mul" else scale / c
        elif name in ("add", "sub") and len(others) == 1 and isinstance(others[0], fx.Node):
            if mask is not None or name == "sub":
                raise KVPolicyError(f"two masks on the scores at {node.format_node()}")
            mask, kind = others[0], "additive"
        elif name == "masked_fill" and node.args[0] is x:
            value = node.args[2]
            if not (isinstance(value, float) and (math.isinf(value) or value < -1e30)):
                raise KVPolicyError(f"masked_fill with {value} is not a mask: {node.format_node()}")
            if mask is not None:
                raise KVPolicyError(f"two masks on the scores at {node.format_node()}")
            mask, kind = node.args[1], "fill"
        else:
            raise KVPolicyError(
                f"kvpolicy cannot rewrite an op between the scores and the softmax: "
                f"{node.format_node()} (supported: scaling by constants, an additive mask, "
                "masked_fill with -inf, casts)"
            )
        node = x
    return scale, mask, kind


def _upstream(target: fx.Node, start: fx.Node) -> set[fx.Node]:
    """Nodes between ``start`` (exclusive) and ``target`` (inclusive), walking inputs."""
    out, stack = set(), list(start.all_input_nodes)
    while stack:
        n = stack.pop()
        if n in out:
            continue
        out.add(n)
        if n is not target:
            stack.extend(n.all_input_nodes)
    return out if target in out else set()


def rewrite_block(
    graph: fx.Graph,
    consumer: Consumer,
    key_point: CachePoint,
    value_point: CachePoint,
    rope: RopeMatch | None,
    pre_rope: bool,
    module_name: str = "kvpolicy_attend",
) -> RewriteResult:
    """Replace the consumer of a *copy* of ``graph`` by a ``KVAttend`` call.

    Node arguments may come from another copy of the same graph; they are mapped by name.
    """
    new = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    out_val = new.graph_copy(graph, env)
    new.output(out_val)
    new._codegen = copy.deepcopy(graph._codegen)

    # The analysis may have run on another copy of this graph (the lifted export):
    # nodes are matched by name, which unlifting preserves.
    by_name = {n.name: n for n in graph.nodes}

    def m(n: fx.Node | None) -> fx.Node | None:
        if n is None:
            return None
        if n.name not in by_name:
            raise AnalysisError(f"node {n.name} is missing from the graph being rewritten")
        return env[by_name[n.name]]

    walked = {n.name: n for n in consumer.node.graph.nodes}
    for point in (key_point, value_point):
        tiled = [walked[x] for x in point.chain if op_name(walked[x]) == "repeat"]
        if tiled:
            # repeat() tiles heads (query head h reads kv head h % Hkv); the cache groups
            # them (h // (Hq // Hkv)) like expand/repeat_interleave.
            raise KVPolicyError(
                f"the attention operand is tiled by {tiled[0].format_node()}; kvpolicy "
                "supports grouped-query heads made by expand or repeat_interleave"
            )
    q = consumer.query
    if len(_shape(q)) != 4:
        raise KVPolicyError(f"the query {q.format_node()} is not [batch, heads, tokens, dim]")
    if rope is not None and pre_rope:
        kp = rope.pre_rope
        key_layout = _layout(_shape(kp), rope.token_dim, rope.channel_dim)
        cos_l = _pos_layout(rope.cos_node, _mul_partner(rope.cos_node),
                            key_point.shape[key_point.token_dim])
        sin_l = None
        if rope.sin_node is not None:
            sin_l = _pos_layout(rope.sin_node, _mul_partner(rope.sin_node),
                                key_point.shape[key_point.token_dim])
        style = "interleaved" if rope.facts.style in (RopeStyle.INTERLEAVED, RopeStyle.COMPLEX) \
            else "rotate_half"
        complex_rope = rope.facts.style is RopeStyle.COMPLEX
        cos_n, sin_n = m(rope.cos_node), m(rope.sin_node)
    else:
        kp = key_point.node
        key_layout = _layout(key_point.shape, key_point.token_dim, key_point.channel_dim)
        cos_l = sin_l = None
        style, complex_rope, cos_n, sin_n = None, False, None, None
    value_layout = _layout(value_point.shape, value_point.token_dim, value_point.channel_dim)

    if consumer.kind == "scaled_dot_product_attention":
        mask, causal, scale = _sdpa_args(consumer.node)
        mask_kind = None if mask is None else "sdpa"
        if mask is not None:
            causal = False
    else:
        scale, mask, mask_kind = _matmul_scale_mask(consumer)
        causal = False
    attend = KVAttend(
        key_layout=key_layout, value_layout=value_layout, scale=scale, causal=causal,
        mask_kind=mask_kind, rope_style=style, complex_rope=complex_rope,
        cos_layout=cos_l, sin_layout=sin_l,
    )
    target = m(consumer.node)
    val = consumer.node.meta.get("val")
    if isinstance(val, torch.Tensor) and not val.is_contiguous():
        attend.tokens_major = val.transpose(1, 2).is_contiguous()
    if _shape(consumer.node) != _shape(q)[:3] + (_shape(consumer.value)[-1],):
        raise KVPolicyError(
            f"the attention output {consumer.node.format_node()} is not laid out like the "
            "query ([batch, heads, tokens, dim]); kvpolicy cannot rewrite this consumer"
        )
    with new.inserting_before(target):
        call = new.call_module(module_name, (m(q), m(kp), m(value_point.node), m(mask),
                                             cos_n, sin_n))
        call.meta = dict(target.meta)
    target.replace_all_uses_with(call)
    new.erase_node(target)  # SDPA counts as impure (dropout RNG): dead-code elim. keeps it
    # Attention weights returned by eager implementations are not available any more.
    if consumer.softmax is not None:
        out = next(n for n in new.nodes if n.op == "output")
        drop = {m(consumer.softmax)} | {u for u in m(consumer.softmax).users if u is not call}
        out.args = _replace_in(out.args, drop)
    if mask is not None:
        _unbind_mask_sizes(new, m(mask))
    for n in list(new.nodes):
        if n.op == "call_function" and op_name(n) in _ASSERTS and not n.users:
            new.erase_node(n)
    new.eliminate_dead_code(is_impure_node=rw_keep)
    new.lint()
    return RewriteResult(new, attend)


def _unbind_mask_sizes(graph: fx.Graph, mask: fx.Node) -> None:
    """Stop sizes from being read off the attention mask.

    The block was traced without a past, where the mask's key length equals the query
    length, so export may read the sequence length off the mask. With a cache the mask
    spans every cached token; such reads are redirected to an input that carries the same
    symbol (the hidden states).
    """
    sources = {mask}
    stack = [mask]
    while stack:
        n = stack.pop()
        for a in n.all_input_nodes:
            if a not in sources and isinstance(a.meta.get("val"), torch.Tensor):
                sources.add(a)
                stack.append(a)
    phs = [n for n in graph.nodes if n.op == "placeholder"
           and isinstance(n.meta.get("val"), torch.Tensor)]
    for node in list(graph.nodes):
        if not (node.op == "call_function" and op_name(node) == "sym_size"):
            continue
        src, dim = node.args[0], node.args[1]
        if src not in sources:
            continue
        expr = _expr(_shape(src)[dim])
        alt = next(
            ((p, d) for p in phs if p not in sources
             for d, size in enumerate(_shape(p)) if _expr(size) == expr),
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


def lossless_check(original: torch.Tensor, rewritten: torch.Tensor, where: str) -> None:
    """The compile-time check: the rewritten block at full precision equals the original."""
    if original.shape != rewritten.shape:
        raise KVPolicyError(f"{where}: rewritten block returns {tuple(rewritten.shape)}, "
                            f"the original {tuple(original.shape)}")
    err = (original.float() - rewritten.float()).abs().max().item()
    ref = original.float().abs().max().item() + 1e-6
    if not err <= 1e-4 * max(ref, 1.0):
        raise KVPolicyError(
            f"{where}: the rewritten block differs from the original by {err:.3g} (max |out| "
            f"{ref:.3g}) at full precision; the rewrite is wrong for this block - please report"
        )
