"""The vectorised torch backend (C++ kernel and eager path) against the reference."""

from __future__ import annotations

import logging

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvpolicy.kernels import cpu_ext
from kvpolicy.kernels import reference as ref
from kvpolicy.kernels import torch_backend as tb
from kvpolicy.kernels.layout import Packed, QuantSpec, RotarySpec
from kvpolicy.zoo.tiny import rope_spec


def make_rope(style: str, rotary_dim: int, positions: int = 4096) -> RotarySpec:
    return rope_spec(style, rotary_dim, positions)


ROPES = {
    "none": None,
    "half": make_rope("rotate_half", 64),
    "interleaved": make_rope("interleaved", 64),
    "partial": make_rope("rotate_half", 32),
}


def require_cpp(monkeypatch) -> None:
    """Skip when no C++ compiler is installed; otherwise build strictly.

    The torch backend asks ``cpu_ext.load``, which turns a failed build into the eager
    fallback; here it asks ``cpu_ext.build`` instead, so a compile error fails the test
    with the compiler's output rather than passing on the eager path.
    """
    if cpu_ext.compiler() is None:
        pytest.skip("no C++ compiler: the C++ path cannot be built here")
    monkeypatch.delenv("KVPOLICY_NO_CPP", raising=False)
    monkeypatch.setattr(cpu_ext, "load", cpu_ext.build)


@pytest.fixture(params=("cpp", "eager"))
def path(request, monkeypatch) -> str:
    """Run a test through the C++ kernel and through the eager fallback."""
    if request.param == "eager":
        monkeypatch.setenv("KVPOLICY_NO_CPP", "1")
    else:
        require_cpp(monkeypatch)
    return request.param


# --------------------------------------------------------------------------- quantize


@settings(max_examples=20, deadline=None)
@given(
    bits=st.sampled_from((1, 2, 3, 4, 8, 16)),
    axis=st.sampled_from(("channel", "token")),
    dtype=st.sampled_from((torch.float32, torch.bfloat16)),
    groups=st.integers(1, 3),
    seed=st.integers(0, 2**31),
)
def test_quantize_is_bit_identical_to_reference(bits, axis, dtype, groups, seed) -> None:
    spec = QuantSpec(bits, 32, axis)
    t = 32 * groups if axis == "channel" else 7 * groups
    x = torch.randn(2, 3, t, 64, generator=torch.Generator().manual_seed(seed)).to(dtype)
    x[0, 0, :, :32] = 0.5  # a zero-range group in either layout
    got, want = tb.quantize(x, spec), ref.quantize(x, spec)
    for a, b in zip(got, want, strict=True):
        assert a.dtype == b.dtype and torch.equal(a, b)
    torch.testing.assert_close(tb.dequantize(got, spec), ref.dequantize(want, spec),
                               atol=0, rtol=0)


@pytest.mark.parametrize("bits", (1, 2, 3, 4, 5, 6, 7, 8))
def test_pack_unpack_match_reference(bits: int) -> None:
    codes = torch.randint(0, 1 << bits, (3, 5, 64), dtype=torch.uint8)
    packed = tb.pack_bits(codes, bits)
    assert torch.equal(packed, ref.pack_bits(codes, bits))
    assert torch.equal(tb.unpack_bits(packed, bits), codes)


# --------------------------------------------------------------------------- attention


