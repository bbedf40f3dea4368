"""The op a rewritten attention block calls: append to the layer's packed cache, attend.

``rewrite`` replaces a block's attention consumer by one ``call_module`` node to a
``KVAttend``. At run time it takes the query, the (pre-RoPE) key and the value in the layout
the block produced them, brings K and V to ``[B, Hkv, T, D]``, hands the cos/sin the block
multiplied the key with to the cache's RoPE table, appends to the layer and attends (a
call of several tokens attends first, over the cache as it stands and its own tokens in
full precision, then appends; docs/concepts.md, Prefill and chunked prefill). The
layer and cache to use come from ``CURRENT``, set by the installed block forward
(``runtime.install``) around each call, or, under ``torch.compile``, from the cache the
model's forward bound for the whole call and the layer index the block's graph passes.

``KVAttend.forward`` is one call of the custom op ``kvpolicy::attend`` (``runtime.ops``),
whose implementation is :meth:`KVAttend.step`: to ``torch.compile`` the step is one opaque
node, and the cache's Python never enters a traced graph.
"""

from __future__ import annotations

import contextvars
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import KVPolicyError
from ..kernels import torch_backend
from ..kernels.masks import mask_rows
from ..kernels.rotation import rotation_matrix
from . import ops
from .checks import check_softcap

__all__ = ["AttendContext", "CURRENT", "KVAttend", "Layout", "PosLayout"]


@dataclass
class AttendContext:
    """What a compiled block needs at run time, set by the caller around each call.

    Set twice in an eager model call: once for the whole call by the model's forward
    (``layer`` None: the cache every block of this call uses), and around each block call
    by the installed block forward (``layer`` that block's). Under ``torch.compile`` only
    the first is set (dynamo cannot trace ``ContextVar.set``; ``runtime.install``), and
    ``kvpolicy::attend`` picks the layer out of ``cache`` by the index it is given.
    """

    layer: object | None  # cache.KVPolicyLayer (or a temporary one); None: by index
    cache: object | None  # cache.KVPolicyCache, None for a temporary layer


CURRENT: contextvars.ContextVar[AttendContext | None] = contextvars.ContextVar(
    "kvpolicy_attend", default=None
)

# Query rows per SDPA call of a prefill under a caller's mask: the mask block widened to
# fp32 is [B, 1, _MASK_ROWS, T]. NOTE: 8K tokens, 4 heads, D=64, bool causal mask, 1
# thread: 2.26 / 2.00 / 2.05 / 2.04 s at 128 / 256 / 512 / 1,024 rows, 1.96 s in one call.
# A soft-capped prefill (which SDPA cannot do) uses the same row blocks: its scores are
# [B, Hq, _MASK_ROWS, T] at most. NOTE: causal 4K tokens, 4 query on 2 kv heads, D=64, 1
# thread: 0.67-0.96 s soft-capped in row blocks against 0.15-0.16 s for SDPA without a cap.
_MASK_ROWS = 256

@dataclass(frozen=True)
class Layout:
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


@dataclass(frozen=True)
class PosLayout:
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


