"""One launch per layer and step: Triton decode attention over a packed and a
full-precision segment.

``Backend.decode_attention`` attends the query rows over two segments of one layer's
cache: the packed body (dequantized in registers, keys rotated at their positions when
stored pre-RoPE) and the full-precision segment (sinks and residual window, plain K/V
in the model dtype, keys rotated the same way at ``fp_positions``). Attending each
segment apart in eager torch and merging them cost a dozen launches and fp32
temporaries per layer per step; here both segments are programs of **one** launch of
:func:`_decode_kernel`:

* the grid is ``(B * Hkv, cdiv(GQA * Tq, BLOCK_M), P + F)``: on the split axis the first
  ``P`` programs of a (batch, kv head, row block) each attend one split of the packed
  keys, the last ``F`` one split of the full-precision keys (``HAS_PACKED``/``HAS_FP``
  are ``tl.constexpr``: a layer without one of the segments compiles without it);
* every program runs the same online softmax (:func:`kvpolicy.kernels.triton_dequant.
  attend_keys`; a full-precision split reads its keys with 16-bit specs, so RoPE,
  softcap, its own mask and GQA are the packed path's) and writes its normalised output
  and log-sum-exp into the split buffer;
* when ``P + F > 1`` one small launch of ``merge_splits_kernel`` merges the splits
  exactly like :func:`kvpolicy.kernels.reference.merge_partials_lse`; with a single split
  the kernel's output is the result. At most two launches per call, and no host sync
  with ``check_positions=False``.

Keys and values with non-uniform levels (``QuantSpec.levels == "normal"``) are read
through their fp32 level tables (``klut_ptr``/``vlut_ptr``, one small tensor per device
and width, :func:`kvpolicy.kernels._triton_util.level_lut`) under the constexpr flags
``K_LUT``/``V_LUT``: a uniform policy compiles without them. Keys and values with 8-bit
metadata (``QuantSpec.meta_bits == 8``: a uint8 scale index and an int8 zero point) read
their scales from the 256-entry fp32 scale table (``stab_ptr``,
:func:`kvpolicy.kernels._triton_util.meta_table`) under ``K_M8``/``V_M8``, False by
default: 16-bit metadata compiles as before. Vector-quantized values
(``QuantSpec.levels == "vq"``) are gathered from their fp32 codebook (``vcb_ptr``,
:func:`kvpolicy.kernels._triton_util.vq_codebook`, per kv head) under ``V_VQ`` (the
sub-vector length; 0 by default), one byte per sub-vector, no zero point.

Queries may be fp32 (IEEE fp32 dots), fp16 or bf16 (dots in that dtype on tensor cores,
fp32 accumulation and softmax statistics). Dequantization runs in fp16 for fp16 queries
(exact for the codes; a rounding of 2**-11, far below a quantization step) and in fp32
for bf16 ones: bf16 rounds at 2**-8 relative, the size of an 8-bit step, and its
mantissa cannot hold an 8-bit code exactly in the bit trick of the fp16 path; the tiles
are rounded to bf16 once, for the dot.

:func:`warm_up_decode` launches the kernel once per segment layout on tiny inputs, so that
the first decode step neither compiles nor autotunes.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

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
    keep_attention_config,
    kernel_strides,
    level_lut,
    mask_arguments,
    meta_table,
    packed_dims,
    plan_splits,
    rope_arguments,
    vq_codebook,
    width_table,
)
from .contract import gather_pages
from .layout import Packed, QuantSpec, RotarySpec
from .triton_dequant import attend_keys, merge_splits_kernel, query_sets, store_split

__all__ = ["decode_attention", "merge_splits", "warm_up_decode", "SEGMENT_LAYOUTS"]

_FULL = QuantSpec(bits=16, group_size=1, axis="token")
# The segment layouts a decode step meets: both segments (steady state), only the
# full-precision one (before the first group is packed), only the packed one (no sinks
# and an empty residual window).
SEGMENT_LAYOUTS = ("packed+fp", "fp", "packed")

# Lengths, split counts, and the strides that follow a length alone (positions [B, T],
# masks [.., Tq, T]) change from step to step: not specialised, so that a length that
# happens to be 1 or a multiple of 16 does not compile another variant mid-generation.
# The K/V strides stay specialised: T * D is a multiple of 16 at every step when D is,
# and their divisibility is what lets the compiler vectorise the plain tile loads.
_PER_STEP = [
    "kv_len", "split_len", "n_packed_splits", "fp_len", "fp_split_len", "n_splits",
    "rows_bucket", "split_bucket", "sp_b", "sm_b", "sm_h", "sm_q", "sfp_b", "sfm_b",
    "sfm_h", "sfm_q",
]


@triton.autotune(
    configs=ATTENTION_CONFIGS,
    key=["rows_bucket", "split_bucket", "K_BITS", "K_CHANNEL", "V_BITS", "V_CHANNEL", "ROPE", "DK",
         "SOFTCAP", "HAS_PACKED", "HAS_FP", "K_LUT", "V_LUT", "K_M8", "V_M8", "K_WID", "V_VQ"],
    prune_configs_by={"early_config_prune": keep_attention_config},
)
@triton.jit(do_not_specialize=_PER_STEP)
def _decode_kernel(
    q_ptr,  # queries [B, Hq, Tq, DK], fp32/fp16/bf16
    kc_ptr, ks_ptr, kz_ptr,  # packed keys: codes, scale, zero (HAS_PACKED)
    vc_ptr, vs_ptr, vz_ptr,  # packed values: codes, scale, zero (HAS_PACKED)
    pos_ptr,  # packed key positions [B, Tk] (HAS_PACKED and ROPE != 0)
    mask_ptr,  # additive mask over the packed keys, expanded to [B, Hq, Tq, Tk] (HAS_MASK)
    fk_ptr, fv_ptr,  # full-precision keys and values [B, Hkv, Tf, D] (HAS_FP)
    fpos_ptr,  # full-precision key positions [B, Tf] (HAS_FP and ROPE != 0)
    fmask_ptr,  # additive mask over the full-precision keys [B, Hq, Tq, Tf] (HAS_FP_MASK)
    cos_ptr, sin_ptr,  # rotary tables [P, rotary_dim], same strides (ROPE != 0)
    out_ptr,  # out fp32 [B, Hq, Tq, S, DV] contiguous (S = P + F splits)
    lse_ptr,  # out fp32 [B, Hq, Tq, S]
    n_kv_heads, n_rows, q_len,  # Hkv, GQA * Tq, Tq
    kv_len, split_len, n_packed_splits,  # packed keys, keys per packed split, P
    fp_len, fp_split_len, n_splits,  # full-precision keys, keys per fp split, P + F
    rows_bucket, split_bucket,  # autotune keys only: next_power_of_2 of rows / longest split
    scale, softcap,
    sq_b, sq_h, sq_t, sq_d,
    skc_b, skc_h, skc_0, skc_1, skc_2,  # packed key codes (see dequant_tile)
    sks_b, sks_h, sks_0, sks_1,  # packed key scale/zero
    svc_b, svc_h, svc_0, svc_1, svc_2,  # packed value codes
    svs_b, svs_h, svs_0, svs_1,  # packed value scale/zero
    sp_b, sp_t,  # packed positions
    sm_b, sm_h, sm_q, sm_k,  # packed mask (0 where broadcast)
    sfk_b, sfk_h, sfk_t, sfk_d,  # full-precision keys
    sfv_b, sfv_h, sfv_t, sfv_d,  # full-precision values
    sfp_b, sfp_t,  # full-precision positions
    sfm_b, sfm_h, sfm_q, sfm_k,  # full-precision mask
    sr_p, sr_d,  # rotary tables
    GQA: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
    K_BITS: tl.constexpr, K_GROUP: tl.constexpr, K_CHANNEL: tl.constexpr,
    V_BITS: tl.constexpr, V_GROUP: tl.constexpr, V_CHANNEL: tl.constexpr,
    K_FAST: tl.constexpr, V_FAST: tl.constexpr,  # byte-at-a-time paths (see triton_dequant)
    ROPE: tl.constexpr,  # 0 none, 1 rotate_half, 2 interleaved
    ROT_DIM: tl.constexpr,  # rotary_dim (0 without RoPE); channels >= ROT_DIM pass through
    HAS_PACKED: tl.constexpr, HAS_FP: tl.constexpr,  # which segments exist
    HAS_MASK: tl.constexpr, HAS_FP_MASK: tl.constexpr,  # which masks are read
    SOFTCAP: tl.constexpr,  # scores soft-capped before the masks
    DOT_F32: tl.constexpr,  # IEEE fp32 dots; else dots in q's dtype
    MATH_F16: tl.constexpr,  # fp16 queries: dequantize and rotate in fp16
    BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_P: tl.constexpr,
    BLOCK_DV: tl.constexpr, BLOCK_N: tl.constexpr,
    # Last, with defaults: a launch or an ahead-of-time compile that names none of them
    # gets the uniform kernel.
    K_LUT: tl.constexpr = False, V_LUT: tl.constexpr = False,  # non-uniform packed levels
    klut_ptr=None, vlut_ptr=None,  # fp32 level tables of the packed keys / values
    K_M8: tl.constexpr = False, V_M8: tl.constexpr = False,  # 8-bit packed metadata
    stab_ptr=None,  # fp32 scales of 8-bit scale indices (K_M8 or V_M8)
    K_WID: tl.constexpr = False,  # per-channel key widths (layout.QuantSpec.widths)
    kwid_ptr=None,  # their table [Hkv, D, 2] int32 (_triton_util.width_table)
    V_VQ: tl.constexpr = 0,  # vector-quantized values: channels per sub-vector; 0 none
    vcb_ptr=None,  # their fp32 centroids [Hkv, 256, V_VQ] (_triton_util.vq_codebook)
):
    tl.static_assert(ROT_DIM % 2 == 0 and ROT_DIM <= DK, "rotary_dim must be even and <= DK")
    tl.static_assert((ROPE == 0) == (ROT_DIM == 0), "ROT_DIM is set exactly when ROPE is")
    tl.static_assert(BLOCK_M >= 16 and BLOCK_N >= 16, "tl.dot needs tiles of at least 16")
    tl.static_assert(BLOCK_R >= ROT_DIM // 2 and BLOCK_P >= DK - ROT_DIM and BLOCK_DV >= DV)
    tl.static_assert(HAS_PACKED or HAS_FP, "a decode needs a segment")
    HAS_PASS: tl.constexpr = DK > ROT_DIM

    pid_bh = tl.program_id(0).to(tl.int64)
    pid_m = tl.program_id(1).to(tl.int64)
    sid = tl.program_id(2)  # int32: key offsets inside a (batch, head) stay int32
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
    # Without a full-precision segment every program is packed (P == S); without a
    # packed one none is (P == 0): the branch is one scalar compare.
    if K_WID:
        kwid_h = kwid_ptr + kvh * (2 * DK)  # this head's [DK, 2] widths and first bits
    else:
        kwid_h = kwid_ptr
    if V_VQ:
        vcb_h = vcb_ptr + kvh * (256 * V_VQ)  # this head's centroids
    else:
        vcb_h = vcb_ptr
    if sid < n_packed_splits:
        if HAS_PACKED:
            start = sid * split_len
            m_i, l_i, acc = attend_keys(
                m_i, l_i, acc, q_ptr, q_a, q_b, ch_a, ch_b, r_ok, q_p, ch_p, p_ok, ch_v, v_ok,
                kc_ptr + b * skc_b + kvh * skc_h, ks_ptr + b * sks_b + kvh * sks_h,
                kz_ptr + b * sks_b + kvh * sks_h, skc_0, skc_1, skc_2, sks_0, sks_1, klut_ptr,
                vc_ptr + b * svc_b + kvh * svc_h, vs_ptr + b * svs_b + kvh * svs_h,
                vz_ptr + b * svs_b + kvh * svs_h, svc_0, svc_1, svc_2, svs_0, svs_1, vlut_ptr,
                stab_ptr, pos_ptr + b * sp_b, sp_t, cos_ptr, sin_ptr, sr_p, sr_d,
                mask_ptr + b * sm_b + hq * sm_h + tq * sm_q, sm_k, row_ok,
                start, tl.minimum(start + split_len, kv_len), scale, softcap,
                K_BITS, K_GROUP, K_CHANNEL, K_LUT, K_FAST,
                V_BITS, V_GROUP, V_CHANNEL, V_LUT, V_FAST, DV,
                ROPE, HAS_PASS, HAS_MASK, SOFTCAP, DOT_F32, MATH_F16, BLOCK_M, BLOCK_N,
                K_M8, V_M8, kwid_h, K_WID, vcb_h, V_VQ,
            )
    else:
        if HAS_FP:
            start = (sid - n_packed_splits) * fp_split_len
            fk = fk_ptr + b * sfk_b + kvh * sfk_h
            fv = fv_ptr + b * sfv_b + kvh * sfv_h
            # Plain tensors through the 16-bit path: codes are the values, no scale.
            m_i, l_i, acc = attend_keys(
                m_i, l_i, acc, q_ptr, q_a, q_b, ch_a, ch_b, r_ok, q_p, ch_p, p_ok, ch_v, v_ok,
                fk, fk, fk, sfk_t, sfk_d, 0, 0, 0, None,
                fv, fv, fv, sfv_t, sfv_d, 0, 0, 0, None, None,
                fpos_ptr + b * sfp_b, sfp_t, cos_ptr, sin_ptr, sr_p, sr_d,
                fmask_ptr + b * sfm_b + hq * sfm_h + tq * sfm_q, sfm_k, row_ok,
                start, tl.minimum(start + fp_split_len, fp_len), scale, softcap,
                16, 1, False, False, False, 16, 1, False, False, False, DV,
                ROPE, HAS_PASS, HAS_FP_MASK, SOFTCAP, DOT_F32, MATH_F16, BLOCK_M, BLOCK_N,
                False, False, None, False,
            )
    row_out = ((b * (n_kv_heads * GQA) + hq) * q_len + tq) * n_splits + sid  # [BLOCK_M]
    store_split(out_ptr, lse_ptr, row_out, row_ok, ch_v, v_ok, m_i, l_i, acc, DV)


def merge_splits(out: torch.Tensor, lse: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge per-split ``out [B, Hq, Tq, S, DV]`` / ``lse [B, Hq, Tq, S]`` (fp32,
    contiguous) into ``(out [B, Hq, Tq, DV], lse [B, Hq, Tq])``: one launch."""
    b, hq, tq, splits, dv = out.shape
    final = torch.empty((b, hq, tq, dv), device=out.device, dtype=torch.float32)
    final_lse = torch.empty((b, hq, tq), device=out.device, dtype=torch.float32)
    merge_splits_kernel[(b * hq * tq,)](
        out, lse, final, final_lse, splits,
        DV=dv, BLOCK_S=triton.next_power_of_2(splits), BLOCK_DV=triton.next_power_of_2(dv),
    )
    return final, final_lse