@pytest.mark.parametrize("tk", (0, 1, 31, 257))
@pytest.mark.parametrize("hq,hkv", ((9, 3), (4, 1), (2, 2)))
def test_attention_partial_matches_reference(tk: int, hq: int, hkv: int) -> None:
    q = torch.randn(2, hq, 3, 16)
    k, v = torch.randn(2, 2, hkv, tk, 16).unbind(0)
    mask = torch.zeros(2, hq, 3, tk)
    mask[0, :, 1] = float("-inf")  # a fully hidden row
    mask[1, 1, :, ::2] = float("-inf")  # per-head mask
    for m in (None, mask, mask[:, :1]):
        out, lse = tb.attention_partial(q, k, v, scale=0.3, mask=m)
        r_out, r_lse = ref.attention_partial(q, k, v, scale=0.3, mask=m)
        torch.testing.assert_close(out, r_out, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(lse, r_lse, atol=1e-5, rtol=1e-5)


def packed_pair(k, v, ks, vs):
    return tb.quantize(k, ks), tb.quantize(v, vs)


@pytest.fixture
def cpp(monkeypatch) -> str:
    require_cpp(monkeypatch)
    return "cpp"


@pytest.mark.parametrize("tk", (96, 544))
@pytest.mark.parametrize("tq", (1, 5))
@pytest.mark.parametrize("hq,hkv", ((9, 3), (4, 1), (3, 3)))
@pytest.mark.parametrize("rope", ROPES)
def test_cpp_packed_attention_matches_reference(cpp, tk, tq, hq, hkv, rope) -> None:
    check_packed_attention(tk, tq, hq, hkv, rope)


@pytest.mark.parametrize("tk,tq", ((32, 1), (544, 5)))
@pytest.mark.parametrize("hq,hkv", ((9, 3), (4, 1)))
@pytest.mark.parametrize("rope", ("none", "interleaved", "partial"))
def test_eager_packed_attention_matches_reference(monkeypatch, tk, tq, hq, hkv, rope) -> None:
    monkeypatch.setenv("KVPOLICY_NO_CPP", "1")
    check_packed_attention(tk, tq, hq, hkv, rope)


def check_packed_attention(tk: int, tq: int, hq: int, hkv: int, rope: str) -> None:
    ks, vs = QuantSpec(2, 32, "channel"), QuantSpec(2, 32, "token")
    torch.manual_seed(tk + tq + hq)
    k, v = torch.randn(2, 2, hkv, tk, 64).unbind(0)
    q = torch.randn(2, hq, tq, 64)
    pk, pv = packed_pair(k, v, ks, vs)
    pos = torch.stack((torch.arange(tk), torch.randperm(4096)[:tk]))  # any positions
    kw = dict(scale=0.125, mask=None, rope=ROPES[rope], k_positions=pos)
    out, lse = tb.packed_attention_partial(q, pk, pv, ks, vs, **kw)
    r_out, r_lse = ref.packed_attention_partial(q, pk, pv, ks, vs, **kw)
    torch.testing.assert_close(out, r_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse, r_lse, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("kb,vb", ((1, 8), (3, 4), (4, 3), (8, 1)))
@pytest.mark.parametrize("tq", (1, 3))
def test_packed_attention_other_bits_with_mask(path, kb, vb, tq) -> None:
    ks, vs = QuantSpec(kb, 32, "channel"), QuantSpec(vb, 32, "token")
    k, v = torch.randn(2, 1, 3, 96, 64).unbind(0)
    q = torch.randn(1, 6, tq, 64)
    pk, pv = packed_pair(k, v, ks, vs)
    mask = torch.zeros(1, 6, tq, 96)
    mask[..., ::3] = float("-inf")
    mask[0, 1, 0] = float("-inf")  # one fully hidden row: out 0, lse -inf
    mask[0, 2, -1, 5] = -3.0
    kw = dict(scale=0.2, mask=mask, rope=ROPES["half"], k_positions=torch.arange(96)[None] + 7)
    out, lse = tb.packed_attention_partial(q, pk, pv, ks, vs, **kw)
    r_out, r_lse = ref.packed_attention_partial(q, pk, pv, ks, vs, **kw)
    torch.testing.assert_close(out, r_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse, r_lse, atol=1e-5, rtol=1e-5)
    assert torch.equal(out[0, 1, 0], torch.zeros(64)) and lse[0, 1, 0] == float("-inf")


def test_broadcast_mask_and_strided_segments(path) -> None:
    """Segments narrowed out of a larger buffer (as the cache stores them) and a [B,1,Tq,Tk]
    mask give the same result as contiguous inputs."""
    ks, vs = QuantSpec(2, 32, "channel"), QuantSpec(4, 32, "token")
    k, v = torch.randn(2, 2, 3, 128, 64).unbind(0)
    big_k, big_v = packed_pair(k, v, ks, vs)
    pk = Packed(*(t.narrow(2, 0, t.shape[2] // 2) for t in big_k))
    pv = Packed(*(t.narrow(2, 0, t.shape[2] // 2) for t in big_v))
    assert not pk.codes.is_contiguous()
    q = torch.randn(2, 9, 2, 64)
    mask = torch.zeros(2, 1, 2, 64)
    mask[1, 0, 0, 40:] = float("-inf")
    kw = dict(scale=0.125, mask=mask, rope=ROPES["interleaved"],
              k_positions=torch.arange(64).expand(2, 64))
    out, _ = tb.packed_attention_partial(q, pk, pv, ks, vs, **kw)
    contiguous = [Packed(*(t.contiguous() for t in p)) for p in (pk, pv)]
    r_out, _ = ref.packed_attention_partial(q, *contiguous, ks, vs, **kw)
    torch.testing.assert_close(out, r_out, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("tk", (1, 31, 33, 257))
@pytest.mark.parametrize(
    "ks,vs",
    (
        (QuantSpec(2, 32, "token"), QuantSpec(2, 32, "token")),  # keys per token: eager
        (QuantSpec(16, 32, "channel"), QuantSpec(3, 32, "token")),  # fp keys: eager
    ),
    ids=("k-token", "k-fp16"),
)
def test_layouts_outside_the_kernel_fall_back_to_eager(tk, ks, vs) -> None:
    k, v = torch.randn(2, 1, 3, tk, 64).unbind(0)
    q = torch.randn(1, 3, 1, 64)
    pk, pv = packed_pair(k, v, ks, vs)
    kw = dict(scale=0.125, rope=ROPES["partial"], k_positions=torch.arange(tk)[None])
    out, lse = tb.packed_attention_partial(q, pk, pv, ks, vs, **kw)
    r_out, r_lse = ref.packed_attention_partial(q, pk, pv, ks, vs, **kw)
    torch.testing.assert_close(out, r_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse, r_lse, atol=1e-5, rtol=1e-5)


def test_other_head_dim_and_group_size(path) -> None:
    ks, vs = QuantSpec(4, 16, "channel"), QuantSpec(2, 16, "token")
    k, v = torch.randn(2, 1, 2, 80, 48).unbind(0)
    q = torch.randn(1, 4, 1, 48)
    pk, pv = packed_pair(k, v, ks, vs)
    rope = make_rope("rotate_half", 48)
    kw = dict(scale=0.3, rope=rope, k_positions=torch.arange(80)[None])
    out, _ = tb.packed_attention_partial(q, pk, pv, ks, vs, **kw)
    r_out, _ = ref.packed_attention_partial(q, pk, pv, ks, vs, **kw)
    torch.testing.assert_close(out, r_out, atol=1e-5, rtol=1e-5)


def test_missing_compiler_falls_back(monkeypatch, tmp_path, caplog) -> None:
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    monkeypatch.setenv("KVPOLICY_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(cpu_ext, "_libs", {})
    monkeypatch.setattr(cpu_ext, "_warned", set())
    monkeypatch.setattr(cpu_ext.shutil, "which", lambda name: None)
    assert cpu_ext.compiler() is None
    with pytest.raises(cpu_ext.BuildError, match="no C\\+\\+ compiler"):
        cpu_ext.build(2, 2, 32, 32, 64, 64)
    ks, vs = QuantSpec(2, 32, "channel"), QuantSpec(2, 32, "token")
    k, v = torch.randn(2, 1, 3, 64, 64).unbind(0)
    q = torch.randn(1, 3, 1, 64)
    pk, pv = packed_pair(k, v, ks, vs)
    with caplog.at_level(logging.WARNING):
        out, _ = tb.packed_attention_partial(q, pk, pv, ks, vs, scale=0.125)
    assert "eager torch path" in caplog.text
    r_out, _ = ref.packed_attention_partial(q, pk, pv, ks, vs, scale=0.125)
    torch.testing.assert_close(out, r_out, atol=1e-5, rtol=1e-5)


def _broken_build(monkeypatch, tmp_path) -> None:
    """A compiler that fails on this source (an #error line), with a fresh build cache."""
    if cpu_ext.compiler() is None:
        pytest.skip("no C++ compiler: a build error cannot be produced here")
    monkeypatch.delenv("KVPOLICY_NO_CPP", raising=False)
    monkeypatch.setenv("KVPOLICY_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(cpu_ext, "_libs", {})
    monkeypatch.setattr(cpu_ext, "_warned", set())
    source = "#error kvpolicy-test-build-error\n" + cpu_ext._source()
    monkeypatch.setattr(cpu_ext, "_source", lambda: source)


def test_build_error_raises_with_the_compiler_output(monkeypatch, tmp_path) -> None:
    _broken_build(monkeypatch, tmp_path)
    with pytest.raises(cpu_ext.BuildError, match="kvpolicy-test-build-error"):
        cpu_ext.build(2, 2, 32, 32, 64, 64)


def test_build_error_falls_back_with_one_warning(monkeypatch, tmp_path, caplog) -> None:
    """For users a failed build is the eager path, logged once at warning level."""
    _broken_build(monkeypatch, tmp_path)
    ks, vs = QuantSpec(2, 32, "channel"), QuantSpec(2, 32, "token")
    k, v = torch.randn(2, 1, 3, 64, 64).unbind(0)
    q = torch.randn(1, 3, 1, 64)
    pk, pv = packed_pair(k, v, ks, vs)
    with caplog.at_level(logging.WARNING, logger=cpu_ext.__name__):
        outs = [tb.packed_attention_partial(q, pk, pv, ks, vs, scale=0.125)[0] for _ in range(3)]
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1, [r.getMessage() for r in warnings]
    assert "kvpolicy-test-build-error" in warnings[0].getMessage()
    assert "eager torch path" in warnings[0].getMessage()
    r_out, _ = ref.packed_attention_partial(q, pk, pv, ks, vs, scale=0.125)
    for out in outs:
        torch.testing.assert_close(out, r_out, atol=1e-5, rtol=1e-5)
