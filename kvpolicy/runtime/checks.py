"""Input checks of a packed layer's ``append`` and ``attend`` (``runtime.layer``), and the
alignment of a sliding-window layer's mask.

Each check raises ``CacheError`` naming the cause and the fix, before anything is stored.
"""

from __future__ import annotations

from typing import Any

import torch

from ..errors import CacheError
from ..kernels.layout import QuantSpec, RotarySpec

__all__ = ["check_pair", "check_query", "check_rope", "check_softcap", "align_window_mask"]


def check_pair(key: Any, value: Any, key_spec: QuantSpec, value_spec: QuantSpec) -> None:
    """``key``/``value`` are floating ``[B, Hkv, T, D]`` tensors that agree on batch, heads,
    tokens, dtype and device, with head dims the per-token groups divide."""
    for name, t in (("key", key), ("value", value)):
        if not isinstance(t, torch.Tensor):
            raise CacheError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise CacheError(
                f"{name} must be [batch, kv_heads, tokens, head_dim], got shape "
                f"{tuple(t.shape)}; transpose to the Hugging Face layout first"
            )
        if not t.dtype.is_floating_point:
            raise CacheError(f"{name} has dtype {t.dtype}; pass a floating tensor")
    if key.shape[:3] != value.shape[:3]:
        raise CacheError(
            f"key {tuple(key.shape)} and value {tuple(value.shape)} disagree on "
            f"[batch, kv_heads, tokens]; append matching key/value pairs"
        )
    if key.dtype != value.dtype:
        raise CacheError(
            f"key dtype {key.dtype} != value dtype {value.dtype}; cast both to one dtype"
        )
    if key.device != value.device:
        raise CacheError(f"key on {key.device}, value on {value.device}; use one device")
    b, h, t, dk = key.shape
    dv = value.shape[3]
    for name, spec, d in (("key", key_spec, dk), ("value", value_spec, dv)):
        if spec.axis == "token" and not spec.full_precision and d % spec.group_size:
            raise CacheError(
                f"{name} head_dim={d} is not a multiple of group_size="
                f"{spec.group_size} (per-token groups span channels); use a group size "
                f"that divides {d}"
            )


def check_query(
    query: Any, attn_mask: Any, kv: tuple[int, int, int], device: torch.device, tokens: int
) -> None:
    """``query [B, Hq, Tq, Dk]`` fits a cache of ``kv = (B, Hkv, Dk)`` on ``device``, and
    ``attn_mask`` broadcasts to ``[B, 1|Hq, Tq, tokens]``."""
    b, h, dk = kv
    if not isinstance(query, torch.Tensor) or query.dim() != 4:
        shape = tuple(query.shape) if isinstance(query, torch.Tensor) else type(query)
        raise CacheError(f"query must be [batch, q_heads, q_len, head_dim], got {shape}")
    if not query.dtype.is_floating_point:
        raise CacheError(f"query has dtype {query.dtype}; pass a floating tensor")
    qb, qh, tq, qd = query.shape
    if qb != b:
        raise CacheError(f"query batch {qb} != cache batch {b}; reorder() the cache first")
    if qd != dk:
        raise CacheError(f"query head_dim {qd} != key head_dim {dk}")
    if qh % h:
        raise CacheError(
            f"{qh} query heads are not a multiple of the cache's {h} kv heads (GQA needs "
            f"q_heads % kv_heads == 0)"
        )
    if query.device != device:
        raise CacheError(f"query on {query.device} but the cache lives on {device}")
    if not torch.isfinite(query).all():
        raise CacheError("query holds NaN or Inf")
    if attn_mask is not None:
        if not isinstance(attn_mask, torch.Tensor):
            raise CacheError("attn_mask must be a bool or float tensor")
        want = (b, qh, tq, tokens)
        ok = attn_mask.dim() == 4 and all(
            m in (1, w) for m, w in zip(attn_mask.shape, want, strict=True)
        )
        if not ok or attn_mask.shape[1] not in (1, qh):
            raise CacheError(
                f"attn_mask {tuple(attn_mask.shape)} does not broadcast to [batch, 1|heads, "
                f"q_len, cached (+ pending) tokens] = {want}"
            )
        if not (attn_mask.dtype == torch.bool or attn_mask.dtype.is_floating_point):
            raise CacheError(f"attn_mask dtype {attn_mask.dtype}: use bool or float")


def check_rope(rope: RotarySpec | None, max_pos: int, head_dim: int) -> None:
    """The rotary table of an ``attend`` call (or None) fits the head dim and covers the
    largest key position ``max_pos``."""
    if rope is None:
        return
    if rope.rotary_dim > head_dim:
        raise CacheError(f"rotary_dim={rope.rotary_dim} > head_dim={head_dim}")
    if max_pos >= rope.max_positions:
        raise CacheError(
            f"a key sits at position {max_pos} but the rotary table has "
            f"{rope.max_positions} rows; pass a table that covers every stored position"
        )


def check_softcap(softcap: Any) -> None:
    """``softcap`` is None (no cap) or a positive finite number."""
    if softcap is None:
        return
    if isinstance(softcap, bool) or not isinstance(softcap, (int, float)) or not (
        0 < softcap < float("inf")
    ):
        raise CacheError(f"softcap={softcap!r} must be a positive number (or None: no cap)")


def align_window_mask(attn_mask: Any, want: int) -> Any:
    """A sliding-window layer's mask, aligned on its last columns to ``want`` held
    (+ pending) tokens.

    transformers builds one mask for all the window layers of a model from the first one's
    sizes, and a layer whose chunks differ holds a different front. Columns of tokens this
    layer has evicted are cut; tokens it still holds before the mask's first column are
    hidden (they lie before the window). Any other mask is returned as it is.
    """
    if not isinstance(attn_mask, torch.Tensor) or attn_mask.dim() != 4:
        return attn_mask
    have = attn_mask.shape[-1]
    if have in (1, want):
        return attn_mask
    if have > want:
        return attn_mask[..., have - want:]
    fill = False if attn_mask.dtype == torch.bool else float("-inf")
    pad = attn_mask.new_full((*attn_mask.shape[:-1], want - have), fill)
    return torch.cat((pad, attn_mask), dim=-1)
