"""Per-channel key widths (``QuantSpec.widths``): the stream layout, the torch backend
against the reference, what the widths buy, and the spec's refusals."""

from __future__ import annotations

import pytest
import torch

from kvpolicy.errors import CacheError
from kvpolicy.kernels import reference as ref
from kvpolicy.kernels import torch_backend as tb
from kvpolicy.kernels.layout import QuantSpec, channel_offsets


def _widths(h: int, d: int, seed: int = 0) -> tuple[tuple[int, ...], ...]:
    """Random widths 1-4 per channel summing to 2 * d per head: moves of one bit from a
    channel to another, starting at 2 everywhere."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(h):
        w = [2] * d
        for _ in range(3 * d):
            a, b = torch.randint(0, d, (2,), generator=g).tolist()
            if a != b and w[a] < 4 and w[b] > 1:
                w[a] += 1
                w[b] -= 1
        rows.append(tuple(w))
    return tuple(rows)


def _stream_codes(packed: torch.Tensor, widths, g: int) -> list[list[list[list[int]]]]:
    """Codes ``[h][group][d][t]`` read bit by bit from the documented stream, the layout's
    docstring written out in Python."""
    b, h, n, r, d = packed.shape
    out = []
    for hh in range(h):
        groups = []
        for nn in range(n):
            stream = packed[0, hh, nn].reshape(-1).tolist()
            bits = [(byte >> i) & 1 for byte in stream for i in range(8)]
            offs = channel_offsets(widths[hh])
            chans = []
            for c in range(d):
                w = widths[hh][c]
                start = g * offs[c]
                chans.append([sum(bits[start + t * w + i] << i for i in range(w))
                              for t in range(g)])
            groups.append(chans)
        out.append(groups)
    return out


@pytest.mark.parametrize("g", [8, 12, 16])
def test_stream_layout_matches_the_docstring(g):
    widths = _widths(2, 16, seed=g)
    spec = QuantSpec(2, g, "channel", widths=widths)
    x = torch.randn(1, 2, 2 * g, 16, generator=torch.Generator().manual_seed(1))
    p = ref.quantize(x, spec)
    assert p.codes.shape == (1, 2, 2, g * 2 // 8, 16)  # the uniform width's shape
    codes = ref.unpack_widths(p.codes, spec)  # [1, H, n, D, G]
    assert _stream_codes(p.codes, widths, g) == codes[0].tolist()
    for hh in range(2):
        top = torch.tensor([2 ** w - 1 for w in widths[hh]])
        assert bool((codes[0, hh].amax((0, 2)) <= top).all())
        # Every level of a wide channel is reachable: min-max puts the extremes on 0 and top.
        assert bool((codes[0, hh].amax((0, 2)) == top).all())


@pytest.mark.parametrize("meta_bits,fit", [(16, "minmax"), (8, "minmax"), (8, "mse")])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_torch_backend_bit_identical_to_reference(meta_bits, fit, dtype):
    spec = QuantSpec(2, 12, "channel", meta_bits=meta_bits, fit=fit, widths=_widths(3, 64))
    x = torch.randn(2, 3, 48, 64, generator=torch.Generator().manual_seed(2)).to(dtype)
    got, want = tb.quantize(x, spec, dtype), ref.quantize(x, spec, dtype)
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a, b)
    assert torch.equal(tb.dequantize(got, spec), ref.dequantize(want, spec))


def test_equal_widths_are_the_uniform_width():
    d = 32
    x = torch.randn(1, 2, 24, d, generator=torch.Generator().manual_seed(3))
    for bits in (2, 3):
        spread = QuantSpec(bits, 8, "channel", widths=((bits,) * d,) * 2)
        plain = QuantSpec(bits, 8, "channel")
        assert torch.equal(ref.dequantize(ref.quantize(x, spread), spread),
                           ref.dequantize(ref.quantize(x, plain), plain))


def test_wider_channels_are_closer():
    widths = _widths(1, 64, seed=4)
    spec = QuantSpec(2, 16, "channel", widths=widths)
    x = torch.randn(1, 1, 256, 64, generator=torch.Generator().manual_seed(5))
    err = (ref.dequantize(ref.quantize(x, spec), spec) - x).square().mean((0, 1, 2))
    w = torch.tensor(widths[0])
    by_width = [err[w == b].mean().item() for b in (1, 2, 3, 4) if bool((w == b).any())]
    assert by_width == sorted(by_width, reverse=True)
    assert by_width[0] > 8 * by_width[-1]


def test_attention_over_widths_matches_dequantized_reference():
    torch.manual_seed(6)
    spec = QuantSpec(2, 16, "channel", meta_bits=8, widths=_widths(2, 32, seed=6))
    vspec = QuantSpec(2, 32, "token")
    k, v = torch.randn(1, 2, 64, 32), torch.randn(1, 2, 64, 32)
    q = torch.randn(1, 4, 1, 32)
    pk, pv = tb.quantize(k, spec), tb.quantize(v, vspec)
    out, lse = tb.packed_attention_partial(q, pk, pv, spec, vspec, scale=32 ** -0.5)
    want, wlse = ref.attention_partial(q, ref.dequantize(pk, spec), ref.dequantize(pv, vspec),
                                       scale=32 ** -0.5)
    torch.testing.assert_close(out, want)
    torch.testing.assert_close(lse, wlse)


@pytest.mark.parametrize("kwargs,match", [
    ({"widths": ((2, 2, 2, 3),)}, "sum to 9"),
    ({"widths": ((5, 1, 1, 1),)}, r"has \[5\]"),
    ({"widths": ((2, 2, 2, 2), (2, 2))}, "same length"),
    ({"widths": ((2, 2, 2, 2),), "levels": "normal"}, "uniform levels"),
])
def test_spec_refuses_bad_widths(kwargs, match):
    with pytest.raises(CacheError, match=match):
        QuantSpec(2, 16, "channel", **kwargs)
    with pytest.raises(CacheError, match="axis='channel'"):
        QuantSpec(2, 16, "token", widths=((2, 2, 2, 2),))


def test_widths_of_other_heads_are_refused_at_pack_time():
    spec = QuantSpec(2, 8, "channel", widths=((2,) * 16,) * 3)
    with pytest.raises(CacheError, match="3 heads"):
        ref.quantize(torch.randn(1, 2, 8, 16), spec)


@pytest.mark.triton
def test_triton_packs_widths_on_the_torch_path():
    """Only the decode kernel reads per-channel widths: packing and the packed-segment
    attention of such keys take the torch backend's functions through the Triton record."""
    from kvpolicy.kernels import triton_backend

    tr = triton_backend.load()
    torch.manual_seed(7)
    spec = QuantSpec(2, 16, "channel", meta_bits=8, fit="mse", widths=_widths(2, 32, seed=7))
    vspec = QuantSpec(2, 32, "token")
    k, v, q = torch.randn(1, 2, 64, 32), torch.randn(1, 2, 64, 32), torch.randn(1, 4, 3, 32)
    pk = tr.quantize(k, spec, torch.float16)
    for a, b in zip(pk, tb.quantize(k, spec, torch.float16), strict=True):
        assert torch.equal(a, b)
    pv = tr.quantize(v, vspec, torch.float16)
    got = tr.packed_attention_partial(q, pk, pv, spec, vspec, scale=0.2)
    want = tb.packed_attention_partial(q, pk, pv, spec, vspec, scale=0.2)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b)


