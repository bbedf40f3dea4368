"""The fused Triton attention over packed segments against the pure-torch reference.

Runs compiled on a GPU, in the interpreter elsewhere (see conftest.py). Shapes are tiny:
one to a few programs each, because the interpreter costs a few ms per program and per
key tile.
"""

from __future__ import annotations

import math

import pytest
import torch

from kvpolicy.errors import CacheError
from kvpolicy.kernels import reference as ref
from kvpolicy.kernels import triton_attention as ta
from kvpolicy.kernels.layout import QuantSpec, RotarySpec

pytestmark = pytest.mark.triton

DEVICE = "cpu" if ta._INTERPRET else "cuda"
# fp32 everywhere: the kernel's dots are IEEE fp32, so only summation order differs.
ATOL = RTOL = 1e-5


def _rand(shape, seed, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g) * scale).to(DEVICE)


def _rope(style: str, rotary_dim: int, positions: int = 256) -> RotarySpec:
    """Tables in the layout the model multiplies with (RotarySpec's contract)."""
    inv = 1.0 / (10000.0 ** (torch.arange(0, rotary_dim, 2).float() / rotary_dim))
    ang = torch.arange(positions).float()[:, None] * inv[None, :]  # [P, r/2]
    if style == "rotate_half":
        ang = torch.cat((ang, ang), dim=-1)
    else:
        ang = ang.repeat_interleave(2, dim=-1)
    return RotarySpec(style, rotary_dim, ang.cos().to(DEVICE), ang.sin().to(DEVICE))


def _case(b, hq, hkv, tq, tk, d, k_spec, v_spec, seed=0):
    """Random q and packed K/V (keys with an outlier channel, as real keys have)."""
    q = _rand((b, hq, tq, d), seed)
    k = _rand((b, hkv, tk, d), seed + 1)
    k[..., 1] += 6.0
    v = _rand((b, hkv, tk, d), seed + 2)
    return q, ref.quantize(k, k_spec), ref.quantize(v, v_spec)


def _positions(b, tk, start=7):
    # Different, non-contiguous positions per batch row.
    base = torch.arange(tk) * 2 + start
    return torch.stack([base + 3 * i for i in range(b)]).to(DEVICE)


def _check(q, kp, vp, k_spec, v_spec, *, mask=None, rope=None, pos=None, num_splits=None):
    scale = 1.0 / math.sqrt(q.shape[-1])
    out, lse = ta.packed_attention_partial(
        q, kp, vp, k_spec, v_spec, scale=scale, mask=mask, rope=rope, k_positions=pos,
        num_splits=num_splits,
    )
    want_out, want_lse = ref.packed_attention_partial(
        q, kp, vp, k_spec, v_spec, scale=scale, mask=mask, rope=rope, k_positions=pos
    )
    assert out.dtype == torch.float32 and lse.dtype == torch.float32
    assert out.shape == want_out.shape and lse.shape == want_lse.shape
    torch.testing.assert_close(out.cpu(), want_out.cpu(), atol=ATOL, rtol=RTOL)
    torch.testing.assert_close(lse.cpu(), want_lse.cpu(), atol=ATOL, rtol=RTOL)
    return out, lse


@pytest.mark.parametrize("bits", [1, 2, 3, 4, 8])
@pytest.mark.parametrize(
    "k_axis, v_axis",
    [("channel", "token"), ("token", "channel"), ("channel", "channel"), ("token", "token")],
)
def test_bits_and_axes(bits, k_axis, v_axis):
    # Pre-RoPE keys (rotate_half), GQA 3:1, one decode query over 48 keys (3 tiles).
    k_spec = QuantSpec(bits=bits, group_size=16, axis=k_axis)
    v_spec = QuantSpec(bits=bits, group_size=16, axis=v_axis)
    q, kp, vp = _case(1, 3, 1, 1, 48, 32, k_spec, v_spec, seed=bits)
    _check(q, kp, vp, k_spec, v_spec, rope=_rope("rotate_half", 32), pos=_positions(1, 48))


@pytest.mark.parametrize(
    "style, rotary_dim",
    [(None, 0), ("rotate_half", 32), ("interleaved", 32), ("rotate_half", 16),
     ("interleaved", 8)],
    ids=["none", "rotate_half", "interleaved", "partial_half", "partial_interleaved"],
)
def test_rope_styles(style, rotary_dim):
    # KIVI-2 layout (K per-channel 2 bits, V per-token 2 bits); batch 2 at own positions.
    k_spec = QuantSpec(bits=2, group_size=16, axis="channel")
    v_spec = QuantSpec(bits=2, group_size=16, axis="token")
    q, kp, vp = _case(2, 3, 1, 1, 32, 32, k_spec, v_spec, seed=11)
    rope = None if style is None else _rope(style, rotary_dim)
    _check(q, kp, vp, k_spec, v_spec, rope=rope, pos=None if rope is None else _positions(2, 32))


