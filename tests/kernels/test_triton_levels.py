"""Normal (Lloyd-Max) levels in the Triton kernels against the reference.

Quantize: the kernel sums the mean and the deviation in another order than torch's
reductions, so a stored scale or zero may differ from the reference's by a rounding.
What is asserted:

* scale within one ulp of the cache dtype or four fp32 ulps of the reference's, zero
  within one ulp or 2 * eps(fp32) * max|x| of its group (a mean that cancels keeps the
  absolute rounding of its summands, many ulps of a small result);
* codes equal wherever the group's scale and zero are equal (the codes are then the same
  fp32 operations on the same numbers), and on >= 99.9% of all elements;
* dequantized tensors within 4 * eps(cache dtype) * max|x| where the codes agree (a
  disagreeing code is one level off, for an element next to a threshold).

NOTE: measured with the interpreter (numpy's pairwise sums; a GPU's tree reduction sums in
yet another order), bits 1-4, both axes, groups of 32 tokens / 16 channels, Gaussian data
with an outlier channel, 262,144 codes per cache dtype: with fp32 scales 81-85% of the
groups have a scale (up to 3 ulps) or zero (up to 1.33 * eps * max|x|) off the
reference's and no code differs; with fp16 scales 11 of 12,288 groups are one fp16 ulp
off and no code differs; bf16 and fp16 inputs give the reference's scales and zeros
exactly (their fp32 sums are exact).

Decode: :func:`triton_decode.decode_attention` and the older
:func:`triton_attention.packed_attention_partial` read a non-uniform code's value from
its level table; checked against :func:`kvpolicy.kernels.reference.decode_attention` on
normal keys only, values only and both, bits 1-4, on the byte-at-a-time paths and the
gathers (3 bits, flipped axes, a head dim that is not a power of two), fp32/fp16/bf16,
GQA, RoPE, masks, softcap and splits. Uniform specs keep the kernels they had
(``K_LUT``/``V_LUT`` False, no table): the other Triton tests check their results.
"""

from __future__ import annotations

import pytest
import torch
from test_triton_decode import _call, _check  # the decode tests' call and check
from test_triton_decode import _case as _decode_case

from kvpolicy.kernels import reference as ref
from kvpolicy.kernels._triton_util import interpreting
from kvpolicy.kernels.layout import Packed, QuantSpec, RotarySpec

pytestmark = pytest.mark.triton

DEVICE = "cpu" if interpreting() else "cuda"
TOL = {torch.float32: 1e-5, torch.float16: 5e-3, torch.bfloat16: 3e-2}
INT_VIEW = {torch.float32: torch.int32, torch.float16: torch.int16, torch.bfloat16: torch.int16}


def _tq():
    from kvpolicy.kernels import triton_quant  # after conftest set TRITON_INTERPRET

    return triton_quant


def _td():
    from kvpolicy.kernels import triton_decode

    return triton_decode


def _ta():
    from kvpolicy.kernels import triton_attention

    return triton_attention


# --------------------------------------------------------------------------- quantize


