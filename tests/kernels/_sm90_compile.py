"""Compile every Triton kernel family for sm_90 ahead of time (no GPU needed).

Run by ``test_triton_compile.py`` in a subprocess *without* ``TRITON_INTERPRET``: the
interpreter executes kernels as Python and accepts programs that the compiler rejects
(typed early returns, shape or dtype mismatches in untaken ``constexpr`` branches), so
this is the only check of the compiled path on a machine without a GPU. Prints one line
per compiled variant and exits non-zero on the first failure. The variants with normal
levels compile the level-table reads (``K_LUT``/``V_LUT``) and the threshold codes of the
quantize kernel; the variants with 8-bit metadata the scale-table reads (``K_M8``/``V_M8``,
uint8 scale indices and int8 zero points) and the quantizer's index search (``META8``);
the others leave those arguments at their defaults, as uniform 16-bit-metadata launches.
"""

from __future__ import annotations

import math
import sys

import triton
from triton.backends.compiler import GPUTarget

from kvpolicy.kernels import triton_attention as ta
from kvpolicy.kernels import triton_decode as td
from kvpolicy.kernels import triton_quant as tq
from kvpolicy.kernels._triton_util import channel_blocks, compile_ahead

TARGET = GPUTarget("cuda", 90, 32)


def _compile(kernel, ints: dict, ptrs: dict, consts: dict, floats=(), warps=4, stages=2):
    """Compile ``kernel`` with the specialisation the runtime would pick for ``ints``."""
    return compile_ahead(kernel, ints, ptrs, consts, floats=tuple(floats), target=TARGET,
                         num_warps=warps, num_stages=stages)


def _levels(consts: dict, ptrs: dict, k_lut: bool, v_lut: bool) -> None:
    """Add the level-table flags and pointers of normal-level keys / values."""
    consts.update(K_LUT=k_lut, V_LUT=v_lut)
    if k_lut:
        ptrs["klut_ptr"] = "*fp32"
    if v_lut:
        ptrs["vlut_ptr"] = "*fp32"


def _meta8(consts: dict, ptrs: dict, k_m8: bool, v_m8: bool) -> None:
    """8-bit metadata of keys / values: uint8 scale indices, int8 zero points, the table."""
    if k_m8 or v_m8:
        consts.update(K_M8=k_m8, V_M8=v_m8)
        ptrs["stab_ptr"] = "*fp32"
    if k_m8:
        ptrs.update(ks_ptr="*u8", kz_ptr="*i8")
    if v_m8:
        ptrs.update(vs_ptr="*u8", vz_ptr="*i8")


