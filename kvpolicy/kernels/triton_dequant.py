"""Triton device code shared by the attention kernels: packed tiles dequantized in
registers, one segment's online softmax, and the merge of split results.

Used by the kernels of :mod:`kvpolicy.kernels.triton_attention` (one packed segment) and
:mod:`kvpolicy.kernels.triton_decode` (a packed and a full-precision segment in one
launch), imported with them, so ``TRITON_INTERPRET`` applies to all alike.

Reading tiles: a generic gather (:func:`dequant_tile`: any bits, either axis, any group
size, or a plain 16-bit tensor; one load per element for the code, scale and zero) and
byte-at-a-time fast paths for the common layouts (per-channel keys in whole groups,
:func:`load_keys`; per-token values, :func:`dequant_token_rows`; bits 1, 2, 4, 8 and
power-of-two groups) that load each byte once and each scale once per group. Every tile
is ``value * scale + zero`` in fp32 (fp16 for fp16 queries), as
:func:`kvpolicy.kernels.reference.dequantize`. A code's value is the code itself for
uniform levels; for non-uniform ones (``LUT``, a constexpr: uniform tiles compile without
it) it is read from the fp32 level table at ``lut_ptr`` (``QuantSpec.table``, 2-16
entries, cached on the device by :func:`kvpolicy.kernels._triton_util.level_lut`).
With 8-bit metadata (``M8``, a constexpr: 16-bit metadata compiles without it) the stored
scale is a uint8 index into the 256 fp32 scales at ``stab_ptr``
(:func:`kvpolicy.kernels.layout.scale_table`, cached by
:func:`kvpolicy.kernels._triton_util.meta_table`) and the stored zero an int8 zero point
``p``: ``scale = stab_ptr[index]``, ``zero = -p * scale / 4`` in fp32, as
:func:`kvpolicy.kernels.reference.meta_values` (:func:`_meta_values`).
Vector-quantized values (``QuantSpec.levels == "vq"``) are read by their own gather
(:func:`dequant_vq_rows`, under ``attend_keys``' constexpr ``V_VQ``): one byte per
sub-vector, its centroid's channels from the fp32 codebook, times the group's scale.

Attending: :func:`query_sets` loads a program's query rows as the channel sets a rotation
pairs, :func:`attend_keys` runs the online softmax of those rows over one range of a
segment's keys (packed, or plain with 16-bit specs), :func:`store_split` writes the
normalised output and log-sum-exp of one split, and :func:`merge_splits_kernel` merges
the splits of every row like :func:`kvpolicy.kernels.reference.merge_partials_lse`.
"""

from __future__ import annotations

import triton
import triton.language as tl

__all__ = [
    "dequant_tile", "dequant_token_rows", "dequant_vq_rows", "load_keys", "qk", "query_sets",
    "attend_keys", "store_split", "merge_splits_kernel",
]


@triton.jit
def _load_meta(s_ptr, z_ptr, off, ok, stab_ptr, M8: tl.constexpr):
    """fp32-or-stored scale and zero at ``off`` where ``ok``: 8-bit metadata through
    :func:`_meta_values` (``M8``), else as stored."""
    if M8:
        scale, zero = _meta_values(tl.load(s_ptr + off, mask=ok, other=0),
                                   tl.load(z_ptr + off, mask=ok, other=0), stab_ptr)
    else:
        scale = tl.load(s_ptr + off, mask=ok, other=0.0)
        zero = tl.load(z_ptr + off, mask=ok, other=0.0)
    return scale, zero


