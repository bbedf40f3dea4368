"""The C++ decode kernel with vector-quantized values (``QuantSpec.levels="vq"``: one byte
per sub-vector of ``8 // bits`` channels indexing the kv head's centroids, one scale per
group, no zero), against the reference.

Every decode test asserts that the C++ kernel itself answered (the levels tests' spy on the
torch backend's ``_cpp_attention``) and that the library asked for is the VQ one (a spy on
``cpu_ext.load``), so a spec the kernel turns down cannot pass on the eager path.
"""

from __future__ import annotations

import pytest
import test_cpu_levels
import test_cpu_meta8
import torch
from test_cpu_levels import Case, check_decode, decode_case
from test_cpu_paged import paged

from kvpolicy.errors import CacheError
from kvpolicy.kernels import cpu_ext
from kvpolicy.kernels import reference as ref
from kvpolicy.kernels import torch_backend as tb
from kvpolicy.kernels.layout import Codebook, Packed, QuantSpec
from kvpolicy.zoo.tiny import rope_spec

# The levels tests' fixture: strict builds and a count of the C++ kernel's calls; the 8-bit
# metadata tests' record of the configurations asked of cpu_ext.load.
cpp_calls = test_cpu_levels.cpp_calls
loads = test_cpu_meta8.loads
STORES = {
    "fp32-none": (torch.float32, lambda d: None),
    "bf16-half": (torch.bfloat16, lambda d: rope_spec("rotate_half", d, 4096)),
    "fp16-interleaved": (torch.float16, lambda d: rope_spec("interleaved", d, 4096)),
}


