"""Input checks of a packed layer's ``append`` and ``attend`` (``runtime.layer``), and the
alignment of a sliding-window layer's mask.

Each check raises ``CacheError`` naming the cause and the fix, before anything is stored.

Checks of *shapes, dtypes and devices* read only metadata and always run. Checks of the
*values* (NaN/Inf in keys, values and queries; that the positions a step's RoPE rows show
are the ones the cache infers) read device data on the host, which on a GPU is a
synchronisation that stalls the launch queue (docs/design.md §7). :func:`data_checks`
says when they run:

- on a CPU tensor, always (the data is already on the host: no stall);
- on any other device, for calls of more than one token (a prefill, a prompt chunk: one
  stall per layer, spread over the whole prompt), not for one-token decode steps;
- ``KVPOLICY_CHECKS=1``: always, every step on every device (to debug a model that turns
  NaN mid-generation); ``KVPOLICY_CHECKS=0``: never (compile-time and metadata checks
  still run).

The same rule decides the one host read that is not a check: whether a mask that hides
nothing is dropped so that the kernels skip reading it (a GPU step reads it instead).
"""

from __future__ import annotations

import os
from typing import Any

import torch

from ..errors import CacheError
from ..kernels.backend import check_name
from ..kernels.layout import QuantSpec, RotarySpec

__all__ = [
    "CHECKS_ENV", "align_window_mask", "check_batch_index", "check_finite", "check_layer_args",
    "check_pair", "check_query", "check_rope", "check_softcap", "check_table", "data_checks",
]

CHECKS_ENV = "KVPOLICY_CHECKS"


def data_checks(device: torch.device, tokens: int) -> bool:
    """Whether a call of ``tokens`` new tokens on ``device`` checks the *values* of its
    tensors (a host read; see the module docstring for the rule and ``KVPOLICY_CHECKS``)."""
    mode = os.environ.get(CHECKS_ENV, "")
    if mode == "1":
        return True
    if mode == "0":
        return False
    if mode not in ("", "auto"):
        raise CacheError(f"{CHECKS_ENV}={mode!r}: use 1 (check every step), 0 (never check "
                         "values) or leave it unset (check where it costs no GPU stall)")
    return device.type == "cpu" or tokens > 1


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


def check_layer_args(
    key_spec: Any, value_spec: Any, residual: int, sinks: int, backend: str, window: Any,
    dtype: torch.dtype | None,
) -> None:
    """The configuration of a ``PackedKVLayer``."""
    if not isinstance(key_spec, QuantSpec) or not isinstance(value_spec, QuantSpec):
        raise CacheError("key_spec and value_spec must be kvpolicy QuantSpec instances")
    if residual < 0 or sinks < 0:
        raise CacheError(f"residual={residual} and sinks={sinks} must be >= 0")
    check_name(backend)
    if window is not None and (isinstance(window, bool) or not isinstance(window, int)
                               or window < 1):
        raise CacheError(f"window={window!r} must be a positive int (or None: global)")
    if dtype is not None and not dtype.is_floating_point:
        raise CacheError(f"dtype={dtype} is not a floating dtype; use bfloat16/float16/32")


def check_batch_index(batch_index: Any, batch: int, values: bool) -> None:
    """``reorder``'s ``batch_index``: a 1-D int tensor; with ``values`` (a host read, see
    :func:`data_checks`), every entry in ``[0, batch)``."""
    if not isinstance(batch_index, torch.Tensor) or batch_index.dim() != 1 or (
        batch_index.dtype not in (torch.int64, torch.int32)
    ):
        raise CacheError("batch_index must be a 1-D int64 tensor")
    if values and batch_index.numel() and (
        int(batch_index.min()) < 0 or int(batch_index.max()) >= batch
    ):
        raise CacheError(f"batch_index values must lie in [0, {batch}); got "
                         f"{batch_index.tolist()}")


def check_finite(key: torch.Tensor, value: torch.Tensor) -> None:
    """An append's ``key``/``value`` hold no NaN or Inf (where :func:`data_checks` says)."""
    t = key.shape[2]
    if t and data_checks(key.device, t) and not (
        torch.isfinite(key).all() and torch.isfinite(value).all()
    ):
        which = "key" if not torch.isfinite(key).all() else "value"
        raise CacheError(
            f"{which} holds NaN or Inf; the cache was left unchanged (check the model "
            f"in full precision, or clamp activations before caching)"
        )


def check_table(rope: RotarySpec, positions: Any, head_dim: int) -> None:
    """A layer's own rotary table covers an append's ``positions`` (``TokenPositions``,
    bounds known on the host) and fits ``head_dim``."""
    if positions.count and positions.hi >= rope.max_positions:
        raise CacheError(
            f"positions span [{positions.lo}, {positions.hi}] but the rotary table "
            f"has {rope.max_positions} rows; build the RotarySpec longer"
        )
    if rope.rotary_dim > head_dim or rope.rotary_dim % 2:
        raise CacheError(f"rotary_dim={rope.rotary_dim} must be even and <= head_dim={head_dim}")


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
    if data_checks(device, tq) and not torch.isfinite(query).all():
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


def check_rope(rope: RotarySpec | None, max_pos: int, head_dim: int, min_pos: int = 0) -> None:
    """The rotary table of an ``attend`` call (or None) fits the head dim and covers the
    key positions ``min_pos .. max_pos``."""
    if rope is None:
        return
    if min_pos < rope.offset:
        raise CacheError(
            f"a key sits at position {min_pos} but the rotary table starts at position "
            f"{rope.offset}; pass a table that covers every stored position")
    if rope.rotary_dim > head_dim:
        raise CacheError(f"rotary_dim={rope.rotary_dim} > head_dim={head_dim}")
    if max_pos >= rope.offset + rope.max_positions:
        raise CacheError(
            f"a key sits at position {max_pos} but the rotary table has "
            f"{rope.max_positions} rows from position {rope.offset}; pass a table that "
            "covers every stored position"
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
