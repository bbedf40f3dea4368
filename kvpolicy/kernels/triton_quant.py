"""Triton quantize-and-pack kernel for cache appends (layout: :mod:`.layout`).

One kernel serves both layouts. Seen from the kernel, a ``[B, H, T, D]`` tensor is, per
(batch, head), a set of *groups* along a group axis and *lanes* along the other axis:

* ``axis="channel"``: groups of G consecutive tokens; lanes are the D channels.
* ``axis="token"``: groups of G consecutive channels; lanes are the T tokens.

A program reduces one group for a block of lanes to its min/max, stores scale and zero in
the cache dtype, and packs the codes computed against the *stored* values, exactly as
:func:`kvpolicy.kernels.reference.quantize` does (same fp32 operations, IEEE division,
round half to even), so the codes are bit-identical.

Normal levels (``NORMAL``, a constexpr: the uniform kernel compiles without them) take the
group's mean and population deviation in two fp32 passes over the tile, and the code of
an element is the number of thresholds (:func:`kvpolicy.kernels.layout.thresholds`,
read from a small fp32 table) strictly below ``(x - zero) / scale``, as
``torch.bucketize`` in the reference. The reference's mean and deviation come from torch
reductions that sum in another order, so a scale or zero can differ from it by one
rounding of the cache dtype, and the codes of an element near a threshold with it; with
equal scale and zero the codes are equal.

8-bit metadata (``META8``, a constexpr: 16-bit metadata compiles without it) stores a
uint8 scale index and an int8 zero point (:mod:`.layout`): the step the group needs,
``max((max - min) / (2**bits - 1), |min| / (127 / 4))``, is looked up in the 256 increasing fp32
scales of :func:`kvpolicy.kernels.layout.scale_table` (a device table) by a branch-free
binary search, 8 comparisons that give ``torch.searchsorted``'s index exactly (clamped
to 255, as the reference); the zero point is ``round(4 * -min / scale)`` (quarter steps)
clamped to int8, and the codes are computed against ``scale`` and ``-point * scale / 4``:
the same fp32 operations
as :func:`kvpolicy.kernels.reference.quantize`, so codes, indices and zero points are
bit-identical. Fit ``mse`` (``FIT``, the number of coarser table steps tried) computes
each candidate grid with the reference's operations and sums its squared error over the
group with ``tl.sum``, whose order differs from torch's: where two candidates' errors
agree to fp32 rounding the two may keep different ones (both of the least error, up to
that rounding); elsewhere the choice and the codes are the reference's. On a GPU the
compiler may also fuse a multiply and add of the error into one rounding.

Packing works in *chunks*: ``CH = 8 // gcd(bits, 8)`` codes fill ``CB = CH * bits // 8``
whole bytes (8 codes -> 3 bytes at 3 bits). ``G * bits % 8 == 0`` makes every group a
whole number of chunks, so a program assembles each chunk in an int32 and writes its CB
bytes; 3-bit codes straddle bytes inside a chunk and never across chunks.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from ..errors import CacheError
from ._triton_util import interpreting, meta_table, threshold_table
from .layout import FIT_STEPS, Packed, QuantSpec

__all__ = ["quantize"]


_INTERPRET = interpreting()


def _keep_quant_config(configs, named_args, **kwargs):
    """Prune filter: no lane block wider than the (power-of-two padded) lane count."""
    lanes = triton.next_power_of_2(named_args["n_lanes"])
    kept = [c for c in configs if c.kwargs["BLOCK_L"] <= max(lanes, 16)]
    return kept or configs[:1]


# NOTE: an append is a few KB, so these only bound the launch; the autotuner picks per
# (group size, lane count). Under the interpreter a single config is kept: tuning there
# would time the interpreter, not a GPU.
_QUANT_CONFIGS = [
    triton.Config({"BLOCK_L": bl}, num_warps=nw)
    for bl in (16, 32, 64, 128, 256)
    for nw in (1, 2, 4)
    if bl * nw <= 512  # a wide lane block needs the warps; a narrow one wastes them
]
if _INTERPRET:
    _QUANT_CONFIGS = [triton.Config({"BLOCK_L": 16}, num_warps=1)]


@triton.jit
def _round_half_even(y):
    """``torch.round`` on fp32: nearest integer, ties to even."""
    f = tl.floor(y)
    d = y - f
    f_is_odd = (f - 2.0 * tl.floor(f * 0.5)) != 0.0
    up = (d > 0.5) | ((d == 0.5) & f_is_odd)
    return tl.where(up, f + 1.0, f)


@triton.jit
def _round_to_bf16(x):
    """fp32 ``x`` rounded to the nearest bf16 value (ties to even), kept in fp32.

    torch rounds fp32 -> bf16 to nearest-even; the interpreter's cast truncates. Rounding
    by hand (finite inputs) makes the final cast exact on every backend.
    """
    u = x.to(tl.uint32, bitcast=True)
    u = (u + (0x7FFF + ((u >> 16) & 1))) & 0xFFFF0000
    return u.to(tl.float32, bitcast=True)


@triton.jit
def _scale_index(need, stab_ptr):
    """``min(searchsorted(table, need), 255)``: the smallest ``i`` with
    ``table[i] >= need`` (255 where none is), for the 256 increasing scales at
    ``stab_ptr``. Branch-free binary search: bit ``7 - k`` of the index is set when the
    entry ``step - 1`` past the bits found so far is still below ``need``."""
    idx = tl.zeros(need.shape, tl.int32)
    for k in tl.static_range(8):
        below = tl.load(stab_ptr + idx + ((128 >> k) - 1)) < need
        idx = tl.where(below, idx + (128 >> k), idx)
    return idx


@triton.jit
def _grid_error(tile, ok, s32, z32, LEVELS: tl.constexpr):
    """Squared error of each lane's group (``tile [BLOCK_G, BLOCK_L]``, ``ok`` its valid
    elements) on the grid of step ``s32`` and zero ``z32`` (fit ``mse``)."""
    q = tl.minimum(tl.maximum(_round_half_even(tl.div_rn(tile - z32[None, :], s32[None, :])),
                              0.0), LEVELS)
    diff = (q * s32[None, :] + z32[None, :]) - tile
    return tl.sum(tl.where(ok, diff * diff, 0.0), axis=0)


@triton.autotune(
    configs=_QUANT_CONFIGS,
    key=["lane_bucket", "GROUP", "BITS", "NORMAL", "META8", "FIT"],
    prune_configs_by={"early_config_prune": _keep_quant_config},
)
@triton.jit
def _quantize_pack_kernel(
    x_ptr,  # input [B, H, T, D] float, any strides
    codes_ptr,  # out uint8: channel [B,H,T//G,G*bits//8,D] / token [B,H,T,D*bits//8]
    scale_ptr,  # out scale in the cache dtype (uint8 index with META8):
    #             channel [B,H,T//G,D] / token [B,H,T,D//G]
    zero_ptr,  # out zero (int8 zero point with META8), same shape/strides as scale
    n_heads,  # H, to split program id 0 into (batch, head)
    n_lanes,  # lanes along the free axis (D for channel, T for token)
    lane_bucket,  # next_power_of_2(n_lanes): an autotune key only (no re-tune per length)
    sx_b, sx_h,  # x strides of batch and head (elements)
    sx_e,  # x stride between consecutive elements of a group
    sx_l,  # x stride between consecutive lanes
    sc_b, sc_h,  # codes strides of batch and head (bytes)
    sc_n,  # codes stride between consecutive groups
    sc_y,  # codes stride between consecutive bytes of one group's stream
    sc_l,  # codes stride between consecutive lanes
    ss_b, ss_h,  # scale/zero strides of batch and head
    ss_n,  # scale/zero stride between consecutive groups
    ss_l,  # scale/zero stride between consecutive lanes
    BITS: tl.constexpr,  # code width, 1..8
    GROUP: tl.constexpr,  # G, elements per group
    CH: tl.constexpr,  # codes per chunk, 8 // gcd(BITS, 8)
    BLOCK_G: tl.constexpr,  # next_power_of_2(G)
    BLOCK_W: tl.constexpr,  # next_power_of_2(G // CH), chunks per group
    STORE_BF16: tl.constexpr,  # scale/zero are bfloat16 (round to nearest-even by hand)
    BLOCK_L: tl.constexpr,  # lanes per program (autotuned)
    NORMAL: tl.constexpr = False,  # normal levels: mean and deviation, codes by thresholds
    thr_ptr=None,  # fp32 thresholds [2**BITS - 1], ascending (NORMAL)
    META8: tl.constexpr = False,  # 8-bit metadata: uint8 scale index, int8 zero point
    stab_ptr=None,  # fp32 scales [256], increasing (META8)
    FIT: tl.constexpr = 0,  # fit mse: table steps below the min-max scale to try (META8)
):
    tl.static_assert(BITS >= 1 and BITS <= 8, "BITS must be 1..8")
    tl.static_assert((GROUP * BITS) % 8 == 0, "every group must start on a byte boundary")
    tl.static_assert(GROUP % CH == 0, "a group holds whole chunks")
    tl.static_assert(not (NORMAL and META8), "8-bit metadata takes uniform levels")
    CB: tl.constexpr = CH * BITS // 8  # bytes per chunk
    LEVELS: tl.constexpr = (1 << BITS) - 1

    pid_bh = tl.program_id(0).to(tl.int64)
    pid_n = tl.program_id(1).to(tl.int64)
    pid_l = tl.program_id(2).to(tl.int64)
    b = pid_bh // n_heads
    h = pid_bh % n_heads

    lanes = pid_l * BLOCK_L + tl.arange(0, BLOCK_L).to(tl.int64)  # [BLOCK_L]
    lane_ok = lanes < n_lanes
    x_base = x_ptr + b * sx_b + h * sx_h + pid_n * GROUP * sx_e

    # Pass 1: the group's min and max (uniform) or mean and deviation (normal) per lane,
    # in fp32 like the reference.
    e = tl.arange(0, BLOCK_G)
    ok = (e[:, None] < GROUP) & lane_ok[None, :]
    tile = tl.load(x_base + e[:, None] * sx_e + lanes[None, :] * sx_l, mask=ok, other=0.0)
    tile = tile.to(tl.float32)
    if NORMAL:
        n = tl.full([BLOCK_L], GROUP, tl.float32)
        mean = tl.div_rn(tl.sum(tl.where(ok, tile, 0.0), axis=0), n)  # [BLOCK_L]
        dev = tl.where(ok, tile - mean[None, :], 0.0)
        zero_st = mean  # padding lanes read zeros: mean 0, deviation 0
        scale_st = tl.sqrt_rn(tl.div_rn(tl.sum(dev * dev, axis=0), n))
    else:
        lo = tl.min(tl.where(ok, tile, float("inf")), axis=0)  # [BLOCK_L]
        hi = tl.max(tl.where(ok, tile, float("-inf")), axis=0)
        lo = tl.where(lane_ok, lo, 0.0)  # padding lanes: keep them finite
        hi = tl.where(lane_ok, hi, 0.0)
        scale_st = tl.div_rn(hi - lo, tl.full(hi.shape, LEVELS, tl.float32))
        zero_st = lo

    if META8:
        # The table's first scale at or above the step the group needs (widened so that
        # the zero point fits an int8), the zero point on that grid.
        # (Quarter steps, layout.ZERO_STEPS: the bound 127 / 4 and the products by 4 and
        # 0.25 are exact, as the reference's.)
        need = tl.maximum(scale_st,
                          tl.div_rn(tl.abs(lo), tl.full(lo.shape, 31.75, tl.float32)))
        idx = _scale_index(need, stab_ptr)
        s32 = tl.load(stab_ptr + idx)
        point = tl.minimum(tl.maximum(_round_half_even(tl.div_rn(-lo, s32) * 4.0), -128.0),
                           127.0)
        z32 = -point * s32 * 0.25
        if FIT > 0:
            # Fit mse: each coarser-clipped grid, centred on the midrange, against the
            # min-max one; the least squared error wins (the first on a tie).
            best = _grid_error(tile, ok, s32, z32, LEVELS)
            mid = (lo + hi) * 0.5
            base = idx
            for k in tl.static_range(1, FIT + 1):
                idx_k = tl.maximum(base - k, 0)
                s_k = tl.load(stab_ptr + idx_k)
                low = mid - LEVELS * s_k * 0.5
                p_k = tl.minimum(
                    tl.maximum(_round_half_even(tl.div_rn(-low, s_k) * 4.0), -128.0), 127.0)
                z_k = -p_k * s_k * 0.25
                err = _grid_error(tile, ok, s_k, z_k, LEVELS)
                better = err < best
                best = tl.where(better, err, best)
                idx = tl.where(better, idx_k, idx)
                s32 = tl.where(better, s_k, s32)
                point = tl.where(better, p_k, point)
                z32 = tl.where(better, z_k, z32)
        s_off = b * ss_b + h * ss_h + pid_n * ss_n + lanes * ss_l
        tl.store(zero_ptr + s_off, point.to(tl.int32).to(tl.int8), mask=lane_ok)
        tl.store(scale_ptr + s_off, idx.to(tl.uint8), mask=lane_ok)
    else:
        # Store scale/zero in the cache dtype; compute codes against the stored values.
        if STORE_BF16:
            zero_st = _round_to_bf16(zero_st)
            scale_st = _round_to_bf16(scale_st)
        zero_st = zero_st.to(zero_ptr.dtype.element_ty)
        scale_st = scale_st.to(scale_ptr.dtype.element_ty)
        s_off = b * ss_b + h * ss_h + pid_n * ss_n + lanes * ss_l
        tl.store(zero_ptr + s_off, zero_st, mask=lane_ok)
        tl.store(scale_ptr + s_off, scale_st, mask=lane_ok)
        z32 = zero_st.to(tl.float32)
        s32 = scale_st.to(tl.float32)
    has_range = s32 > 0.0
    safe = tl.where(has_range, s32, 1.0)

    # Pass 2: chunk w holds elements w*CH .. w*CH+CH-1; assemble each chunk's bits.
    w = tl.arange(0, BLOCK_W)
    w_ok = (w[:, None] < GROUP // CH) & lane_ok[None, :]
    word = tl.zeros([BLOCK_W, BLOCK_L], dtype=tl.int32)
    for k in tl.static_range(CH):
        e_k = w * CH + k
        xv = tl.load(x_base + e_k[:, None] * sx_e + lanes[None, :] * sx_l, mask=w_ok, other=0.0)
        y = tl.div_rn(xv.to(tl.float32) - z32[None, :], safe[None, :])
        if NORMAL:
            q = tl.zeros([BLOCK_W, BLOCK_L], dtype=tl.int32)
            for i in tl.static_range(LEVELS):
                q += (y > tl.load(thr_ptr + i)).to(tl.int32)
            q = tl.where(has_range[None, :], q, 0)
        else:
            q = tl.minimum(tl.maximum(_round_half_even(y), 0.0), LEVELS)
            q = tl.where(has_range[None, :], q, 0.0).to(tl.int32)
        word = word | (q << (k * BITS))

    c_base = codes_ptr + b * sc_b + h * sc_h + pid_n * sc_n + lanes[None, :] * sc_l
    for m in tl.static_range(CB):
        byte = ((word >> (8 * m)) & 0xFF).to(tl.uint8)
        tl.store(c_base + (w[:, None] * CB + m) * sc_y, byte, mask=w_ok)


def quantize(x: torch.Tensor, spec: QuantSpec, dtype: torch.dtype | None = None) -> Packed:
    """Quantize and pack ``x`` on the GPU (or the Triton interpreter); see the reference.

    Args:
        x: ``[B, H, T, D]`` float16/bfloat16/float32 (any strides). For
            ``spec.axis == "channel"`` T must be a multiple of ``spec.group_size``; for
            ``"token"`` D must be.
        spec: bits, group size, axis, levels, metadata width.
        dtype: dtype of the stored scale/zero (and of the plain tensor at 16 bits);
            defaults to ``x.dtype``. 8-bit metadata is uint8 (scale index) and int8
            (zero point) whatever ``dtype``.
    Returns:
        :class:`Packed` with contiguous tensors, bit-identical to
        :func:`kvpolicy.kernels.reference.quantize` for uniform levels, with 16- or 8-bit
        metadata (for normal ones
        up to the summation order of the mean and deviation: see the module docstring):
        channel: codes uint8 ``[B, H, T//G, G*bits//8, D]``, scale/zero ``[B, H, T//G, D]``;
        token: codes uint8 ``[B, H, T, D*bits//8]``, scale/zero ``[B, H, T, D//G]``.

    Grid: ``(B * H, n_groups, cdiv(n_lanes, BLOCK_L))`` with ``n_groups = T//G`` and
    ``n_lanes = D`` for channel, ``n_groups = D//G`` and ``n_lanes = T`` for token.
    """
    if x.dim() != 4:
        raise CacheError(f"quantize input must be [B, H, T, D], got shape {tuple(x.shape)}")
    if not x.is_floating_point():
        raise CacheError(f"quantize input must be floating point, got {x.dtype}")
    dtype = x.dtype if dtype is None else dtype
    if spec.full_precision:
        empty = x.new_empty(0, dtype=dtype)
        return Packed(x.to(dtype), empty, empty)
    if spec.vq:  # the backend record routes vq to the shared encoder (triton_backend)
        raise CacheError("triton_quant.quantize has no vq kernel; pack vq values with "
                         "kvpolicy.kernels.vq_codes.vq_encode (the backend's quantize does)")

    b, h, t, d = x.shape
    g, bits = spec.group_size, spec.bits
    nbytes = g * bits // 8
    scale_dtype = torch.uint8 if spec.meta8 else dtype
    if spec.axis == "channel":
        if t % g != 0:
            raise CacheError(
                f"per-channel quantization needs whole token groups: T={t} is not a "
                f"multiple of group_size={g}; keep the remainder in the residual window"
            )
        n_groups, n_lanes = t // g, d
        codes = torch.empty((b, h, n_groups, nbytes, d), dtype=torch.uint8, device=x.device)
        scale = torch.empty((b, h, n_groups, d), dtype=scale_dtype, device=x.device)
        sx_e, sx_l = x.stride(2), x.stride(3)
        sc_n, sc_y, sc_l = codes.stride(2), codes.stride(3), codes.stride(4)
        ss_n, ss_l = scale.stride(2), scale.stride(3)
    else:
        if d % g != 0:
            raise CacheError(
                f"per-token quantization needs whole channel groups: head_dim={d} is not a "
                f"multiple of group_size={g}; use a group_size that divides {d}"
            )
        n_groups, n_lanes = d // g, t
        codes = torch.empty((b, h, t, d * bits // 8), dtype=torch.uint8, device=x.device)
        scale = torch.empty((b, h, t, d // g), dtype=scale_dtype, device=x.device)
        sx_e, sx_l = x.stride(3), x.stride(2)
        sc_n, sc_y, sc_l = nbytes * codes.stride(3), codes.stride(3), codes.stride(2)
        ss_n, ss_l = scale.stride(3), scale.stride(2)
    zero = torch.empty_like(scale, dtype=torch.int8 if spec.meta8 else dtype)
    if codes.numel() == 0:
        return Packed(codes, scale, zero)

    ch = 8 // math.gcd(bits, 8)

    def grid(meta):
        return (b * h, n_groups, triton.cdiv(n_lanes, meta["BLOCK_L"]))

    _quantize_pack_kernel[grid](
        x, codes, scale, zero,
        h, n_lanes, triton.next_power_of_2(n_lanes),
        x.stride(0), x.stride(1), sx_e, sx_l,
        codes.stride(0), codes.stride(1), sc_n, sc_y, sc_l,
        scale.stride(0), scale.stride(1), ss_n, ss_l,
        BITS=bits,
        GROUP=g,
        CH=ch,
        BLOCK_G=triton.next_power_of_2(g),
        BLOCK_W=triton.next_power_of_2(g // ch),
        STORE_BF16=dtype == torch.bfloat16 and not spec.meta8,
        NORMAL=not spec.uniform,
        thr_ptr=None if spec.uniform else threshold_table(bits, x.device),
        META8=spec.meta8,
        stab_ptr=meta_table(spec, device=x.device),
        FIT=FIT_STEPS if spec.fit == "mse" else 0,  # QuantSpec: mse only with META8
    )
    return Packed(codes, scale, zero)
