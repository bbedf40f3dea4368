"""8-bit metadata (``QuantSpec.meta_bits == 8``) in the Triton kernels against the reference.

Quantize: the kernel finds the scale index by a binary search over the 256-entry scale
table and computes the zero point and the codes with the reference's fp32 operations, so
codes, scale indices (uint8) and zero points (int8) are bit-identical to
:func:`kvpolicy.kernels.reference.quantize`; also at the ends of the table, for a step
that equals a table entry exactly (the search is ``searchsorted``'s left side), for zero
points widened to fit an int8 and rounded half to even.

Decode: :func:`triton_decode.decode_attention` and
:func:`triton_attention.packed_attention_partial` read a scale index and a zero point,
``scale = table[index]``, ``zero = -point * scale / 4``; checked against the reference with
8-bit keys only, values only and both, on the byte-at-a-time paths and the gathers, with
the decode tests' cases and tolerances. 16-bit metadata keeps the kernels it had
(``K_M8``/``V_M8`` False, no table; the sm_90 PTX of those variants is unchanged).
"""

from __future__ import annotations

import pytest
import torch
from test_triton_decode import TOL, _call, _case, _check, _Launches, _rope
from test_triton_levels import _ta, _td, _tq
from test_triton_quant import _assert_same, _data

from kvpolicy.errors import CacheError
from kvpolicy.kernels import reference as ref
from kvpolicy.kernels._triton_util import interpreting
from kvpolicy.kernels.layout import Packed, QuantSpec, scale_table

pytestmark = pytest.mark.triton

DEVICE = "cpu" if interpreting() else "cuda"
TABLE = scale_table()


def _m8(bits: int, g: int, axis: str) -> QuantSpec:
    return QuantSpec(bits, g, axis, meta_bits=8)


# --------------------------------------------------------------------------- quantize


