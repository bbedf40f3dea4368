"""Triton attention over a packed KV-cache segment, dequantization fused in the kernel.

One program owns one (batch, kv head, block of query rows, split of the keys). Its query
rows are *all* query heads that share the kv head (GQA/MQA) times the query positions,
so the packed bytes of a kv head are read once per split, not once per query head. Each
key/value tile is unpacked from its codes, scaled in registers (``code * scale + zero``,
fp32, as :func:`kvpolicy.kernels.reference.dequantize`) and, for keys stored before
RoPE, rotated at each key's own position; a dequantized cache is never materialised.

The policy is baked into the kernel as ``tl.constexpr``: bits, group size and scale axis
of each tensor (both layouts for both K and V), RoPE style and rotary_dim, head dims and
GQA ratio. Pre-RoPE keys are read as two channel sets that a rotation pairs (``i`` and
``i + r/2`` for rotate_half, ``2i`` and ``2i+1`` for interleaved) plus the pass-through
channels ``>= r``; the score is the sum of three dot products, so every code is read
once and no register shuffle is needed.

Tiles are read by the device functions of :mod:`kvpolicy.kernels.triton_dequant`: a
generic gather for any layout and byte-at-a-time fast paths for the common ones.

Long caches are split over the key axis (flash-decoding): each split writes its own
normalised output and log-sum-exp, and a second kernel merges the splits exactly like
:func:`kvpolicy.kernels.reference.merge_partials_lse`.
"""

from __future__ import annotations

import functools
import math

import torch
import triton
import triton.language as tl

from ..errors import CacheError
from ._triton_util import interpreting
from .layout import Packed, QuantSpec, RotarySpec
from .triton_dequant import dequant_tile, dequant_token_rows, load_keys

__all__ = ["packed_attention_partial", "attention_partial"]

_ROPE_STYLES = {None: 0, "rotate_half": 1, "interleaved": 2}
_FULL = QuantSpec(bits=16, group_size=1, axis="token")


_INTERPRET = interpreting()


def _keep_attention_config(configs, named_args, **kwargs):
    """Prune filter: no key tile longer than a split, none that spills registers."""
    split = max(16, triton.next_power_of_2(named_args["split_len"]))
    # Channels held per key tile. Triton 3.6 and 3.9 pass the constexpr kwargs here;
    # where a version does not, only the split bound applies.
    width = 2 * kwargs.get("BLOCK_R", 0) * int(kwargs.get("ROPE", 0) != 0)
    width += kwargs.get("BLOCK_P", 0) * int(kwargs.get("DK", 0) > kwargs.get("ROT_DIM", 0))
    width += kwargs.get("BLOCK_DV", 0)
    # NOTE: sm_90 AOT compile of the 2-bit decode kernel, head_dim 128: 136 tile elements
    # per thread use 204-235 registers without spills; 272 (128 keys, 4 warps) spill.
    kept = [
        c
        for c in configs
        if c.kwargs["BLOCK_N"] <= split
        and c.kwargs["BLOCK_N"] * width <= 160 * 32 * c.num_warps
    ]
    return kept or configs[:1]


# NOTE: no GPU was available when this was written, so the tile length along the keys
# and the warps per program are left to the autotuner (keyed on buckets of the query
# rows and split length, and on the policy). What was measured is static
# (bench/sm90_static.py): an sm_90 AOT compile of the decode shape (32q/8kv heads,
# head_dim 128, 2-bit, fp16) spills no registers in any kept config, and its key loop
# costs ~3.2-3.9K thread-instructions per key, so the kernel is likely issue-bound
# rather than bound by the packed bytes (~0.1 ns per key and kv head on an H200, about
# what SDPA needs to stream the same key from an fp16 cache). The list is
# small so that tuning stays within seconds per shape. Under the interpreter a single
# config is kept (tuning there would time the interpreter).
_ATTENTION_CONFIGS = [
    triton.Config({"BLOCK_N": bn}, num_warps=nw, num_stages=ns)
    for bn in (32, 64, 128)
    for nw in (4, 8)
    for ns in (2, 3)
    if not (bn == 32 and nw == 8)  # 8 warps over a 32-key tile leave most threads idle
]
if _INTERPRET:
    _ATTENTION_CONFIGS = [triton.Config({"BLOCK_N": 16}, num_warps=4, num_stages=1)]


@triton.jit
def _qk(q, k, DOT_F32: tl.constexpr):
    """``q [M, C] @ k[N, C]^T`` in fp32 (IEEE) or in q's dtype with an fp32 accumulator."""
    if DOT_F32:
        return tl.dot(q, tl.trans(k), input_precision="ieee")
    return tl.dot(q, tl.trans(k.to(q.dtype)))


