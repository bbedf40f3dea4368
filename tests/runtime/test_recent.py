"""The residual window held packed per token (``residual_bits``, runtime.recent): against
the reference quantizer, exact at 16, bytes counted, and every layer operation."""

from __future__ import annotations

import math

import pytest
import torch

from kvpolicy.errors import CacheError
from kvpolicy.kernels import reference
from kvpolicy.kernels.layout import QuantSpec
from kvpolicy.runtime.layer import PackedKVLayer
from kvpolicy.runtime.recent import Recent, recent_spec

KS, VS = QuantSpec(2, 32, "channel"), QuantSpec(2, 32, "token")
D = 64


def _kv(t: int, seed: int = 0, b: int = 2, h: int = 2) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(b, h, t, D, generator=g)
    k[..., 5] *= 8  # an outlier channel, as real keys have
    return k, torch.randn(b, h, t, D, generator=g)


def _layer(rb: int | tuple[int, int], **kw) -> PackedKVLayer:
    args = {"residual": 24, "sinks": 3, "dtype": torch.float16, **kw}
    return PackedKVLayer(KS, VS, residual_bits=rb, **args)


def _per_token(x: torch.Tensor, bits: int) -> torch.Tensor:
    """The reference quantizer's round trip of each token's channels as one group."""
    spec = QuantSpec(bits, x.shape[-1], "token")
    return reference.dequantize(reference.quantize(x, spec, torch.float16), spec,
                                torch.float16)