@pytest.mark.parametrize(
    "d, rotary_dim, group",
    [(48, 32, 16), (32, 32, 32)],
    ids=["head_dim48_partial", "group_longer_than_tile"],
)
def test_head_dims_and_group_sizes(d, rotary_dim, group):
    # head_dim 48 is not a power of two (padded channel blocks, generic value path);
    # G=32 is longer than the interpreter's 16-key tile (generic key path there).
    k_spec = QuantSpec(bits=4, group_size=group, axis="channel")
    v_spec = QuantSpec(bits=2, group_size=group, axis="token")
    q, kp, vp = _case(1, 3, 1, 1, 64, d, k_spec, v_spec, seed=d)
    _check(q, kp, vp, k_spec, v_spec, rope=_rope("rotate_half", rotary_dim),
           pos=_positions(1, 64))


@pytest.mark.parametrize("hq, hkv", [(6, 2), (4, 1)], ids=["gqa3", "mqa"])
@pytest.mark.parametrize("tq", [1, 5])
def test_heads_and_query_lengths(hq, hkv, tq):
    # Tq > 1: a causal mask over the segment plus a key hidden for one query head only.
    k_spec = QuantSpec(bits=3, group_size=8, axis="channel")
    v_spec = QuantSpec(bits=4, group_size=8, axis="token")
    tk = 24
    q, kp, vp = _case(1, hq, hkv, tq, tk, 16, k_spec, v_spec, seed=5)
    mask = None
    if tq > 1:
        qpos = torch.arange(tk - tq, tk)
        mask = torch.zeros(1, hq, tq, tk)
        mask[..., torch.arange(tk)[None, :] > qpos[:, None]] = float("-inf")
        mask[0, 1, :, 3] = float("-inf")
        mask = mask.to(DEVICE)
    _check(q, kp, vp, k_spec, v_spec, mask=mask, rope=_rope("interleaved", 16),
           pos=_positions(1, tk))


def test_split_k_with_hidden_split_and_hidden_row():
    # Three splits of 32 keys. Query position 0 sees only the first split's keys in
    # query head 0; every key is hidden from query position 1 (out 0, lse -inf); a
    # broadcast [Tq, Tk] mask exercises stride-0 heads.
    k_spec = QuantSpec(bits=2, group_size=16, axis="channel")
    v_spec = QuantSpec(bits=2, group_size=16, axis="token")
    q, kp, vp = _case(1, 2, 1, 3, 96, 16, k_spec, v_spec, seed=3)
    mask = torch.zeros(3, 96)
    mask[0, 32:] = float("-inf")
    mask[1, :] = float("-inf")
    mask = mask.to(DEVICE)
    rope = _rope("rotate_half", 16, positions=512)
    out, lse = _check(q, kp, vp, k_spec, v_spec, mask=mask, rope=rope, pos=_positions(1, 96),
                      num_splits=3)
    assert torch.all(out[:, :, 1] == 0) and torch.all(lse[:, :, 1] == float("-inf")), (
        "a fully hidden query row must give out 0 and lse -inf"
    )
    # The split count must not change the result beyond summation order.
    out1, lse1 = ta.packed_attention_partial(
        q, kp, vp, k_spec, v_spec, scale=0.25, mask=mask, rope=rope,
        k_positions=_positions(1, 96), num_splits=1,
    )
    out2, lse2 = ta.packed_attention_partial(
        q, kp, vp, k_spec, v_spec, scale=0.25, mask=mask, rope=rope,
        k_positions=_positions(1, 96), num_splits=2,
    )
    torch.testing.assert_close(out1, out2, atol=ATOL, rtol=RTOL)
    torch.testing.assert_close(lse1, lse2, atol=ATOL, rtol=RTOL)


def test_full_precision_segment_and_merge():
    # The residual window in full precision, merged with a packed segment, equals
    # attention over the union.
    q = _rand((1, 3, 1, 16), 21)
    k = _rand((1, 1, 40, 16), 22)
    v = _rand((1, 1, 40, 16), 23)
    out, lse = ta.attention_partial(q, k[:, :, 32:], v[:, :, 32:], scale=0.25)
    want_out, want_lse = ref.attention_partial(q, k[:, :, 32:], v[:, :, 32:], scale=0.25)
    torch.testing.assert_close(out, want_out, atol=ATOL, rtol=RTOL)
    torch.testing.assert_close(lse, want_lse, atol=ATOL, rtol=RTOL)
    k_spec = QuantSpec(bits=8, group_size=16, axis="channel")
    v_spec = QuantSpec(bits=8, group_size=16, axis="token")
    kp, vp = ref.quantize(k[:, :, :32], k_spec), ref.quantize(v[:, :, :32], v_spec)
    packed = ta.packed_attention_partial(q, kp, vp, k_spec, v_spec, scale=0.25)
    union = ref.attention_partial(
        q,
        torch.cat((ref.dequantize(kp, k_spec), k[:, :, 32:]), dim=2),
        torch.cat((ref.dequantize(vp, v_spec), v[:, :, 32:]), dim=2),
        scale=0.25,
    )[0]
    torch.testing.assert_close(ref.merge_partials([packed, (out, lse)]), union,
                               atol=ATOL, rtol=RTOL)


