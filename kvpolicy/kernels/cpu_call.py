"""What the torch backend hands the C++ CPU kernel (:mod:`kvpolicy.kernels.cpu_ext`) besides
the cache's own tensors: slab strides, checked positions and block tables, compact rotary
tables, for 8-bit metadata the fp32 scale table, and for vector-quantized values their
centroids.

The kernel reads raw pointers: every tensor these return must stay alive for the call
(the caller keeps them; the tables are cached here).
"""

from __future__ import annotations

import weakref
from functools import cache

import torch

from ..errors import CacheError
from . import reference
from .layout import Packed, QuantSpec, RotarySpec, scale_table

__all__ = ["bh_slabs", "checked_blocks", "checked_positions", "compact_rope", "is_meta8",
           "key_width_table", "scale_table_f32", "value_codebook"]

_rope_tables: weakref.WeakKeyDictionary[RotarySpec, tuple[torch.Tensor, torch.Tensor]] = (
    weakref.WeakKeyDictionary()
)


def compact_rope(rope: RotarySpec) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 cos/sin whose first ``rotary_dim/2`` columns hold each frequency once.

    For rotate_half the model's own table already has that layout (``cat(f, f)``): it is
    used in place, so a table that grows with the sequence costs no copy per step. The
    interleaved layout (``repeat_interleave(f, 2)``) is compacted once per spec.
    """
    got = _rope_tables.get(rope)
    if got is None:
        cos, sin = rope.cos, rope.sin
        if rope.style == "interleaved":
            cos, sin = cos[:, 0::2], sin[:, 0::2]
        cos = cos.to("cpu", torch.float32)
        sin = sin.to("cpu", torch.float32)
        if cos.stride(-1) != 1 or sin.stride() != cos.stride():
            cos, sin = cos.contiguous(), sin.contiguous()
        got = (cos, sin)
        _rope_tables[rope] = got
    return got


def bh_slabs(t: torch.Tensor) -> tuple[torch.Tensor, int, int]:
    """``t`` with each ``[b, h]`` slab contiguous, and its batch and head strides."""
    if t.is_contiguous():  # the common case, without the Python loop (once per field)
        return t, t.stride(0), t.stride(1)
    want = 1
    for size, stride in zip(reversed(t.shape[2:]), reversed(t.stride()[2:]), strict=True):
        if size != 1 and stride != want:
            t = t.contiguous()
            break
        want *= size
    return t, t.stride(0), t.stride(1)


def checked_positions(
    pos: torch.Tensor | None, b: int, t: int, rope: RotarySpec, check: bool = True
) -> torch.Tensor:
    """``pos`` as contiguous int64 ``[b, t]``, checked against the rotary table's rows
    unless ``check`` is False (the caller guarantees it)."""
    if pos is None:
        raise CacheError("pre-RoPE keys need positions [B, Tk]")
    pos = pos.to(torch.int64).contiguous()
    if pos.shape != (b, t):
        raise CacheError(f"positions must be [B, Tk] = {(b, t)}, got {tuple(pos.shape)}")
    # The kernel indexes the table with these: check, never read out of bounds.
    if check and pos.numel() and (int(pos.min()) < 0 or int(pos.max()) >= rope.max_positions):
        raise CacheError(f"positions exceed the rotary table ({rope.max_positions} rows)")
    return pos


def checked_blocks(table: torch.Tensor, b: int, pages: int, check: bool) -> torch.Tensor:
    """``table`` as contiguous int64 ``[b, nb]``, its ids checked against the ``pages``
    the kernel reads (unless ``check`` is False: the caller guarantees them)."""
    table = table.to(torch.int64).contiguous()
    if table.dim() != 2 or table.shape[0] != b:
        raise CacheError(f"block_table must be [B={b}, blocks], got {tuple(table.shape)}")
    if check and table.numel() and (int(table.min()) < 0 or int(table.max()) >= pages):
        raise CacheError(f"block_table names a block outside the {pages} pages given")
    return table


def value_codebook(spec: QuantSpec, heads: int) -> torch.Tensor | None:
    """The fp32 centroids ``[heads, 256, d]`` of vector-quantized values (``Params.vcb``),
    or None for values coded per element. Checked against the cache's kv heads, since the
    kernel indexes them by head; cached per device by the codebook, so the pointer outlives
    the call. Read with getattr: the kernel's tests hand in stand-ins of a spec without one."""
    book = getattr(spec, "codebook", None)
    if book is None:
        return None
    if book.heads != heads:
        raise CacheError(f"the value codebook has centroids for {book.heads} kv heads, the "
                         f"cache has {heads}")
    return book.tensor("cpu")


def is_meta8(p: Packed) -> bool:
    """Whether a packed segment stores 8-bit metadata: a uint8 scale index and an int8
    zero point (``QuantSpec.meta_bits == 8``), which the kernel reads as stored. Vector-
    quantized values keep the zero's dtype on their empty ``[B, H, T, 0]`` zero (int8 with
    a uint8 index, else the cache dtype), so they answer the same way."""
    m8 = p.scale.dtype == torch.uint8
    if m8 != (p.zero.dtype == torch.int8):
        raise CacheError(
            f"8-bit metadata is a uint8 scale index with an int8 zero point; got scale "
            f"{p.scale.dtype} with zero {p.zero.dtype}"
        )
    return m8


@cache
def scale_table_f32() -> torch.Tensor:
    """:func:`~kvpolicy.kernels.layout.scale_table` as a CPU fp32 tensor (``Params.stab``),
    made once and kept, so its pointer outlives every call."""
    return torch.tensor(scale_table(), dtype=torch.float32)


def key_width_table(spec: QuantSpec, heads: int, dim: int) -> torch.Tensor:
    """The per-channel key widths of ``spec`` as the kernel reads them (``Params.kwid``:
    int32 ``[Hkv, D, 2]``, cached), after checking they have ``heads`` rows of ``dim``."""
    reference.check_widths_shape(spec, heads, dim)
    return reference.width_table(spec, "cpu")