def _attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Plain softmax attention over every token (GQA by repeating kv heads)."""
    rep = q.shape[1] // k.shape[1]
    k, v = (x.float().repeat_interleave(rep, dim=1) for x in (k, v))
    w = torch.softmax(q.float() @ k.transpose(-1, -2) / math.sqrt(q.shape[-1]), dim=-1)
    return w @ v


def test_sixteen_bits_is_the_plain_residual_bit_for_bit():
    k, v = _kv(150)
    q = torch.randn(2, 4, 1, D)
    plain, sixteen = PackedKVLayer(KS, VS, residual=24, sinks=3, dtype=torch.float16), _layer(16)
    for layer in (plain, sixteen):
        layer.append(k[:, :, :100], v[:, :, :100])
        for i in range(100, 150):
            layer.append(k[:, :, i : i + 1], v[:, :, i : i + 1])
    assert torch.equal(plain.attend(q), sixteen.attend(q))
    for a, b in zip(plain.dequantized(), sixteen.dequantized(), strict=True):
        assert torch.equal(a, b)
    assert plain.memory_report()["bytes"] == sixteen.memory_report()["bytes"]


@pytest.mark.parametrize("bits", [8, 4])
def test_the_residual_is_the_reference_per_token_round_trip(bits):
    k, v = _kv(150)
    layer = _layer(bits)
    layer.append(k, v)
    ns, npk, nr = layer.n_sinks, layer.n_packed, layer.n_residual
    assert (ns, npk, nr) == (3, 96, 51)
    dk, dv = layer.dequantized()
    k16, v16 = k.half(), v.half()
    # Sinks stay exact; the residual is each token quantized alone at ``bits``.
    assert torch.equal(dk[:, :, :ns], k16[:, :, :ns])
    torch.testing.assert_close(dk[:, :, ns + npk :], _per_token(k16[:, :, ns + npk :], bits),
                               atol=0, rtol=0)
    torch.testing.assert_close(dv[:, :, ns + npk :], _per_token(v16[:, :, ns + npk :], bits),
                               atol=0, rtol=0)
    # The body is packed from the residual's values, as they were when its chunk left.
    body = _per_token(k16[:, :, ns : ns + npk], bits)
    torch.testing.assert_close(dk[:, :, ns : ns + npk],
                               reference.dequantize(reference.quantize(body, KS, torch.float16),
                                                    KS, torch.float16), atol=1e-3, rtol=0)
    # Attention reads exactly what dequantized() shows, sinks, body and residual alike.
    q = torch.randn(2, 4, 1, D)
    torch.testing.assert_close(layer.attend(q), _attention(q, dk, dv),
                               atol=2e-3, rtol=2e-3)
    # And the error is what the width says: 8 bits is far closer than 4.
    err = (dk[:, :, ns + npk :].float() - k[:, :, ns + npk :]).abs().max().item()
    span = (k.amax(-1) - k.amin(-1)).max().item()
    assert err <= span / (2**bits - 1) / 2 + 1e-2


@pytest.mark.parametrize("bits", [8, 4])
def test_one_token_at_a_time_stores_what_a_bulk_append_stores(bits):
    k, v = _kv(140, seed=1)
    bulk, steps = _layer(bits), _layer(bits)
    bulk.append(k, v)
    steps.append(k[:, :, :7], v[:, :, :7])
    for i in range(7, 140):
        steps.append(k[:, :, i : i + 1], v[:, :, i : i + 1])
    for a, b in zip(bulk._res_k.data, steps._res_k.data, strict=True):
        assert torch.equal(a, b)
    for a, b in zip((*bulk._pk, *bulk._pv), (*steps._pk, *steps._pv), strict=True):
        assert (a.data is None) == (b.data is None)
        if a.data is not None:
            assert torch.equal(a.view(), b.view())


@pytest.mark.parametrize("bits", [16, 8, 4])
def test_memory_report_counts_the_residual_at_its_width(bits):
    k, v = _kv(150)
    layer = _layer(bits)
    layer.append(k, v)
    r = layer.memory_report()
    b, h, nr = 2, 2, layer.n_residual
    per_token = 2 * D if bits == 16 else D * bits // 8 + 2 * 2  # codes + fp16 scale, zero
    assert r["residual_bytes"] == 2 * b * h * nr * per_token  # keys and values
    assert r["residual_bits"] == (bits, bits)
    parts = ("sink_bytes", "residual_bytes", "code_bytes", "scale_bytes", "zero_bytes",
             "position_bytes")
    assert r["bytes"] == sum(r[p] for p in parts)


def test_keys_and_values_take_their_own_width():
    k, v = _kv(60)
    layer = _layer((8, 16))
    layer.append(k, v)
    assert layer._res_k.spec == recent_spec(8, D) and layer._res_v.spec is None
    _, dv = layer.dequantized()
    assert torch.equal(dv[:, :, -layer.n_residual :], v[:, :, -layer.n_residual :].half())


def test_reorder_and_slide_keep_the_packed_residual_whole():
    k, v = _kv(120)
    layer = _layer(8, window=40)
    ref = _layer(8, window=40)
    layer.append(k, v)
    ref.append(k, v)
    layer.reorder(torch.tensor([1, 0]))
    for a, b in zip(layer.dequantized(), ref.dequantized(), strict=True):
        assert torch.equal(a, b.flip(0))
    dropped = layer.slide()
    assert dropped > 0 and layer.n_seen == 120
    # What is left is the tail of what was held, read the same way.
    for a, b in zip(layer.dequantized(), ref.dequantized(), strict=True):
        assert torch.equal(a, b.flip(0)[:, :, dropped:])


def test_a_refused_append_leaves_the_packed_residual_as_it_was():
    k, v = _kv(50)
    layer = _layer(8)
    layer.append(k, v)
    before = [t.clone() for t in layer._res_k.data]
    with pytest.raises(CacheError, match="kv_heads"):
        layer.append(torch.randn(2, 3, 1, D), torch.randn(2, 3, 1, D))
    assert all(torch.equal(a, b) for a, b in zip(before, layer._res_k.data, strict=True))
    assert layer.seq_len == 50


@pytest.mark.parametrize("bad", [2, 5, 32])
def test_an_unsupported_width_is_refused_when_the_layer_is_built(bad):
    with pytest.raises(CacheError, match="residual_bits=.*use one of"):
        _layer(bad)


def test_recent_tokens_held_two_ways_do_not_join():
    x = torch.randn(1, 1, 3, D)
    plain = Recent.of(x, None, reference.quantize)
    packed = Recent.of(x, recent_spec(8, D), reference.quantize)
    assert packed.shape == plain.shape == (1, 1, 3, D) and packed.nbytes < plain.nbytes
    with pytest.raises(CacheError, match="two ways"):
        plain.joined(packed)


def test_the_policy_offers_the_widths_the_runtime_holds():
    import typing

    from kvpolicy.policies.rules import ResidualBits
    from kvpolicy.runtime.recent import RESIDUAL_BITS

    assert typing.get_args(ResidualBits) == RESIDUAL_BITS