def book(heads: int, bits: int, seed: int) -> Codebook:
    g = torch.Generator().manual_seed(seed)
    return Codebook.from_tensor(torch.randn(heads, 256, 8 // bits, generator=g))


def vq_spec(bits: int, group: int, meta: int, heads: int = 3, seed: int = 0) -> QuantSpec:
    return QuantSpec(bits, group, "token", "vq", meta, codebook=book(heads, bits, seed))


def assert_vq_library(loads: list[tuple[int, ...]], bits: int, meta: int) -> None:
    """The last library asked for reads VQ values: no level table, d = 8 // bits."""
    cfg = loads[-1]
    assert len(cfg) == 13 and cfg[12] == 8 // bits and cfg[9] == 0 and cfg[11] == (meta == 8)


@pytest.mark.parametrize("store", STORES)
@pytest.mark.parametrize("meta", (16, 8))
@pytest.mark.parametrize("bits", (1, 2))
def test_vq_values_match_reference(cpp_calls, loads, store, meta, bits) -> None:
    """GQA (9 query heads on 3 kv heads), packed and full-precision segments, masks."""
    dtype, rope = STORES[store]
    c = Case(32, 32, 9, 3, dtype, rope)
    ks, vs = QuantSpec(2, 32, "channel", meta_bits=meta), vq_spec(bits, 32, meta, seed=bits)
    args, kw = decode_case(c, ks, vs, tk=6 * 32 + 64, tf=37, seed=bits * 10 + meta)
    pv = args[2]
    assert pv.codes.shape[-1] == 64 // (8 // bits) and pv.zero.shape[-1] == 0
    assert pv.scale.dtype == (torch.uint8 if meta == 8 else dtype)
    check_decode(cpp_calls, args, kw)
    assert_vq_library(loads, bits, meta)


@pytest.mark.parametrize("meta", (16, 8))
@pytest.mark.parametrize("bits,gv", ((1, 8), (2, 4), (2, 12)))
def test_groups_of_few_sub_vectors(cpp_calls, loads, meta, bits, gv) -> None:
    """Value groups of one sub-vector (8 channels at 1 bit, 4 at 2 bits) and of three (a
    group not a multiple of 8 channels), head_dim 48, MQA with 3 query rows."""
    c = Case(16, gv, 4, 1, torch.bfloat16, lambda d: rope_spec("rotate_half", d, 4096),
             d=48, tq=3)
    ks = QuantSpec(4, 16, "channel", meta_bits=meta)
    vs = vq_spec(bits, gv, meta, heads=1, seed=gv)
    check_decode(cpp_calls, *decode_case(c, ks, vs, tk=160, tf=9, seed=gv + meta))
    assert_vq_library(loads, bits, meta)


@pytest.mark.parametrize("meta", (16, 8))
@pytest.mark.parametrize("bits", (1, 2))
def test_packed_segment_alone_matches_reference(cpp_calls, loads, meta, bits) -> None:
    """``packed_attention_partial`` (no full-precision tokens), two work items, fp16."""
    g = torch.Generator().manual_seed(bits + meta)
    tk = 544
    k, v = torch.randn(2, 2, 3, tk, 64, generator=g).unbind(0)
    q = torch.randn(2, 9, 1, 64, generator=g)
    ks, vs = QuantSpec(2, 32, "channel", meta_bits=meta), vq_spec(bits, 16, meta)
    pk, pv = ref.quantize(k, ks, torch.float16), ref.quantize(v, vs, torch.float16)
    mask = torch.zeros(2, 9, 1, tk)
    mask[..., ::7] = float("-inf")
    kw = dict(scale=0.125, mask=mask)
    before = len(cpp_calls)
    out, lse = tb.packed_attention_partial(q, pk, pv, ks, vs, **kw)
    assert len(cpp_calls) == before + 1, "the C++ kernel did not serve this call"
    assert_vq_library(loads, bits, meta)
    r_out, r_lse = ref.packed_attention_partial(q, pk, pv, ks, vs, **kw)
    torch.testing.assert_close(out, r_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse, r_lse, atol=1e-5, rtol=1e-5)
    # the reference attends over what vq_decode gives: the values the kernel must reproduce
    want = ref.attention_partial(q, ref.dequantize(pk, ks), ref.dequantize(pv, vs),
                                 scale=0.125, mask=mask)
    torch.testing.assert_close(out, want[0], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("meta", (16, 8))
@pytest.mark.parametrize("bits", (1, 2))
def test_paged_reads_equal_the_contiguous_segment(cpp_calls, loads, meta, bits) -> None:
    """Pages read in place (their empty zeros included) against the reference."""
    case = Case(16, 32, 9, 3, torch.bfloat16, lambda d: rope_spec("rotate_half", d, 4096))
    ks, vs = QuantSpec(2, 16, "channel", meta_bits=meta), vq_spec(bits, 32, meta, seed=7)
    block, nb = 32, 5
    args, kw = decode_case(case, ks, vs, tk=nb * block, tf=19, seed=bits + meta)
    q, pk, pv, _, _, fk, fv = args
    n_pages = 2 * nb + 3
    table = torch.randperm(n_pages, generator=torch.Generator().manual_seed(1))[: 2 * nb]
    table = table.view(2, nb)
    k_pages, v_pages = paged(pk, ks, block, table, n_pages), paged(pv, vs, block, table,
                                                                   n_pages)
    assert v_pages.zero.shape == (n_pages, 3, block, 0)
    before = len(cpp_calls)
    out, lse = tb.decode_attention(q, k_pages, v_pages, ks, vs, fk, fv, block_table=table,
                                   **kw)
    assert len(cpp_calls) == before + 1, "the C++ kernel did not serve the paged step"
    assert_vq_library(loads, bits, meta)
    want_out, want_lse = ref.decode_attention(*args, **kw)
    torch.testing.assert_close(out, want_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse, want_lse, atol=1e-5, rtol=1e-5)


def test_threads_share_the_codebook(cpp_calls) -> None:
    """Enough tokens for several work items on several threads."""
    c = Case(32, 32, 9, 3, torch.bfloat16, lambda d: rope_spec("rotate_half", d, 4096))
    ks, vs = QuantSpec(2, 32, "channel", meta_bits=8), vq_spec(2, 32, 8, seed=3)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        check_decode(cpp_calls, *decode_case(c, ks, vs, tk=4608, tf=130, seed=8))
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("meta", (16, 8))
@pytest.mark.parametrize("bits", (1, 2))
def test_vq_rows_are_bitwise_the_per_element_decode(cpp_calls, meta, bits) -> None:
    """With integer centroids (0..255, exact in fp16), a VQ value row is code8 * scale for
    the 8-bit codes code8 = C[h, byte][i]: the VQ library then computes exactly what an
    8-bit uniform library does with those codes, the same scales and a zero of 0, bit for
    bit (same keys, same products, same summation order)."""
    g = torch.Generator().manual_seed(bits * meta)
    d, gv, hkv = 8 // bits, 16, 3
    cents = torch.randint(0, 256, (hkv, 256, d), generator=g).float()
    vs = QuantSpec(bits, gv, "token", "vq", meta, codebook=Codebook.from_tensor(cents))
    ks = QuantSpec(2, 32, "channel", meta_bits=meta)
    c = Case(32, gv, 9, hkv, torch.float32, lambda d: rope_spec("rotate_half", d, 4096))
    (q, pk, pv, _, _, _, _), kw = decode_case(c, ks, vs, tk=288, tf=0, seed=bits + meta)
    b, _, tk, n = pv.codes.shape
    code8 = cents[torch.arange(hkv).view(1, hkv, 1, 1), pv.codes.long()]  # [B, H, T, n, d]
    zero = torch.zeros(*pv.scale.shape, dtype=torch.int8 if meta == 8 else torch.float32)
    pv8 = Packed(code8.reshape(b, hkv, tk, n * d).to(torch.uint8), pv.scale, zero)
    vs8 = QuantSpec(8, gv, "token", meta_bits=meta)
    assert torch.equal(ref.dequantize(pv8, vs8), ref.dequantize(pv, vs))
    tail = (None, None, kw["scale"], kw["mask"], None, kw["rope"], kw["k_positions"], None)
    m8 = int(meta == 8)
    vq_lib = cpu_ext.build(2, bits, 32, gv, 64, 64, 32, 0, 0, 0, m8, m8, d)
    u8_lib = cpu_ext.build(2, 8, 32, gv, 64, 64, 32, 0, 0, 0, m8, m8)
    got = tb._cpp_attention(vq_lib, q, pk, pv, ks, vs, *tail)
    want = tb._cpp_attention(u8_lib, q, pk, pv8, ks, vs8, *tail)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_a_library_refuses_values_it_was_not_built_for(cpp_calls) -> None:
    """A library without a codebook handed one (or a VQ library none) answers 'not mine'
    instead of reading bytes as 2-bit codes, or codes as centroid indices."""
    c = Case(32, 32, 9, 3, torch.float32, lambda d: None)
    ks, vs = QuantSpec(2, 32, "channel"), vq_spec(2, 32, 16)
    (q, pk, pv, _, _, _, _), kw = decode_case(c, ks, vs, tk=64, tf=0, seed=3)
    tail = (None, None, kw["scale"], None, None, None, None, None)
    for lib in (cpu_ext.build(2, 2, 32, 32, 64, 64), cpu_ext.build(2, 2, 32, 32, 64, 64, 0, 0,
                                                                    0, 1)):
        with pytest.raises(CacheError, match="built for another spec"):
            tb._cpp_attention(lib, q, pk, pv, ks, vs, *tail)
    vs_u = QuantSpec(2, 32, "token")
    pv_u = tb.quantize(torch.randn(2, 3, 64, 64), vs_u)
    vq_lib = cpu_ext.build(2, 2, 32, 32, 64, 64, 0, 0, 0, 0, 0, 0, 4)
    with pytest.raises(CacheError, match="built for another spec"):
        tb._cpp_attention(vq_lib, q, pk, pv_u, ks, vs_u, *tail)
    assert vq_lib._name != cpu_ext.build(2, 2, 32, 32, 64, 64)._name


def test_a_codebook_for_other_heads_is_refused(cpp_calls) -> None:
    """The kernel indexes the centroids by kv head: a codebook of fewer heads than the
    cache is refused rather than read past."""
    c = Case(32, 32, 9, 3, torch.float32, lambda d: None)
    ks, vs = QuantSpec(2, 32, "channel"), vq_spec(2, 32, 16)
    (q, pk, pv, _, _, fk, fv), kw = decode_case(c, ks, vs, tk=64, tf=5, seed=4)
    other = vq_spec(2, 32, 16, heads=2)
    with pytest.raises(CacheError, match="centroids for 2 kv heads"):
        tb.decode_attention(q, pk, pv, ks, other, fk, fv, **kw)