class KVAttend(nn.Module):
    """Append the new K/V of one block call to its packed layer and attend over it.

    Inputs: query ``[B, Hq, Tq, D]`` (rotated), key and value in the layout the block
    produced them (pre-RoPE key), the consumer's mask (or None), and the cos/sin operands
    of the key rotation (or None). ``softcap``: the consumer's logit soft-capping
    (``softcap * tanh(scale * q·k / softcap)`` before the mask), None for none.
    """

    def __init__(
        self, *, key_layout: Layout, value_layout: Layout, scale: float | None,
        causal: bool, mask_kind: str | None, rope_style: str | None, complex_rope: bool,
        cos_layout: PosLayout | None, sin_layout: PosLayout | None,
        softcap: float | None = None,
    ) -> None:
        super().__init__()
        self.key_layout, self.value_layout = key_layout, value_layout
        self.scale, self.causal, self.mask_kind = scale, causal, mask_kind
        self.softcap = softcap
        self.rope_style, self.complex_rope = rope_style, complex_rope
        self.cos_layout, self.sin_layout = cos_layout, sin_layout
        # The replaced consumer's output memory layout: later views in the graph were
        # traced against it (SDPA on CPU returns [B, T, H, D]-major storage).
        self.tokens_major = False
        # Set by the rewrite for a block that writes K/V into its own buffer at their
        # positions (gpt-fast): its mask has a column per absolute position, and its calls
        # name the positions they write (a call at position 0 starts a new sequence).
        self.mask_by_position = False
        # Where the model keeps RoPE frequencies (runtime.rotary.rotary_sources), set by
        # the compiler: the cache computes rows from them instead of storing rows.
        self.rotary_sources: tuple = ()
        self.op_id = ops.register(self)

    def extra_repr(self) -> str:
        return (
            f"scale={self.scale}, softcap={self.softcap}, causal={self.causal}, "
            f"mask={self.mask_kind}, rope={self.rope_style}"
            f"{' (complex)' if self.complex_rope else ''}"
        )

    def _rope_rows(self, cos, sin) -> tuple[torch.Tensor, torch.Tensor]:
        if self.complex_rope:
            rows = self.cos_layout.rows(cos)
            return (
                rows.real.repeat_interleave(2, dim=-1).contiguous(),
                rows.imag.repeat_interleave(2, dim=-1).contiguous(),
            )
        return self.cos_layout.rows(cos), self.sin_layout.rows(sin)

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
        cos: torch.Tensor | None, sin: torch.Tensor | None,
        write_positions: torch.Tensor | None = None, layer: int = -1,
    ) -> torch.Tensor:
        """One call of the op ``kvpolicy::attend`` (``runtime.ops``), which runs
        :meth:`step`: to ``torch.compile`` the whole step is one opaque node.

        ``layer``: the attention layer's index, which each layer's own graph passes
        (``runtime.install.layer_graph_module``); -1 (a graph built for no layer in
        particular) uses the layer bound around the call.
        """
        return ops.attend(q, k, v, mask, cos, sin, write_positions, self.op_id, layer)

    def __setstate__(self, state: dict) -> None:
        # A copy (copy.deepcopy, pickle) is a module of its own: the op must find it, not
        # the original, which may be freed while the copy lives.
        super().__setstate__(state)
        self.op_id = ops.register(self)

    def output_like(self, q: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """An empty tensor like :meth:`step`'s output (``kvpolicy::attend``'s fake):
        ``[B, Hq, Tq, Dv]`` in ``q``'s dtype, contiguous or, for ``tokens_major``, laid
        out ``[B, Tq, Hq, Dv]`` in memory."""
        b, hq, tq, _ = q.shape
        dv = v.shape[self.value_layout.perm[-1]]  # the channel dim of the value
        if self.tokens_major:
            return q.new_empty((b, tq, hq, dv)).transpose(1, 2)
        return q.new_empty((b, hq, tq, dv))

    def step(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
        cos: torch.Tensor | None, sin: torch.Tensor | None,
        write_positions: torch.Tensor | None, layer: int,
    ) -> torch.Tensor:
        """The attention step (``kvpolicy::attend``'s implementation): append, attend.

        The layer is the one bound around the block call or, when only the model call's
        cache is bound (under ``torch.compile``), layer ``layer`` of that cache.
        """
        ctx = CURRENT.get()
        if ctx is None:
            raise KVPolicyError(
                "a kvpolicy-compiled attention block was called outside its model wrapper, "
                "so no cache is bound for it; call the model. Under torch.compile a block "
                "finds its cache in the binding of the model's forward: compile the model "
                "(or its body, model.model), not an attention block alone"
            )
        cache = ctx.cache
        if ctx.layer is not None:
            layer_obj = ctx.layer
            if cache is not None and layer >= 0 and layer_obj.layer_idx != layer:
                raise KVPolicyError(
                    f"the graph of attention layer {layer} ran with layer "
                    f"{layer_obj.layer_idx} of the cache bound; this is a kvpolicy bug"
                )
        elif layer < 0 or cache is None:
            raise KVPolicyError(
                "kvpolicy::attend needs an attention layer index (the graph of a compiled "
                "layer passes it) to find its layer in the model call's cache"
            )
        else:
            layer_obj = cache.packed_layer(layer)
        packed = layer_obj.packed
        k = self.key_layout.apply(k)
        v = self.value_layout.apply(v)
        rotation = rotation_matrix(layer_obj.value_rotation, v.shape[-1], v.device)
        start = packed.n_seen
        positions = rope = None
        if self.rope_style is not None:
            # The cache turns the rows into positions (runtime.rotary) and hands back a
            # table they index; `positions` is a runtime.positions.TokenPositions.
            c, s = self._rope_rows(cos, sin)
            rope, positions = cache.rope_rows(layer_obj, c, s, self.rope_style, k.shape[0],
                                              self.rotary_sources)
        scale = self.scale if self.scale is not None else 1.0 / math.sqrt(q.shape[-1])
        if q.shape[2] == 1 and not self.mask_by_position:
            # A decode step: one fused C++ call where it covers the layer and the step
            # (runtime.layer_step), the value rotated and the output rotated back inside it.
            out = packed.decode_step(q, k, v, positions, mask,
                                     mask_inverted=self.mask_kind == "fill", scale=scale,
                                     rope=rope, softcap=self.softcap, rotation=rotation)
            if out is not None:
                packed.slide()
                return self._laid_out(out)
        if rotation is not None:  # every stored value is v R; the output is rotated back
            v = (v.float() @ rotation).to(v.dtype)
        if self.mask_by_position and write_positions is not None:
            start = _own_cache_start(packed, write_positions, start)
        attn_mask = None
        if mask is not None:
            attn_mask = mask if self.mask_kind != "fill" else ~mask
            while attn_mask.dim() < 4:
                attn_mask = attn_mask.unsqueeze(0)
            if self.mask_by_position:
                # Columns are buffer slots (absolute positions); the keys attended are
                # those held, from the first not evicted up to this call's last.
                attn_mask = attn_mask[..., packed.n_evicted : start + q.shape[2]]
        if q.shape[2] > 1:
            # A prefill, a prompt chunk or a new turn attends over the cache as it stands and
            # over its own keys and values in full precision (KIVI); the cache then stores
            # them, quantized once the residual overflows, for the steps that follow.
            if start == 0:
                out = _prefill_attention(q, k, v, attn_mask, self.causal, scale, rope,
                                         positions, self.softcap)
            else:
                out = packed.attend(q, scale=scale, attn_mask=attn_mask, causal=self.causal,
                                    rope=rope, pending=(k, v, positions),
                                    softcap=self.softcap)
            packed.append(k, v, positions)
            if start == 0 and q.device.type == "cuda":
                # The prompt already stalls: compile and tune the decode kernels now
                # rather than at the first step (once per policy variant and process).
                packed.warm_up(q[:, :, :1], rope=rope, softcap=self.softcap)
        else:
            packed.append(k, v, positions)
            out = packed.attend(
                q, scale=scale, attn_mask=attn_mask, causal=self.causal, rope=rope,
                softcap=self.softcap,
            )
        # A sliding-window layer frees what the next step cannot see (after attending:
        # this step's queries reach one token further back).
        packed.slide()
        if rotation is not None:
            out = (out.float() @ rotation.T).to(out.dtype)
        return self._laid_out(out)

    def _laid_out(self, out: torch.Tensor) -> torch.Tensor:
        # One layout whatever the path (SDPA on CPU returns [B, T, H, D]-major storage):
        # the op's fake implementation promises it (output_like).
        if self.tokens_major:
            return out.transpose(1, 2).contiguous().transpose(1, 2)
        return out.contiguous()


def _own_cache_start(packed, write_positions: torch.Tensor, start: int) -> int:
    """Where a call of a block with its own cache buffer writes (the index tensor of its
    buffer write): appended after what the layer holds, or, at position 0, a new sequence
    (the layer is cleared first, as the block would overwrite its buffer from slot 0).
    Returns the layer's token count before this call's tokens."""
    # NOTE: one host read per layer and call (the first position), as the block's own
    # buffer write reads its index on the host too.
    first = int(write_positions.reshape(-1)[0])
    if first == start:
        return start
    if first == 0:
        packed.clear()
        return 0
    raise KVPolicyError(
        f"the attention block writes its keys at position {first}, but its packed cache "
        f"holds positions 0-{start - 1}: kvpolicy's cache appends (the next position is "
        f"{start}) or starts again at position 0; it cannot overwrite the middle of a "
        "sequence"
    )


def _prefill_attention(q, k, v, attn_mask, causal, scale, rope, positions,
                       softcap=None) -> torch.Tensor:
    """Full-precision attention of a prefill over its own tokens ``[B, H, T, D]``.

    torch's fused ``scaled_dot_product_attention`` (flash on CPU, flash or memory-efficient
    on CUDA): no ``[T, T]`` score matrix, and no ``[T, T]`` mask for a causal prefill. On
    CPU (and for an fp32 model) it runs in fp32, as the cache's own kernels compute; a
    half-precision model on a GPU runs it in its dtype, which is what the fused GPU kernels
    take (fp32 accumulation inside) and half the bytes of an fp32 copy. A caller's mask
    (left padding) is passed in blocks of query rows, so that only a block of it is ever
    widened. SDPA cannot soft-cap: with ``softcap`` the rows are attended in fp32 blocks by
    :func:`_capped_prefill`.
    """
    if rope is not None:
        k = torch_backend.BACKEND.apply_rope(k, rope.rows_of(positions.tensor(k.device)), rope)
    dtype = q.dtype
    half_gpu = q.device.type == "cuda" and dtype in (torch.float16, torch.bfloat16)
    if softcap is not None:
        check_softcap(softcap)
        q, k, v = q.float(), k.float(), v.float()
        return _capped_prefill(q, k, v, attn_mask, causal, scale, softcap).to(dtype)
    if not half_gpu:
        q, k, v = q.float(), k.float(), v.float()
    gqa = q.shape[1] != k.shape[1]
    # enable_gqa where the kernel that will run takes it: CPU's flash kernel, and CUDA's
    # flash kernel (half precision, head_dim <= 256, no mask). Elsewhere (ROCm's
    # memory-efficient kernel, a masked prefill, fp32 on CUDA) a refusal would fall back
    # to the math path, which builds the [T, T] scores, so K/V are expanded to the
    # query's heads instead. NOTE: causal SDPA on CPU, 16K tokens, 4 query heads on 2 kv
    # heads, D=64, fp32: peak RSS rises 54 MB with K/V expanded, 20 MB with enable_gqa.
    # The CUDA choice follows torch's documented kernel constraints; no GPU run checked it.
    native_gqa = q.device.type == "cpu" or (
        half_gpu and attn_mask is None and q.shape[-1] <= 256
        and torch.version.hip is None
    )
    if gqa and not native_gqa:
        rep = q.shape[1] // k.shape[1]
        k, v, gqa = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1), False
    if attn_mask is None:
        out = F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale,
                                             enable_gqa=gqa)
    else:
        t = q.shape[2]
        blocks = [
            F.scaled_dot_product_attention(
                q[:, :, r0 : r0 + _MASK_ROWS], k, v, scale=scale, enable_gqa=gqa,
                attn_mask=mask_rows(attn_mask, False, range(r0, min(t, r0 + _MASK_ROWS)), t,
                                    t).to(q.dtype),
            )
            for r0 in range(0, t, _MASK_ROWS)
        ]
        out = blocks[0] if len(blocks) == 1 else torch.cat(blocks, dim=2)
    # A row that sees no key is 0 (the kernel contract, docs/design.md §6); SDPA's math
    # fallback would give NaN there, which the next layer's append refuses.
    return out.nan_to_num_(0.0).to(dtype)