@triton.jit
def _meta_values(index, point, stab_ptr):
    """fp32 scale and zero of 8-bit metadata (``M8``): ``stab_ptr[index]`` for the uint8
    scale index and ``-point * scale / 4`` for the int8 zero point (quarter steps,
    ``layout.ZERO_STEPS``), as the reference."""
    # NOTE: sm_90 static cost (bench/sm90_static.py --meta8, 2-bit keys and values, G=32,
    # fp16): the table gather and the product add 5-20% thread-instructions per key over
    # fp16 metadata (Llama-3-8B shape, 64 keys x 4 warps: 3200 -> 3406; SmolLM2: 1838 ->
    # 2140); one kept config (SmolLM2, 64 keys x 8 warps, 3 stages) spills 16 bytes. Not
    # timed (no GPU when written).
    scale = tl.load(stab_ptr + index.to(tl.int32))  # masked metadata reads index 0
    return scale, -point.to(tl.float32) * scale * 0.25


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
    lut_ptr,  # fp32 value of each code (LUT); None otherwise
    stab_ptr,  # fp32 scales of 8-bit scale indices (M8); None otherwise
    BITS: tl.constexpr,  # code width, or 16 for a plain tensor
    GROUP: tl.constexpr,  # group size G
    CHANNEL_AXIS: tl.constexpr,  # True: groups of G tokens per channel; False: G channels
    LUT: tl.constexpr,  # non-uniform levels: a code's value is lut_ptr[code]
    M8: tl.constexpr,  # 8-bit metadata: uint8 scale index, int8 zero point
    wid_ptr=None,  # this head's per-channel widths and first bits (WID); None otherwise
    WID: tl.constexpr = False,  # per-channel widths (channel axis; layout.QuantSpec.widths)
):
    """Dequantized fp32 ``[N, C]`` tile of one packed tensor (``value * scale + zero``).

    With per-channel widths (``WID``) ``wid_ptr`` holds ``[D, 2]`` int32 per head: channel
    ``c``'s width and the stream bit its group's first code starts at
    (:func:`kvpolicy.kernels._triton_util.width_table`); a group's bytes are one stream
    along ``sc_2`` (the host checks that its last two dims are contiguous).
    """
    t2 = tok[:, None]
    c2 = ch[None, :]
    if BITS == 16:
        x = tl.load(c_ptr + t2 * sc_0 + c2 * sc_1, mask=ok, other=0.0).to(tl.float32)
    elif WID:
        grp = t2 // GROUP
        w = tl.load(wid_ptr + 2 * c2 + 0 * t2, mask=ok, other=1)  # [N, C], cached rows
        bit = tl.load(wid_ptr + 2 * c2 + 1 + 0 * t2, mask=ok, other=0) + (t2 % GROUP) * w
        byte_ptr = c_ptr + grp * sc_0 + (bit // 8) * sc_2
        shift = (bit % 8).to(tl.int32)
        raw = tl.load(byte_ptr, mask=ok, other=0).to(tl.int32)
        nxt = tl.load(byte_ptr + sc_2, mask=ok & (shift + w > 8), other=0)
        code = ((raw | (nxt.to(tl.int32) << 8)) >> shift) & ((1 << w) - 1)
        scale, zero = _load_meta(s_ptr, z_ptr, grp * ss_0 + c2 * ss_1, ok, stab_ptr, M8)
        x = _code_to_f32(code) * scale.to(tl.float32) + zero.to(tl.float32)
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
        if M8:
            scale, zero = _meta_values(tl.load(s_ptr + s_off, mask=ok, other=0),
                                       tl.load(z_ptr + s_off, mask=ok, other=0), stab_ptr)
        else:
            scale = tl.load(s_ptr + s_off, mask=ok, other=0.0).to(tl.float32)
            zero = tl.load(z_ptr + s_off, mask=ok, other=0.0).to(tl.float32)
        if LUT:
            x = tl.load(lut_ptr + code) * scale + zero  # masked elements read code 0
        else:
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
def _dequant(codes, scale, zero, lut_ptr, F16: tl.constexpr, LUT: tl.constexpr):
    """``value * scale + zero`` in fp32, or in fp16 (codes < 1024 are exact there; a
    table value rounds once, to 2**-11 relative).

    fp16 rounding (2**-11) is far below a 2-8 bit quantization step; fp32 and bf16 queries
    keep fp32. ``value`` is the code, or ``lut_ptr[code]`` with ``LUT``.
    """
    # NOTE: fp16 math for fp16 queries (packed HFMA2, no fp16<->fp32 conversions) cut the
    # key loop of the sm_90 decode kernel by 22-23% (bench/sm90_static.py: 4096 -> 3176
    # thread-instructions per key at head_dim 128, 2124 -> 1629 at 64).
    if LUT:
        c = tl.load(lut_ptr + codes)
        if F16:
            x = c.to(tl.float16) * scale.to(tl.float16) + zero.to(tl.float16)
        else:
            x = c * scale.to(tl.float32) + zero.to(tl.float32)
    elif F16:
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
    lut_ptr,  # fp32 value of each code (LUT); None otherwise
    stab_ptr,  # fp32 scales of 8-bit scale indices (M8); None otherwise
    BITS: tl.constexpr,  # code width dividing 8
    GROUP: tl.constexpr,  # G, a power of two dividing BLOCK_N
    BLOCK_N: tl.constexpr,  # tokens in the tile
    F16: tl.constexpr,  # compute in fp16 (fp16 queries) instead of fp32
    LUT: tl.constexpr,  # non-uniform levels (see _dequant)
    M8: tl.constexpr,  # 8-bit metadata (see _meta_values)
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
    scale, zero = _load_meta(s_ptr, z_ptr, s_off, g_ok[:, None] & ch_ok[None, :], stab_ptr,
                             M8)
    x = _dequant(codes, scale[:, None, :], zero[:, None, :], lut_ptr, F16, LUT)
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
    lut_ptr,  # fp32 value of each code (LUT); None otherwise
    stab_ptr,  # fp32 scales of 8-bit scale indices (M8); None otherwise
    BITS: tl.constexpr,  # code width dividing 8
    GROUP: tl.constexpr,  # G, a power of two dividing D
    D: tl.constexpr,  # head dim, a power of two
    F16: tl.constexpr,  # compute in fp16 (fp16 queries) instead of fp32
    LUT: tl.constexpr,  # non-uniform levels (see _dequant)
    M8: tl.constexpr,  # 8-bit metadata (see _meta_values)
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
    scale, zero = _load_meta(s_ptr, z_ptr, s_off, tok_ok[:, None] & (jg[None, :] >= 0),
                             stab_ptr, M8)
    x = _dequant(codes, scale[:, :, None], zero[:, :, None], lut_ptr, F16, LUT)
    return tl.reshape(x, [tok.shape[0], D])


@triton.jit
def dequant_vq_rows(
    c_ptr,  # vector-quantized codes of this (batch, head): [T, D // VQ] uint8
    s_ptr,  # scale of this (batch, head): [T, D // G], or uint8 scale indices (M8)
    cb_ptr,  # fp32 centroids of this kv head [256, VQ] (layout.Codebook.tensor)
    sc_0, sc_1,  # codes strides: token, byte
    ss_0, ss_1,  # scale strides: token, channel group
    tok,  # [N] token indices
    ch,  # [C] channel indices
    ok,  # [N, C] which elements exist
    stab_ptr,  # fp32 scales of 8-bit scale indices (M8); None otherwise
    VQ: tl.constexpr,  # channels per sub-vector (layout.vq_dim: 4 at 2 bits, 8 at 1)
    GROUP: tl.constexpr,  # channels per scale, a multiple of VQ
    M8: tl.constexpr,  # the scale is a uint8 index into stab_ptr
):
    """Dequantized fp32 ``[N, C]`` tile of vector-quantized values: channel ``c`` is
    entry ``c % VQ`` of the centroid its sub-vector's byte ``c // VQ`` names, times its
    group's scale, one fp32 product as :func:`kvpolicy.kernels.vq_codes.vq_decode`. A
    VQ group has no zero point: nothing is loaded for it."""
    t2 = tok[:, None]
    c2 = ch[None, :]
    code = tl.load(c_ptr + t2 * sc_0 + (c2 // VQ) * sc_1, mask=ok, other=0).to(tl.int32)
    cent = tl.load(cb_ptr + code * VQ + c2 % VQ, mask=ok, other=0.0)
    s_off = t2 * ss_0 + (c2 // GROUP) * ss_1
    if M8:  # masked elements read index 0, times a centroid of 0
        scale = tl.load(stab_ptr + tl.load(s_ptr + s_off, mask=ok, other=0).to(tl.int32))
    else:
        scale = tl.load(s_ptr + s_off, mask=ok, other=0.0).to(tl.float32)
    return cent * scale


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
    lut_ptr,  # fp32 value of each code (LUT); None otherwise
    stab_ptr,  # fp32 scales of 8-bit scale indices (M8); None otherwise
    BITS: tl.constexpr, GROUP: tl.constexpr, CHANNEL_AXIS: tl.constexpr,  # key policy
    LUT: tl.constexpr,  # non-uniform levels (see dequant_tile)
    M8: tl.constexpr,  # 8-bit metadata (see dequant_tile)
    FAST: tl.constexpr,  # whole per-channel groups with BITS dividing 8 (host-checked)
    BLOCK_N: tl.constexpr,  # tokens in the tile
    F16: tl.constexpr,  # return fp16 (fp16 queries) instead of fp32
    wid_ptr,  # per-channel widths of this head (WID); None otherwise
    WID: tl.constexpr,  # per-channel widths (see dequant_tile; never FAST)
):
    """Dequantized ``[N, C]`` key tile, by the fast path where the layout allows."""
    if WID:
        x = dequant_tile(c_ptr, s_ptr, z_ptr, sc_0, sc_1, sc_2, ss_0, ss_1, tok, ch,
                         tok_ok[:, None] & ch_ok[None, :], lut_ptr, stab_ptr, BITS, GROUP,
                         CHANNEL_AXIS, LUT, M8, wid_ptr, True)
        if F16:
            x = x.to(tl.float16)
    elif FAST and BLOCK_N % GROUP == 0:
        x = _dequant_channel_groups(c_ptr, s_ptr, z_ptr, sc_0, sc_1, sc_2, ss_0, ss_1, n0,
                                    n_end, ch, ch_ok, lut_ptr, stab_ptr, BITS, GROUP, BLOCK_N,
                                    F16, LUT, M8)
    else:
        x = dequant_tile(c_ptr, s_ptr, z_ptr, sc_0, sc_1, sc_2, ss_0, ss_1, tok, ch,
                          tok_ok[:, None] & ch_ok[None, :], lut_ptr, stab_ptr, BITS, GROUP,
                          CHANNEL_AXIS, LUT, M8)
        if F16:
            x = x.to(tl.float16)
    return x


@triton.jit
def qk(q, k, DOT_F32: tl.constexpr):
    """``q [M, C] @ k[N, C]^T`` in fp32 (IEEE) or in q's dtype with an fp32 accumulator."""
    if DOT_F32:
        return tl.dot(q, tl.trans(k), input_precision="ieee")
    return tl.dot(q, tl.trans(k.to(q.dtype)))


@triton.jit
def query_sets(
    q_ptr,  # queries (for the dtype of the placeholders)
    q_row,  # [BLOCK_M] pointers to channel 0 of each query row
    row_ok,  # [BLOCK_M] which rows exist
    sq_d,  # channel stride of q
    ROPE: tl.constexpr, ROT_DIM: tl.constexpr, DK: tl.constexpr,
    DOT_F32: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr,
    BLOCK_P: tl.constexpr,
):
    """``(q_a, q_b, ch_a, ch_b, r_ok, q_p, ch_p, p_ok)``: a program's queries as the
    channel sets that a rotation pairs (``i`` and ``i + r/2`` for rotate_half, ``2i`` and
    ``2i+1`` for interleaved) and the pass-through channels ``>= r``, with their channel
    indices and masks. A score is the sum of three dots over these sets, so every key
    code is read once and no register shuffle is needed. Sets a head does not have are
    zero placeholders (never read)."""
    i_r = tl.arange(0, BLOCK_R)
    r_ok = i_r < ROT_DIM // 2
    if ROPE == 2:  # interleaved pairs channel 2i with 2i + 1
        ch_a = 2 * i_r
        ch_b = 2 * i_r + 1
    else:  # rotate_half pairs channel i with i + r/2
        ch_a = i_r
        ch_b = i_r + ROT_DIM // 2
    if ROPE != 0:
        q_a = tl.load(q_row[:, None] + ch_a[None, :] * sq_d, row_ok[:, None] & r_ok[None, :], 0.0)
        q_b = tl.load(q_row[:, None] + ch_b[None, :] * sq_d, row_ok[:, None] & r_ok[None, :], 0.0)
    else:
        q_a = tl.zeros([BLOCK_M, BLOCK_R], q_ptr.dtype.element_ty)
        q_b = q_a
    ch_p = ROT_DIM + tl.arange(0, BLOCK_P)
    p_ok = ch_p < DK
    if DK > ROT_DIM:
        q_p = tl.load(q_row[:, None] + ch_p[None, :] * sq_d, row_ok[:, None] & p_ok[None, :], 0.0)
    else:
        q_p = tl.zeros([BLOCK_M, BLOCK_P], q_ptr.dtype.element_ty)
    if DOT_F32:
        q_a = q_a.to(tl.float32)
        q_b = q_b.to(tl.float32)
        q_p = q_p.to(tl.float32)
    return q_a, q_b, ch_a, ch_b, r_ok, q_p, ch_p, p_ok


@triton.jit
def attend_keys(
    m_i, l_i, acc,  # running max, sum and output of the rows (fp32), updated and returned
    q_ptr,  # queries (for the dtype of the dots)
    q_a, q_b, ch_a, ch_b, r_ok, q_p, ch_p, p_ok,  # query_sets of the rows
    ch_v, v_ok,  # value channels [BLOCK_DV] and which exist
    kc, ks, kz,  # keys of this (batch, kv head): codes (or plain), scale, zero
    skc_0, skc_1, skc_2, sks_0, sks_1,  # their strides (see dequant_tile)
    klut,  # fp32 value of each key code (K_LUT); None otherwise
    vc, vs, vz,  # values of this (batch, kv head)
    svc_0, svc_1, svc_2, svs_0, svs_1,  # their strides
    vlut,  # fp32 value of each value code (V_LUT); None otherwise
    stab,  # fp32 scales of 8-bit scale indices (K_M8 or V_M8); None otherwise
    pos_row, sp_t,  # positions of this batch row's keys and their stride (ROPE != 0)
    cos_ptr, sin_ptr, sr_p, sr_d,  # rotary tables and their strides (ROPE != 0)
    mask_rows, sm_k,  # [BLOCK_M] pointers to each row's mask, key stride (HAS_MASK)
    row_ok,  # [BLOCK_M] which rows exist
    start, end,  # keys [start, end) of the segment
    scale, softcap,
    K_BITS: tl.constexpr, K_GROUP: tl.constexpr, K_CHANNEL: tl.constexpr,
    K_LUT: tl.constexpr, K_FAST: tl.constexpr,
    V_BITS: tl.constexpr, V_GROUP: tl.constexpr, V_CHANNEL: tl.constexpr,
    V_LUT: tl.constexpr, V_FAST: tl.constexpr, DV: tl.constexpr,
    ROPE: tl.constexpr, HAS_PASS: tl.constexpr, HAS_MASK: tl.constexpr,
    SOFTCAP: tl.constexpr, DOT_F32: tl.constexpr, MATH_F16: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    K_M8: tl.constexpr, V_M8: tl.constexpr,  # 8-bit metadata of the keys / values
    kwid, K_WID: tl.constexpr,  # per-channel key widths of this head (see dequant_tile)
    vcb=None,  # fp32 centroids of this kv head's values (V_VQ); None otherwise
    V_VQ: tl.constexpr = 0,  # vector-quantized values: channels per sub-vector; 0 none
):
    """Online softmax of a program's query rows over keys ``[start, end)`` of one segment.

    Keys are dequantized (or, with 16-bit specs, loaded plain) tile by tile, rotated at
    their own positions when stored pre-RoPE, scored as ``scale * q·k``, soft-capped in
    fp32, masked, and folded into ``(m_i, l_i, acc)``. A row that sees only hidden keys
    keeps ``m = -inf, l = 0``. Offsets inside one (batch, head) are int32 (the launchers
    check the extent): int64 index tiles doubled the registers of every gathered tile.
    """
    for n0 in range(start, end, BLOCK_N):
        tok = n0 + tl.arange(0, BLOCK_N)
        tok_ok = tok < end
        s = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        if ROPE != 0:
            ok = tok_ok[:, None] & r_ok[None, :]
            k_a = load_keys(kc, ks, kz, skc_0, skc_1, skc_2, sks_0, sks_1, n0, end, tok,
                            tok_ok, ch_a, r_ok, klut, stab, K_BITS, K_GROUP, K_CHANNEL, K_LUT,
                            K_M8, K_FAST, BLOCK_N, MATH_F16, kwid, K_WID)
            k_b = load_keys(kc, ks, kz, skc_0, skc_1, skc_2, sks_0, sks_1, n0, end, tok,
                            tok_ok, ch_b, r_ok, klut, stab, K_BITS, K_GROUP, K_CHANNEL, K_LUT,
                            K_M8, K_FAST, BLOCK_N, MATH_F16, kwid, K_WID)
            # Both channels of a pair turn by the same angle (RotarySpec's table layout),
            # so one gather of the table at the first channel serves both.
            pos = tl.load(pos_row + tok * sp_t, mask=tok_ok, other=0)
            r_off = pos[:, None] * sr_p + ch_a[None, :] * sr_d
            cos = tl.load(cos_ptr + r_off, mask=ok, other=0.0).to(k_a.dtype)
            sin = tl.load(sin_ptr + r_off, mask=ok, other=0.0).to(k_a.dtype)
            rot_a = k_a * cos - k_b * sin
            rot_b = k_b * cos + k_a * sin
            s += qk(q_a, rot_a, DOT_F32)
            s += qk(q_b, rot_b, DOT_F32)
        if HAS_PASS:
            k_p = load_keys(kc, ks, kz, skc_0, skc_1, skc_2, sks_0, sks_1, n0, end, tok,
                            tok_ok, ch_p, p_ok, klut, stab, K_BITS, K_GROUP, K_CHANNEL, K_LUT,
                            K_M8, K_FAST, BLOCK_N, MATH_F16, kwid, K_WID)
            s += qk(q_p, k_p, DOT_F32)
        s = s * scale
        if SOFTCAP:
            # tanh(x) = sign(x) (1 - e) / (1 + e) with e = exp(-2|x|) in (0, 1], in fp32: no
            # overflow, +-1 where e underflows (tl has no tanh the interpreter also runs).
            e = tl.exp(-2.0 * tl.abs(s) / softcap)
            t = (1.0 - e) / (1.0 + e)
            s = softcap * tl.where(s < 0.0, -t, t)
        if HAS_MASK:
            add = tl.load(mask_rows[:, None] + tok[None, :] * sm_k,
                          mask=row_ok[:, None] & tok_ok[None, :], other=0.0)
            s += add.to(tl.float32)
        s = tl.where(tok_ok[None, :], s, float("-inf"))

        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp(m_i - m_use)
        p = tl.exp(s - m_use[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        if V_VQ:
            v = dequant_vq_rows(vc, vs, vcb, svc_0, svc_1, svs_0, svs_1, tok, ch_v,
                                tok_ok[:, None] & v_ok[None, :], stab, V_VQ, V_GROUP, V_M8)
        elif V_FAST:
            v = dequant_token_rows(vc, vs, vz, svc_0, svc_1, svs_0, svs_1, tok, tok_ok, vlut,
                                   stab, V_BITS, V_GROUP, DV, MATH_F16, V_LUT, V_M8)
        else:
            v = dequant_tile(vc, vs, vz, svc_0, svc_1, svc_2, svs_0, svs_1, tok, ch_v,
                             tok_ok[:, None] & v_ok[None, :], vlut, stab, V_BITS, V_GROUP,
                             V_CHANNEL, V_LUT, V_M8)
        if DOT_F32:
            pv = tl.dot(p, v, input_precision="ieee")
        else:
            pv = tl.dot(p.to(q_ptr.dtype.element_ty), v.to(q_ptr.dtype.element_ty))
        acc = acc * alpha[:, None] + pv
        m_i = m_new
    return m_i, l_i, acc


@triton.jit
def store_split(
    out_ptr,  # fp32 [R, S, DV] contiguous (R = B * Hq * Tq rows, S splits)
    lse_ptr,  # fp32 [R, S]
    row_out,  # [BLOCK_M] row * S + split of each query row
    row_ok,  # [BLOCK_M] which rows exist
    ch_v, v_ok,  # value channels and which exist
    m_i, l_i, acc,  # the split's softmax state (attend_keys)
    DV: tl.constexpr,
):
    """Write one split's normalised output and natural log-sum-exp; a row that saw no
    key gets ``out = 0`` and ``lse = -inf`` (never NaN)."""
    seen = l_i > 0.0
    out = acc / tl.where(seen, l_i, 1.0)[:, None]
    m_fin = tl.where(m_i == float("-inf"), 0.0, m_i)
    lse = tl.where(seen, m_fin + tl.log(tl.where(seen, l_i, 1.0)), float("-inf"))
    tl.store(out_ptr + row_out[:, None] * DV + ch_v[None, :], out,
             mask=row_ok[:, None] & v_ok[None, :])
    tl.store(lse_ptr + row_out, lse, mask=row_ok)


# The split count changes with the cache length: not specialised (no recompile when it
# is 1 or a multiple of 16); BLOCK_S keys the compiled variants instead.
@triton.jit(do_not_specialize=["n_splits"])
def merge_splits_kernel(
    part_ptr,  # per-split outputs fp32 [R, S, DV] contiguous (R = B * Hq * Tq)
    plse_ptr,  # per-split log-sum-exp fp32 [R, S]
    out_ptr,  # out fp32 [R, DV]
    lse_ptr,  # out fp32 [R]
    n_splits,  # S
    DV: tl.constexpr,  # value head dim
    BLOCK_S: tl.constexpr,  # next_power_of_2(S)
    BLOCK_DV: tl.constexpr,  # next_power_of_2(DV)
):
    """One program per row: the softmax over the union of the splits' keys."""
    row = tl.program_id(0).to(tl.int64)
    sp = tl.arange(0, BLOCK_S)
    d = tl.arange(0, BLOCK_DV)
    s_ok = sp < n_splits
    lse = tl.load(plse_ptr + row * n_splits + sp, mask=s_ok, other=float("-inf"))
    m = tl.max(lse, axis=0)
    m = tl.where(m == float("-inf"), 0.0, m)
    w = tl.exp(lse - m)  # 0 for empty splits
    total = tl.sum(w, axis=0)
    part = tl.load(part_ptr + (row * n_splits + sp[:, None]) * DV + d[None, :],
                   mask=s_ok[:, None] & (d[None, :] < DV), other=0.0)
    out = tl.sum(w[:, None] * part, axis=0) / tl.where(total > 0.0, total, 1.0)
    tl.store(out_ptr + row * DV + d, out, mask=d < DV)
    tl.store(lse_ptr + row, tl.where(total > 0.0, m + tl.log(tl.where(total > 0.0, total, 1.0)),
                                     float("-inf")))