@pytest.mark.parametrize("bits", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("axis", ["channel", "token"])
@pytest.mark.parametrize("g", [16, 32])
@pytest.mark.parametrize("x_dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_quantize_bit_identical(bits, axis, g, x_dtype):
    # channel: 64 tokens (2 or 4 groups), D=24 (not a power of two); token: 5 tokens, D=64.
    spec = _m8(bits, g, axis)
    shape = (1, 2, 64, 24) if axis == "channel" else (1, 2, 5, 64)
    x = _data(shape, x_dtype, seed=bits + g)
    got = _tq().quantize(x, spec)
    assert got.scale.dtype == torch.uint8 and got.zero.dtype == torch.int8
    _assert_same(got, ref.quantize(x, spec))


@pytest.mark.parametrize("bits", [2, 3, 4])
@pytest.mark.parametrize("axis", ["channel", "token"])
def test_quantize_fit_mse_bit_identical(bits, axis):
    # Fit mse: the kernel tries the same coarser centred grids and keeps the same ones.
    spec = QuantSpec(bits, 16, axis, meta_bits=8, fit="mse")
    shape = (1, 2, 64, 24) if axis == "channel" else (1, 2, 5, 64)
    x = _data(shape, torch.float32, seed=bits + 40)
    got, want = _tq().quantize(x, spec), ref.quantize(x, spec)
    _assert_same(got, want)
    # Not vacuous: some groups kept a clipped grid (a smaller index than min-max's).
    minmax = ref.quantize(x, _m8(bits, 16, axis))
    assert (want.scale < minmax.scale).any()


def test_quantize_ignores_the_cache_dtype_and_strides():
    # The metadata is one byte each whatever the cache dtype; a transposed input.
    spec = _m8(3, 8, "token")
    x = _data((1, 24, 3, 16), torch.float32, seed=7).transpose(1, 2)
    for dtype in (torch.float16, torch.bfloat16):
        _assert_same(_tq().quantize(x, spec, dtype), ref.quantize(x, spec, dtype))


def test_quantize_table_ends_exact_steps_and_ties():
    """Groups of 8 channels at 1 bit and of 4 at 2 bits whose index and zero point are
    known."""
    t = torch.tensor(TABLE)
    up = torch.nextafter(t[140], torch.tensor(float("inf"))).item()
    down = torch.nextafter(t[140], torch.tensor(0.0)).item()
    pad = [0.0] * 6
    rows = [
        ([0.0] * 8, 0, 0),  # constant zero: the smallest scale, point 0
        ([1.0] * 8, 89, -117),  # constant: widened until |min| <= 127 / 4 * scale
        ([0.0, t[140].item()] + pad, 140, 0),  # the step is an entry: that entry
        ([0.0, up] + pad, 141, 0),  # just above: the next one
        ([0.0, down] + pad, 140, 0),  # just below: still that one
        ([0.0, 1e-9] + pad, 0, 0),  # below the table: index 0
        ([-1e6, 1e6] + pad, 255, 67),  # beyond it: 255
        ([-1e7] * 8, 255, 127),  # and the zero point clamped to an int8
    ]
    x = torch.tensor([r[0] for r in rows]).reshape(1, 1, len(rows), 8).to(DEVICE)
    spec = _m8(1, 8, "token")
    got = _tq().quantize(x, spec)
    _assert_same(got, ref.quantize(x, spec))
    assert got.scale.flatten().tolist() == [r[1] for r in rows]
    assert got.zero.flatten().tolist() == [r[2] for r in rows]
    # Zero points (quarter steps) on exact halves round to even: scale 1 (index 128) at 2
    # bits, min -0.625 -> point 2.5 -> 2 (not 3), min -0.375 -> 1.5 -> 2.
    x = torch.tensor([[-0.625, 2.375, 0.0, 1.0], [-0.375, 2.625, 0.0, 1.0]]).reshape(1, 1, 2, 4)
    spec = _m8(2, 4, "token")
    got = _tq().quantize(x.to(DEVICE), spec)
    _assert_same(got, ref.quantize(x.to(DEVICE), spec))
    assert got.scale.flatten().tolist() == [128, 128]
    assert got.zero.flatten().tolist() == [2, 2]


# --------------------------------------------------------------------------- decode


def _specs(which: str, kb: int, vb: int, k_axis: str = "channel", v_axis: str = "token",
           g: int = 16) -> tuple[QuantSpec, QuantSpec]:
    """Key and value specs, 8-bit metadata on ``which`` ("keys", "values", "both")."""
    k_meta = 8 if which in ("keys", "both") else 16
    v_meta = 8 if which in ("values", "both") else 16
    return (QuantSpec(kb, g, k_axis, meta_bits=k_meta),
            QuantSpec(vb, g, v_axis, meta_bits=v_meta))


@pytest.mark.parametrize("which", ["keys", "values", "both"])
def test_decode_fast_paths(which):
    # Keys per channel (2 bits) and values per token (4 bits): the byte-at-a-time paths.
    k_spec, v_spec = _specs(which, 2, 4)
    _check(_case(k_spec=k_spec, v_spec=v_spec, rope=_rope("rotate_half", 16), seed=1))


@pytest.mark.parametrize("splits", [1, 2])
def test_two_bit_default_keys_in_groups_of_12(splits):
    # compile_model(bits=2)'s specs: fitted keys in groups of 12 tokens (not a power of two:
    # a split starts on a multiple of lcm(16, 12) = 48 tokens), values in groups of 32.
    k_spec = QuantSpec(2, 12, "channel", meta_bits=8, fit="mse")
    v_spec = QuantSpec(2, 32, "token", meta_bits=8)
    x = _data((1, 2, 48, 24), torch.float32, seed=21)
    _assert_same(_tq().quantize(x, k_spec), ref.quantize(x, k_spec))
    a = _case(k_spec=k_spec, v_spec=v_spec, tk=96, rope=_rope("rotate_half", 32), seed=13)
    _check(a, num_splits=splits)


def test_decode_gathers_flipped_axes_and_odd_head_dim():
    # Keys per token (3 bits, straddling bytes) and values per channel, head dim 48:
    # every tile by the generic gather.
    k_spec, v_spec = _specs("both", 3, 2, k_axis="token", v_axis="channel")
    _check(_case(k_spec=k_spec, v_spec=v_spec, d=48, rope=_rope("rotate_half", 32), seed=3))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_decode_half_precision(dtype):
    # fp16 queries dequantize in fp16 (the table scale and -point * scale / 4 round once);
    # bf16 ones in fp32.
    k_spec, v_spec = _specs("both", 2, 4)
    a = _case(dtype=dtype, k_spec=k_spec, v_spec=v_spec,
              rope=_rope("interleaved", 32, dtype=dtype), seed=5)
    _check(a, TOL[dtype])


def test_decode_masks_softcap_and_splits():
    # Row 0 sees only full-precision keys, row 1 nothing; three packed splits, two fp ones.
    k_spec, v_spec = _specs("both", 2, 4)
    a = _case(k_spec=k_spec, v_spec=v_spec, hq=4, hkv=2, tq=2, tk=48, tf=20,
              rope=_rope("rotate_half", 32), seed=7)
    mask = torch.zeros(1, 4, 2, 48)
    mask[:, :, :2] = float("-inf")
    mask[:, 0, 1, ::5] = 0.0
    fp_mask = torch.zeros(2, 20)
    fp_mask[1] = float("-inf")
    a.update(mask=mask.to(DEVICE), fp_mask=fp_mask.to(DEVICE), softcap=2.0)
    _check(a, num_splits=3, fp_splits=2)


def test_decode_over_kernel_quantized_codes():
    # The Triton quantizer's codes and metadata, the packed segment alone.
    k_spec, v_spec = _specs("both", 4, 2)
    a = _case(k_spec=k_spec, v_spec=v_spec, seed=11)
    g = torch.Generator().manual_seed(12)
    k, v = torch.randn(2, 2, 1, 32, 32, generator=g).to(DEVICE).unbind(0)
    a.update(k=_tq().quantize(k, k_spec), v=_tq().quantize(v, v_spec), fk=None, fv=None,
             rope=None)
    _check(a)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_packed_attention_partial(dtype):
    # The single-segment kernel: 8-bit keys (3 bits, gathered), 8-bit values (2 bits, fast
    # path), a mask, two splits, RoPE.
    k_spec, v_spec = _specs("both", 3, 2)
    a = _case(dtype=dtype, k_spec=k_spec, v_spec=v_spec, tq=2, tk=48,
              rope=_rope("rotate_half", 32, dtype=dtype), seed=9)
    mask = torch.zeros(1, 1, 2, 48, device=DEVICE)
    mask[..., 1, ::3] = float("-inf")
    kw = dict(scale=a["scale"], mask=mask, rope=a["rope"], k_positions=a["k_positions"])
    out, lse = _ta().packed_attention_partial(a["q"], a["k"], a["v"], k_spec, v_spec,
                                              num_splits=2, **kw)
    want, want_lse = ref.packed_attention_partial(a["q"], a["k"], a["v"], k_spec, v_spec, **kw)
    torch.testing.assert_close(out.cpu(), want.cpu(), atol=TOL[dtype], rtol=TOL[dtype])
    torch.testing.assert_close(lse.cpu(), want_lse.cpu(), atol=TOL[dtype], rtol=TOL[dtype])


# --------------------------------------------------------------------------- variants


def test_flags_table_and_warm_up(monkeypatch):
    """16-bit metadata launches with False flags and no table; 8-bit metadata passes the
    cached table, which a warm-up (zeros in uint8/int8 metadata) creates."""
    from kvpolicy.kernels import _triton_util

    monkeypatch.setattr(_triton_util, "_TABLES", {})
    with _Launches(monkeypatch) as seen:
        _call(_td().decode_attention, _case(k_spec=_m8(2, 16, "channel"),
                                            v_spec=QuantSpec(4, 16, "token")))
        _call(_td().decode_attention, _case())
    flags = [(kw["K_M8"], kw["V_M8"], kw["stab_ptr"]) for name, kw in seen.kernels
             if name == "_decode_kernel"]
    assert flags[0][:2] == (True, False) and flags[1] == (False, False, None)
    table = flags[0][2]
    assert table.dtype == torch.float32 and table.tolist() == list(TABLE)

    k_spec, v_spec = _specs("values", 2, 4)
    with _Launches(monkeypatch) as seen:
        _td().warm_up_decode(k_spec, v_spec, n_kv_heads=1, gqa=4, head_dim=32,
                             dtype=torch.float16, device=DEVICE, packed_tokens=(16,),
                             fp_tokens=2, max_splits=1)
    decode = [kw for name, kw in seen.kernels if name == "_decode_kernel"]
    assert [(kw["HAS_PACKED"], kw["V_M8"]) for kw in decode] == [(True, True), (False, False)]
    assert decode[0]["stab_ptr"] is table  # cached per device
    assert len(_triton_util._TABLES) == 1


def test_metadata_dtypes_must_match_the_spec():
    a = _case(k_spec=_m8(2, 16, "channel"))
    k = a["k"]
    as_fp16 = Packed(k.codes, k.scale.half(), k.zero.half())
    with pytest.raises(CacheError, match="uint8 scale index"):
        _call(_td().decode_attention, a, k=as_fp16)
    with pytest.raises(CacheError, match="meta_bits=8"):
        _call(_td().decode_attention, a, k_spec=QuantSpec(2, 16, "channel"))
