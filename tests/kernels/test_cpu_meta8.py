"""The C++ decode kernel with 8-bit metadata (``QuantSpec.meta_bits=8``: a uint8 scale index
into ``layout.scale_table()`` and an int8 zero point), against the reference.

Every decode test asserts that the C++ kernel itself answered (the levels tests' spy on the
torch backend's ``_cpp_attention``), and the libraries asked for are recorded (a spy on
``cpu_ext.load``), so a spec the kernel turns down cannot pass on the eager path.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import test_cpu_levels
import torch
from test_cpu_levels import Case, check_decode, decode_case

from kvpolicy.errors import CacheError
from kvpolicy.kernels import cpu_ext
from kvpolicy.kernels import reference as ref
from kvpolicy.kernels import torch_backend as tb
from kvpolicy.kernels.layout import Packed, QuantSpec
from kvpolicy.zoo.tiny import rope_spec

# The levels tests' fixture: strict builds and a count of the C++ kernel's calls.
cpp_calls = test_cpu_levels.cpp_calls
LOAD = cpu_ext.load  # before any fixture replaces it
BITS = ((2, 2), (4, 2), (3, 3), (8, 4))
STORES = {
    "bf16-none": (torch.bfloat16, lambda d: None),
    "fp16-half": (torch.float16, lambda d: rope_spec("rotate_half", d, 4096)),
}


@pytest.fixture
def loads(cpp_calls, monkeypatch) -> list[tuple[int, ...]]:
    """The configurations the torch backend asks ``cpu_ext.load`` for (built strictly)."""
    asked: list[tuple[int, ...]] = []
    real = cpu_ext.load

    def spy(*args):
        asked.append(args)
        return real(*args)

    monkeypatch.setattr(cpu_ext, "load", spy)
    return asked


def case_of(group: int, store: str) -> Case:
    dtype, rope = STORES[store]
    return Case(group, group, 9, 3, dtype, rope)


@pytest.mark.parametrize("store", STORES)
@pytest.mark.parametrize("group", (16, 32))
@pytest.mark.parametrize("kb,vb", BITS)
def test_meta8_matches_reference(cpp_calls, loads, store, group, kb, vb) -> None:
    c = case_of(group, store)
    ks = QuantSpec(kb, group, "channel", meta_bits=8)
    vs = QuantSpec(vb, group, "token", meta_bits=8)
    args, kw = decode_case(c, ks, vs, tk=6 * group + 64, tf=37, seed=kb * 10 + vb)
    assert args[1].scale.dtype == torch.uint8 and args[1].zero.dtype == torch.int8
    check_decode(cpp_calls, args, kw)
    # km8 = vm8 = 1, and the fp tokens alone decide the storage type
    assert loads[-1][-2:] == (1, 1) and loads[-1][7] == {torch.bfloat16: 1, torch.float16: 2}[
        c.dtype]


@pytest.mark.parametrize("store", STORES)
def test_two_bit_default_keys_in_groups_of_12(cpp_calls, loads, store) -> None:
    """compile_model(bits=2)'s specs: fitted keys in groups of 12 tokens (not a power of
    two), values in groups of 32 channels, both 8-bit."""
    dtype, rope = STORES[store]
    c = Case(12, 32, 9, 3, dtype, rope)
    ks = QuantSpec(2, 12, "channel", meta_bits=8, fit="mse")
    vs = QuantSpec(2, 32, "token", meta_bits=8)
    check_decode(cpp_calls, *decode_case(c, ks, vs, tk=12 * 20, tf=37, seed=12))
    assert loads[-1][-2:] == (1, 1)


@pytest.mark.parametrize("store", STORES)
@pytest.mark.parametrize("meta", ((8, 16), (16, 8)))
@pytest.mark.parametrize("kb,vb", ((2, 2), (3, 4)))
def test_mixed_metadata_widths(cpp_calls, loads, store, meta, kb, vb) -> None:
    """Keys with 8-bit metadata and values with 16-bit (in the storage type), and the
    other way round."""
    c = case_of(16, store)
    ks = QuantSpec(kb, 16, "channel", meta_bits=meta[0])
    vs = QuantSpec(vb, 16, "token", meta_bits=meta[1])
    check_decode(cpp_calls, *decode_case(c, ks, vs, tk=160, tf=21, seed=meta[0] + kb))
    assert loads[-1][-2:] == (int(meta[0] == 8), int(meta[1] == 8))


@pytest.mark.parametrize("rope", ("none", "interleaved"))
@pytest.mark.parametrize("kb,vb", BITS)
def test_packed_segment_alone_matches_reference(cpp_calls, loads, rope, kb, vb) -> None:
    """No full-precision tokens and both 8-bit: nothing is read in a storage type (fp32
    asked), the packed segment alone against ``reference.packed_attention_partial``."""
    g = torch.Generator().manual_seed(kb + vb)
    tk = 544  # two work items
    k, v = torch.randn(2, 2, 3, tk, 64, generator=g).unbind(0)
    q = torch.randn(2, 9, 1, 64, generator=g)
    ks, vs = QuantSpec(kb, 32, "channel", meta_bits=8), QuantSpec(vb, 16, "token", meta_bits=8)
    pk, pv = tb.quantize(k, ks, torch.float16), tb.quantize(v, vs, torch.float16)
    mask = torch.zeros(2, 9, 1, tk)
    mask[..., ::7] = float("-inf")
    kw = dict(scale=0.125, mask=mask, rope=None if rope == "none" else
              rope_spec("interleaved", 64, 4096), k_positions=torch.randint(0, 4096, (2, tk)))
    before = len(cpp_calls)
    out, lse = tb.packed_attention_partial(q, pk, pv, ks, vs, **kw)
    assert len(cpp_calls) == before + 1, "the C++ kernel did not serve this call"
    assert loads[-1][7] == 0 and loads[-1][-2:] == (1, 1)
    r_out, r_lse = ref.packed_attention_partial(q, pk, pv, ks, vs, **kw)
    torch.testing.assert_close(out, r_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse, r_lse, atol=1e-5, rtol=1e-5)


def test_scalar_paths(cpp_calls) -> None:
    """head_dim 20 and value groups of 4 channels (the portable value loop), fp32 tokens."""
    c = Case(8, 4, 6, 2, torch.float32, lambda d: rope_spec("rotate_half", d, 4096), d=20)
    ks = QuantSpec(2, 8, "channel", meta_bits=8)
    vs = QuantSpec(4, 4, "token", meta_bits=8)
    check_decode(cpp_calls, *decode_case(c, ks, vs, tk=96, tf=9, seed=5))


def test_threads_share_the_scale_table(cpp_calls) -> None:
    """Enough tokens for several work items on several threads."""
    c = case_of(16, "bf16-none")
    ks, vs = QuantSpec(2, 16, "channel", meta_bits=8), QuantSpec(2, 16, "token", meta_bits=8)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        check_decode(cpp_calls, *decode_case(c, ks, vs, tk=4608, tf=130, seed=8))
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("kb,vb", ((2, 2), (3, 3), (4, 8)))
def test_meta8_is_bitwise_its_fp32_metadata(cpp_calls, kb, vb) -> None:
    """The 8-bit reads compute exactly what a 16-bit-metadata library does when handed the
    same scale and zero in fp32 (``reference.meta_values``): same products, bit for bit."""
    c = case_of(16, "fp16-half")
    ks, vs = QuantSpec(kb, 16, "channel", meta_bits=8), QuantSpec(vb, 16, "token", meta_bits=8)
    (q, pk, pv, _, _, _, _), kw = decode_case(c, ks, vs, tk=192, tf=0, seed=kb * vb)
    tail = (None, None, kw["scale"], kw["mask"], None, kw["rope"], kw["k_positions"], None)
    k32 = Packed(pk.codes, *ref.meta_values(pk.scale, pk.zero, ks))
    v32 = Packed(pv.codes, *ref.meta_values(pv.scale, pv.zero, vs))
    ks16, vs16 = QuantSpec(kb, 16, "channel"), QuantSpec(vb, 16, "token")
    m8 = tb._cpp_attention(cpu_ext.build(kb, vb, 16, 16, 64, 64, 32, 0, 0, 0, 1, 1),
                           q, pk, pv, ks, vs, *tail)
    m16 = tb._cpp_attention(cpu_ext.build(kb, vb, 16, 16, 64, 64, 32, 0),
                            q, k32, v32, ks16, vs16, *tail)
    assert torch.equal(m8[0], m16[0]) and torch.equal(m8[1], m16[1])


def test_a_library_refuses_metadata_it_was_not_built_for(cpp_calls) -> None:
    """A 16-bit-metadata library handed a scale table (8-bit metadata), or an 8-bit one
    none, answers 'not mine' instead of reading indices as scales."""
    c = case_of(32, "bf16-none")
    ks, vs = QuantSpec(2, 32, "channel", meta_bits=8), QuantSpec(2, 32, "token", meta_bits=8)
    (q, pk, pv, _, _, _, _), kw = decode_case(c, ks, vs, tk=64, tf=0, seed=3)
    tail = (None, None, kw["scale"], None, None, None, None, None)
    with pytest.raises(CacheError, match="built for another spec"):
        tb._cpp_attention(cpu_ext.build(2, 2, 32, 32, 64, 64), q, pk, pv, ks, vs, *tail)
    ks16, vs16 = QuantSpec(2, 32, "channel"), QuantSpec(2, 32, "token")
    pk16 = tb.quantize(torch.randn(2, 3, 64, 64), ks16)
    pv16 = tb.quantize(torch.randn(2, 3, 64, 64), vs16)
    for km8, vm8 in ((1, 0), (0, 1), (1, 1)):
        lib = cpu_ext.build(2, 2, 32, 32, 64, 64, 0, 0, 0, 0, km8, vm8)
        with pytest.raises(CacheError, match="built for another spec"):
            tb._cpp_attention(lib, q, pk16, pv16, ks16, vs16, *tail)


def test_spec_and_stored_metadata_must_agree(cpp_calls) -> None:
    ks8, vs = QuantSpec(2, 32, "channel", meta_bits=8), QuantSpec(2, 32, "token")
    pk = tb.quantize(torch.randn(1, 3, 64, 64), QuantSpec(2, 32, "channel"))  # fp32 metadata
    pv = tb.quantize(torch.randn(1, 3, 64, 64), vs)
    with pytest.raises(CacheError, match="do not match the metadata widths"):
        tb.packed_attention_partial(torch.randn(1, 9, 1, 64), pk, pv, ks8, vs, scale=0.125)


def test_uniform_16_bit_builds_keep_their_configuration(cpp_calls, monkeypatch) -> None:
    """The configuration grew two trailing zeros: a call with the old positional arguments
    is the 16-bit-metadata library, the same file and the same cached entry."""
    old = (2, 2, 32, 32, 64, 64, 32, 1, 0, 0)
    lib = cpu_ext.build(*old)
    assert Path(lib._name) == cpu_ext._build_dir(old + (0, 0)) / "libkvpolicy_cpu.so"
    assert Path(lib._name).parent.name.endswith("-2-2-32-32-64-64-32-1-0-0-0-0")
    assert cpu_ext.build(*old, 0, 0)._name == lib._name
    monkeypatch.setattr(cpu_ext, "load", LOAD)  # the real one (the fixture swapped in build)
    assert LOAD(*old) is LOAD(*old, 0, 0) is not None