@pytest.mark.triton
@pytest.mark.parametrize("g,meta_bits", [(16, 8), (12, 8), (16, 16)])
@pytest.mark.parametrize("rope", [None, "rotate_half", "interleaved"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_triton_decode_reads_widths(g, meta_bits, rope, dtype):
    """The decode kernel's per-channel-width gather (``K_WID``) against the reference, with
    a packed and a full-precision segment, GQA 2, pre-RoPE keys of both RoPE styles."""
    from test_triton_decode import TOL, _case, _check, _rope

    spec = QuantSpec(2, g, "channel", meta_bits=meta_bits,
                     fit="mse" if meta_bits == 8 else "minmax", widths=_widths(2, 32, seed=g))
    a = _case(dtype=dtype, hq=4, hkv=2, tk=48, k_spec=spec,
              v_spec=QuantSpec(2, 32, "token"), rope=None if rope is None else _rope(rope, 32),
              seed=g)
    assert a["k"].codes.shape[-2:] == (g * 2 // 8, 32)
    _check(a, TOL[dtype])
    _check(a, TOL[dtype], num_splits=3 if g == 16 else 2)


@pytest.mark.parametrize("g,meta_bits", [(12, 8), (16, 16)])
@pytest.mark.parametrize("rope", [None, "rotate_half"])
def test_cpu_kernel_reads_widths(g, meta_bits, rope):
    """The fused C++ decode (``Params.kwid``) against the reference: packed and
    full-precision segments, GQA 2, pre-RoPE keys."""
    from test_triton_decode import _case, _rope

    spec = QuantSpec(2, g, "channel", meta_bits=meta_bits,
                     fit="mse" if meta_bits == 8 else "minmax", widths=_widths(2, 32, seed=g))
    a = _case(hq=4, hkv=2, tk=48, k_spec=spec, v_spec=QuantSpec(2, 32, "token"),
              rope=None if rope is None else _rope(rope, 32), seed=g)
    args = (a["q"], a["k"], a["v"], spec, a["v_spec"], a["fk"], a["fv"])
    kw = dict(scale=a["scale"], rope=a["rope"], k_positions=a["k_positions"],
              fp_positions=a["fp_positions"])
    got = tb.fused_attention(*args, **kw)
    if got is None:
        pytest.skip("the C++ kernel is not available here (no compiler)")
    want = ref.decode_attention(*args, **kw)
    for x, y in zip(got, want, strict=True):
        torch.testing.assert_close(x, y, atol=1e-5, rtol=1e-5)


def test_the_quantize_op_refuses_widths_it_cannot_carry():
    from kvpolicy.kernels import ops

    spec = QuantSpec(2, 8, "channel", widths=((2,) * 16,) * 2)
    with pytest.raises(CacheError, match="per-channel widths"):
        ops.quantize_packed(torch.randn(1, 2, 8, 16), spec, backend="torch")