def _capped_prefill(q, k, v, attn_mask, causal, scale, softcap) -> torch.Tensor:
    """A soft-capped prefill in blocks of ``_MASK_ROWS`` query rows (fp32 ``[B, H, T, D]``).

    Each block runs the torch backend's ``attention_partial`` (GQA folded into rows, the cap
    applied before the mask) over the keys it can see: under a causal mask and no
    caller's mask, only the keys up to its last row. Its scores are ``[B, Hq, rows, T]``
    at most, never the prompt's whole ``[T, T]``.
    """
    t = q.shape[2]
    blocks = []
    for r0 in range(0, t, _MASK_ROWS):
        rows = range(r0, min(t, r0 + _MASK_ROWS))
        mask = mask_rows(attn_mask, causal, rows, t, t, q.device)
        kb, vb = k, v
        if attn_mask is None and mask is not None:  # causal: keys past the last row hidden
            kb, vb, mask = k[:, :, : rows.stop], v[:, :, : rows.stop], mask[..., : rows.stop]
        blocks.append(torch_backend.BACKEND.attention_partial(
            q[:, :, r0 : rows.stop], kb, vb, scale=scale, mask=mask, softcap=softcap)[0])
    return blocks[0] if len(blocks) == 1 else torch.cat(blocks, dim=2)
