"""Normal (Lloyd-Max) levels of the packed format: the reference and the torch backend's
quantizer (kvpolicy/kernels/layout.py, reference.encode_groups, torch_backend.quantize)."""

from __future__ import annotations

import pytest
import torch

from kvpolicy.errors import CacheError
from kvpolicy.kernels import ops
from kvpolicy.kernels import reference as ref
from kvpolicy.kernels import torch_backend as tb
from kvpolicy.kernels.layout import NORMAL_LEVELS, QuantSpec, level_table, thresholds

AXES = ("channel", "token")


def _x(seed: int = 0, shape=(2, 3, 64, 64)) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g) * 0.7 + 0.3


def test_tables_are_symmetric_increasing_and_thresholds_midpoints():
    for bits, table in NORMAL_LEVELS.items():
        assert len(table) == 1 << bits
        assert list(table) == sorted(table)
        assert all(abs(a + b) < 1e-6 for a, b in zip(table, reversed(table), strict=True))
        mids = thresholds(bits)
        assert len(mids) == len(table) - 1
        assert all(table[i] < m < table[i + 1] for i, m in enumerate(mids))
    assert level_table(2) == (0.0, 1.0, 2.0, 3.0)
    assert QuantSpec(2, 32, "token", "normal").table == NORMAL_LEVELS[2]


def test_refuses_a_width_without_a_table():
    with pytest.raises(CacheError, match="levels='normal' has tables for bits"):
        QuantSpec(8, 32, "token", "normal")
    with pytest.raises(CacheError, match="levels='lloyd' is not one of"):
        QuantSpec(2, 32, "token", "lloyd")  # type: ignore[arg-type]
    assert QuantSpec(16, 1, "token", "normal").uniform  # full precision ignores levels


@pytest.mark.parametrize("axis", AXES)
@pytest.mark.parametrize("bits", sorted(NORMAL_LEVELS))
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_encoding_follows_the_rule_and_torch_backend_is_bit_identical(axis, bits, dtype):
    x = _x(bits)
    spec = QuantSpec(bits, 32, axis, "normal")
    p = ref.quantize(x, spec, dtype)
    assert all(torch.equal(a, b) for a, b in zip(p, tb.quantize(x, spec, dtype), strict=True))
    # zero = mean and scale = population deviation of each group, in the storage dtype.
    groups = ref._grouped(x, spec).float()
    torch.testing.assert_close(p.zero, groups.mean(-1).to(dtype))
    torch.testing.assert_close(p.scale, groups.std(-1, correction=0).to(dtype))
    # Each code counts the thresholds below its normalised input.
    t = (groups - p.zero.float()[..., None]) / p.scale.float()[..., None]
    want = (t[..., None] > torch.tensor(thresholds(bits))).sum(-1)
    codes = ref.unpack_bits(p.codes if axis == "token" else p.codes.transpose(3, 4), bits)
    got = codes.reshape(want.shape) if axis == "token" else codes
    assert torch.equal(got.long(), want)
    # Dequantization reads table[code] * scale + zero, the same in both backends.
    back = ref.dequantize(p, spec)
    assert torch.equal(back, tb.dequantize(p, spec))
    table = torch.tensor(spec.table)
    manual = table[want] * p.scale.float()[..., None] + p.zero.float()[..., None]
    if axis == "channel":
        manual = manual.transpose(3, 4)
    torch.testing.assert_close(back, manual.reshape(x.shape), rtol=0, atol=1e-6)


@pytest.mark.parametrize("axis", AXES)
def test_normal_levels_beat_uniform_at_two_bits_and_lose_at_four_on_gaussian_data(axis):
    """On Gaussian groups of 32 the Lloyd-Max levels cut the 2-bit error; at 4 bits the
    uniform grid's exact extremes win."""
    x = torch.randn(1, 4, 256, 64, generator=torch.Generator().manual_seed(7))

    def err(bits: int, levels: str) -> float:
        spec = QuantSpec(bits, 32, axis, levels)  # type: ignore[arg-type]
        return float((ref.dequantize(ref.quantize(x, spec), spec) - x).norm() / x.norm())

    assert err(2, "normal") < 0.9 * err(2, "uniform")
    assert err(1, "normal") < 0.5 * err(1, "uniform")
    assert err(4, "normal") > err(4, "uniform")
    # Near the Lloyd-Max distortion of a unit Gaussian at 2 bits (MSE 0.1175, relative
    # error 0.343), a little above it since each group's mean and deviation are estimates.
    assert 0.31 < err(2, "normal") < 0.35


@pytest.mark.parametrize("axis", AXES)
def test_a_constant_group_is_exact(axis):
    x = torch.full((1, 1, 32, 32), 0.375)
    spec = QuantSpec(2, 32, axis, "normal")
    p = ref.quantize(x, spec)
    assert torch.equal(p.scale, torch.zeros_like(p.scale))
    assert torch.equal(ref.dequantize(p, spec), x)


def test_the_quantize_op_passes_the_levels():
    x = _x(3)
    spec = QuantSpec(2, 32, "token", "normal")
    got = ops.quantize_packed(x, spec, torch.float16, backend="torch")
    want = ref.quantize(x, spec, torch.float16)
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
    plain = ops.quantize_packed(x, QuantSpec(2, 32, "token"), torch.float16, backend="torch")
    assert not torch.equal(plain.zero, want.zero)
