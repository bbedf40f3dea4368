"""Vectorised PyTorch backend: quantize and attend over the packed cache on CPU (or any device).

Same signatures as :mod:`kvpolicy.kernels.reference`. No Python loop runs over tokens or
groups. Two paths for :func:`packed_attention_partial`:

* a fused C++ kernel (:mod:`kvpolicy.kernels._cpu_ext`) for CPU decode-sized queries,
  which reads each packed byte once and never materialises a dequantized cache;
* an eager path (any device, any query length, or when no compiler is available):
  word-wise unpack, dequantize, rotate, one batched matmul pair.
"""

from __future__ import annotations

import logging
import math

import torch

from ..errors import CacheError
from . import reference as _ref
from .layout import Packed, QuantSpec, RotarySpec

__all__ = ["quantize", "dequantize", "attention_partial", "packed_attention_partial"]

log = logging.getLogger(__name__)

# Reference attention is already one matmul pair with a numerically safe softmax.
attention_partial = _ref.attention_partial


# --------------------------------------------------------------------------- bit packing


def _unit(bits: int) -> tuple[int, int]:
    """(codes, bytes) of the smallest whole-byte unit of ``bits``-wide codes."""
    common = bits * 8 // math.gcd(bits, 8)
    return common // bits, common // 8


def pack_bits(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Same contract as :func:`reference.pack_bits`, one word per byte-aligned unit.

    NOTE: packing a unit of codes into an int64 word and splitting the word into bytes
    touches each code once; the reference expands every code to ``bits`` single-bit
    elements first (8x the temporaries).
    """
    if bits == 8:
        return codes
    per, nbytes = _unit(bits)
    n = codes.shape[-1]
    if n % per != 0:
        raise CacheError(f"pack_bits: {n} codes of {bits} bits do not fill whole bytes")
    dev = codes.device
    c = codes.reshape(*codes.shape[:-1], n // per, per).to(torch.int64)
    word = (c << (torch.arange(per, device=dev) * bits)).sum(dim=-1, keepdim=True)
    out = (word >> (torch.arange(nbytes, device=dev) * 8)) & 0xFF
    return out.to(torch.uint8).reshape(*codes.shape[:-1], n // per * nbytes)


def unpack_bits(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """Same contract as :func:`reference.unpack_bits`."""
    if bits == 8:
        return packed
    per, nbytes = _unit(bits)
    m = packed.shape[-1]
    dev = packed.device
    if nbytes == 1:
        # NOTE: for 1/2/4 bits a uint8 shift-and-mask avoids the int64 word entirely.
        shifts = torch.arange(per, device=dev, dtype=torch.uint8) * bits
        out = (packed.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)
        return out.reshape(*packed.shape[:-1], m * per)
    b = packed.reshape(*packed.shape[:-1], m // nbytes, nbytes).to(torch.int64)
    word = (b << (torch.arange(nbytes, device=dev) * 8)).sum(dim=-1, keepdim=True)
    out = (word >> (torch.arange(per, device=dev) * bits)) & ((1 << bits) - 1)
    return out.to(torch.uint8).reshape(*packed.shape[:-1], m // nbytes * per)


# --------------------------------------------------------------------------- quantization


def quantize(x: torch.Tensor, spec: QuantSpec, dtype: torch.dtype | None = None) -> Packed:
    """Same contract and bit-identical result as :func:`reference.quantize`."""
    if x.dim() != 4:
        raise CacheError(f"quantize input must be [B, H, T, D], got shape {tuple(x.shape)}")
    dtype = x.dtype if dtype is None else dtype
    if spec.full_precision:
        empty = x.new_empty(0, dtype=dtype)
        return Packed(x.to(dtype), empty, empty)
    b, h, t, d = x.shape
    g = spec.group_size
    levels = (1 << spec.bits) - 1
    if spec.axis == "channel":
        if t % g != 0:
            raise CacheError(
                f"per-channel quantization needs whole token groups: T={t} is not a "
                f"multiple of group_size={g}; keep the remainder in the residual window"
            )
        groups = x.reshape(b, h, t // g, g, d).float()  # reduce over dim 3
        red = 3
    else:
        if d % g != 0:
            raise CacheError(
                f"per-token quantization needs whole channel groups: head_dim={d} is not a "
                f"multiple of group_size={g}; use a group_size that divides {d}"
            )
        groups = x.reshape(b, h, t, d // g, g).float()  # reduce over dim 4
        red = 4
    lo, hi = groups.amin(dim=red), groups.amax(dim=red)
    zero = lo.to(dtype)
    scale = ((hi - lo) / levels).to(dtype)
    z32 = zero.float().unsqueeze(red)
    s32 = scale.float().unsqueeze(red)
    safe = torch.where(s32 > 0, s32, torch.ones_like(s32))
    codes = torch.round((groups - z32) / safe).clamp_(0, levels)
    codes = torch.where(s32 > 0, codes, torch.zeros_like(codes)).to(torch.uint8)
    if spec.axis == "channel":
        # [B,H,n,G,D] -> stream along G -> [B,H,n,G*bits/8,D]
        packed = pack_bits(codes.transpose(3, 4), spec.bits).transpose(3, 4).contiguous()
    else:
        packed = pack_bits(codes.reshape(b, h, t, d), spec.bits)
    return Packed(packed, scale.contiguous(), zero.contiguous())


def dequantize(p: Packed, spec: QuantSpec, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Same contract as :func:`reference.dequantize`, with word-wise unpacking."""
    if spec.full_precision:
        return p.codes.to(dtype)
    codes, scale, zero = p
    if spec.axis == "channel":
        b, h, n, _, d = codes.shape
        c = unpack_bits(codes.transpose(3, 4), spec.bits)  # [B,H,n,D,G]
        x = torch.addcmul(zero.float().unsqueeze(-1), c.float(), scale.float().unsqueeze(-1))
        return x.transpose(3, 4).reshape(b, h, n * spec.group_size, d).to(dtype)
    b, h, t, _ = codes.shape
    c = unpack_bits(codes, spec.bits)
    d = c.shape[-1]
    c = c.reshape(b, h, t, d // spec.group_size, spec.group_size)
    x = torch.addcmul(zero.float().unsqueeze(-1), c.float(), scale.float().unsqueeze(-1))
    return x.reshape(b, h, t, d).to(dtype)


# --------------------------------------------------------------------------- attention


def _eager_packed_attention(
    q: torch.Tensor,
    k: Packed,
    v: Packed,
    k_spec: QuantSpec,
    v_spec: QuantSpec,
    scale: float,
    mask: torch.Tensor | None,
    rope: RotarySpec | None,
    k_positions: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    kd = dequantize(k, k_spec)
    vd = dequantize(v, v_spec)
    if rope is not None:
        if k_positions is None:
            raise CacheError("pre-RoPE keys need k_positions [B, Tk]")
        kd = _ref.apply_rope(kd, k_positions, rope)
    return attention_partial(q, kd, vd, scale=scale, mask=mask)


def packed_attention_partial(
    q: torch.Tensor,
    k: Packed,
    v: Packed,
    k_spec: QuantSpec,
    v_spec: QuantSpec,
    *,
    scale: float,
    mask: torch.Tensor | None = None,
    rope: RotarySpec | None = None,
    k_positions: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention over one packed segment; contract of :func:`reference.packed_attention_partial`.

    Args:
        q: ``[B, Hq, Tq, D]``; k, v: packed ``[B, Hkv, Tk, D]`` segments.
        scale: multiplies ``q·k``; mask: additive, broadcastable to ``[B, Hq, Tq, Tk]``.
        rope, k_positions: rotate pre-RoPE keys at ``k_positions [B, Tk]``.
    Returns:
        ``(out [B, Hq, Tq, D] fp32, lse [B, Hq, Tq] fp32)``.
    """
    return _eager_packed_attention(q, k, v, k_spec, v_spec, scale, mask, rope, k_positions)