def _ulps(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Distance of two float tensors of one dtype in units in the last place (ordered
    integer views, so that a step across zero counts like any other)."""
    bits = {torch.float32: 31, torch.float16: 15, torch.bfloat16: 15}[a.dtype]
    ia = a.cpu().view(INT_VIEW[a.dtype]).long()
    ib = b.cpu().view(INT_VIEW[b.dtype]).long()
    sign = 1 << bits
    oa = torch.where(ia < 0, -(ia + sign), ia)
    ob = torch.where(ib < 0, -(ib + sign), ib)
    return (oa - ob).abs()


def _codes(p: Packed, spec: QuantSpec) -> torch.Tensor:
    """The unpacked codes ``[..., groups, G]`` in the order of the scales."""
    if spec.axis == "channel":
        return ref.unpack_bits(p.codes.cpu().transpose(3, 4), spec.bits)  # [B,H,n,D,G]
    b, h, t, _ = p.codes.shape
    c = ref.unpack_bits(p.codes.cpu(), spec.bits)
    return c.reshape(b, h, t, -1, spec.group_size)


def _group_amax(x: torch.Tensor, spec: QuantSpec) -> torch.Tensor:
    """max |x| of each group, in the shape of the scales."""
    b, h, t, d = x.shape
    g = spec.group_size
    xa = x.float().abs().cpu()
    if spec.axis == "channel":
        return xa.reshape(b, h, t // g, g, d).amax(dim=3)
    return xa.reshape(b, h, t, d // g, g).amax(dim=4)


def _compare_quantize(x: torch.Tensor, spec: QuantSpec, dtype: torch.dtype | None) -> Packed:
    """Assert the module docstring's claims; returns the kernel's segment."""
    got = _tq().quantize(x, spec, dtype)
    want = ref.quantize(x, spec, dtype)
    for name, a, b in zip(("codes", "scale", "zero"), got, want, strict=True):
        assert a.shape == b.shape and a.dtype == b.dtype, name
    eps32 = torch.finfo(torch.float32).eps
    bounds = (("scale", got.scale, want.scale, 4 * eps32 * want.scale.float().abs().cpu()),
              ("zero", got.zero, want.zero, 2 * eps32 * _group_amax(x, spec)))
    for name, a, b, bound in bounds:
        near = (_ulps(a, b) <= 1) | ((a.float() - b.float()).abs().cpu() <= bound)
        assert near.all(), f"{int((~near).sum())} {name}s are off the reference's"
    same_meta = (got.scale.cpu() == want.scale.cpu()) & (got.zero.cpu() == want.zero.cpu())
    cg, cw = _codes(got, spec), _codes(want, spec)
    differ = cg != cw
    assert not differ[same_meta].any(), "codes differ in a group with the same scale and zero"
    n_diff = int(differ.sum())
    assert n_diff <= 1e-3 * differ.numel(), f"{n_diff} of {differ.numel()} codes differ"
    # Where the codes agree the dequantized values differ by the metadata's roundings.
    agree = _element_mask(~differ, spec, x.shape)
    tol = 4 * torch.finfo(want.scale.dtype).eps * x.float().abs().max().item()
    xg, xw = ref.dequantize(got, spec).cpu(), ref.dequantize(want, spec).cpu()
    torch.testing.assert_close(xg[agree], xw[agree], atol=tol, rtol=0)
    return got


def _element_mask(ok: torch.Tensor, spec: QuantSpec, shape: torch.Size) -> torch.Tensor:
    """A per-code mask in the grouped order of :func:`_codes` as ``[B, H, T, D]``."""
    b, h, t, d = shape
    if spec.axis == "channel":
        return ok.transpose(3, 4).reshape(b, h, t, d)
    return ok.reshape(b, h, t, d)


def _data(shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g) * 2.0
    x[..., 3] += 9.0  # an outlier channel, as keys have
    return x.to(DEVICE, dtype)


@pytest.mark.parametrize("bits", [1, 2, 3, 4])
@pytest.mark.parametrize("axis", ["channel", "token"])
@pytest.mark.parametrize(
    "x_dtype, cache_dtype",
    [(torch.float32, None), (torch.float32, torch.float16), (torch.bfloat16, None)],
    ids=["fp32", "fp32-fp16", "bf16"],
)
def test_quantize_matches_the_reference(bits, axis, x_dtype, cache_dtype):
    # channel: 2 token groups of 16, D=24 (not a power of two); token: 5 tokens, D=32.
    spec = QuantSpec(bits, 16, axis, "normal")
    shape = (1, 2, 32, 24) if axis == "channel" else (1, 2, 5, 32)
    _compare_quantize(_data(shape, x_dtype, seed=bits), spec, cache_dtype)


def test_quantize_small_groups_strided_input_and_constant_groups():
    # G=8 at 3 bits (one 3-byte chunk per group), a transposed input, and constant groups:
    # deviation 0 -> scale 0 -> codes 0, zero = the constant.
    spec = QuantSpec(3, 8, "token", "normal")
    buf = _data((1, 24, 3, 16), torch.float32, seed=7)  # [B, T, H, D], as models produce
    buf[0, 0, 0, :8] = 1.25
    p = _compare_quantize(buf.transpose(1, 2), spec, None)
    assert p.scale[0, 0, 0, 0] == 0 and p.zero[0, 0, 0, 0] == 1.25
    assert _codes(p, spec)[0, 0, 0, 0].tolist() == [0] * 8


@pytest.mark.parametrize("bits, want", [(1, [0] * 6 + [1, 0]), (2, [1] * 6 + [3, 0])])
def test_quantize_codes_count_the_thresholds_strictly_below(bits, want):
    # Mean 0 and deviation 1 exactly (every sum exact in fp32), so (x - zero) / scale is x:
    # the zeros sit on the middle threshold, 0, which is not below them.
    spec = QuantSpec(bits, 8, "token", "normal")
    x = torch.tensor([0.0] * 6 + [2.0, -2.0]).reshape(1, 1, 1, 8).to(DEVICE)
    p = _compare_quantize(x, spec, None)
    assert p.scale.item() == 1.0 and p.zero.item() == 0.0
    assert _codes(p, spec).flatten().tolist() == want


# --------------------------------------------------------------------------- decode


def _rope(style: str, rotary_dim: int, dtype: torch.dtype = torch.float32) -> RotarySpec:
    inv = 1.0 / (10000.0 ** (torch.arange(0, rotary_dim, 2).float() / rotary_dim))
    ang = torch.arange(128).float()[:, None] * inv[None, :]
    ang = torch.cat((ang, ang), -1) if style == "rotate_half" else ang.repeat_interleave(2, -1)
    return RotarySpec(style, rotary_dim, ang.cos().to(DEVICE, dtype), ang.sin().to(DEVICE, dtype))


def _case(k_spec: QuantSpec, v_spec: QuantSpec, **kw) -> dict:
    """Arguments of one decode call (the decode tests' case), packed by the reference."""
    return _decode_case(k_spec=k_spec, v_spec=v_spec, **kw)


def _specs(which: str, kb: int, vb: int, k_axis: str = "channel", v_axis: str = "token",
           g: int = 16) -> tuple[QuantSpec, QuantSpec]:
    """Key and value specs, normal levels on ``which`` ("keys", "values", "both")."""
    k_levels = "normal" if which in ("keys", "both") else "uniform"
    v_levels = "normal" if which in ("values", "both") else "uniform"
    return QuantSpec(kb, g, k_axis, k_levels), QuantSpec(vb, g, v_axis, v_levels)


@pytest.mark.parametrize("which", ["keys", "values", "both"])
@pytest.mark.parametrize("bits", [1, 2, 3, 4])
def test_decode_normal_levels(which, bits):
    # Keys per channel and values per token: the byte-at-a-time paths at 1, 2, 4 bits,
    # the gathers at 3 (codes straddling bytes). Partial rotate_half RoPE, GQA 4.
    k_spec, v_spec = _specs(which, bits, bits)
    _check(_case(k_spec, v_spec, rope=_rope("rotate_half", 16), seed=bits))


def test_normal_levels_change_the_result():
    # The same codes read as uniform levels give another attention: the table is read.
    k_spec, v_spec = _specs("both", 2, 2)
    a = _case(k_spec, v_spec)
    out, _ = _call(_td().decode_attention, a)
    uni, _ = _call(_td().decode_attention, a, k_spec=QuantSpec(2, 16, "channel"),
                   v_spec=QuantSpec(2, 16, "token"))
    assert (out - uni).abs().max() > 0.1


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("which", ["keys", "values", "both"])
def test_decode_half_precision(dtype, which):
    # fp16 queries dequantize in fp16 (a table value rounds once); bf16 ones in fp32.
    k_spec, v_spec = _specs(which, 2, 4)
    a = _case(k_spec, v_spec, dtype=dtype, rope=_rope("interleaved", 32, dtype=dtype), seed=5)
    _check(a, TOL[dtype])


def test_decode_gathers_flipped_axes_and_odd_head_dim():
    # Keys per token (4 bits) and values per channel (3 bits), head dim 48: every tile by
    # the generic gather, padded channel blocks.
    k_spec, v_spec = _specs("both", 4, 3, k_axis="token", v_axis="channel")
    _check(_case(k_spec, v_spec, d=48, rope=_rope("rotate_half", 32), seed=3))


@pytest.mark.parametrize("hq, hkv", [(2, 2), (4, 1)], ids=["gqa1", "gqa4"])
def test_decode_masks_softcap_and_splits(hq, hkv):
    # Row 0 sees only full-precision keys, row 1 nothing, row 2 all but a few; three
    # packed splits and two full-precision ones, a soft cap.
    k_spec, v_spec = _specs("both", 2, 4)
    a = _case(k_spec, v_spec, hq=hq, hkv=hkv, tq=3, tk=48, tf=20,
              rope=_rope("rotate_half", 32), seed=7)
    mask = torch.zeros(1, hq, 3, 48)
    mask[:, :, :2] = float("-inf")
    mask[:, 0, 2, ::5] = float("-inf")
    fp_mask = torch.zeros(3, 20)
    fp_mask[1] = float("-inf")
    fp_mask[2, 3:7] = float("-inf")
    a.update(mask=mask.to(DEVICE), fp_mask=fp_mask.to(DEVICE), softcap=2.0)
    out, lse = _check(a, num_splits=3, fp_splits=2)
    assert torch.all(out[:, :, 1] == 0) and torch.all(lse[:, :, 1] == float("-inf"))


def test_decode_packed_segment_alone_over_kernel_quantized_codes():
    # The Triton quantizer's codes, no full-precision segment, no RoPE.
    k_spec, v_spec = _specs("both", 4, 2)
    a = _case(k_spec, v_spec, seed=11)
    g = torch.Generator().manual_seed(12)
    k, v = torch.randn(2, 2, 1, 32, 32, generator=g).to(DEVICE).unbind(0)
    a.update(k=_tq().quantize(k, k_spec), v=_tq().quantize(v, v_spec), fk=None, fv=None,
             rope=None)
    _check(a)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_packed_attention_partial(dtype):
    # The older single-segment kernel: normal keys (3 bits, gathered), normal values
    # (2 bits, fast path), a mask, two splits, RoPE.
    k_spec, v_spec = _specs("both", 3, 2)
    a = _case(k_spec, v_spec, dtype=dtype, tq=2, tk=48, rope=_rope("rotate_half", 32, dtype),
              seed=9)
    mask = torch.zeros(1, 1, 2, 48, device=DEVICE)
    mask[..., 1, ::3] = float("-inf")
    kw = dict(scale=a["scale"], mask=mask, rope=a["rope"], k_positions=a["k_positions"])
    out, lse = _ta().packed_attention_partial(a["q"], a["k"], a["v"], k_spec, v_spec,
                                              num_splits=2, **kw)
    want, want_lse = ref.packed_attention_partial(a["q"], a["k"], a["v"], k_spec, v_spec, **kw)
    torch.testing.assert_close(out.cpu(), want.cpu(), atol=TOL[dtype], rtol=TOL[dtype])
    torch.testing.assert_close(lse.cpu(), want_lse.cpu(), atol=TOL[dtype], rtol=TOL[dtype])


# --------------------------------------------------------------------------- variants


def test_uniform_specs_launch_without_tables_and_tables_are_cached(monkeypatch):
    """A uniform policy passes no table and False flags (its kernel is the one it was);
    a normal one passes its cached tables: a warm-up creates them, a step reuses them."""
    td = _td()
    from kvpolicy.kernels import _triton_util

    seen: list[dict] = []
    cls = type(td._decode_kernel.fn)
    run = cls.run

    def recording(fn, *args, **kwargs):
        seen.append(kwargs)
        return run(fn, *args, **kwargs)

    monkeypatch.setattr(cls, "run", recording)
    monkeypatch.setattr(_triton_util, "_TABLES", {})
    uni = _specs("none", 2, 4)
    _call(td.decode_attention, _case(*uni))
    kernel = [kw for kw in seen if "K_LUT" in kw]
    assert kernel and all(not kw["K_LUT"] and not kw["V_LUT"] for kw in kernel)
    assert all(kw["klut_ptr"] is None and kw["vlut_ptr"] is None for kw in kernel)
    assert not _triton_util._TABLES

    k_spec, v_spec = _specs("keys", 2, 4)
    td.warm_up_decode(k_spec, v_spec, n_kv_heads=1, gqa=4, head_dim=32, dtype=torch.float32,
                      device=DEVICE, packed_tokens=(16,), fp_tokens=2, max_splits=1)
    tables = dict(_triton_util._TABLES)
    assert len(tables) == 1
    seen.clear()
    _call(td.decode_attention, _case(k_spec, v_spec))
    kw = next(kw for kw in seen if "K_LUT" in kw)
    assert kw["K_LUT"] and not kw["V_LUT"] and kw["vlut_ptr"] is None
    assert kw["klut_ptr"] is next(iter(tables.values()))
    assert kw["klut_ptr"].tolist() == pytest.approx(list(k_spec.table))
