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
from typing import Any

import torch

from ..errors import CacheError
from . import cpu_ext, reference
from .layout import Packed, QuantSpec, RotarySpec, scale_table

__all__ = ["CHUNK_TOKENS", "CPP_BITS", "DTYPE_CODES", "THREADS_FROM", "bh_slabs",
           "checked_blocks", "checked_positions", "compact_rope", "is_meta8", "load_library",
           "scale_table_f32", "set_spec_tables", "specs_why_not", "value_codebook"]

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


# Bit widths the kernel reads, and its codes for the dtypes of stored tokens and 16-bit
# metadata (and of an engine's rows): -D KVP_SDT, Params.sdt, Step/LStep edt.
CPP_BITS = (1, 2, 3, 4, 8)
DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
# Tokens per parallel work item of a contiguous packed segment (all kv heads of one batch
# row): a small score buffer and 16 items at 8K tokens to balance over the threads. Not
# tuned (no quiet machine to tune on).
CHUNK_TOKENS = 512
# Threads are used when a call holds this many tokens in all. NOTE: a helper thread costs
# tens of us to start, more on a loaded machine: a 1K step measured 0.33 ms on one thread vs
# 0.71 ms on two (load ~3). The 4K cut itself is a guess between 1K (one thread faster) and
# 8K (two threads faster).
THREADS_FROM = 4096


def specs_why_not(ks: QuantSpec, vs: QuantSpec) -> str | None:
    """Why the kernel cannot read keys ``ks`` / values ``vs`` (None: it can)."""
    if ks.full_precision or vs.full_precision:
        return "one tensor at 16 bits"
    if ks.axis != "channel" or vs.axis != "token":
        return f"axes {ks.axis}/{vs.axis} (the kernel reads channel keys, token values)"
    if ks.bits not in CPP_BITS or vs.bits not in CPP_BITS:
        return f"widths {ks.bits}/{vs.bits}"
    return None


def load_library(ks: QuantSpec, vs: QuantSpec, dk: int, dv: int, half: int,
                 store: torch.dtype) -> Any:
    """:func:`~kvpolicy.kernels.cpu_ext.load` for these specs, head dims, rotary half-width
    (0: none) and storage dtype (a key of :data:`DTYPE_CODES`), or None."""
    # VQ values: no level table, the d-channel codebook instead (vvq, asked for only then,
    # so every other library keeps its 12-number configuration)
    vq = (vs.vq_dim,) if vs.vq else ()
    return cpu_ext.load(ks.bits, vs.bits, ks.group_size, vs.group_size, dk, dv, half,
                        DTYPE_CODES[store], int(not ks.uniform),
                        int(not vs.uniform and not vq), int(ks.meta8), int(vs.meta8), *vq)


def set_spec_tables(p: Any, ks: QuantSpec, vs: QuantSpec, heads: int, dk: int,
                    book: torch.Tensor | None, keep: list[torch.Tensor]) -> None:
    """Point ``p`` (a :class:`~kvpolicy.kernels.cpu_ext.Params`) at the tables the specs
    need, each kept alive in ``keep``: per-channel key widths, the value codebook ``book``
    (:func:`value_codebook`), the level tables of specs that are not uniform. A null
    pointer is what tells the kernel "one width", "no VQ values", "uniform"."""
    if ks.widths is not None:
        reference.check_widths_shape(ks, heads, dk)
        table = reference.width_table(ks, "cpu")
        keep.append(table)
        p.kwid = table.data_ptr()
    if book is not None:
        keep.append(book)
        p.vcb = book.data_ptr()
    for spec, field in ((ks, "klut"),) + (((vs, "vlut"),) if book is None else ()):
        if not spec.uniform:
            table = torch.tensor(spec.table, dtype=torch.float32)
            keep.append(table)
            setattr(p, field, table.data_ptr())
