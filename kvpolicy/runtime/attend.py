"""The op a rewritten attention block calls: append to the layer's packed cache, attend.

``rewrite`` replaces a block's attention consumer by one ``call_module`` node to a
``KVAttend``. At run time it takes the query, the (pre-RoPE) key and the value in the layout
the block produced them, brings K and V to ``[B, Hkv, T, D]``, hands the cos/sin the block
multiplied the key with to the cache's RoPE table, appends to the layer and attends. The
layer and cache to use come from ``CURRENT``, set by the installed block forward
(``runtime.install``) around each call.
"""

from __future__ import annotations

import contextvars
import math
from dataclasses import dataclass

import torch
from torch import nn

from ..errors import KVPolicyError
from ..kernels import torch_backend
from ..kernels.masks import causal_mask, to_additive

__all__ = ["AttendContext", "CURRENT", "KVAttend", "Layout", "PosLayout"]


@dataclass
class AttendContext:
    """What a compiled block needs at run time, set by the caller around each call."""

    layer: object  # model_cache.KVPolicyLayer (or a temporary one)
    cache: object | None  # model_cache.KVPolicyCache, None for a temporary layer


CURRENT: contextvars.ContextVar[AttendContext | None] = contextvars.ContextVar(
    "kvpolicy_attend", default=None
)

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
    of the key rotation (or None).
    """

    def __init__(
        self, *, key_layout: Layout, value_layout: Layout, scale: float | None,
        causal: bool, mask_kind: str | None, rope_style: str | None, complex_rope: bool,
        cos_layout: PosLayout | None, sin_layout: PosLayout | None,
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
    """Full-precision attention of a prefill over its own tokens ``[B, H, T, D]``.

    Always the torch backend's kernels, whatever the layer's backend: nothing here is
    packed, so no packed kernel applies.
    """
    kernels = torch_backend.BACKEND
    if rope is not None:
        k = kernels.apply_rope(k, positions, rope)
    t = q.shape[2]
    if attn_mask is not None:
        add = to_additive(attn_mask)
    elif causal:
        add = causal_mask(t, t, q.device)[None, None]
    else:
        add = None
    out, _ = kernels.attention_partial(q.float(), k.float(), v.float(), scale=scale, mask=add)
    return out.to(q.dtype)
