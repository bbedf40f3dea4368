"""Vectorised PyTorch backend: quantize and attend over the packed cache on CPU (or any device).

Same signatures as :mod:`kvpolicy.kernels.reference`. No Python loop runs over tokens or
groups. Two paths for :func:`packed_attention_partial`:

* a fused C++ kernel (:mod:`kvpolicy.kernels.cpu_ext`) on CPU for up to
  ``_CPP_MAX_ROWS`` query rows per kv head (decode, chunked prefill), which reads each
  packed byte once and never materialises a dequantized cache; :func:`fused_attention`
  (and so :func:`decode_attention`) also folds the cache's full-precision tokens into the
  same call;
* an eager path (other devices, longer prefills, layouts the kernel does not cover, or no
  compiler): word-wise unpack, dequantize, rotate, one matmul pair with GQA folded into
  query rows.

:func:`apply_rope` and :func:`merge_partials_lse` are the reference's own functions,
re-exported: there they are already vectorised torch (one gather and elementwise ops; one
stacked log-sum-exp), so this backend has nothing faster to offer. :data:`BACKEND` is this
backend's record (:class:`~kvpolicy.kernels.contract.Backend`); the Triton backend borrows
its dequantize, full-precision attention, rotation and merge.
"""

# NOTE: 8K tokens, SmolLM2 shapes, 2-bit, rope; 2 threads, shared machine: C++ 0.9-1.1 ms,
# the eager path 8.6-18 ms, the eager path under torch.compile 2.3-2.6 ms after a 19 s
# compile.

from __future__ import annotations

import ctypes
import logging
import math
from typing import Any

import torch

from ..errors import CacheError
from . import cpu_ext, reference, vq_codes
from .contract import Backend, compose_decode
from .cpu_call import (
    CHUNK_TOKENS,
    CPP_BITS,
    DTYPE_CODES,
    THREADS_FROM,
    bh_slabs,
    checked_blocks,
    checked_positions,
    compact_rope,
    is_meta8,
    load_library,
    scale_table_f32,
    set_spec_tables,
    value_codebook,
)
from .layout import Packed, QuantSpec, RotarySpec, byte_aligned

__all__ = [
    "quantize",
    "dequantize",
    "attention_partial",
    "packed_attention_partial",
    "apply_rope",
    "merge_partials_lse",
    "fused_attention",
    "decode_attention",
    "BACKEND",
]

log = logging.getLogger(__name__)

# Already vectorised torch in the reference (see the module docstring).
apply_rope = reference.apply_rope
merge_partials_lse = reference.merge_partials_lse