def _plain_segment(
    fk: torch.Tensor, fv: torch.Tensor, b: int, dk: int, device: torch.device
) -> tuple[int, int, int]:
    """``(Hkv, Tf, DV)`` of the full-precision segment, checking it."""
    for name, t in (("fk", fk), ("fv", fv)):
        if t.dim() != 4:
            raise CacheError(f"{name} must be [B, Hkv, Tf, D], got shape {tuple(t.shape)}")
        if not t.is_floating_point():
            raise CacheError(f"{name} must be a float tensor (the model dtype), got {t.dtype}")
        if t.device != device:
            raise CacheError(f"{name} is on {t.device} but q is on {device}; move them together")
    if fk.shape[:3] != fv.shape[:3] or fk.shape[0] != b:
        raise CacheError(f"q batch {b}, fk {tuple(fk.shape)} and fv {tuple(fv.shape)} disagree "
                         "in [B, Hkv, Tf]")
    if fk.shape[3] != dk:
        raise CacheError(f"query head_dim {dk} != full-precision key head_dim {fk.shape[3]}")
    return fk.shape[1], fk.shape[2], fv.shape[3]


def decode_attention(
    q: torch.Tensor,
    k: Packed | None,
    v: Packed | None,
    k_spec: QuantSpec,
    v_spec: QuantSpec,
    fk: torch.Tensor | None,
    fv: torch.Tensor | None,
    *,
    scale: float,
    mask: torch.Tensor | None = None,
    fp_mask: torch.Tensor | None = None,
    rope: RotarySpec | None = None,
    k_positions: torch.Tensor | None = None,
    fp_positions: torch.Tensor | None = None,
    check_positions: bool = True,
    softcap: float | None = None,
    num_splits: int | None = None,
    fp_splits: int | None = None,
    block_table: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One softmax over a packed and a full-precision segment in one kernel launch
    (``Backend.decode_attention``; the module docstring says how).

    Args:
        q: ``[B, Hq, Tq, D]`` fp32, fp16 or bf16, already rotated by the model.
        k, v: the packed segment ``[B, Hkv, Tk, D]`` in the layouts of ``k_spec``/``v_spec``
            (any bits, either axis, uniform or normal levels, 16- or 8-bit metadata,
            per-channel key widths, vector-quantized values), or both None.
        fk, fv: the full-precision segment ``[B, Hkv, Tf, D]`` in any float dtype (the
            model's), or both None. At least one segment must be given.
        scale, softcap: multiply ``q·k``; cap each score in fp32 before the masks.
        mask, fp_mask: additive float masks broadcastable to ``[B, Hq, Tq, Tk]`` and
            ``[B, Hq, Tq, Tf]`` (``-inf`` hides a key), or None.
        rope: keys of both segments are stored pre-RoPE and rotated in the kernel at
            ``k_positions [B, Tk]`` and ``fp_positions [B, Tf]`` (int64 or int32).
        check_positions: check every position against the rotary table (a host sync);
            False: the caller has, and nothing in this call waits for the device.
        num_splits, fp_splits: splits of each segment's keys (tests; default one on CPU,
            enough programs for two waves on a GPU).
        block_table: ``k, v`` are pages and this names each row's (``Backend``); they are
            gathered into one segment first (:func:`~kvpolicy.kernels.contract.gather_pages`).
    Returns:
        ``out`` fp32 ``[B, Hq, Tq, D]`` and ``lse`` fp32 ``[B, Hq, Tq]``; a row that sees
        no key gives ``out = 0`` and ``lse = -inf``.
    """
    if q.dim() != 4:
        raise CacheError(f"q must be [B, Hq, Tq, D], got shape {tuple(q.shape)}")
    if (k is None) != (v is None) or (fk is None) != (fv is None):
        raise CacheError("keys and values of a segment come together: pass k with v and fk "
                         "with fv (or None for both)")
    if k is None and fk is None:
        raise CacheError("decode_attention needs a packed or a full-precision segment")
    if block_table is not None and k is not None and v is not None:
        k, v = gather_pages(k, block_table), gather_pages(v, block_table)
    b, hq, tq, dq = q.shape
    device = q.device
    hkv = tk = tf = 0
    dv = None
    if k is not None:
        kb, hkv, tk, dk = packed_dims(k, k_spec, "keys")
        vb, vh, vt, dv = packed_dims(v, v_spec, "values")
        if (kb, hkv, tk) != (vb, vh, vt) or kb != b:
            raise CacheError(
                f"q batch {b}, keys [B, H, T]={[kb, hkv, tk]} and values {[vb, vh, vt]} disagree"
            )
        if dk != dq:
            raise CacheError(f"query head_dim {dq} != key head_dim {dk}")
        for name, t in (("keys", k.codes), ("values", v.codes)):
            if t.device != device:
                raise CacheError(f"{name} are on {t.device} but q is on {device}; move them "
                                 "together")
    if fk is not None:
        fh, tf, fdv = _plain_segment(fk, fv, b, dq, device)
        if k is not None and (fh, fdv) != (hkv, dv):
            raise CacheError(f"the full-precision segment has {fh} kv heads of value dim {fdv}, "
                             f"the packed one {hkv} of {dv}")
        hkv, dv = fh, fdv
    if hkv == 0 or hq % hkv != 0:
        raise CacheError(f"{hq} query heads are not a multiple of {hkv} kv heads")
    check_softcap(softcap)
    has_packed, has_fp = tk > 0, tf > 0
    if not (has_packed or has_fp) or b == 0 or tq == 0:
        return (
            torch.zeros(b, hq, tq, dv, device=device, dtype=torch.float32),
            torch.full((b, hq, tq), float("-inf"), device=device, dtype=torch.float32),
        )

    rot_dim = style = 0
    pos = fpos = cos = sin = q  # placeholders, never read without RoPE
    if rope is not None:
        if has_packed:
            style, rot_dim, pos, cos, sin = rope_arguments(
                rope, k_positions, b, tk, dq, device, check=check_positions, name="k_positions")
        if has_fp:
            style, rot_dim, fpos, cos, sin = rope_arguments(
                rope, fp_positions, b, tf, dq, device, check=check_positions,
                name="fp_positions", keys="full-precision keys")
    mask_t = fmask_t = q
    mask_s = fmask_s = (0, 0, 0, 0)
    if mask is not None and has_packed:
        mask_t, mask_s = mask_arguments(mask, (b, hq, tq, tk), device)
    if fp_mask is not None and has_fp:
        fmask_t, fmask_s = mask_arguments(fp_mask, (b, hq, tq, tf), device)

    if not has_packed:  # one fp-only variant for every policy
        k_spec = v_spec = _FULL
        k = v = Packed(q, q, q)
    ks, kz, kcs, kss = kernel_strides(k, k_spec)
    vs, vz, vcs, vss = kernel_strides(v, v_spec)
    inner = [inner_extent(t, 2) for t in (k.codes, ks, v.codes, vs)]
    if has_fp:
        inner += [inner_extent(fk, 2), inner_extent(fv, 2)]
    if rope is not None:
        inner.append(inner_extent(cos, 0))
    if max(inner) >= 2**31:
        raise CacheError(
            f"one head of a segment spans {max(inner)} elements, beyond the kernel's int32 "
            "offsets; split the segment along the tokens"
        )

    gqa = hq // hkv
    n_rows = gqa * tq
    block_m = min(64, max(16, triton.next_power_of_2(n_rows)))
    m_blocks = triton.cdiv(n_rows, block_m)
    programs = b * hkv * m_blocks
    n_packed = split_len = n_fp = fp_split_len = 0
    if has_packed:
        # Splits start on whole tiles of the smallest BLOCK_N and on key-group bounds.
        align = 16 if k_spec.axis != "channel" else math.lcm(16, k_spec.group_size)
        n_packed, split_len = plan_splits(q, programs, tk, num_splits, align, "num_splits")
    if has_fp:
        n_fp, fp_split_len = plan_splits(q, programs, tf, fp_splits, 16, "fp_splits")
    splits = n_packed + n_fp

    out = torch.empty((b, hq, tq, splits, dv), device=device, dtype=torch.float32)
    lse = torch.empty((b, hq, tq, splits), device=device, dtype=torch.float32)
    fk_t, fv_t = (fk, fv) if has_fp else (q, q)
    klut, vlut = level_lut(k_spec, device), level_lut(v_spec, device)
    stab = meta_table(k_spec, v_spec, device=device)
    kwid = width_table(k_spec, device) if has_packed else None
    vcb = vq_codebook(v_spec, hkv, device)
    if kwid is not None and k.codes.stride(3) != k.codes.shape[4] * k.codes.stride(4):
        raise CacheError("packed keys with per-channel widths must keep each group's bytes "
                         "contiguous (one stream); pass codes as the cache stores them")
    _decode_kernel[(b * hkv, m_blocks, splits)](
        q, k.codes, ks, kz, v.codes, vs, vz, pos, mask_t, fk_t, fv_t, fpos, fmask_t, cos, sin,
        out, lse,
        hkv, n_rows, tq, tk, split_len, n_packed, tf, fp_split_len, splits,
        triton.next_power_of_2(n_rows), triton.next_power_of_2(max(split_len, fp_split_len)),
        float(scale), 1.0 if softcap is None else float(softcap),
        *q.stride(), *kcs, *kss, *vcs, *vss,
        *(pos.stride() if rope is not None and has_packed else (0, 0)), *mask_s,
        *(fk.stride() if has_fp else (0, 0, 0, 0)), *(fv.stride() if has_fp else (0, 0, 0, 0)),
        *(fpos.stride() if rope is not None and has_fp else (0, 0)), *fmask_s,
        *(cos.stride() if rope is not None else (0, 0)),
        GQA=gqa, DK=dq, DV=dv,
        K_BITS=k_spec.bits, K_GROUP=k_spec.group_size, K_CHANNEL=k_spec.axis == "channel",
        V_BITS=v_spec.bits, V_GROUP=v_spec.group_size, V_CHANNEL=v_spec.axis == "channel",
        K_FAST=fast_layout(k_spec, "channel", dq), V_FAST=fast_layout(v_spec, "token", dv),
        ROPE=style, ROT_DIM=rot_dim, HAS_PACKED=has_packed, HAS_FP=has_fp,
        HAS_MASK=mask is not None and has_packed, HAS_FP_MASK=fp_mask is not None and has_fp,
        SOFTCAP=softcap is not None, DOT_F32=dots_in_fp32(q.dtype),
        MATH_F16=q.dtype == torch.float16, BLOCK_M=block_m, **channel_blocks(rot_dim, dq, dv),
        K_LUT=klut is not None, V_LUT=vlut is not None, klut_ptr=klut, vlut_ptr=vlut,
        K_M8=k_spec.meta8, V_M8=v_spec.meta8, stab_ptr=stab,
        **({} if kwid is None else {"K_WID": True, "kwid_ptr": kwid}),
        **({} if vcb is None else {"V_VQ": v_spec.vq_dim, "vcb_ptr": vcb}),
    )
    if splits == 1:
        return out.squeeze(3), lse.squeeze(3)
    return merge_splits(out, lse)


def _zeros_packed(spec: QuantSpec, h: int, t: int, d: int, dtype: torch.dtype,
                  device: torch.device) -> Packed:
    """A packed segment of zeros in ``spec``'s layout (shapes and dtypes of a real one)."""
    if spec.full_precision:
        empty = torch.empty(0, device=device, dtype=dtype)
        return Packed(torch.zeros(1, h, t, d, device=device, dtype=dtype), empty, empty)
    g, nbytes = spec.group_size, spec.group_size * spec.bits // 8
    if spec.axis == "channel":
        codes = torch.zeros(1, h, t // g, nbytes, d, device=device, dtype=torch.uint8)
        scale_shape = (1, h, t // g, d)
    else:
        if d % g:
            raise CacheError(f"head_dim={d} is not a multiple of group_size={g} (per-token "
                             "groups of channels); use a group_size that divides the head dim")
        codes = torch.zeros(1, h, t, d * spec.bits // 8, device=device, dtype=torch.uint8)
        scale_shape = (1, h, t, d // g)
    if spec.vq:  # one scale per group, no zero point
        scale = torch.zeros(scale_shape, device=device,
                            dtype=torch.uint8 if spec.meta8 else dtype)
        return Packed(codes, scale, scale.new_empty(1, h, t, 0))
    if spec.meta8:  # a uint8 scale index and an int8 zero point
        scale = torch.zeros(scale_shape, device=device, dtype=torch.uint8)
        return Packed(codes, scale, torch.zeros(scale_shape, device=device, dtype=torch.int8))
    scale = torch.zeros(scale_shape, device=device, dtype=dtype)
    return Packed(codes, scale, torch.zeros_like(scale))


def warm_up_decode(
    key_spec: QuantSpec,
    value_spec: QuantSpec,
    *,
    n_kv_heads: int,
    gqa: int,
    head_dim: int,
    dtype: torch.dtype,
    device: torch.device | str,
    query_dtype: torch.dtype | None = None,
    rope: RotarySpec | None = None,
    softcap: float | None = None,
    query_len: int = 1,
    layouts: Sequence[str] = ("packed+fp", "fp"),
    packed_tokens: Sequence[int] = (128,),
    fp_tokens: int = 16,
    max_splits: int = 64,
) -> tuple[str, ...]:
    """Compile (and on a GPU autotune) the decode kernel of one layer's policy ahead of the
    first step, by launching :func:`decode_attention` on tiny inputs of batch 1.

    A compiled variant is fixed by the policy's widths, layouts, levels and metadata
    widths, the head shape, the dtypes of every tensor (positions int64, as the runtime
    builds them), the RoPE style and rotary_dim, softcap, and which segments exist; the
    autotuner also keys on buckets of the query rows and the split length. Lengths that
    change per step are not specialised, so one warm launch per segment layout covers
    every later step of that layout and bucket.

    Args:
        key_spec, value_spec: the layer's policy.
        n_kv_heads, gqa, head_dim: kv heads, query heads per kv head, head dim.
        dtype: the model dtype (scale/zero and the full-precision segment).
        device: where the layer's cache lives.
        query_dtype: the dtype the queries arrive in (default ``dtype``).
        rope: the layer's rotary table when keys are stored pre-RoPE (its dtype and
            layout are part of the variant).
        softcap: the layer's logit cap, or None.
        query_len: query rows per call (1 for decode).
        layouts: which of :data:`SEGMENT_LAYOUTS` to warm: ``"packed+fp"`` the steady
            state, ``"fp"`` the first steps (nothing packed yet), ``"packed"`` a layer
            without sinks or residual window.
        packed_tokens: packed lengths to warm, each in one split (each is one autotune
            bucket of the split length; rounded up to whole key groups). The default
            keeps every configuration of the prune filter, so all are compiled.
        fp_tokens: length of the warm full-precision segment.
        max_splits: the merge kernel is compiled for every power-of-two split count up
            to this (a GPU step splits long caches; 1 skips it).
    Returns:
        The layouts warmed, in order.
    """
    for name in layouts:
        if name not in SEGMENT_LAYOUTS:
            raise CacheError(f"unknown segment layout {name!r}; use one of {SEGMENT_LAYOUTS}")
    if min(n_kv_heads, gqa, head_dim, query_len, fp_tokens, *packed_tokens) < 1:
        raise CacheError("n_kv_heads, gqa, head_dim, query_len, fp_tokens and packed_tokens "
                         "must be positive")
    device = torch.device(device)
    qdt = dtype if query_dtype is None else query_dtype
    h, d = n_kv_heads, head_dim
    q = torch.zeros(1, h * gqa, query_len, d, device=device, dtype=qdt)
    group = math.lcm(key_spec.token_group, value_spec.token_group)
    fk = torch.zeros(1, h, fp_tokens, d, device=device, dtype=dtype)
    fpos = torch.zeros(1, fp_tokens, device=device, dtype=torch.int64)
    for name in layouts:
        for tokens in packed_tokens if "packed" in name else (0,):
            t = triton.cdiv(tokens, group) * group
            k = v = kpos = None
            if t:
                k = _zeros_packed(key_spec, h, t, d, dtype, device)
                v = _zeros_packed(value_spec, h, t, d, dtype, device)
                kpos = torch.zeros(1, t, device=device, dtype=torch.int64)
            with_fp = "fp" in name
            decode_attention(
                q, k, v, key_spec, value_spec, fk if with_fp else None,
                fk if with_fp else None, scale=1.0, rope=rope, k_positions=kpos,
                fp_positions=fpos if with_fp else None, check_positions=False,
                softcap=softcap, num_splits=1 if t else None, fp_splits=1,
            )
    splits = 2
    while splits <= triton.next_power_of_2(max_splits):
        part = torch.zeros(1, 1, 1, splits, d, device=device, dtype=torch.float32)
        merge_splits(part, torch.zeros(1, 1, 1, splits, device=device, dtype=torch.float32))
        splits *= 2
    return tuple(layouts)
