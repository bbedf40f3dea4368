"""What one page of one layer holds in a paged cache (:class:`PagedLayout`), the layout
:mod:`kvpolicy.runtime.paged` appends to and attends over (docs/design.md §8)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..errors import CacheError
from ..kernels.layout import QuantSpec

__all__ = ["PagedField", "PagedLayout"]

_ALIGN = 16  # byte alignment of every field in a page


@dataclass(frozen=True)
class PagedField:
    """One tensor of a page: ``dtype`` elements of ``shape`` at byte ``offset``."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


def _meta_dtypes(spec: QuantSpec, store: torch.dtype) -> tuple[torch.dtype, torch.dtype]:
    return (torch.uint8, torch.int8) if spec.meta8 else (store, store)


class PagedLayout:
    """What one page of one layer holds, for a key and a value ``QuantSpec``.

    Args:
        key_spec, value_spec: the layer's packing (``bits == 16``: full precision).
        num_kv_heads: the kv heads this process holds (a tensor-parallel rank's share).
        head_dim, v_head_dim: channels of a key and of a value.
        block_size: tokens per page; a multiple of the chunk (:attr:`chunk`).
        sinks: first tokens of a sequence kept in full precision.
        store_dtype: dtype of full-precision tokens and of 16-bit scales/zeros.
    Raises:
        CacheError: a block size the groups do not tile, or more sinks than a block holds.
    """

    def __init__(
        self, key_spec: QuantSpec, value_spec: QuantSpec, *, num_kv_heads: int,
        head_dim: int, v_head_dim: int | None = None, block_size: int, sinks: int,
        store_dtype: torch.dtype,
    ) -> None:
        self.key_spec, self.value_spec = key_spec, value_spec
        self.num_kv_heads, self.head_dim = num_kv_heads, head_dim
        self.v_head_dim = head_dim if v_head_dim is None else v_head_dim
        self.block_size, self.store_dtype = block_size, store_dtype
        self.full_precision = key_spec.full_precision and value_spec.full_precision
        self.sinks = 0 if self.full_precision else sinks
        self.chunk = math.lcm(key_spec.token_group, value_spec.token_group)
        if block_size % self.chunk:
            raise CacheError(
                f"block_size {block_size} is not a multiple of the policy's key group of "
                f"{self.chunk} tokens, so a group would span two blocks; use a block size "
                f"that is a multiple of {math.lcm(self.chunk, 16)}"
            )
        if self.sinks > block_size:
            raise CacheError(f"{sinks} sink tokens do not fit the first block of "
                             f"{block_size} tokens; use fewer sinks or larger blocks")
        for spec, d, what in ((key_spec, head_dim, "key"), (value_spec, self.v_head_dim,
                                                           "value")):
            if spec.axis == "token" and not spec.full_precision and d % spec.group_size:
                raise CacheError(f"{what} groups of {spec.group_size} channels do not tile "
                                 f"head_dim {d}")
        self.fields = self._fields()
        end = self.fields[-1].offset + self.fields[-1].nbytes
        self.page_bytes = -(-end // _ALIGN) * _ALIGN

    def _tensor_fields(self, prefix: str, spec: QuantSpec, d: int) -> list[tuple]:
        h, bs, store = self.num_kv_heads, self.block_size, self.store_dtype
        if spec.full_precision:
            return [(prefix, store, (h, bs, d))]
        sdt, zdt = _meta_dtypes(spec, store)
        g, bits = spec.group_size, spec.bits
        if spec.axis == "channel":
            return [(f"{prefix}_codes", torch.uint8, (h, bs // g, g * bits // 8, d)),
                    (f"{prefix}_scale", sdt, (h, bs // g, d)),
                    (f"{prefix}_zero", zdt, (h, bs // g, d))]
        if spec.vq:  # one byte per sub-vector of vq_dim channels, a scale per group, no zero
            return [(f"{prefix}_codes", torch.uint8, (h, bs, d // spec.vq_dim)),
                    (f"{prefix}_scale", sdt, (h, bs, d // g)),
                    (f"{prefix}_zero", zdt, (h, bs, 0))]
        return [(f"{prefix}_codes", torch.uint8, (h, bs, d * bits // 8)),
                (f"{prefix}_scale", sdt, (h, bs, d // g)),
                (f"{prefix}_zero", zdt, (h, bs, d // g))]

    def _fields(self) -> tuple[PagedField, ...]:
        h, store = self.num_kv_heads, self.store_dtype
        raw = (self._tensor_fields("k", self.key_spec, self.head_dim)
               + self._tensor_fields("v", self.value_spec, self.v_head_dim))
        if not self.full_precision:
            if self.chunk > 1:
                raw += [("stage_k", store, (h, self.chunk, self.head_dim)),
                        ("stage_v", store, (h, self.chunk, self.v_head_dim))]
            if self.sinks:
                raw += [("sink_k", store, (h, self.sinks, self.head_dim)),
                        ("sink_v", store, (h, self.sinks, self.v_head_dim))]
        out, offset = [], 0
        for name, dtype, shape in raw:
            f = PagedField(name, dtype, tuple(shape), offset)
            out.append(f)
            offset = -(-(offset + f.nbytes) // _ALIGN) * _ALIGN
        return tuple(out)

    def fp_page_bytes(self) -> int:
        """Bytes a page of the same tokens takes as plain K and V in ``store_dtype``."""
        return (self.num_kv_heads * self.block_size * (self.head_dim + self.v_head_dim)
                * self.store_dtype.itemsize)

    def views(self, pages: torch.Tensor) -> dict[str, torch.Tensor]:
        """Every field of ``pages [num_blocks, >= page_bytes]`` (uint8 or int8) as a view
        ``[num_blocks, *shape]`` of its dtype: writes go to the pages."""
        if pages.dim() != 2 or pages.shape[1] < self.page_bytes:
            raise CacheError(f"pages must be [num_blocks, >= {self.page_bytes}] bytes, got "
                             f"{tuple(pages.shape)}")
        pages = pages.view(torch.uint8)
        out = {}
        for f in self.fields:
            raw = pages[:, f.offset : f.offset + f.nbytes]
            out[f.name] = raw.view(f.dtype).view(pages.shape[0], *f.shape)
        return out

    def describe(self) -> str:
        """One line: bytes per page against plain K/V, and what a page holds."""
        fp = self.fp_page_bytes()
        return (f"{self.page_bytes} bytes per block of {self.block_size} tokens "
                f"({fp / self.page_bytes:.2f}x smaller than {self.store_dtype} K/V); "
                + ", ".join(f.name for f in self.fields))
