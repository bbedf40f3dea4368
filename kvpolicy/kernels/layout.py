"""The packed KV-cache format: one contract shared by every backend.

A cached tensor has the Hugging Face layout ``[B, H, T, D]`` (batch, kv heads, tokens,
head_dim). Quantization is uniform and asymmetric per *group*:

    zero  = min(group)                       stored in the cache dtype
    scale = (max(group) - min(group)) / (2**bits - 1)   stored in the cache dtype
    code  = clamp(round((x - zero) / scale), 0, 2**bits - 1)  (0 where scale == 0)
    x̂     = code * scale + zero

Codes are computed against the *stored* (rounded) scale and zero so that dequantization
reproduces exactly what the quantizer assumed.

Two layouts, named by the axis along which the scales vary (docs/design.md §1):

``Axis "channel"`` (keys: contracted over channels -> one scale per channel)
    groups are G consecutive tokens of one channel.
    codes  uint8 [B, H, T // G, G * bits // 8, D]   (the G codes of one channel form a
                                                       bit stream along dim 3; D innermost
                                                       so that a block of channels loads
                                                       contiguously)
    scale  [B, H, T // G, D]
    zero   [B, H, T // G, D]

``Axis "token"`` (values: contracted over tokens -> one scale per token)
    groups are G consecutive channels of one token.
    codes  uint8 [B, H, T, D * bits // 8]            (the D codes of one token form a bit
                                                       stream; group j is bytes
                                                       [j*G*bits//8, (j+1)*G*bits//8))
    scale  [B, H, T, D // G]
    zero   [B, H, T, D // G]

Bit order: element i of a stream occupies bits ``[i*bits, (i+1)*bits)`` of the stream,
counted from the least significant bit of byte 0 (little-endian). 3-bit codes therefore
straddle byte boundaries: 32 codes take 12 bytes, no padding to 4 bits.
``G * bits`` must be a multiple of 8 so that every group starts on a byte boundary
(:func:`byte_aligned`).

``bits == 16`` means "kept in full precision": the segment is stored as the plain tensor.

This module is the one home of these facts (:data:`SUPPORTED_BITS`, :data:`FULL_PRECISION`,
:func:`byte_aligned`). It imports torch only for type checking, so the policy schema can
import them without loading torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal, NamedTuple

from ..errors import CacheError

if TYPE_CHECKING:
    import torch

__all__ = [
    "SUPPORTED_BITS", "FULL_PRECISION", "byte_aligned", "QuantSpec", "Packed", "RotarySpec",
]

# The code widths the packed layout supports; 16 means "kept in full precision".
SUPPORTED_BITS: tuple[int, ...] = (1, 2, 3, 4, 8, 16)
FULL_PRECISION = 16


def byte_aligned(n: int, bits: int) -> bool:
    """Whether ``n`` codes of ``bits`` bits fill whole bytes, i.e. a group of ``n`` codes
    starts every following group on a byte boundary (always true in full precision)."""
    return bits >= FULL_PRECISION or (n * bits) % 8 == 0

AxisName = Literal["channel", "token"]


@dataclass(frozen=True)
class QuantSpec:
    """How one cached tensor is quantized: code width, group size and scale axis."""

    bits: int
    group_size: int
    axis: AxisName

    def __post_init__(self) -> None:
        if self.bits not in SUPPORTED_BITS:
            raise CacheError(f"bits={self.bits} is not supported; use one of {SUPPORTED_BITS}")
        if self.axis not in ("channel", "token"):
            raise CacheError(f"axis={self.axis!r} is not 'channel' or 'token'")
        if self.group_size < 1:
            raise CacheError(f"group_size={self.group_size} must be a positive integer")
        if not byte_aligned(self.group_size, self.bits):
            ok = [g for g in (8, 16, 32, 64, 128) if byte_aligned(g, self.bits)]
            raise CacheError(
                f"group_size={self.group_size} with bits={self.bits} does not start every "
                f"group on a byte boundary (group_size*bits must be a multiple of 8); "
                f"use one of {ok}"
            )

    @property
    def full_precision(self) -> bool:
        return self.bits == FULL_PRECISION

    @property
    def token_group(self) -> int:
        """Tokens that must arrive before they can be packed (G for 'channel', else 1)."""
        return self.group_size if (self.axis == "channel" and not self.full_precision) else 1


class Packed(NamedTuple):
    """One packed segment of a cached tensor (see the module docstring for shapes).

    For a full-precision (16-bit) segment ``codes`` is the plain ``[B, H, T, D]`` tensor
    and ``scale``/``zero`` are empty tensors.
    """

    codes: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor


@dataclass(frozen=True, eq=False)
class RotarySpec:
    """A rotary embedding re-applied to pre-RoPE keys after dequantization.

    ``cos``/``sin`` are tables indexed by the keys' stored positions, ``[P, rotary_dim]``
    (absolute positions; or rows of a table of the rows the model gave, for rotations the
    cache cannot recompute, ``runtime.rotary``), in the layout the model itself multiplies
    with (for ``rotate_half``: ``cat(f, f)``; for ``interleaved``:
    ``repeat_interleave(f, 2)``), already multiplied by any attention scaling. Every RoPE
    variant whose angles depend only on the position fits (linear, NTK, YaRN, Llama-3
    scaling). Channels ``>= rotary_dim`` pass through (partial rotary).

    rotate_half:  out[:r] = x[:r] * cos + cat(-x[r/2:r], x[:r/2]) * sin
    interleaved:  pairs (x[2i], x[2i+1]) -> (x0*cos - x1*sin, x1*cos + x0*sin)
    """

    style: Literal["rotate_half", "interleaved"]
    rotary_dim: int
    cos: torch.Tensor  # [P, rotary_dim]
    sin: torch.Tensor  # [P, rotary_dim]

    @property
    def max_positions(self) -> int:
        return self.cos.shape[0]