def test_half_precision_scales_and_strided_segment():
    # fp16 scale/zero, and a segment that is a token slice of a larger packed buffer
    # (non-contiguous in batch/head), as a preallocated cache hands out.
    k_spec = QuantSpec(bits=4, group_size=8, axis="channel")
    v_spec = QuantSpec(bits=2, group_size=8, axis="token")
    q = _rand((2, 2, 1, 16), 31)
    kb = ref.quantize(_rand((2, 2, 40, 16), 32), k_spec, torch.float16)
    vb = ref.quantize(_rand((2, 2, 40, 16), 33), v_spec, torch.float16)
    kp = type(kb)(kb.codes[:, :, 1:4], kb.scale[:, :, 1:4], kb.zero[:, :, 1:4])
    vp = type(vb)(vb.codes[:, :, 8:32], vb.scale[:, :, 8:32], vb.zero[:, :, 8:32])
    assert not kp.codes.is_contiguous() and not vp.codes.is_contiguous()
    _check(q, kp, vp, k_spec, v_spec)


_BF16_DOT = pytest.mark.skipif(
    ta._INTERPRET,
    reason="the Triton interpreter multiplies bf16 bit patterns in tl.dot (triton#11584)",
)


@pytest.mark.parametrize(
    "dtype, atol",
    [(torch.float16, 5e-3), pytest.param(torch.bfloat16, 3e-2, marks=_BF16_DOT)],
    ids=["fp16", "bf16"],
)
def test_half_precision_queries(dtype, atol):
    # The GPU path: half-precision queries, dots in q's dtype with fp32 accumulation;
    # the tolerance is the rounding of q, the dequantized keys and p to that dtype.
    k_spec = QuantSpec(bits=2, group_size=16, axis="channel")
    v_spec = QuantSpec(bits=2, group_size=16, axis="token")
    q, kp, vp = _case(1, 4, 2, 1, 32, 32, k_spec, v_spec, seed=41)
    q = q.to(dtype)
    kp = type(kp)(kp.codes, kp.scale.to(dtype), kp.zero.to(dtype))
    vp = type(vp)(vp.codes, vp.scale.to(dtype), vp.zero.to(dtype))
    rope, pos = _rope("rotate_half", 32), _positions(1, 32)
    out, lse = ta.packed_attention_partial(q, kp, vp, k_spec, v_spec, scale=0.2, rope=rope,
                                           k_positions=pos)
    want, want_lse = ref.packed_attention_partial(q, kp, vp, k_spec, v_spec, scale=0.2,
                                                  rope=rope, k_positions=pos)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out.cpu(), want.cpu(), atol=atol, rtol=atol)
    torch.testing.assert_close(lse.cpu(), want_lse.cpu(), atol=atol, rtol=atol)


def test_errors_name_the_problem():
    k_spec = QuantSpec(bits=2, group_size=16, axis="channel")
    v_spec = QuantSpec(bits=2, group_size=16, axis="token")
    q, kp, vp = _case(1, 3, 2, 1, 16, 16, k_spec, v_spec)
    with pytest.raises(CacheError, match="not a multiple"):
        ta.packed_attention_partial(q, kp, vp, k_spec, v_spec, scale=1.0)
    q, kp, vp = _case(1, 2, 1, 1, 16, 16, k_spec, v_spec)
    with pytest.raises(CacheError, match="k_positions"):
        ta.packed_attention_partial(q, kp, vp, k_spec, v_spec, scale=1.0,
                                    rope=_rope("rotate_half", 16))
    with pytest.raises(CacheError, match="rotary table"):
        ta.packed_attention_partial(q, kp, vp, k_spec, v_spec, scale=1.0,
                                    rope=_rope("rotate_half", 16, positions=8),
                                    k_positions=_positions(1, 16))
    bad = type(kp)(kp.codes, kp.scale[:, :, :, :8], kp.zero[:, :, :, :8])
    with pytest.raises(CacheError, match="scale"):
        ta.packed_attention_partial(q, bad, vp, k_spec, v_spec, scale=1.0)
    with pytest.raises(CacheError, match="broadcast"):
        ta.packed_attention_partial(q, kp, vp, k_spec, v_spec, scale=1.0,
                                    mask=torch.zeros(3, 16, device=DEVICE))
