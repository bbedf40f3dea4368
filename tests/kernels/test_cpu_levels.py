"""The C++ decode kernel with normal (Lloyd-Max) levels, against the reference.

Every test asserts that the C++ kernel itself answered (a spy on the torch backend's
``_cpp_attention``), so a spec the kernel turns down cannot pass on the eager path.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch

from kvpolicy.errors import CacheError
from kvpolicy.kernels import cpu_ext
from kvpolicy.kernels import reference as ref
from kvpolicy.kernels import torch_backend as tb
from kvpolicy.kernels.layout import QuantSpec, RotarySpec
from kvpolicy.zoo.tiny import rope_spec

LEVELS = {"k": ("normal", "uniform"), "v": ("uniform", "normal"), "kv": ("normal", "normal")}


@pytest.fixture
def cpp_calls(monkeypatch) -> list[int]:
    """Build strictly (a compile error fails the test) and count the C++ kernel's calls."""
    if cpu_ext.compiler() is None:
        pytest.skip("no C++ compiler: the C++ path cannot be built here")
    monkeypatch.delenv("KVPOLICY_NO_CPP", raising=False)
    monkeypatch.setattr(cpu_ext, "load", cpu_ext.build)
    calls: list[int] = []
    real = tb._cpp_attention

    def spy(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(tb, "_cpp_attention", spy)
    return calls


@dataclass(frozen=True)
class Case:
    """One decode step's shapes: groups, heads, storage dtype, rotary embedding."""

    gk: int
    gv: int
    hq: int
    hkv: int
    dtype: torch.dtype
    rope: Callable[[int], RotarySpec | None]
    d: int = 64
    tq: int = 1


CASES = {
    "g32-gqa-fp32-half": Case(32, 32, 9, 3, torch.float32,
                              lambda d: rope_spec("rotate_half", d, 4096)),
    "g16x8-mqa-fp16-interleaved": Case(16, 8, 4, 1, torch.float16,
                                       lambda d: rope_spec("interleaved", d, 4096), tq=3),
}


def decode_case(
    case: Case, ks: QuantSpec, vs: QuantSpec, tk: int, tf: int, seed: int
) -> tuple[tuple, dict]:
    """Packed and full-precision segments, queries, masks and positions for one step."""
    g = torch.Generator().manual_seed(seed)
    b, d = 2, case.d
    k, v = torch.randn(2, b, case.hkv, tk + tf, d, generator=g).unbind(0)
    q = torch.randn(b, case.hq, case.tq, d, generator=g)
    pk = tb.quantize(k[:, :, :tk], ks, case.dtype)
    pv = tb.quantize(v[:, :, :tk], vs, case.dtype)
    fk, fv = k[:, :, tk:].to(case.dtype), v[:, :, tk:].to(case.dtype)
    mask = torch.zeros(b, case.hq, case.tq, tk)
    mask[..., ::5] = float("-inf")
    mask[1, 0, -1, 3] = -2.5
    fp_mask = torch.zeros(b, case.hq, case.tq, tf)
    fp_mask[0, 1, 0, :2] = float("-inf")
    mask[0, 2, 0] = float("-inf")  # one row hidden in both segments: out 0, lse -inf
    fp_mask[0, 2, 0] = float("-inf")
    pos = torch.randint(0, 4096, (b, tk + tf), generator=g)  # any positions
    kw = dict(scale=d**-0.5, mask=mask, fp_mask=fp_mask, rope=case.rope(d),
              k_positions=pos[:, :tk], fp_positions=pos[:, tk:])
    return (q, pk, pv, ks, vs, fk, fv), kw


def check_decode(cpp_calls: list[int], args: tuple, kw: dict) -> None:
    before = len(cpp_calls)
    out, lse = tb.decode_attention(*args, **kw)
    assert len(cpp_calls) == before + 1, "the C++ kernel did not serve this step"
    r_out, r_lse = ref.decode_attention(*args, **kw)
    torch.testing.assert_close(out, r_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse, r_lse, atol=1e-5, rtol=1e-5)
    assert torch.equal(out[0, 2, 0], torch.zeros_like(out[0, 2, 0]))  # the hidden row
    assert lse[0, 2, 0] == float("-inf")


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("levels", LEVELS)
@pytest.mark.parametrize("bits", (1, 2, 3, 4))
def test_normal_levels_match_reference(cpp_calls, case: str, levels: str, bits: int) -> None:
    c = CASES[case]
    kl, vl = LEVELS[levels]
    ks, vs = QuantSpec(bits, c.gk, "channel", kl), QuantSpec(bits, c.gv, "token", vl)
    check_decode(cpp_calls, *decode_case(c, ks, vs, tk=6 * c.gk + 64, tf=37, seed=bits))


@pytest.mark.parametrize("kb,vb", ((2, 4), (4, 1), (3, 8), (8, 3)))
def test_mixed_bits(cpp_calls, kb: int, vb: int) -> None:
    """Different widths for keys and values; 8 bits (no normal table) stays uniform."""
    c = CASES["g32-gqa-fp32-half"]
    ks = QuantSpec(kb, 32, "channel", "uniform" if kb == 8 else "normal")
    vs = QuantSpec(vb, 32, "token", "uniform" if vb == 8 else "normal")
    check_decode(cpp_calls, *decode_case(c, ks, vs, tk=256, tf=5, seed=kb * 10 + vb))


@pytest.mark.parametrize("bits", (2, 4))
def test_scalar_paths(cpp_calls, bits: int) -> None:
    """head_dim 20 (not a multiple of 8: the key lookup's scalar tail) and value groups of
    4 channels (the portable value loop instead of the 8-wide one), bf16 storage."""
    c = Case(8, 4, 6, 2, torch.bfloat16, lambda d: rope_spec("rotate_half", d, 4096), d=20)
    ks, vs = QuantSpec(bits, 8, "channel", "normal"), QuantSpec(bits, 4, "token", "normal")
    check_decode(cpp_calls, *decode_case(c, ks, vs, tk=96, tf=9, seed=bits))


def test_threads_share_the_tables(cpp_calls) -> None:
    """Enough tokens for several work items on several threads."""
    c = CASES["g32-gqa-fp32-half"]
    ks, vs = QuantSpec(2, 32, "channel", "normal"), QuantSpec(3, 32, "token", "normal")
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        check_decode(cpp_calls, *decode_case(c, ks, vs, tk=4608, tf=130, seed=7))
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("bits", (1, 2, 3, 4, 8))
def test_uniform_levels_still_match_reference(cpp_calls, case: str, bits: int) -> None:
    c = CASES[case]
    ks, vs = QuantSpec(bits, c.gk, "channel"), QuantSpec(bits, c.gv, "token")
    check_decode(cpp_calls, *decode_case(c, ks, vs, tk=4 * c.gk, tf=11, seed=bits))


@dataclass(frozen=True)
class IdentityTable:
    """A spec stand-in whose level table is ``0, 1, ..., 2**bits - 1`` but that claims not
    to be uniform, so that the kernel is handed the table and takes its lookup path."""

    bits: int
    group_size: int
    axis: str
    uniform: bool = False
    widths: None = None  # one width per tensor

    @property
    def table(self) -> tuple[float, ...]:
        return tuple(float(c) for c in range(1 << self.bits))


@pytest.mark.parametrize("kb,vb,gv", ((1, 1, 32), (2, 2, 32), (3, 3, 32), (4, 4, 32),
                                      (2, 4, 4)))
def test_lookup_of_the_identity_table_is_bitwise_uniform(cpp_calls, kb, vb, gv) -> None:
    """The lookup paths compute exactly what the uniform ones do when the table is the
    uniform one: same products, same rounding, bit for bit."""
    c = CASES["g32-gqa-fp32-half"]
    ks, vs = QuantSpec(kb, 32, "channel"), QuantSpec(vb, gv, "token")
    (q, pk, pv, _, _, fk, fv), kw = decode_case(c, ks, vs, tk=288, tf=0, seed=kb + vb)
    rope = kw["rope"]
    args = (q, pk, pv)
    tail = (None, None, kw["scale"], kw["mask"], None, rope, kw["k_positions"], None)
    uni_lib = cpu_ext.build(kb, vb, 32, gv, 64, 64, 32, 0)
    lut_lib = cpu_ext.build(kb, vb, 32, gv, 64, 64, 32, 0, 1, 1)
    uni = tb._cpp_attention(uni_lib, *args, ks, vs, *tail)
    lut = tb._cpp_attention(lut_lib, *args, IdentityTable(kb, 32, "channel"),
                            IdentityTable(vb, gv, "token"), *tail)
    assert torch.equal(uni[0], lut[0]) and torch.equal(uni[1], lut[1])


def test_a_library_refuses_a_table_it_was_not_built_for(cpp_calls) -> None:
    """A uniform library handed a table (or a table library none) answers 'not mine'
    instead of silently reading codes as their own values."""
    c = CASES["g32-gqa-fp32-half"]
    ks, vs = QuantSpec(2, 32, "channel"), QuantSpec(2, 32, "token", "normal")
    (q, pk, pv, _, _, _, _), kw = decode_case(c, ks, vs, tk=64, tf=0, seed=3)
    tail = (None, None, kw["scale"], None, None, None, None, None)
    for lib in (cpu_ext.build(2, 2, 32, 32, 64, 64), cpu_ext.build(2, 2, 32, 32, 64, 64, 0, 0,
                                                                    1, 1)):
        with pytest.raises(CacheError, match="built for another spec"):
            tb._cpp_attention(lib, q, pk, pv, ks, vs, *tail)
