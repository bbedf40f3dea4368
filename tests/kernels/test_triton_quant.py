"""The Triton quantize-and-pack kernel against the reference: bit-identical codes.

Runs compiled on a GPU, in the interpreter elsewhere (see conftest.py); shapes are tiny
because the interpreter costs a few ms per program instance.
"""

from __future__ import annotations

import pytest
import torch

from kvpolicy.errors import CacheError
from kvpolicy.kernels import reference as ref
from kvpolicy.kernels import triton_quant as tq
from kvpolicy.kernels.layout import QuantSpec

pytestmark = pytest.mark.triton

DEVICE = "cpu" if tq._INTERPRET else "cuda"


def _data(shape, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g) * 2.0
    x[..., 3] += 9.0  # an outlier channel, as keys have
    return x.to(DEVICE, dtype)


def _assert_same(got, want):
    for name, a, b in zip(("codes", "scale", "zero"), got, want, strict=True):
        assert a.shape == b.shape, f"{name}: shape {tuple(a.shape)} != {tuple(b.shape)}"
        assert a.dtype == b.dtype, f"{name}: dtype {a.dtype} != {b.dtype}"
        diff = (a.cpu() != b.cpu()).sum().item()
        assert diff == 0, f"{name}: {diff} of {a.numel()} entries differ from the reference"


@pytest.mark.parametrize("bits", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("axis", ["channel", "token"])
@pytest.mark.parametrize(
    "x_dtype, cache_dtype",
    [(torch.float32, None), (torch.float32, torch.float16), (torch.bfloat16, None)],
)
def test_codes_bit_identical(bits, axis, x_dtype, cache_dtype):
    # channel: 2 token groups of 16 (T=32), D=24 (not a power of two);
    # token: T=5 tokens (odd), D=32 in groups of 16.
    spec = QuantSpec(bits=bits, group_size=16, axis=axis)
    shape = (1, 2, 32, 24) if axis == "channel" else (1, 2, 5, 32)
    x = _data(shape, x_dtype, seed=bits)
    _assert_same(tq.quantize(x, spec, cache_dtype), ref.quantize(x, spec, cache_dtype))


@pytest.mark.parametrize("axis", ["channel", "token"])
def test_small_groups_and_strided_input(axis):
    # G=8 with 3 bits: one 3-byte chunk per group; a non-contiguous input (a transposed
    # [B, T, H, D] buffer, as models produce) must give the same codes.
    spec = QuantSpec(bits=3, group_size=8, axis=axis)
    x = _data((2, 24, 3, 16), torch.float32, seed=7).transpose(1, 2)
    _assert_same(tq.quantize(x, spec), ref.quantize(x, spec))


def test_constant_groups_and_ties():
    # Constant groups have scale 0 -> codes 0. Values on exact half steps must round
    # half to even, as torch.round does: (0, 1.5, 3) with 2 bits has scale 1 and
    # code 1.5 -> 2; (0, 0.5, 3) -> 0.5 -> 0.
    spec = QuantSpec(bits=2, group_size=4, axis="token")
    x = torch.tensor([[[[1.0, 1.0, 1.0, 1.0], [0.0, 1.5, 3.0, 0.5], [0.0, 2.5, 3.0, 0.5]]]])
    x = x.to(DEVICE)
    got, want = tq.quantize(x, spec), ref.quantize(x, spec)
    _assert_same(got, want)
    codes = ref.unpack_bits(got.codes.cpu(), 2)
    assert codes[0, 0, 0].tolist() == [0, 0, 0, 0], "a constant group must give codes 0"
    assert codes[0, 0, 1].tolist() == [0, 2, 3, 0], "1.5 must round to 2 and 0.5 to 0"
    assert codes[0, 0, 2].tolist() == [0, 2, 3, 0], "2.5 must round to 2 (ties to even)"


def test_full_precision_and_errors():
    x = _data((1, 1, 8, 16), torch.float32, seed=1)
    p = tq.quantize(x, QuantSpec(bits=16, group_size=8, axis="channel"), torch.float16)
    assert p.codes.dtype == torch.float16 and p.scale.numel() == 0
    with pytest.raises(CacheError, match="multiple of group_size"):
        tq.quantize(x[:, :, :5], QuantSpec(bits=2, group_size=8, axis="channel"))
    with pytest.raises(CacheError, match="divides"):
        tq.quantize(x, QuantSpec(bits=2, group_size=12, axis="token"))
