"""Triton attention over a packed KV-cache segment, dequantization fused in the kernel.

One program owns one (batch, kv head, block of query rows, split of the keys). Its query
rows are *all* query heads that share the kv head (GQA/MQA) times the query positions,
so the packed bytes of a kv head are read once per split, not once per query head. Each
key/value tile is unpacked from its codes, scaled in registers (``code * scale + zero``,
fp32, as :func:`kvpolicy.kernels.reference.dequantize`) and, for keys stored before
RoPE, rotated at each key's own position; a dequantized cache is never materialised.

The policy is baked into the kernel as ``tl.constexpr``: bits, group size, scale axis and
levels of each tensor (both layouts for both K and V; non-uniform levels read a small fp32
table of code values; 8-bit metadata, a uint8 scale index and an int8 zero point, reads
its scale from the fp32 table of 256 scales; vector-quantized values gather each
sub-vector's centroid from the per-head fp32 codebook), RoPE style and rotary_dim, head
dims and GQA ratio. Pre-RoPE keys are read as two channel sets that a rotation pairs (``i`` and
``i + r/2`` for rotate_half, ``2i`` and ``2i+1`` for interleaved) plus the pass-through
channels ``>= r``; the score is the sum of three dot products, so every code is read once
and no register shuffle is needed.

The key loop and the tile reads are device functions of
:mod:`kvpolicy.kernels.triton_dequant` (a generic gather for any layout and
byte-at-a-time fast paths for the common ones), shared with the decode kernel; the host
checks, autotune configs and their prune filter are in :mod:`kvpolicy.kernels._triton_util`.

Long caches are split over the key axis (flash-decoding): each split writes its own
normalised output and log-sum-exp, and a second kernel merges the splits exactly like
:func:`kvpolicy.kernels.reference.merge_partials_lse`.

The decode step does not use this kernel: :mod:`kvpolicy.kernels.triton_decode` attends
the packed and the full-precision segment in one launch. Its ``decode_attention`` and
``warm_up_decode`` are re-exported here because this is the module the Triton backend
imports (the lazily imported kernel modules are a fixed list, tests/test_structure.py).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from ..errors import CacheError
from ._triton_util import (
    ATTENTION_CONFIGS,
    channel_blocks,
    check_softcap,
    dots_in_fp32,
    fast_layout,
    inner_extent,
    interpreting,
    keep_attention_config,
    kernel_strides,
    level_lut,
    mask_arguments,
    meta_table,
    packed_dims,
    plan_splits,
    rope_arguments,
    vq_codebook,
)
from .layout import Packed, QuantSpec, RotarySpec
from .triton_decode import decode_attention, merge_splits, warm_up_decode
from .triton_dequant import attend_keys, merge_splits_kernel, query_sets, store_split

__all__ = ["packed_attention_partial", "attention_partial", "decode_attention", "warm_up_decode"]

_FULL = QuantSpec(bits=16, group_size=1, axis="token")

_INTERPRET = interpreting()
# The names bench/ and tests/ read here; the objects live with the code both kernels share.
_ATTENTION_CONFIGS = ATTENTION_CONFIGS
_keep_attention_config = keep_attention_config
_fast_layout = fast_layout
_merge_splits_kernel = merge_splits_kernel


@triton.autotune(
    configs=ATTENTION_CONFIGS,
    key=["rows_bucket", "split_bucket", "K_BITS", "K_CHANNEL", "V_BITS", "V_CHANNEL", "ROPE", "DK",
         "SOFTCAP", "K_LUT", "V_LUT", "K_M8", "V_M8", "V_VQ"],
    prune_configs_by={"early_config_prune": keep_attention_config},
)
@triton.jit
def _packed_attention_kernel(
    q_ptr,  # queries [B, Hq, Tq, DK], any float dtype
    kc_ptr, ks_ptr, kz_ptr,  # keys: codes, scale, zero (layout of K_BITS/K_CHANNEL)
    vc_ptr, vs_ptr, vz_ptr,  # values: codes, scale, zero (layout of V_BITS/V_CHANNEL)
    pos_ptr,  # key positions [B, Tk] int64 (ROPE != 0 only)
    cos_ptr, sin_ptr,  # rotary tables [P, rotary_dim], same strides (ROPE != 0 only)
    mask_ptr,  # additive mask expanded to [B, Hq, Tq, Tk] (HAS_MASK only)
    out_ptr,  # out fp32 [B, Hq, Tq, S, DV] contiguous (S = splits; S == 1: final output)
    lse_ptr,  # out fp32 [B, Hq, Tq, S] contiguous, natural log-sum-exp of each split
    n_kv_heads,  # Hkv, to split program id 0 into (batch, kv head)
    n_rows,  # query rows per kv head: GQA * Tq
    q_len,  # Tq
    kv_len,  # Tk, keys in the segment
    split_len,  # keys per split
    n_splits,  # S
    rows_bucket,  # next_power_of_2(n_rows): an autotune key only (no re-tune per prompt)
    split_bucket,  # next_power_of_2(split_len): an autotune key only
    scale,  # softmax scale multiplying q·k
    softcap,  # logit cap: s = softcap * tanh(s / softcap) (read when SOFTCAP only)
    sq_b, sq_h, sq_t, sq_d,  # q strides
    skc_b, skc_h, skc_0, skc_1, skc_2,  # key codes strides (see dequant_tile)
    sks_b, sks_h, sks_0, sks_1,  # key scale/zero strides
    svc_b, svc_h, svc_0, svc_1, svc_2,  # value codes strides
    svs_b, svs_h, svs_0, svs_1,  # value scale/zero strides
    sp_b, sp_t,  # positions strides
    sr_p, sr_d,  # rotary table strides (position, channel)
    sm_b, sm_h, sm_q, sm_k,  # mask strides (0 where broadcast)
    GQA: tl.constexpr,  # query heads per kv head
    DK: tl.constexpr,  # key head dim
    DV: tl.constexpr,  # value head dim
    K_BITS: tl.constexpr, K_GROUP: tl.constexpr, K_CHANNEL: tl.constexpr,  # key policy
    V_BITS: tl.constexpr, V_GROUP: tl.constexpr, V_CHANNEL: tl.constexpr,  # value policy
    K_FAST: tl.constexpr,  # keys per-channel, bits | 8, G a power of two (tiles of whole groups)
    V_FAST: tl.constexpr,  # values per-token, bits | 8, G and DV powers of two
    ROPE: tl.constexpr,  # 0 none, 1 rotate_half, 2 interleaved
    ROT_DIM: tl.constexpr,  # rotary_dim (0 without RoPE); channels >= ROT_DIM pass through
    HAS_MASK: tl.constexpr,  # whether mask_ptr is read
    SOFTCAP: tl.constexpr,  # whether scores are soft-capped (before the mask)
    DOT_F32: tl.constexpr,  # IEEE fp32 dots (fp32 queries; see dots_in_fp32); else q dtype
    MATH_F16: tl.constexpr,  # fp16 queries: dequantize and rotate in fp16 (fp32 otherwise)
    BLOCK_M: tl.constexpr,  # query rows per program (>= 16 for tl.dot)
    BLOCK_R: tl.constexpr,  # next_power_of_2(ROT_DIM // 2), >= 16
    BLOCK_P: tl.constexpr,  # next_power_of_2(DK - ROT_DIM), >= 16
    BLOCK_DV: tl.constexpr,  # next_power_of_2(DV), >= 16
    BLOCK_N: tl.constexpr,  # keys per tile (autotuned)
    # Last, with defaults: a launch or an ahead-of-time compile that names none of them
    # gets the uniform kernel.
    K_LUT: tl.constexpr = False, V_LUT: tl.constexpr = False,  # non-uniform levels
    klut_ptr=None, vlut_ptr=None,  # fp32 level tables of the keys / values (K_LUT / V_LUT)
    K_M8: tl.constexpr = False, V_M8: tl.constexpr = False,  # 8-bit metadata of keys / values
    stab_ptr=None,  # fp32 scales of 8-bit scale indices (K_M8 or V_M8)
    V_VQ: tl.constexpr = 0,  # vector-quantized values: channels per sub-vector; 0 none
    vcb_ptr=None,  # their fp32 centroids [Hkv, 256, V_VQ] (_triton_util.vq_codebook)
):
    tl.static_assert(ROT_DIM % 2 == 0 and ROT_DIM <= DK, "rotary_dim must be even and <= DK")
    tl.static_assert((ROPE == 0) == (ROT_DIM == 0), "ROT_DIM is set exactly when ROPE is")
    tl.static_assert(BLOCK_M >= 16 and BLOCK_N >= 16, "tl.dot needs tiles of at least 16")
    tl.static_assert(BLOCK_R >= ROT_DIM // 2 and BLOCK_P >= DK - ROT_DIM and BLOCK_DV >= DV)
    HAS_PASS: tl.constexpr = DK > ROT_DIM

    pid_bh = tl.program_id(0).to(tl.int64)
    pid_m = tl.program_id(1).to(tl.int64)
    pid_s = tl.program_id(2).to(tl.int64)
    b = pid_bh // n_kv_heads
    kvh = pid_bh % n_kv_heads

    # Query rows: row r is query head kvh*GQA + r // Tq at query position r % Tq.
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M).to(tl.int64)
    row_ok = rows < n_rows
    hq = kvh * GQA + rows // q_len
    tq = rows % q_len
    q_row = q_ptr + b * sq_b + hq * sq_h + tq * sq_t  # [BLOCK_M] pointers
    q_a, q_b, ch_a, ch_b, r_ok, q_p, ch_p, p_ok = query_sets(
        q_ptr, q_row, row_ok, sq_d, ROPE, ROT_DIM, DK, DOT_F32, BLOCK_M, BLOCK_R, BLOCK_P)
    ch_v = tl.arange(0, BLOCK_DV)
    v_ok = ch_v < DV

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)
    start = tl.program_id(2) * split_len
    end = tl.minimum(start + split_len, kv_len)
    if V_VQ:
        vcb_h = vcb_ptr + kvh * (256 * V_VQ)  # this head's centroids
    else:
        vcb_h = vcb_ptr
    m_i, l_i, acc = attend_keys(
        m_i, l_i, acc, q_ptr, q_a, q_b, ch_a, ch_b, r_ok, q_p, ch_p, p_ok, ch_v, v_ok,
        kc_ptr + b * skc_b + kvh * skc_h, ks_ptr + b * sks_b + kvh * sks_h,
        kz_ptr + b * sks_b + kvh * sks_h, skc_0, skc_1, skc_2, sks_0, sks_1, klut_ptr,
        vc_ptr + b * svc_b + kvh * svc_h, vs_ptr + b * svs_b + kvh * svs_h,
        vz_ptr + b * svs_b + kvh * svs_h, svc_0, svc_1, svc_2, svs_0, svs_1, vlut_ptr, stab_ptr,
        pos_ptr + b * sp_b, sp_t, cos_ptr, sin_ptr, sr_p, sr_d,
        mask_ptr + b * sm_b + hq * sm_h + tq * sm_q, sm_k, row_ok, start, end, scale, softcap,
        K_BITS, K_GROUP, K_CHANNEL, K_LUT, K_FAST, V_BITS, V_GROUP, V_CHANNEL, V_LUT, V_FAST, DV,
        ROPE, HAS_PASS, HAS_MASK, SOFTCAP, DOT_F32, MATH_F16, BLOCK_M, BLOCK_N, K_M8, V_M8,
        None, False,  # per-channel key widths: the decode kernel's, not this one's
        vcb_h, V_VQ,
    )
    row_out = ((b * (n_kv_heads * GQA) + hq) * q_len + tq) * n_splits + pid_s  # [BLOCK_M]
    store_split(out_ptr, lse_ptr, row_out, row_ok, ch_v, v_ok, m_i, l_i, acc, DV)


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
    num_splits: int | None = None,
    check_positions: bool = True,
    softcap: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention of ``q`` over one packed K/V segment, dequantizing in the kernel.

    Same contract as :func:`kvpolicy.kernels.reference.packed_attention_partial`.

    Args:
        q: ``[B, Hq, Tq, D]`` float16/bfloat16/float32, already rotated by the model.
            fp32 queries use IEEE fp32 dot products; half-precision queries use tensor
            cores with the dequantized tiles cast to q's dtype (fp32 accumulation).
        k, v: packed ``[B, Hkv, Tk, D]`` segments in the layouts of ``k_spec``/``v_spec``
            (any of bits 1, 2, 3, 4, 8, 16, either axis, uniform or normal levels, 16- or
            8-bit metadata, vector-quantized values; not per-channel key widths);
            ``Hq % Hkv == 0``.
        k_spec, v_spec: how each segment was quantized.
        scale: multiplies ``q·k``.
        mask: additive float mask broadcastable to ``[B, Hq, Tq, Tk]`` (``-inf`` hides
            a key), or None.
        rope: if given, keys are stored pre-RoPE and rotated at ``k_positions``; the
            tables are read at the first channel of each rotated pair (both channels of
            a pair share the angle in :class:`RotarySpec`'s layout).
        k_positions: ``[B, Tk]`` int64 absolute positions of the keys (with ``rope``).
        num_splits: splits of the key axis; default: one on CPU, enough for two waves
            of programs on a GPU.
        check_positions: raise if a position falls outside the rotary table. This costs
            a host sync per call on a GPU; a caller that builds the positions itself
            (the cache) may pass False. Out-of-range positions then read outside the
            table.
        softcap: if given (> 0), each score becomes ``softcap * tanh(s / softcap)`` in
            fp32 inside the kernel, before the mask.
    Returns:
        ``out`` fp32 ``[B, Hq, Tq, D]`` and ``lse`` fp32 ``[B, Hq, Tq]``; a row that
        sees no key gives ``out = 0`` and ``lse = -inf``.

    Grid: ``(B * Hkv, cdiv(Hq // Hkv * Tq, BLOCK_M), S)`` for the attention kernel and,
    when ``S > 1``, ``(B * Hq * Tq,)`` for the merge of the splits.
    """
    b, hq, tq, dq = _query_dims(q)
    if k_spec.widths is not None:  # read by the decode kernel only (K_WID)
        raise CacheError("packed keys with per-channel widths are attended by the torch "
                         "backend or the decode kernel; this kernel reads one width")
    kb, hkv, tk, dk = packed_dims(k, k_spec, "keys")
    vb, vh, vt, dv = packed_dims(v, v_spec, "values")
    if (kb, hkv, tk) != (vb, vh, vt) or kb != b:
        raise CacheError(
            f"q batch {b}, keys [B, H, T]={[kb, hkv, tk]} and values {[vb, vh, vt]} disagree"
        )
    if dk != dq:
        raise CacheError(f"query head_dim {dq} != key head_dim {dk}")
    if hkv == 0 or hq % hkv != 0:
        raise CacheError(f"{hq} query heads are not a multiple of {hkv} kv heads")
    gqa = hq // hkv
    device = q.device
    for name, t in (("keys", k.codes), ("values", v.codes)):
        if t.device != device:
            raise CacheError(f"{name} are on {t.device} but q is on {device}; move them together")
    if tk == 0 or b == 0 or tq == 0:
        return (
            torch.zeros(b, hq, tq, dv, device=device, dtype=torch.float32),
            torch.full((b, hq, tq), float("-inf"), device=device, dtype=torch.float32),
        )

    rot_dim, style = 0, 0
    pos = cos = sin = q  # placeholders, never read without RoPE
    if rope is not None:
        style, rot_dim, pos, cos, sin = rope_arguments(
            rope, k_positions, b, tk, dk, device, check=check_positions, name="k_positions")
    check_softcap(softcap)
    mask_t, mask_strides = q, (0, 0, 0, 0)
    if mask is not None:
        mask_t, mask_strides = mask_arguments(mask, (b, hq, tq, tk), device)

    ks, kz, kcs, kss = kernel_strides(k, k_spec)
    vs, vz, vcs, vss = kernel_strides(v, v_spec)
    inner = [inner_extent(t, 2) for t in (k.codes, ks, v.codes, vs)]
    if rope is not None:
        inner.append(inner_extent(cos, 0))
    if max(inner) >= 2**31:
        raise CacheError(
            f"one head of this segment spans {max(inner)} elements, beyond the kernel's "
            "int32 offsets; split the segment along the tokens"
        )

    n_rows = gqa * tq
    block_m = min(64, max(16, triton.next_power_of_2(n_rows)))
    m_blocks = triton.cdiv(n_rows, block_m)
    # Splits start on whole tiles of the smallest BLOCK_N and on key-group bounds.
    align = 16 if k_spec.axis != "channel" else math.lcm(16, k_spec.group_size)
    splits, split_len = plan_splits(q, b * hkv * m_blocks, tk, num_splits, align, "num_splits")

    out = torch.empty((b, hq, tq, splits, dv), device=device, dtype=torch.float32)
    lse = torch.empty((b, hq, tq, splits), device=device, dtype=torch.float32)
    klut, vlut = level_lut(k_spec, device), level_lut(v_spec, device)
    stab = meta_table(k_spec, v_spec, device=device)
    vcb = vq_codebook(v_spec, hkv, device)
    _packed_attention_kernel[(b * hkv, m_blocks, splits)](
        q, k.codes, ks, kz, v.codes, vs, vz, pos, cos, sin, mask_t, out, lse,
        hkv, n_rows, tq, tk, split_len, splits,
        triton.next_power_of_2(n_rows), triton.next_power_of_2(split_len), float(scale),
        1.0 if softcap is None else float(softcap),
        *q.stride(),
        *kcs, *kss,
        *vcs, *vss,
        *(pos.stride() if rope is not None else (0, 0)),
        *(cos.stride() if rope is not None else (0, 0)),
        *mask_strides,
        GQA=gqa, DK=dk, DV=dv,
        K_BITS=k_spec.bits, K_GROUP=k_spec.group_size, K_CHANNEL=k_spec.axis == "channel",
        V_BITS=v_spec.bits, V_GROUP=v_spec.group_size, V_CHANNEL=v_spec.axis == "channel",
        K_FAST=fast_layout(k_spec, "channel", dk), V_FAST=fast_layout(v_spec, "token", dv),
        ROPE=style, ROT_DIM=rot_dim, HAS_MASK=mask is not None, SOFTCAP=softcap is not None,
        DOT_F32=dots_in_fp32(q.dtype),
        MATH_F16=q.dtype == torch.float16,
        BLOCK_M=block_m,
        **channel_blocks(rot_dim, dk, dv),
        K_LUT=klut is not None, V_LUT=vlut is not None, klut_ptr=klut, vlut_ptr=vlut,
        K_M8=k_spec.meta8, V_M8=v_spec.meta8, stab_ptr=stab,
        **({} if vcb is None else {"V_VQ": v_spec.vq_dim, "vcb_ptr": vcb}),
    )
    if splits == 1:
        return out.squeeze(3), lse.squeeze(3)
    return merge_splits(out, lse)


def _query_dims(q: torch.Tensor) -> tuple[int, int, int, int]:
    if q.dim() != 4:
        raise CacheError(f"q must be [B, Hq, Tq, D], got shape {tuple(q.shape)}")
    return tuple(q.shape)


def attention_partial(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    scale: float,
    mask: torch.Tensor | None = None,
    num_splits: int | None = None,
    softcap: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention over a full-precision segment (sinks, residual window): the same kernel
    with 16-bit specs. Shapes and results as :func:`packed_attention_partial`."""
    empty = k.new_empty(0)
    return packed_attention_partial(
        q, Packed(k, empty, empty), Packed(v, empty, empty), _FULL, _FULL,
        scale=scale, mask=mask, num_splits=num_splits, softcap=softcap,
    )
