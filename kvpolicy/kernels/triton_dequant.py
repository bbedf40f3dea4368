"""Triton device functions that read one tile of a packed tensor, dequantized in registers.

Used by the attention kernel of :mod:`kvpolicy.kernels.triton_attention` (imported with
it, so ``TRITON_INTERPRET`` applies to both alike). Two ways to read a tile: a generic
gather (:func:`dequant_tile`: any bits, either axis, any group size; one load per element
for the code, scale and zero) and byte-at-a-time fast paths for the common layouts
(per-channel keys in whole groups, :func:`load_keys`; per-token values,
:func:`dequant_token_rows`; bits 1, 2, 4, 8 and power-of-two groups) that load each byte
once and each scale once per group. Every tile is ``code * scale + zero`` in fp32 (fp16
for fp16 queries), as :func:`kvpolicy.kernels.reference.dequantize`.
"""

from __future__ import annotations

import triton
import triton.language as tl

__all__ = ["dequant_tile", "dequant_token_rows", "load_keys"]


@triton.jit
def dequant_tile(
    c_ptr,  # codes of this (batch, head); plain values when BITS == 16
    s_ptr,  # scale of this (batch, head) (unused when BITS == 16)
    z_ptr,  # zero of this (batch, head), same strides as scale
    sc_0,  # codes stride: token group (channel axis) / token (token axis, plain)
    sc_1,  # codes stride: byte of a stream (packed) / channel (plain)
    sc_2,  # codes stride: channel (channel axis); unused otherwise
    ss_0,  # scale stride: token group (channel axis) / token (token axis)
    ss_1,  # scale stride: channel (channel axis) / channel group (token axis)
    tok,  # [N] int32 token indices inside the segment
    ch,  # [C] channel indices
    ok,  # [N, C] which elements exist
    BITS: tl.constexpr,  # code width, or 16 for a plain tensor
    GROUP: tl.constexpr,  # group size G
    CHANNEL_AXIS: tl.constexpr,  # True: groups of G tokens per channel; False: G channels
):
    """Dequantized fp32 ``[N, C]`` tile of one packed tensor (``code * scale + zero``)."""
    t2 = tok[:, None]
    c2 = ch[None, :]
    if BITS == 16:
        x = tl.load(c_ptr + t2 * sc_0 + c2 * sc_1, mask=ok, other=0.0).to(tl.float32)
    else:
        if CHANNEL_AXIS:
            grp = t2 // GROUP
            bit = (t2 % GROUP) * BITS
            byte_ptr = c_ptr + grp * sc_0 + (bit // 8) * sc_1 + c2 * sc_2
            s_off = grp * ss_0 + c2 * ss_1
        else:
            bit = c2 * BITS
            byte_ptr = c_ptr + t2 * sc_0 + (bit // 8) * sc_1
            s_off = t2 * ss_0 + (c2 // GROUP) * ss_1
        shift = (bit % 8).to(tl.int32)
        raw = tl.load(byte_ptr, mask=ok, other=0).to(tl.int32)
        if 8 % BITS != 0:
            # 3-bit codes straddle bytes; the next byte is in the same group.
            nxt = tl.load(byte_ptr + sc_1, mask=ok & (shift + BITS > 8), other=0)
            raw = raw | (nxt.to(tl.int32) << 8)
        code = (raw >> shift) & ((1 << BITS) - 1)
        scale = tl.load(s_ptr + s_off, mask=ok, other=0.0).to(tl.float32)
        zero = tl.load(z_ptr + s_off, mask=ok, other=0.0).to(tl.float32)
        x = _code_to_f32(code) * scale + zero
    return x


@triton.jit
def _code_to_f32(code):
    """Exact fp32 of small non-negative int32 codes without I2F: ``bits(2**23 + code) - 2**23``."""
    # NOTE: I2F issues at a quarter of the FMA rate on sm_90 and was one instruction per
    # element; this is a LOP3 and an FADD (SASS of the decode kernel: 128 I2F per warp and
    # 64-key tile -> 0).
    return (code | 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0


@triton.jit
def _dequant(codes, scale, zero, F16: tl.constexpr):
    """``code * scale + zero`` in fp32, or in fp16 (codes < 1024 are exact there).

    fp16 rounding (2**-11) is far below a 2-8 bit quantization step; fp32 and bf16 queries
    keep fp32.
    """
    # NOTE: fp16 math for fp16 queries (packed HFMA2, no fp16<->fp32 conversions) cut the
    # key loop of the sm_90 decode kernel by 22-23% (bench/sm90_static.py: 4096 -> 3176
    # thread-instructions per key at head_dim 128, 2124 -> 1629 at 64).
    if F16:
        c = (codes | 0x6400).to(tl.int16).to(tl.float16, bitcast=True) - 1024.0
        x = c * scale.to(tl.float16) + zero.to(tl.float16)
    else:
        x = _code_to_f32(codes) * scale.to(tl.float32) + zero.to(tl.float32)
    return x


@triton.jit
def _dequant_channel_groups(
    c_ptr,  # channel-packed codes of this (batch, head): [T//G, G*bits//8, D]
    s_ptr,  # scale of this (batch, head): [T//G, D]
    z_ptr,  # zero, same strides as scale
    sc_0, sc_1, sc_2,  # codes strides: group, byte, channel
    ss_0, ss_1,  # scale strides: group, channel
    n0,  # first token of the tile, a multiple of GROUP
    n_end,  # tokens from n_end on are not read (end of the split)
    ch,  # [C] channel indices
    ch_ok,  # [C] which channels exist
    BITS: tl.constexpr,  # code width dividing 8
    GROUP: tl.constexpr,  # G, a power of two dividing BLOCK_N
    BLOCK_N: tl.constexpr,  # tokens in the tile
    F16: tl.constexpr,  # compute in fp16 (fp16 queries) instead of fp32
):
    """Fast path of :func:`dequant_tile` for whole groups of per-channel codes.

    Each byte is loaded once (contiguous along the channels) and split into its
    ``8 // BITS`` codes in registers; scale and zero are loaded once per group row.
    """
    NGT: tl.constexpr = BLOCK_N // GROUP  # groups in the tile
    GB: tl.constexpr = GROUP * BITS // 8  # bytes per channel and group
    PER: tl.constexpr = 8 // BITS  # codes per byte
    g = n0 // GROUP + tl.arange(0, NGT)
    g_ok = g * GROUP < n_end  # the last tile may run past the segment
    j = tl.arange(0, GB)
    ok = g_ok[:, None, None] & (j[None, :, None] >= 0) & ch_ok[None, None, :]
    ptr = c_ptr + g[:, None, None] * sc_0 + j[None, :, None] * sc_1 + ch[None, None, :] * sc_2
    byts = tl.load(ptr, mask=ok, other=0).to(tl.int32)  # [NGT, GB, C]
    sh = tl.arange(0, PER) * BITS
    codes = (byts[:, :, None, :] >> sh[None, None, :, None]) & ((1 << BITS) - 1)
    codes = tl.reshape(codes, [NGT, GROUP, ch.shape[0]])  # token = byte * PER + k
    s_off = g[:, None] * ss_0 + ch[None, :] * ss_1
    s_ok = g_ok[:, None] & ch_ok[None, :]
    scale = tl.load(s_ptr + s_off, mask=s_ok, other=0.0)
    zero = tl.load(z_ptr + s_off, mask=s_ok, other=0.0)
    x = _dequant(codes, scale[:, None, :], zero[:, None, :], F16)
    return tl.reshape(x, [BLOCK_N, ch.shape[0]])


@triton.jit
def dequant_token_rows(
    c_ptr,  # token-packed codes of this (batch, head): [T, D*bits//8]
    s_ptr,  # scale of this (batch, head): [T, D//G]
    z_ptr,  # zero, same strides as scale
    sc_0, sc_1,  # codes strides: token, byte
    ss_0, ss_1,  # scale strides: token, channel group
    tok,  # [N] token indices
    tok_ok,  # [N] which tokens exist
    BITS: tl.constexpr,  # code width dividing 8
    GROUP: tl.constexpr,  # G, a power of two dividing D
    D: tl.constexpr,  # head dim, a power of two
    F16: tl.constexpr,  # compute in fp16 (fp16 queries) instead of fp32
):
    """Fast path of :func:`dequant_tile` for whole rows of per-token codes: each byte is
    loaded once and split in registers, scale and zero once per (token, group)."""
    NG: tl.constexpr = D // GROUP  # groups per token
    GBY: tl.constexpr = GROUP * BITS // 8  # bytes per group
    PER: tl.constexpr = 8 // BITS
    jg = tl.arange(0, NG)
    by = tl.arange(0, GBY)
    ok = tok_ok[:, None, None] & (jg[None, :, None] >= 0) & (by[None, None, :] >= 0)
    ptr = c_ptr + tok[:, None, None] * sc_0 + (jg[None, :, None] * GBY + by[None, None, :]) * sc_1
    byts = tl.load(ptr, mask=ok, other=0).to(tl.int32)  # [N, NG, GBY]
    sh = tl.arange(0, PER) * BITS
    codes = (byts[:, :, :, None] >> sh[None, None, None, :]) & ((1 << BITS) - 1)
    codes = tl.reshape(codes, [tok.shape[0], NG, GROUP])  # channel = g*G + byte*PER + k
    s_off = tok[:, None] * ss_0 + jg[None, :] * ss_1
    s_ok = tok_ok[:, None] & (jg[None, :] >= 0)
    scale = tl.load(s_ptr + s_off, mask=s_ok, other=0.0)
    zero = tl.load(z_ptr + s_off, mask=s_ok, other=0.0)
    x = _dequant(codes, scale[:, :, None], zero[:, :, None], F16)
    return tl.reshape(x, [tok.shape[0], D])


@triton.jit
def load_keys(
    c_ptr, s_ptr, z_ptr,  # key codes, scale, zero of this (batch, head)
    sc_0, sc_1, sc_2, ss_0, ss_1,  # their strides (see dequant_tile)
    n0,  # first token of the tile
    n_end,  # end of the split (the fast path must not read past it)
    tok,  # [N] token indices
    tok_ok,  # [N] which tokens exist
    ch,  # [C] channel indices
    ch_ok,  # [C] which channels exist
    BITS: tl.constexpr, GROUP: tl.constexpr, CHANNEL_AXIS: tl.constexpr,  # key policy
    FAST: tl.constexpr,  # whole per-channel groups with BITS dividing 8 (host-checked)
    BLOCK_N: tl.constexpr,  # tokens in the tile
    F16: tl.constexpr,  # return fp16 (fp16 queries) instead of fp32
):
    """Dequantized ``[N, C]`` key tile, by the fast path where the layout allows."""
    if FAST and BLOCK_N % GROUP == 0:
        x = _dequant_channel_groups(c_ptr, s_ptr, z_ptr, sc_0, sc_1, sc_2, ss_0, ss_1, n0,
                                    n_end, ch, ch_ok, BITS, GROUP, BLOCK_N, F16)
    else:
        x = dequant_tile(c_ptr, s_ptr, z_ptr, sc_0, sc_1, sc_2, ss_0, ss_1, tok, ch,
                          tok_ok[:, None] & ch_ok[None, :], BITS, GROUP, CHANNEL_AXIS)
        if F16:
            x = x.to(tl.float16)
    return x
