"""kvpolicy's custom ops, tested as ops: ``torch.library.opcheck`` and their fake
implementations under ``FakeTensorMode``.

``kvpolicy::quantize`` is a function of its inputs, so every opcheck test applies.
"""

from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from kvpolicy.errors import CacheError
from kvpolicy.kernels import ops as kernel_ops
from kvpolicy.kernels import reference
from kvpolicy.kernels.layout import QuantSpec

SPECS = [
    (2, 16, "channel"), (2, 16, "token"), (1, 32, "channel"), (3, 8, "token"),
    (4, 32, "token"), (8, 16, "channel"), (16, 32, "channel"), (16, 32, "token"),
]


def _meta(t: torch.Tensor) -> tuple:
    """Shape, strides (of the dims that have more than one element: the others never
    move a pointer), dtype and device."""
    strides = tuple(s for s, n in zip(t.stride(), t.shape, strict=True) if n > 1)
    return tuple(t.shape), strides, t.dtype, t.device.type


# --------------------------------------------------------------------------- quantize


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: f"{s[0]}b-g{s[1]}-{s[2]}")
@pytest.mark.parametrize("dtype", [None, torch.float16])
def test_quantize_passes_opcheck(spec, dtype):
    x = torch.randn(2, 3, 32, 32)
    torch.library.opcheck(torch.ops.kvpolicy.quantize.default, (x, *spec, dtype, "torch"))


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: f"{s[0]}b-g{s[1]}-{s[2]}")
def test_quantize_op_is_the_backend_kernel_and_its_fake_has_its_shapes(spec):
    x = torch.randn(2, 3, 32, 32)
    q = QuantSpec(*spec)
    got = kernel_ops.quantize_packed(x, q, torch.float16, backend="torch")
    want = reference.quantize(x, q, torch.float16)
    for g, w in zip(got, want, strict=True):
        assert torch.equal(g, w)
    with FakeTensorMode() as mode:
        fake = torch.ops.kvpolicy.quantize(mode.from_tensor(x), *spec, torch.float16, "torch")
    assert [_meta(f) for f in fake] == [_meta(g) for g in got]


def test_quantize_outputs_alias_neither_input_nor_each_other_at_16_bits():
    x = torch.randn(1, 2, 8, 32)
    codes, scale, zero = torch.ops.kvpolicy.quantize(x, 16, 32, "channel", None, "torch")
    assert torch.equal(codes, x) and codes.data_ptr() != x.data_ptr()
    assert scale is not zero and scale.numel() == zero.numel() == 0


def test_quantize_fake_refuses_what_the_kernel_refuses():
    x = torch.randn(1, 2, 20, 32)  # 20 tokens: not whole groups of 16
    with pytest.raises(CacheError, match="whole token groups"):
        torch.ops.kvpolicy.quantize(x, 2, 16, "channel", None, "torch")
    with FakeTensorMode() as mode, pytest.raises(CacheError, match="whole token groups"):
        torch.ops.kvpolicy.quantize(mode.from_tensor(x), 2, 16, "channel", None, "torch")
    with pytest.raises(CacheError, match="group_size=3"):  # the spec is checked as a QuantSpec
        torch.ops.kvpolicy.quantize(x, 2, 3, "token", None, "torch")