def attention(qdt, kb, kaxis, vb, vaxis, rope, rot, d=128, gqa=4, mask=False, block_n=64,
              k_lut=False, v_lut=False, k_m8=False, v_m8=False):
    """One attention variant: ``kaxis``/``vaxis`` are "channel" or "token"; ``k_lut`` /
    ``v_lut``: normal levels, ``k_m8`` / ``v_m8``: 8-bit metadata (None pointers and False
    flags otherwise, as at run time)."""
    g = 32
    t = 4096
    ints = {n: 64 for n in ta._packed_attention_kernel.arg_names}  # strides, sizes
    ints.update(q_len=1, sq_d=1, skc_2=1, sks_1=1, svc_2=1, svs_1=1, sp_t=1, sr_d=1,
                n_rows=gqa, kv_len=t, split_len=t // 4)
    ptrs = dict(
        q_ptr=f"*{qdt}", kc_ptr="*u8" if kb < 16 else f"*{qdt}", ks_ptr=f"*{qdt}",
        kz_ptr=f"*{qdt}", vc_ptr="*u8" if vb < 16 else f"*{qdt}", vs_ptr=f"*{qdt}",
        vz_ptr=f"*{qdt}", pos_ptr="*i64", cos_ptr="*fp32", sin_ptr="*fp32",
        mask_ptr=f"*{qdt}", out_ptr="*fp32", lse_ptr="*fp32",
    )
    kspec = ta.QuantSpec(kb, g, kaxis)
    vspec = ta.QuantSpec(vb, g, vaxis)
    consts = dict(
        GQA=gqa, DK=d, DV=d, K_BITS=kb, K_GROUP=g, K_CHANNEL=kaxis == "channel",
        V_BITS=vb, V_GROUP=g, V_CHANNEL=vaxis == "channel",
        K_FAST=ta._fast_layout(kspec, "channel", d), V_FAST=ta._fast_layout(vspec, "token", d),
        ROPE=rope, ROT_DIM=rot, HAS_MASK=mask, DOT_F32=qdt == "fp32",
        MATH_F16=qdt == "fp16", BLOCK_M=16,
        BLOCK_R=max(16, triton.next_power_of_2(max(rot // 2, 1))),
        BLOCK_P=max(16, triton.next_power_of_2(max(d - rot, 1))),
        BLOCK_DV=triton.next_power_of_2(d), BLOCK_N=block_n,
    )
    _levels(consts, ptrs, k_lut, v_lut)
    _meta8(consts, ptrs, k_m8, v_m8)
    return _compile(ta._packed_attention_kernel, ints, ptrs, consts, floats=("scale",))


def decode(qdt, kb, kaxis, vb, vaxis, rope, rot, d=128, gqa=4, k_lut=False, v_lut=False,
           k_m8=False, v_m8=False, kg=32, vg=32, k_wid=False):
    """One variant of the fused decode kernel (both segments, fp16 cache); ``kg``/``vg``:
    the key and value group sizes; ``k_wid``: per-channel key widths (their gather)."""
    ints = {n: 64 for n in td._decode_kernel.arg_names}
    ints.update(q_len=1, sq_d=1, skc_2=1, sks_1=1, svc_2=1, svs_1=1, sp_t=1, sfk_d=1, sfv_d=1,
                sfp_t=1, sr_d=1, n_rows=gqa)
    ptrs = dict(
        q_ptr=f"*{qdt}", kc_ptr="*u8", ks_ptr="*fp16", kz_ptr="*fp16", vc_ptr="*u8",
        vs_ptr="*fp16", vz_ptr="*fp16", pos_ptr="*i64", mask_ptr="*fp32", fk_ptr="*fp16",
        fv_ptr="*fp16", fpos_ptr="*i64", fmask_ptr="*fp32", cos_ptr="*fp16", sin_ptr="*fp16",
        out_ptr="*fp32", lse_ptr="*fp32",
    )
    kspec, vspec = ta.QuantSpec(kb, kg, kaxis), ta.QuantSpec(vb, vg, vaxis)
    consts = dict(
        GQA=gqa, DK=d, DV=d, K_BITS=kb, K_GROUP=kg, K_CHANNEL=kaxis == "channel",
        V_BITS=vb, V_GROUP=vg, V_CHANNEL=vaxis == "channel",
        K_FAST=ta._fast_layout(kspec, "channel", d), V_FAST=ta._fast_layout(vspec, "token", d),
        ROPE=rope, ROT_DIM=rot, HAS_PACKED=True, HAS_FP=True, HAS_MASK=False,
        HAS_FP_MASK=False, SOFTCAP=False, DOT_F32=qdt == "fp32", MATH_F16=qdt == "fp16",
        BLOCK_M=16, BLOCK_N=64, **channel_blocks(rot, d, d),
    )
    _levels(consts, ptrs, k_lut, v_lut)
    _meta8(consts, ptrs, k_m8, v_m8)
    if k_wid:
        consts["K_WID"] = True
        ptrs["kwid_ptr"] = "*i32"
    return _compile(td._decode_kernel, ints, ptrs, consts, floats=("scale", "softcap"))


def quantize(bits, g, sdt, normal=False, meta8=False, fit=0):
    ints = {n: 64 for n in tq._quantize_pack_kernel.arg_names}
    ints.update(sx_l=1, sc_l=1, ss_l=1)
    ptrs = dict(x_ptr="*fp16", codes_ptr="*u8", scale_ptr=f"*{sdt}", zero_ptr=f"*{sdt}")
    ch = 8 // math.gcd(bits, 8)
    consts = dict(BITS=bits, GROUP=g, CH=ch, BLOCK_G=triton.next_power_of_2(g),
                  BLOCK_W=triton.next_power_of_2(g // ch), STORE_BF16=sdt == "bf16", BLOCK_L=64,
                  NORMAL=normal)
    if normal:
        ptrs["thr_ptr"] = "*fp32"
    if meta8:  # a uint8 scale index and an int8 zero point, whatever the cache dtype
        consts.update(META8=True, STORE_BF16=False, FIT=fit)
        ptrs.update(scale_ptr="*u8", zero_ptr="*i8", stab_ptr="*fp32")
    return _compile(tq._quantize_pack_kernel, ints, ptrs, consts, warps=2)


def main() -> int:
    merge_ptrs = dict(part_ptr="*fp32", plse_ptr="*fp32", out_ptr="*fp32", lse_ptr="*fp32")
    variants = [
        # the kvpolicy-2 decode policy on both fast paths, fp16 and bf16 queries
        ("attn fp16 K2ch V2tok rotate_half",
         lambda: attention("fp16", 2, "channel", 2, "token", 1, 128)),
        ("attn bf16 K4ch V1tok interleaved d64",
         lambda: attention("bf16", 4, "channel", 1, "token", 2, 64, d=64, gqa=3)),
        ("attn fp16 K8ch V8tok (one code per byte)",
         lambda: attention("fp16", 8, "channel", 8, "token", 1, 128, block_n=128)),
        ("attn fp16 K1ch V1tok MQA",
         lambda: attention("fp16", 1, "channel", 1, "token", 1, 64, d=64, gqa=8)),
        # generic gathers: 3-bit straddling codes, flipped axes, partial rotary, a mask
        ("attn fp32 K3ch V3ch partial+mask",
         lambda: attention("fp32", 3, "channel", 3, "channel", 1, 32, mask=True)),
        ("attn fp16 K8tok V2ch no-rope d80",
         lambda: attention("fp16", 8, "token", 2, "channel", 0, 0, d=80, block_n=32)),
        ("attn fp16 full-precision segment",
         lambda: attention("fp16", 16, "token", 16, "token", 0, 0, mask=True)),
        ("merge splits",
         lambda: _compile(ta._merge_splits_kernel, {"n_splits": 8}, merge_ptrs,
                          dict(DV=128, BLOCK_S=8, BLOCK_DV=128))),
        ("quantize 2-bit fp16 scales", lambda: quantize(2, 32, "fp16")),
        ("quantize 3-bit bf16 scales", lambda: quantize(3, 32, "bf16")),
        # normal levels: table reads on the fast paths (fp16 math) and in the gathers
        ("attn fp16 K2ch V4tok normal levels, fast paths",
         lambda: attention("fp16", 2, "channel", 4, "token", 1, 128, k_lut=True, v_lut=True)),
        ("attn fp32 K3ch normal, V3ch uniform, partial+mask",
         lambda: attention("fp32", 3, "channel", 3, "channel", 1, 32, mask=True, k_lut=True)),
        ("decode fp16 K2ch uniform, V2tok normal",
         lambda: decode("fp16", 2, "channel", 2, "token", 1, 128, v_lut=True)),
        ("decode bf16 K4tok V3ch normal d80",
         lambda: decode("bf16", 4, "token", 3, "channel", 1, 64, d=80, k_lut=True,
                        v_lut=True)),
        ("quantize 4-bit normal fp16 scales", lambda: quantize(4, 32, "fp16", normal=True)),
        ("quantize 3-bit normal bf16 scales", lambda: quantize(3, 32, "bf16", normal=True)),
        # 8-bit metadata: scale-table reads on the fast paths (fp16 math), in the gathers
        # and in the decode kernel; the quantizer's index search
        ("attn fp16 K2ch V2tok 8-bit metadata, fast paths",
         lambda: attention("fp16", 2, "channel", 2, "token", 1, 128, k_m8=True, v_m8=True)),
        ("attn fp32 K3ch 8-bit metadata, V3ch 16-bit, partial+mask",
         lambda: attention("fp32", 3, "channel", 3, "channel", 1, 32, mask=True, k_m8=True)),
        ("decode fp16 K2ch V2tok 8-bit metadata",
         lambda: decode("fp16", 2, "channel", 2, "token", 1, 128, k_m8=True, v_m8=True)),
        ("decode bf16 K4tok 16-bit, V3ch 8-bit metadata d80",
         lambda: decode("bf16", 4, "token", 3, "channel", 1, 64, d=80, v_m8=True)),
        ("quantize 2-bit 8-bit metadata", lambda: quantize(2, 32, "fp16", meta8=True)),
        ("quantize 3-bit 8-bit metadata", lambda: quantize(3, 16, "bf16", meta8=True)),
        # fit mse: the quantizer's search over coarser centred grids (kvpolicy-2's keys)
        ("quantize 2-bit 8-bit metadata, fit mse",
         lambda: quantize(2, 16, "fp16", meta8=True, fit=3)),
        # compile_model(bits=2): fitted keys in groups of 12 tokens (not a power of two),
        # values in groups of 32 channels, both 8-bit
        ("decode fp16 K2ch G12 V2tok G32 8-bit metadata",
         lambda: decode("fp16", 2, "channel", 2, "token", 1, 128, k_m8=True, v_m8=True,
                        kg=12)),
        ("quantize 2-bit groups of 12, 8-bit metadata, fit mse",
         lambda: quantize(2, 12, "fp16", meta8=True, fit=3)),
        # channel_widths auto: keys 1-4 bits per channel (the width table's gather)
        ("decode fp16 K2ch G12 per-channel widths V2tok G32 8-bit metadata",
         lambda: decode("fp16", 2, "channel", 2, "token", 1, 128, k_m8=True, v_m8=True,
                        kg=12, k_wid=True)),
    ]
    for name, build in variants:
        build()
        print(f"compiled for sm_90: {name}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
