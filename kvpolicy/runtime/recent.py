"""The recent tokens of one cached tensor: the residual window, plain or packed per token.

A layer keeps its most recent tokens (the residual window and the incomplete chunk that
waits in it) outside the packed body: every step reads them, and a chunk leaves them for
the body once it is complete (``runtime.layer``). ``residual_bits`` sets how they are held:

``16``
    the plain ``[B, H, r, D]`` tensor in the cache dtype (the default; exact).
``8`` or ``4``
    each token's ``D`` channels are one group of the token layout
    (``QuantSpec(bits, D, "token")``, ``kernels.layout``): ``D * bits / 8`` bytes of codes
    and a scale and a zero in the cache dtype per token and kv head. At 8 bits and
    ``D = 64`` a token costs 8.5 bits per element against 16.

A packed token is quantized once, on arrival, by the backend's own ``quantize`` and read
through its ``dequantize``: one token's group does not depend on its neighbours, so tokens
appended one at a time or in bulk are stored bit-identically, and a chunk that leaves for
the body is packed from the same dequantized values either way (the body's codes are then
those of the residual's rounding, not of the original tokens). Attention reads the window
dequantized, ``O(r)`` work per step beside the body's ``O(T)``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..errors import CacheError
from ..kernels.layout import FULL_PRECISION, Packed, QuantSpec

__all__ = ["RESIDUAL_BITS", "Recent", "check_residual_bits", "recent_spec"]

# Widths the recent tokens may be held at (16: full precision).
RESIDUAL_BITS: tuple[int, ...] = (16, 8, 4)


def check_residual_bits(bits: int) -> None:
    """``bits`` is a width recent tokens can be held at; :class:`CacheError` otherwise."""
    if bits not in RESIDUAL_BITS:
        raise CacheError(f"residual_bits={bits} is not supported; use one of {RESIDUAL_BITS}")


@functools.lru_cache(maxsize=None)
def recent_spec(bits: int, head_dim: int) -> QuantSpec | None:
    """The per-token spec of recent tokens at ``bits`` (None: full precision); cached, since
    every append asks for it and the answer depends on these two ints alone."""
    check_residual_bits(bits)
    if bits == FULL_PRECISION:
        return None
    return QuantSpec(bits=bits, group_size=head_dim, axis="token")


@dataclass(frozen=True)
class Recent:
    """Recent tokens ``[B, H, r, D]`` of one tensor: plain (``spec`` None) or packed per
    token (``Packed`` whose three fields all have the token on dim 2)."""

    data: torch.Tensor | Packed
    spec: QuantSpec | None = None

    @classmethod
    def of(cls, x: torch.Tensor, spec: QuantSpec | None,
           quantize: Callable[..., Packed]) -> Recent:
        """``x`` held at ``spec``: a copy (plain), or its codes (the cache dtype is
        ``x``'s)."""
        if spec is None:
            return cls(x.clone())
        return cls(Packed(*quantize(x, spec, x.dtype)), spec)

    @classmethod
    def pair(cls, key: torch.Tensor, value: torch.Tensor, key_spec: QuantSpec | None,
             value_spec: QuantSpec | None, quantize: Callable[..., Packed]
             ) -> tuple[Recent, Recent]:
        """``(Recent.of(key, ...), Recent.of(value, ...))``, in one ``quantize`` call where
        both are packed alike: a token's group does not depend on its neighbours, so the
        codes are the same, and a decode step pays one call (~50 us on CPU) instead of
        two."""
        if (key_spec is None or key_spec != value_spec or key.shape != value.shape
                or key.dtype != value.dtype):
            return cls.of(key, key_spec, quantize), cls.of(value, value_spec, quantize)
        b = key.shape[0]
        both = quantize(torch.cat((key, value), dim=0), key_spec, key.dtype)
        return (cls(Packed(*(t[:b] for t in both)), key_spec),
                cls(Packed(*(t[b:] for t in both)), value_spec))

    def _fields(self) -> tuple[torch.Tensor, ...]:
        return (self.data,) if self.spec is None else tuple(self.data)

    def _map(self, f: Callable[[torch.Tensor], torch.Tensor]) -> Recent:
        if self.spec is None:
            return Recent(f(self.data))
        return Recent(Packed(*map(f, self.data)), self.spec)

    @property
    def n(self) -> int:
        return self._fields()[0].shape[2]

    @property
    def shape(self) -> tuple[int, int, int, int]:
        """The logical ``[B, H, r, D]``."""
        if self.spec is None:
            return tuple(self.data.shape)  # type: ignore[return-value]
        b, h, r, _ = self.data.codes.shape
        return b, h, r, self.spec.group_size

    @property
    def dtype(self) -> torch.dtype:
        """The cache dtype (of the tokens, or of the scales)."""
        return self.data.dtype if self.spec is None else self.data.scale.dtype

    @property
    def device(self) -> torch.device:
        return self._fields()[0].device

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self._fields())

    def joined(self, other: Recent) -> Recent:
        """These tokens followed by ``other``'s (held the same way)."""
        if (self.spec is None) != (other.spec is None):
            raise CacheError("recent tokens held two ways cannot be joined")
        mine, theirs = self._fields(), other._fields()
        cat = tuple(torch.cat((a, b), dim=2) for a, b in zip(mine, theirs, strict=True))
        return Recent(cat[0]) if self.spec is None else Recent(Packed(*cat), self.spec)

    def tokens(self, start: int, stop: int | None = None) -> Recent:
        """Tokens ``[start, stop)`` (views)."""
        return self._map(lambda t: t[:, :, start:stop])

    def contiguous(self) -> Recent:
        return self._map(torch.Tensor.contiguous)

    def select(self, index: torch.Tensor) -> Recent:
        """Batch rows ``index`` (beam search)."""
        return self._map(lambda t: t.index_select(0, index))

    def values(self, dequantize: Callable[..., torch.Tensor],
               dtype: torch.dtype | None = None) -> torch.Tensor:
        """The tokens as attention reads them, ``[B, H, r, D]`` in ``dtype`` (default: the
        cache dtype); the plain tensor itself where it already has that dtype."""
        dtype = self.dtype if dtype is None else dtype
        if self.spec is None:
            return self.data.to(dtype)
        return dequantize(self.data, self.spec, dtype)