@triton.autotune(
    configs=_ATTENTION_CONFIGS,
    key=["rows_bucket", "split_bucket", "K_BITS", "K_CHANNEL", "V_BITS", "V_CHANNEL", "ROPE", "DK",
         "SOFTCAP"],
    prune_configs_by={"early_config_prune": _keep_attention_config},
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
    DOT_F32: tl.constexpr,  # fp32 queries: IEEE fp32 dots; else dots in q's dtype
    MATH_F16: tl.constexpr,  # fp16 queries: dequantize and rotate in fp16 (fp32 otherwise)
    BLOCK_M: tl.constexpr,  # query rows per program (>= 16 for tl.dot)
    BLOCK_R: tl.constexpr,  # next_power_of_2(ROT_DIM // 2), >= 16
    BLOCK_P: tl.constexpr,  # next_power_of_2(DK - ROT_DIM), >= 16
    BLOCK_DV: tl.constexpr,  # next_power_of_2(DV), >= 16
    BLOCK_N: tl.constexpr,  # keys per tile (autotuned)
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

    kc = kc_ptr + b * skc_b + kvh * skc_h
    ks = ks_ptr + b * sks_b + kvh * sks_h
    kz = kz_ptr + b * sks_b + kvh * sks_h
    vc = vc_ptr + b * svc_b + kvh * svc_h
    vs = vs_ptr + b * svs_b + kvh * svs_h
    vz = vz_ptr + b * svs_b + kvh * svs_h

    if ROPE != 0:
        i_r = tl.arange(0, BLOCK_R)
        r_ok = i_r < ROT_DIM // 2
        if ROPE == 1:  # rotate_half pairs channel i with i + r/2
            ch_a = i_r
            ch_b = i_r + ROT_DIM // 2
        else:  # interleaved pairs channel 2i with 2i + 1
            ch_a = 2 * i_r
            ch_b = 2 * i_r + 1
        q_a = tl.load(q_row[:, None] + ch_a[None, :] * sq_d, row_ok[:, None] & r_ok[None, :], 0.0)
        q_b = tl.load(q_row[:, None] + ch_b[None, :] * sq_d, row_ok[:, None] & r_ok[None, :], 0.0)
        if DOT_F32:
            q_a = q_a.to(tl.float32)
            q_b = q_b.to(tl.float32)
    if HAS_PASS:
        ch_p = ROT_DIM + tl.arange(0, BLOCK_P)
        p_ok = ch_p < DK
        q_p = tl.load(q_row[:, None] + ch_p[None, :] * sq_d, row_ok[:, None] & p_ok[None, :], 0.0)
        if DOT_F32:
            q_p = q_p.to(tl.float32)
    ch_v = tl.arange(0, BLOCK_DV)
    v_ok = ch_v < DV

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)

    # Offsets *inside* one (batch, head) stay int32 (Tk * D < 2**31 is checked by the
    # launcher): int64 index tiles doubled the registers of every gathered tile.
    start = tl.program_id(2) * split_len
    end = tl.minimum(start + split_len, kv_len)
    for n0 in range(start, end, BLOCK_N):
        tok = n0 + tl.arange(0, BLOCK_N)
        tok_ok = tok < end
        s = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        if ROPE != 0:
            ok = tok_ok[:, None] & r_ok[None, :]
            k_a = load_keys(kc, ks, kz, skc_0, skc_1, skc_2, sks_0, sks_1, n0, end, tok,
                             tok_ok, ch_a, r_ok, K_BITS, K_GROUP, K_CHANNEL, K_FAST, BLOCK_N,
                             MATH_F16)
            k_b = load_keys(kc, ks, kz, skc_0, skc_1, skc_2, sks_0, sks_1, n0, end, tok,
                             tok_ok, ch_b, r_ok, K_BITS, K_GROUP, K_CHANNEL, K_FAST, BLOCK_N,
                             MATH_F16)
            # Both channels of a pair turn by the same angle (RotarySpec's table layout),
            # so one gather of the table at the first channel serves both.
            pos = tl.load(pos_ptr + b * sp_b + tok * sp_t, mask=tok_ok, other=0)
            r_off = pos[:, None] * sr_p + ch_a[None, :] * sr_d
            cos = tl.load(cos_ptr + r_off, mask=ok, other=0.0).to(k_a.dtype)
            sin = tl.load(sin_ptr + r_off, mask=ok, other=0.0).to(k_a.dtype)
            rot_a = k_a * cos - k_b * sin
            rot_b = k_b * cos + k_a * sin
            s += _qk(q_a, rot_a, DOT_F32)
            s += _qk(q_b, rot_b, DOT_F32)
        if HAS_PASS:
            k_p = load_keys(kc, ks, kz, skc_0, skc_1, skc_2, sks_0, sks_1, n0, end, tok,
                             tok_ok, ch_p, p_ok, K_BITS, K_GROUP, K_CHANNEL, K_FAST, BLOCK_N,
                             MATH_F16)
            s += _qk(q_p, k_p, DOT_F32)
        s = s * scale
        if SOFTCAP:
            # tanh(x) = sign(x) (1 - e) / (1 + e) with e = exp(-2|x|) in (0, 1], in fp32: no
            # overflow, +-1 where e underflows (tl has no tanh the interpreter also runs).
            e = tl.exp(-2.0 * tl.abs(s) / softcap)
            t = (1.0 - e) / (1.0 + e)
            s = softcap * tl.where(s < 0.0, -t, t)
        if HAS_MASK:
            m_off = b * sm_b + hq[:, None] * sm_h + tq[:, None] * sm_q + tok[None, :] * sm_k
            add = tl.load(mask_ptr + m_off, mask=row_ok[:, None] & tok_ok[None, :], other=0.0)
            s += add.to(tl.float32)
        s = tl.where(tok_ok[None, :], s, float("-inf"))

        # Online softmax; a row that has seen only hidden keys keeps m = -inf, l = 0.
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp(m_i - m_use)
        p = tl.exp(s - m_use[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        if V_FAST:
            v = dequant_token_rows(vc, vs, vz, svc_0, svc_1, svs_0, svs_1, tok, tok_ok,
                                    V_BITS, V_GROUP, DV, MATH_F16)
        else:
            v = dequant_tile(vc, vs, vz, svc_0, svc_1, svc_2, svs_0, svs_1, tok, ch_v,
                              tok_ok[:, None] & v_ok[None, :], V_BITS, V_GROUP, V_CHANNEL)
        if DOT_F32:
            pv = tl.dot(p, v, input_precision="ieee")
        else:
            pv = tl.dot(p.to(q_ptr.dtype.element_ty), v.to(q_ptr.dtype.element_ty))
        acc = acc * alpha[:, None] + pv
        m_i = m_new

    seen = l_i > 0.0
    out = acc / tl.where(seen, l_i, 1.0)[:, None]
    m_fin = tl.where(m_i == float("-inf"), 0.0, m_i)
    lse = tl.where(seen, m_fin + tl.log(tl.where(seen, l_i, 1.0)), float("-inf"))

    row_out = ((b * (n_kv_heads * GQA) + hq) * q_len + tq) * n_splits + pid_s  # [BLOCK_M]
    tl.store(out_ptr + row_out[:, None] * DV + ch_v[None, :], out,
             mask=row_ok[:, None] & v_ok[None, :])
    tl.store(lse_ptr + row_out, lse, mask=row_ok)


@triton.jit
def _merge_splits_kernel(
    part_ptr,  # per-split outputs fp32 [R, S, DV] contiguous (R = B * Hq * Tq)
    plse_ptr,  # per-split log-sum-exp fp32 [R, S]
    out_ptr,  # out fp32 [R, DV]
    lse_ptr,  # out fp32 [R]
    n_splits,  # S
    DV: tl.constexpr,  # value head dim
    BLOCK_S: tl.constexpr,  # next_power_of_2(S)
    BLOCK_DV: tl.constexpr,  # next_power_of_2(DV)
):
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


@functools.lru_cache(maxsize=None)
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def _choose_splits(q: torch.Tensor, programs: int, tk: int) -> int:
    """Splits of the key axis: enough programs for two waves, >= 256 keys per split."""
    if q.device.type != "cuda":
        return 1
    # NOTE: not measured (no GPU when written): two waves of programs and at least 256
    # keys per split follow flash-decoding; bench/gpu_attention.py shows the result.
    want = triton.cdiv(2 * _sm_count(q.device.index or 0), max(programs, 1))
    return max(1, min(want, triton.cdiv(tk, 256)))


def _packed_dims(p: Packed, spec: QuantSpec, what: str) -> tuple[int, int, int, int]:
    """(B, H, T, D) of a packed segment, checking its layout."""
    c = p.codes
    if spec.full_precision:
        if c.dim() != 4:
            raise CacheError(f"{what}: a 16-bit segment must be [B, H, T, D], got {tuple(c.shape)}")
        return tuple(c.shape)
    if spec.axis == "channel":
        if c.dim() != 5 or c.shape[3] != spec.group_size * spec.bits // 8:
            raise CacheError(
                f"{what}: channel-packed codes must be [B, H, T//G, G*bits//8, D] with "
                f"G*bits//8={spec.group_size * spec.bits // 8}, got {tuple(c.shape)}"
            )
        b, h, n, _, d = c.shape
        t = n * spec.group_size
    else:
        if c.dim() != 4 or (c.shape[3] * 8) % spec.bits != 0:
            raise CacheError(f"{what}: token-packed codes must be [B, H, T, D*bits//8], got "
                             f"{tuple(c.shape)}")
        b, h, t, nb = c.shape
        d = nb * 8 // spec.bits
    want = (b, h, n, d) if spec.axis == "channel" else (b, h, t, d // spec.group_size)
    if d % spec.group_size and spec.axis == "token":
        raise CacheError(f"{what}: head_dim={d} is not a multiple of group_size={spec.group_size}")
    if tuple(p.scale.shape) != want or tuple(p.zero.shape) != want:
        raise CacheError(f"{what}: scale {tuple(p.scale.shape)} and zero "
                         f"{tuple(p.zero.shape)} must both be {want} for codes {tuple(c.shape)}")
    return b, h, t, d


def _pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def _fast_layout(spec: QuantSpec, axis: str, d: int) -> bool:
    """Whether the byte-at-a-time path reads this tensor (see triton_dequant)."""
    return (
        spec.axis == axis and spec.bits in (1, 2, 4, 8) and _pow2(spec.group_size)
        and (axis == "channel" or (_pow2(d) and spec.group_size <= d))
    )


def _inner_extent(t: torch.Tensor, first: int) -> int:
    """Largest element offset of ``t`` from dim ``first`` on (the kernel's int32 range)."""
    return sum((n - 1) * st for n, st in zip(t.shape[first:], t.stride()[first:], strict=True))


def _strides(p: Packed, spec: QuantSpec) -> tuple[torch.Tensor, torch.Tensor, tuple, tuple]:
    """(scale, zero, codes strides (b, h, 0, 1, 2), scale strides (b, h, 0, 1))."""
    c = p.codes
    if spec.full_precision:
        return c, c, (c.stride(0), c.stride(1), c.stride(2), c.stride(3), 0), (0, 0, 0, 0)
    scale, zero = p.scale, p.zero
    if scale.stride() != zero.stride():
        scale, zero = scale.contiguous(), zero.contiguous()
    cs = c.stride() if c.dim() == 5 else (*c.stride(), 0)
    return scale, zero, cs, scale.stride()


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
            (any of bits 1, 2, 3, 4, 8, 16 and either axis); ``Hq % Hkv == 0``.
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
    if q.dim() != 4:
        raise CacheError(f"q must be [B, Hq, Tq, D], got shape {tuple(q.shape)}")
    b, hq, tq, dq = q.shape
    kb, hkv, tk, dk = _packed_dims(k, k_spec, "keys")
    vb, vh, vt, dv = _packed_dims(v, v_spec, "values")
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
    pos_strides, rot_strides = (0, 0), (0, 0)
    if rope is not None:
        if rope.style not in ("rotate_half", "interleaved"):
            raise CacheError(f"unknown rotary style {rope.style!r}; use rotate_half or interleaved")
        rot_dim, style = rope.rotary_dim, _ROPE_STYLES[rope.style]
        if rot_dim % 2 != 0 or not 0 < rot_dim <= dk:
            raise CacheError(f"rotary_dim={rot_dim} must be even and in (0, head_dim={dk}]")
        if k_positions is None:
            raise CacheError("pre-RoPE keys need k_positions [B, Tk]")
        if tuple(k_positions.shape) != (b, tk):
            raise CacheError(f"k_positions must be [B, Tk] = {(b, tk)}, got "
                             f"{tuple(k_positions.shape)}")
        if k_positions.dtype not in (torch.int64, torch.int32):
            raise CacheError(f"k_positions must be int64, got {k_positions.dtype}")
        if check_positions:
            lo, hi = int(k_positions.min()), int(k_positions.max())
            if lo < 0 or hi >= rope.max_positions:
                raise CacheError(
                    f"positions span [{lo}, {hi}] but the rotary table has "
                    f"{rope.max_positions} rows; build the RotarySpec with more positions"
                )
        pos = k_positions.to(device)
        cos, sin = rope.cos.to(device), rope.sin.to(device)
        if cos.stride() != sin.stride():
            cos, sin = cos.contiguous(), sin.contiguous()
        pos_strides, rot_strides = pos.stride(), cos.stride()

    if softcap is not None and not softcap > 0:
        raise CacheError(f"softcap={softcap} must be a positive float (or None: no cap)")
    has_mask = mask is not None
    mask_t, mask_strides = q, (0, 0, 0, 0)
    if has_mask:
        if not mask.is_floating_point():
            raise CacheError(f"mask must be an additive float mask (-inf hides), got {mask.dtype}")
        mask_t = mask.to(device)
        if mask_t.dim() > 4:
            raise CacheError(f"mask has {mask_t.dim()} dims; it must broadcast to [B,Hq,Tq,Tk]")
        mask_t = mask_t.reshape((1,) * (4 - mask_t.dim()) + tuple(mask_t.shape))
        try:
            mask_t = mask_t.expand(b, hq, tq, tk)
        except RuntimeError as e:
            raise CacheError(
                f"mask of shape {tuple(mask.shape)} does not broadcast to {(b, hq, tq, tk)}"
            ) from e
        mask_strides = mask_t.stride()

    ks, kz, kcs, kss = _strides(k, k_spec)
    vs, vz, vcs, vss = _strides(v, v_spec)
    inner = [_inner_extent(t, 2) for t in (k.codes, ks, v.codes, vs)]
    if rope is not None:
        inner.append(_inner_extent(cos, 0))
    if max(inner) >= 2**31:
        raise CacheError(
            f"one head of this segment spans {max(inner)} elements, beyond the kernel's "
            "int32 offsets; split the segment along the tokens"
        )

    n_rows = gqa * tq
    block_m = min(64, max(16, triton.next_power_of_2(n_rows)))
    m_blocks = triton.cdiv(n_rows, block_m)
    splits = num_splits if num_splits is not None else _choose_splits(q, b * hkv * m_blocks, tk)
    if splits < 1:
        raise CacheError(f"num_splits={splits} must be >= 1")
    split_len = triton.cdiv(tk, splits)
    if splits > 1:
        # Splits start on whole tiles of the smallest BLOCK_N and on key-group bounds.
        align = 16 if k_spec.axis != "channel" else math.lcm(16, k_spec.group_size)
        split_len = triton.cdiv(split_len, align) * align
    splits = triton.cdiv(tk, split_len)

    out = torch.empty((b, hq, tq, splits, dv), device=device, dtype=torch.float32)
    lse = torch.empty((b, hq, tq, splits), device=device, dtype=torch.float32)
    _packed_attention_kernel[(b * hkv, m_blocks, splits)](
        q, k.codes, ks, kz, v.codes, vs, vz, pos, cos, sin, mask_t, out, lse,
        hkv, n_rows, tq, tk, split_len, splits,
        triton.next_power_of_2(n_rows), triton.next_power_of_2(split_len), float(scale),
        1.0 if softcap is None else float(softcap),
        *q.stride(),
        *kcs, *kss,
        *vcs, *vss,
        *pos_strides,
        *rot_strides,
        *mask_strides,
        GQA=gqa, DK=dk, DV=dv,
        K_BITS=k_spec.bits, K_GROUP=k_spec.group_size, K_CHANNEL=k_spec.axis == "channel",
        V_BITS=v_spec.bits, V_GROUP=v_spec.group_size, V_CHANNEL=v_spec.axis == "channel",
        K_FAST=_fast_layout(k_spec, "channel", dk), V_FAST=_fast_layout(v_spec, "token", dv),
        ROPE=style, ROT_DIM=rot_dim, HAS_MASK=has_mask, SOFTCAP=softcap is not None,
        DOT_F32=q.dtype == torch.float32,
        MATH_F16=q.dtype == torch.float16,
        BLOCK_M=block_m,
        BLOCK_R=max(16, triton.next_power_of_2(max(rot_dim // 2, 1))),
        BLOCK_P=max(16, triton.next_power_of_2(max(dk - rot_dim, 1))),
        BLOCK_DV=max(16, triton.next_power_of_2(dv)),
    )
    if splits == 1:
        return out.squeeze(3), lse.squeeze(3)
    final = torch.empty((b, hq, tq, dv), device=device, dtype=torch.float32)
    final_lse = torch.empty((b, hq, tq), device=device, dtype=torch.float32)
    _merge_splits_kernel[(b * hq * tq,)](
        out, lse, final, final_lse, splits,
        DV=dv, BLOCK_S=triton.next_power_of_2(splits), BLOCK_DV=triton.next_power_of_2(dv),
    )
    return final, final_lse


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
