"""Vector-quantized values (``levels: vq``): the format's spec checks, the one encoder and
decoder (``kernels.vq_codes``), and every backend's quantize and dequantize against them."""

from __future__ import annotations

import pytest
import torch

from kvpolicy.errors import CacheError
from kvpolicy.kernels import reference, torch_backend, vq_codes
from kvpolicy.kernels.layout import VQ_ENTRIES, Codebook, QuantSpec, scale_table
from kvpolicy.kernels.ops import quantize_packed


def _book(heads: int, d: int, seed: int = 0) -> Codebook:
    return Codebook.from_tensor(torch.randn(heads, VQ_ENTRIES, d,
                                            generator=torch.Generator().manual_seed(seed)))


def _spec(bits: int = 2, group: int = 32, meta: int = 16, heads: int = 2) -> QuantSpec:
    return QuantSpec(bits, group, "token", "vq", meta, codebook=_book(heads, 8 // bits))


def test_codebook_round_trips_through_fp16_and_compares_by_content():
    c = torch.randn(2, VQ_ENTRIES, 4)
    book = Codebook.from_tensor(c)
    assert book.nbytes == 2 * VQ_ENTRIES * 4 * 2
    assert torch.equal(book.tensor(), c.half().float())
    again = Codebook.from_tensor(c.clone())
    assert again == book and hash(again) == hash(book)
    assert _spec() == _spec() and {_spec(): 1}[_spec()] == 1  # specs stay dict keys
    with pytest.raises(CacheError, match=r"\[heads, 256, dim\]"):
        Codebook.from_tensor(torch.randn(2, 16, 4))
    with pytest.raises(CacheError, match="finite"):
        Codebook.from_tensor(torch.full((1, VQ_ENTRIES, 4), 1e6))
    with pytest.raises(CacheError, match="bytes of fp16"):
        Codebook(1, 4, b"\0" * 10)


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"axis": "channel"}, "axis='token'"),
    ({"bits": 3}, "at bits"),
    ({"group_size": 6}, "not a multiple of 4"),
    ({"codebook": None}, "needs its codebook"),
    ({"codebook": "d8"}, "needs 4"),
    ({"fit": "mse", "meta_bits": 8}, "fit='minmax'"),
])
def test_a_vq_spec_that_cannot_be_served_is_refused(kwargs, match):
    args = {"bits": 2, "group_size": 32, "axis": "token", "levels": "vq", "meta_bits": 16,
            "codebook": _book(1, 4)}
    if kwargs.get("codebook") == "d8":
        kwargs = {"codebook": _book(1, 8)}
    args.update(kwargs)
    with pytest.raises(CacheError, match=match):
        QuantSpec(**args)
    with pytest.raises(CacheError, match="codebook is for levels='vq'"):
        QuantSpec(2, 32, "token", "uniform", codebook=_book(1, 4))