def attention_partial(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    scale: float,
    mask: torch.Tensor | None = None,
    softcap: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Contract of :func:`reference.attention_partial`, with GQA folded into query rows.

    The query heads of one kv head become rows of one matmul instead of expanding K and V
    ``Hq/Hkv`` times (the reference's repeat_interleave copies the cache that many times).
    """
    b, hq, tq, d = q.shape
    hkv, tk, dv = k.shape[1], k.shape[2], v.shape[-1]
    if hkv == 0 or hq % hkv:
        raise CacheError(f"{hq} query heads are not a multiple of {hkv} kv heads")
    if tk == 0:
        return (
            q.new_zeros(b, hq, tq, dv, dtype=torch.float32),
            q.new_full((b, hq, tq), float("-inf"), dtype=torch.float32),
        )
    rep = hq // hkv
    qg = q.float().reshape(b, hkv, rep * tq, d)
    s = torch.matmul(qg, k.float().transpose(-1, -2)) * scale  # [B, Hkv, rep*Tq, Tk]
    if softcap is not None:
        s = torch.tanh(s.div_(softcap)).mul_(softcap)
    if mask is not None:
        s = s + mask.float().expand(b, hq, tq, tk).reshape(b, hkv, rep * tq, tk)
    m = s.amax(dim=-1, keepdim=True)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    p = torch.exp(s - m)
    denom = p.sum(dim=-1, keepdim=True)
    out = torch.matmul(p, v.float()) / torch.where(denom > 0, denom, torch.ones_like(denom))
    lse = (m + torch.log(denom)).squeeze(-1)
    return out.reshape(b, hq, tq, dv), lse.reshape(b, hq, tq)


# --------------------------------------------------------------------------- bit packing


def _unit(bits: int) -> tuple[int, int]:
    """(codes, bytes) of the smallest whole-byte unit of ``bits``-wide codes."""
    common = bits * 8 // math.gcd(bits, 8)
    return common // bits, common // 8


def pack_bits(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Same contract as :func:`reference.pack_bits`: OR the codes of each byte-aligned unit
    together (a loop over the <= 8 code slots of a unit, not over tokens or groups)."""
    # NOTE: quantize of [1, 3, 8192, 64] at 2 bits, 2 threads: 14.0 ms (keys) / 6.5 ms
    # (values) with an int64 word per unit built by a shifted sum over the unit dim; 2.8 /
    # 3.8 ms with this OR of strided uint8 slices.
    if bits == 8:
        return codes
    per, nbytes = _unit(bits)
    n = codes.shape[-1]
    if not byte_aligned(n, bits):
        raise CacheError(f"pack_bits: {n} codes of {bits} bits do not fill whole bytes")
    lead = codes.shape[:-1]
    c = codes.reshape(*lead, n // per, per)
    if nbytes == 1:
        out = c[..., 0].clone()
        for i in range(1, per):
            out |= c[..., i] << (i * bits)
        return out
    wide = torch.int32 if per * bits <= 31 else torch.int64  # 5-7 bits: 40-56-bit units
    word = c[..., 0].to(wide)
    for i in range(1, per):
        word |= c[..., i].to(wide) << (i * bits)
    out = torch.stack([((word >> (8 * j)) & 0xFF).to(torch.uint8) for j in range(nbytes)], -1)
    return out.reshape(*lead, n // per * nbytes)


def unpack_bits(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """Same contract as :func:`reference.unpack_bits`."""
    if bits == 8:
        return packed
    per, nbytes = _unit(bits)
    m = packed.shape[-1]
    dev = packed.device
    if nbytes == 1:
        # For 1/2/4 bits a uint8 shift-and-mask avoids the int64 word entirely.
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
    if spec.vq:  # a nearest-centroid search: the reference's matmul and argmin
        return Packed(*vq_codes.vq_encode(x, spec, dtype))
    b, h, t, d = x.shape
    g = spec.group_size
    if spec.axis == "channel":
        if t % g != 0:
            raise CacheError(
                f"per-channel quantization needs whole token groups: T={t} is not a "
                f"multiple of group_size={g}; keep the remainder in the residual window"
            )
        # The reference's view (each group along the last dim), so that the reductions
        # and the codes are bit-identical to it.
        groups = x.reshape(b, h, t // g, g, d).float().transpose(3, 4)
    else:
        if d % g != 0:
            raise CacheError(
                f"per-token quantization needs whole channel groups: head_dim={d} is not a "
                f"multiple of group_size={g}; use a group_size that divides {d}"
            )
        groups = x.reshape(b, h, t, d // g, g).float()
    codes, scale, zero = reference.encode_groups(groups, spec, dtype)
    if spec.widths is not None:  # per-channel widths: the reference's gather and scatter
        packed = reference.pack_widths(codes, spec)
    elif spec.axis == "channel":
        # [B,H,n,D,G] -> stream along G -> [B,H,n,G*bits/8,D]
        packed = pack_bits(codes, spec.bits).transpose(3, 4).contiguous()
    else:
        packed = pack_bits(codes.reshape(b, h, t, d), spec.bits)
    return Packed(packed, scale.contiguous(), zero.contiguous())


def dequantize(p: Packed, spec: QuantSpec, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Same contract as :func:`reference.dequantize`, with word-wise unpacking."""
    if spec.full_precision:
        return p.codes.to(dtype)
    if spec.vq:  # one gather of d floats per byte: the reference's
        return vq_codes.vq_decode(p, spec, dtype)
    codes, scale, zero = p
    if spec.axis == "channel":
        b, h, n, _, d = codes.shape
        c = reference.code_values(
            reference.unpack_widths(codes, spec) if spec.widths is not None
            else unpack_bits(codes.transpose(3, 4), spec.bits), spec)
        # Not addcmul: its fused multiply-add rounds once and would differ from the reference.
        s32, z32 = reference.meta_values(scale, zero, spec)
        x = c * s32.unsqueeze(-1) + z32.unsqueeze(-1)
        return x.transpose(3, 4).reshape(b, h, n * spec.group_size, d).to(dtype)
    b, h, t, _ = codes.shape
    c = reference.code_values(unpack_bits(codes, spec.bits), spec)
    d = c.shape[-1]
    c = c.reshape(b, h, t, d // spec.group_size, spec.group_size)
    s32, z32 = reference.meta_values(scale, zero, spec)
    x = c * s32.unsqueeze(-1) + z32.unsqueeze(-1)
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
    softcap: float | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    kd = dequantize(k, k_spec)
    vd = dequantize(v, v_spec)
    if rope is not None:
        if k_positions is None:
            raise CacheError("pre-RoPE keys need k_positions [B, Tk]")
        kd = apply_rope(kd, k_positions, rope)
    return attention_partial(q, kd, vd, scale=scale, mask=mask, softcap=softcap)


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
    softcap: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention over one packed segment; contract of :func:`reference.packed_attention_partial`.

    Args:
        q: ``[B, Hq, Tq, D]``; k, v: packed ``[B, Hkv, Tk, D]`` segments.
        scale: multiplies ``q·k``; mask: additive, broadcastable to ``[B, Hq, Tq, Tk]``.
        rope, k_positions: rotate pre-RoPE keys at ``k_positions [B, Tk]``.
        softcap: cap each score at ``softcap * tanh(s / softcap)`` before the mask.
    Returns:
        ``(out [B, Hq, Tq, D] fp32, lse [B, Hq, Tq] fp32)``.
    """
    if rope is not None and k_positions is None:
        raise CacheError("pre-RoPE keys need k_positions [B, Tk]")
    got = fused_attention(
        q, k, v, k_spec, v_spec, None, None,
        scale=scale, mask=mask, rope=rope, k_positions=k_positions, softcap=softcap,
    )
    if got is not None:
        return got
    return _eager_packed_attention(q, k, v, k_spec, v_spec, scale, mask, rope, k_positions,
                                   softcap)


def fused_attention(
    q: torch.Tensor,
    k: Packed,
    v: Packed,
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
    block_table: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """One softmax over a packed segment and a full-precision segment, in one C++ call.

    The cache's decode step: packed groups plus sinks and residual window (``fk``/``fv``
    ``[B, Hkv, Tf, D]``, keys pre-RoPE at ``fp_positions [B, Tf]`` when ``rope`` is set;
    ``fp_mask`` over those ``Tf`` columns). ``check_positions=False`` skips the bounds
    check of positions against the rotary table (the caller guarantees it). ``softcap``
    is applied in the kernel to every score of both segments, before the masks.
    ``block_table [B, nb]``: ``k``/``v`` are pages, read in place (``Backend``). Returns
    ``(out, lse)`` as :func:`packed_attention_partial` over the union of both segments, or
    ``None`` when the C++ kernel does not cover these inputs (the caller then runs the
    segments separately).
    """
    # NOTE: 8K-token decode step, SmolLM2 shapes, 1 thread (min): with the ~160
    # full-precision tokens in eager torch (rope, matmuls, LSE merge) a whole `attend` took
    # 1.7-1.9 ms against 1.0-1.3 ms for the packed kernel alone; folded into the same call,
    # 0.95 ms (kernel 0.71 ms).
    if not _cpp_supported(q, k, k_spec, v_spec, rope):
        return None
    dv = v.codes.shape[-1] * 8 // v_spec.bits
    if fv is not None and fv.shape[-1] != dv:
        return None
    if (k_spec.meta8, v_spec.meta8) != (is_meta8(k), is_meta8(v)):
        raise CacheError(f"stored scale/zero dtypes {k.scale.dtype}/{v.scale.dtype} do not "
                         f"match the metadata widths of {k_spec} / {v_spec}")
    half = 0 if rope is None else rope.rotary_dim // 2
    store = _storage_dtype(k, v, fk, fv)
    lib = load_library(k_spec, v_spec, q.shape[-1], dv, half, store)
    if lib is None:
        return None
    return _cpp_attention(lib, q, k, v, k_spec, v_spec, fk, fv, scale, mask, fp_mask, rope,
                          k_positions, fp_positions, check_positions, store, softcap,
                          block_table)


_by_segments = compose_decode(
    packed_attention_partial=packed_attention_partial,
    attention_partial=attention_partial,
    apply_rope=apply_rope,
    merge_partials=merge_partials_lse,
)


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
    block_table: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One softmax over a packed and a full-precision segment (``Backend.decode_attention``).

    :func:`fused_attention` (one C++ call) where it covers the inputs and there is a packed
    segment; otherwise the segments one by one (:func:`packed_attention_partial`,
    :func:`attention_partial` over the rotated full-precision keys) merged by
    :func:`merge_partials_lse`.
    """
    if k is not None and v is not None:
        got = fused_attention(
            q, k, v, k_spec, v_spec, fk, fv, scale=scale, mask=mask, fp_mask=fp_mask,
            rope=rope, k_positions=k_positions, fp_positions=fp_positions,
            check_positions=check_positions, softcap=softcap, block_table=block_table,
        )
        if got is not None:
            return got
    return _by_segments(
        q, k, v, k_spec, v_spec, fk, fv, scale=scale, mask=mask, fp_mask=fp_mask, rope=rope,
        k_positions=k_positions, fp_positions=fp_positions, softcap=softcap,
        block_table=block_table,
    )


BACKEND = Backend(
    name="torch",
    quantize=quantize,
    dequantize=dequantize,
    attention_partial=attention_partial,
    packed_attention_partial=packed_attention_partial,
    apply_rope=apply_rope,
    merge_partials=merge_partials_lse,
    decode_attention=decode_attention,
)


# --------------------------------------------------------------------------- C++ path

# NOTE: query rows per kv head up to which the C++ kernel runs. Measured at 8K packed tokens,
# 1 thread, SmolLM2 shapes (C++ vs eager dequantize + rope + matmul, ms): Tq=1 1.1 vs 14,
# Tq=16 5.1 vs 21, Tq=64 18 vs 50, Tq=256 (768 rows) 73 vs 256. Longer prefills were not
# measured; the score buffer (rows x 512 floats per work item) bounds it.
_CPP_MAX_ROWS = 1024


def _cpp_supported(
    q: torch.Tensor, k: Packed, k_spec: QuantSpec, v_spec: QuantSpec, rope: RotarySpec | None
) -> bool:
    hkv = k.codes.shape[1] if k.codes.dim() == 5 else 0
    return (
        hkv > 0
        and q.dim() == 4
        and q.shape[1] % hkv == 0
        and q.shape[1] // hkv * q.shape[2] <= _CPP_MAX_ROWS
        and q.device.type == "cpu"
        and k_spec.axis == "channel"
        and v_spec.axis == "token"
        and k_spec.bits in CPP_BITS
        and v_spec.bits in CPP_BITS
        and (
            rope is None
            or (rope.style in ("rotate_half", "interleaved") and rope.rotary_dim % 2 == 0
                and rope.rotary_dim <= q.shape[-1])
        )
    )


def _fp_len(fk: torch.Tensor | None) -> int:
    return 0 if fk is None else fk.shape[2]


# NOTE: 16-bit-metadata scales and zeros and full-precision tokens are read in their storage
# dtype and widened inside the kernel (8-bit metadata: as stored, uint8 / int8). 8K step,
# bf16 cache, 1 thread (min of 100): 0.77-0.80 ms read as stored, 0.85-0.87 ms converting
# them to fp32 in torch first (fp32 cache: 0.80 ms).
def _storage_dtype(
    k: Packed, v: Packed, fk: torch.Tensor | None, fv: torch.Tensor | None
) -> torch.dtype:
    """The one dtype of 16-bit-metadata scales/zeros and fp tokens if they share one the
    kernel reads, else fp32 (also when there are none: both 8-bit metadata, no fp tokens)."""
    ts = [t for p in (k, v) if not is_meta8(p) for t in (p.scale, p.zero)]
    ts += [t for t in (fk, fv) if t is not None]
    dt = ts[0].dtype if ts else torch.float32
    return dt if dt in DTYPE_CODES and all(t.dtype == dt for t in ts) else torch.float32


def _cpp_attention(
    lib: Any,
    q: torch.Tensor,
    k: Packed,
    v: Packed,
    k_spec: QuantSpec,
    v_spec: QuantSpec,
    fk: torch.Tensor | None,
    fv: torch.Tensor | None,
    scale: float,
    mask: torch.Tensor | None,
    fp_mask: torch.Tensor | None,
    rope: RotarySpec | None,
    k_positions: torch.Tensor | None,
    fp_positions: torch.Tensor | None,
    check_positions: bool = True,
    store: torch.dtype = torch.float32,
    softcap: float | None = None,
    block_table: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    b, hq, tq, dk = q.shape
    kc, ks, kz = k
    vc, vs, vz = v
    hkv = kc.shape[1]
    tk = kc.shape[2] * k_spec.group_size  # a page's tokens when paged
    dv = vc.shape[3] * 8 // v_spec.bits
    rows = b if block_table is None else kc.shape[0]
    if kc.shape[0] != rows or vc.shape[:2] != kc.shape[:2] or vc.shape[2] != tk:
        raise CacheError(
            f"packed key codes {tuple(kc.shape)} and value codes {tuple(vc.shape)} do not "
            f"describe the same [{'num_blocks' if block_table is not None else f'B={b}'}, "
            f"Hkv, Tk] {'pages' if block_table is not None else 'segment'}"
        )
    keep: list[torch.Tensor] = []  # everything whose pointer the kernel reads stays alive
    book = value_codebook(v_spec, hkv)  # VQ values' centroids; None: coded per element
    bsz, chunk = tk, max(k_spec.group_size, CHUNK_TOKENS // k_spec.group_size
                         * k_spec.group_size)
    if block_table is not None:
        btab = checked_blocks(block_table, b, rows, check_positions)
        keep.append(btab)
        tk, chunk = btab.shape[1] * bsz, bsz  # a work item never spans two pages
    qs = (q.float() * scale).contiguous()
    km8, vm8 = is_meta8(k), is_meta8(v)  # 8-bit metadata: passed as stored (uint8 / int8)
    kc, kc_sb, kc_sh = bh_slabs(kc)
    ks, ks_sb, ks_sh = bh_slabs(ks if km8 else ks.to(store))
    kz, kz_sb, kz_sh = bh_slabs(kz if km8 else kz.to(store))
    vc, vc_sb, vc_sh = bh_slabs(vc)
    vs, vs_sb, vs_sh = bh_slabs(vs if vm8 else vs.to(store))
    vz, vz_sb, vz_sh = bh_slabs(vz if vm8 else vz.to(store))
    keep += [qs, kc, ks, kz, vc, vs, vz]
    out = torch.empty(b, hq, tq, dv)
    lse = torch.empty(b, hq, tq)
    p = cpu_ext.Params(
        B=b, Hkv=hkv, rep=hq // hkv, Tq=tq, Dk=dk, Dv=dv, Tk=tk,
        Gk=k_spec.group_size, Gv=v_spec.group_size,
        chunk=chunk,
        nthreads=torch.get_num_threads() if b * (tk + _fp_len(fk)) >= THREADS_FROM else 1,
        q=qs.data_ptr(),
        kc=kc.data_ptr(), kc_sb=kc_sb, kc_sh=kc_sh,
        ks=ks.data_ptr(), ks_sb=ks_sb, ks_sh=ks_sh,
        kz=kz.data_ptr(), kz_sb=kz_sb, kz_sh=kz_sh,
        vc=vc.data_ptr(), vc_sb=vc_sb, vc_sh=vc_sh,
        vs=vs.data_ptr(), vs_sb=vs_sb, vs_sh=vs_sh,
        vz=None if book is not None else vz.data_ptr(), vz_sb=vz_sb, vz_sh=vz_sh,  # VQ: none
        out=out.data_ptr(), lse=lse.data_ptr(), sdt=DTYPE_CODES[store],
        softcap=0.0 if softcap is None else float(softcap),  # 0: no cap
        # a null table is what tells the kernel "no 8-bit metadata" (kept alive by its cache)
        stab=scale_table_f32().data_ptr() if km8 or vm8 else None,
    )
    if block_table is not None:
        p.btab, p.btab_sb, p.bsz = btab.data_ptr(), btab.stride(0), bsz
    if mask is not None:
        mf = mask.float().expand(b, hq, tq, tk)
        keep.append(mf)
        p.mask = mf.data_ptr()
        p.m0, p.m1, p.m2, p.m3 = mf.stride()
    if fk is not None and fv is not None and fk.shape[2] > 0:
        tf = fk.shape[2]
        if fk.shape[:2] != (b, hkv) or fv.shape[:3] != fk.shape[:3] or fk.shape[3] != dk:
            raise CacheError(
                f"full-precision keys {tuple(fk.shape)} / values {tuple(fv.shape)} do not "
                f"match the packed segment [B={b}, Hkv={hkv}, *, D]"
            )
        fk32, fk_sb, fk_sh = bh_slabs(fk.to(store))
        fv32, fv_sb, fv_sh = bh_slabs(fv.to(store))
        keep += [fk32, fv32]
        p.Tf = tf
        p.fk, p.fk_sb, p.fk_sh = fk32.data_ptr(), fk_sb, fk_sh
        p.fv, p.fv_sb, p.fv_sh = fv32.data_ptr(), fv_sb, fv_sh
        if fp_mask is not None:
            fm = fp_mask.float().expand(b, hq, tq, tf)
            keep.append(fm)
            p.fmask = fm.data_ptr()
            p.f0, p.f1, p.f2, p.f3 = fm.stride()
        if rope is not None:
            fpos = checked_positions(fp_positions, b, tf, rope, check_positions)
            keep.append(fpos)
            p.fpos, p.fpos_sb = fpos.data_ptr(), fpos.stride(0)
    if rope is not None:
        kpos = checked_positions(k_positions, b, tk, rope, check_positions)
        cos, sin = compact_rope(rope)
        keep += [kpos, cos, sin]
        p.kpos, p.kpos_sb = kpos.data_ptr(), kpos.stride(0)
        p.cosc, p.sinc, p.rope_rs = cos.data_ptr(), sin.data_ptr(), cos.stride(0)
        p.half, p.rope_style = rope.rotary_dim // 2, 1 if rope.style == "rotate_half" else 2
    set_spec_tables(p, k_spec, v_spec, hkv, dk, book, keep)
    if lib.kvp_packed_attention(ctypes.byref(p), k_spec.bits, v_spec.bits) != 0:
        raise CacheError(f"CPU kernel was built for another spec than {k_spec}/{v_spec}")
    del keep
    return out, lse
