"""Fit ``mse`` of 8-bit metadata (``QuantSpec.fit``): the reference's grid search.

The min-max grid is the first candidate, so no group's squared error can grow; on
Gaussian groups at 2 bits the clipped, centred grids cut it by about a third. The stored
format is unchanged, so every decoder reads it as before (the C++ kernel against the
reference, below; the Triton quantizer is checked in test_triton_meta8)."""

from __future__ import annotations

import pytest
import torch

from kvpolicy.errors import CacheError
from kvpolicy.kernels import reference as ref
from kvpolicy.kernels.layout import FIT_STEPS, QuantSpec, scale_table


def _error(x: torch.Tensor, spec: QuantSpec) -> torch.Tensor:
    """Squared error per group of ``x [1, 1, T, 16]`` along channels (axis 'token')."""
    back = ref.dequantize(ref.quantize(x, spec), spec)
    return (back - x).square().reshape(*x.shape[:3], -1, spec.group_size).sum(-1)


@pytest.mark.parametrize("bits", [1, 2, 3, 4, 8])
def test_mse_never_loses_to_minmax_and_wins_at_low_widths(bits):
    torch.manual_seed(bits)
    x = torch.randn(1, 1, 512, 16) * torch.where(torch.rand(1, 1, 512, 16) < 0.05, 6.0, 1.0)
    x += 0.5
    minmax = QuantSpec(bits, 16, "token", meta_bits=8)
    mse = QuantSpec(bits, 16, "token", meta_bits=8, fit="mse")
    e0, e1 = _error(x, minmax), _error(x, mse)
    assert (e1 <= e0).all()
    if bits <= 2:
        assert e1.sum() < 0.8 * e0.sum()
    # The search moves the scale by at most FIT_STEPS table steps, and only downwards.
    s0, s1 = ref.quantize(x, minmax).scale.long(), ref.quantize(x, mse).scale.long()
    assert ((s0 - s1) >= 0).all() and ((s0 - s1) <= FIT_STEPS).all()


def test_a_group_on_the_minmax_grid_keeps_it():
    # Codes 0..3 times a table scale: the min-max grid is exact, so no candidate is
    # strictly better and the first (min-max) stays.
    step = scale_table()[120]
    x = (torch.arange(16) % 4).float().reshape(1, 1, 1, 16) * step
    minmax = QuantSpec(2, 16, "token", meta_bits=8)
    mse = QuantSpec(2, 16, "token", meta_bits=8, fit="mse")
    for a, b in zip(ref.quantize(x, minmax), ref.quantize(x, mse), strict=True):
        assert torch.equal(a, b)
    assert int(ref.quantize(x, mse).scale) == 120


def test_mse_needs_8_bit_metadata_and_a_known_name():
    with pytest.raises(CacheError, match="fit='mse' searches the 8-bit scale table"):
        QuantSpec(2, 32, "channel", fit="mse")
    with pytest.raises(CacheError, match="fit='best' is not one of"):
        QuantSpec(2, 16, "channel", meta_bits=8, fit="best")
    QuantSpec(16, 16, "channel", fit="mse")  # full precision: nothing to fit


def test_the_cpu_kernel_reads_mse_keys_as_the_reference_does():
    from kvpolicy.runtime.layer import PackedKVLayer

    torch.manual_seed(0)
    key = QuantSpec(2, 16, "channel", meta_bits=8, fit="mse")
    value = QuantSpec(2, 16, "token", meta_bits=8)
    layer = PackedKVLayer(key, value, residual=16, sinks=2, backend="torch")
    k, v = torch.randn(1, 2, 80, 32), torch.randn(1, 2, 80, 32)
    layer.append(k, v)
    q = torch.randn(1, 4, 1, 32)
    kd, vd = layer.dequantized(torch.float32)
    want, _ = ref.attention_partial(q, kd, vd, scale=32 ** -0.5)
    got = layer.attend(q, scale=32 ** -0.5)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)