@pytest.mark.parametrize("bits", [1, 2])
@pytest.mark.parametrize("meta", [16, 8])
def test_encode_follows_the_format(bits, meta):
    """Each sub-vector's code is its nearest centroid after the group's unit-RMS
    normalisation; the scale is the least-squares one (8-bit: the log-nearest table entry);
    the decoder multiplies centroid and scale; every backend packs and unpacks the same."""
    d, g = 8 // bits, 32
    spec = _spec(bits, g, meta)
    x = torch.randn(2, 2, 5, 64)
    p = reference.quantize(x, spec, torch.float16)
    assert p.codes.shape == (2, 2, 5, 64 // d) and p.codes.dtype == torch.uint8
    assert p.scale.shape == (2, 2, 5, 64 // g) and p.zero.shape == (2, 2, 5, 0)
    assert p.scale.dtype == (torch.uint8 if meta == 8 else torch.float16)
    book = spec.codebook.tensor()
    groups = x.reshape(2, 2, 5, 64 // g, g)
    unit = groups / groups.square().mean(-1, keepdim=True).sqrt()
    sub = unit.reshape(2, 2, 5, 64 // d, d)
    want = torch.stack([torch.cdist(sub[:, h].reshape(-1, d), book[h]).argmin(-1)
                        .reshape(2, 5, 64 // d) for h in range(2)], 1)
    # distances computed two ways can tie differently only at exact ties (none here)
    assert torch.equal(p.codes.long(), want)
    c = torch.stack([book[h][want[:, h]] for h in range(2)], 1).reshape(2, 2, 5, 64 // g, g)
    s = ((groups * c).sum(-1) / c.square().sum(-1)).clamp(min=0)
    table = torch.tensor(scale_table())
    got_s = table[p.scale.long()] if meta == 8 else p.scale.float()
    if meta == 8:  # within half a 9% table step of the least-squares scale
        assert ((got_s / s).log2().abs() <= 1 / 16 + 1e-6).all()
    else:
        assert torch.allclose(got_s, s.half().float())
    y = reference.dequantize(p, spec)
    assert torch.equal(y, (c * got_s.unsqueeze(-1)).reshape(2, 2, 5, 64))
    for backend in (torch_backend,):
        q = backend.quantize(x, spec, torch.float16)
        assert all(torch.equal(a, b) for a, b in zip(p, q, strict=True))
        assert torch.equal(backend.dequantize(q, spec, torch.float16),
                           vq_codes.vq_decode(p, spec, torch.float16))


@pytest.mark.parametrize("meta", [16, 8])
def test_an_all_zero_group_is_coded_as_zero(meta):
    """Code 0 and scale 0: exactly zero with a 16-bit scale, within the smallest table
    scale (2**-16) times centroid 0 with an 8-bit one."""
    spec = _spec(2, 32, meta)
    x = torch.randn(1, 2, 3, 64)
    x[0, 1, 2, :32] = 0
    p = reference.quantize(x, spec, torch.float16)
    y = reference.dequantize(p, spec)
    assert (p.codes[0, 1, 2, :8] == 0).all()
    bound = 0.0 if meta == 16 else 2.0 ** -16 * spec.codebook.tensor()[1, 0].abs().max()
    assert y[0, 1, 2, :32].abs().max() <= bound
    assert y[0, 1, 2, 32:].abs().max() > 0.1


def test_clustered_values_are_coded_exactly_where_a_scalar_grid_is_not():
    """Every token one of 16 unit-RMS patterns times its own scale: a codebook of the
    patterns' 256 sub-vectors codes them to fp16 rounding; a 2-bit uniform grid of the same
    group cannot."""
    gen = torch.Generator().manual_seed(3)
    patterns = torch.randn(16, 64, generator=gen)
    patterns /= patterns.square().mean(-1, keepdim=True).sqrt()
    spec = QuantSpec(2, 64, "token", "vq", 16,
                     codebook=Codebook.from_tensor(patterns.reshape(1, VQ_ENTRIES, 4)))
    which = torch.randint(0, 16, (50,), generator=gen)
    x = (patterns[which] * (torch.rand(50, 1, generator=gen) + 0.5)).reshape(1, 1, 50, 64)
    vq_err = (reference.dequantize(reference.quantize(x, spec), spec) - x).abs().max()
    uni = QuantSpec(2, 64, "token")
    uni_err = (reference.dequantize(reference.quantize(x, uni), uni) - x).abs().max()
    assert vq_err < 1e-2 < 0.1 < uni_err


def test_packing_in_blocks_keeps_the_empty_zero_and_the_op_refuses_a_codebook():
    from kvpolicy.kernels.contract import quantize_in_blocks

    spec = _spec(2, 32, 8)
    x = torch.randn(1, 2, 10, 64)
    whole = reference.quantize(x, spec, torch.float16)
    parts = quantize_in_blocks(reference.quantize, x, spec, torch.float16, 3)
    assert all(torch.equal(a, b) for a, b in zip(whole, parts, strict=True))
    assert parts.zero.shape == (1, 2, 10, 0)
    with pytest.raises(CacheError, match="has a codebook"):
        quantize_packed(x, spec)
