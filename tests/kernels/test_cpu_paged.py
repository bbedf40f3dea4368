"""Paged reads: ``decode_attention(block_table=...)`` over a pool of pages equals the same
step over the contiguous segment those pages hold, on the C++ kernel (which reads the pages
in place) and on the reference (which gathers them first)."""

from __future__ import annotations

import pytest
import test_cpu_levels
import torch
from test_cpu_levels import Case, decode_case

from kvpolicy.errors import CacheError
from kvpolicy.kernels import reference as ref
from kvpolicy.kernels import torch_backend as tb
from kvpolicy.kernels.contract import gather_pages
from kvpolicy.kernels.layout import Packed, QuantSpec
from kvpolicy.zoo.tiny import rope_spec

# The levels tests' fixture: strict builds and a count of the C++ kernel's calls.
cpp_calls = test_cpu_levels.cpp_calls


def paged(p: Packed, spec: QuantSpec, block: int, table: torch.Tensor,
          n_pages: int) -> Packed:
    """The segment ``p`` ``[B, H, rows, ...]`` cut into pages of ``block`` tokens, page
    ``j`` of row ``b`` stored at ``table[b, j]`` of a pool of ``n_pages`` (others random)."""
    def one(x: torch.Tensor) -> torch.Tensor:
        rows = block // spec.token_group
        pool = torch.randint(-100, 100, (n_pages, *x.shape[1:2], rows, *x.shape[3:]))
        pool = pool.to(x.dtype)
        for b in range(table.shape[0]):
            for j in range(table.shape[1]):
                pool[table[b, j]] = x[b, :, j * rows : (j + 1) * rows]
        return pool
    return Packed(one(p.codes), one(p.scale), one(p.zero))


def widths(bits: int, d: int, heads: int) -> tuple[tuple[int, ...], ...]:
    row = [bits - 1, bits + 1] * (d // 4) + [bits] * (d // 2)
    return (tuple(row),) * heads


SPECS = {
    # compile_model(bits=2)'s served quantizer: fitted keys in groups of 12, 8-bit metadata
    "bits2-meta8": (Case(12, 32, 9, 3, torch.bfloat16,
                         lambda d: rope_spec("rotate_half", d, 4096)),
                    QuantSpec(2, 12, "channel", meta_bits=8, fit="mse"),
                    QuantSpec(2, 32, "token", meta_bits=8), 48),
    "fp16-meta-mqa-3-rows": (Case(16, 16, 4, 1, torch.float16,
                                  lambda d: rope_spec("interleaved", d, 4096), tq=3),
                             QuantSpec(4, 16, "channel"), QuantSpec(2, 16, "token"), 64),
    "channel-widths": (Case(16, 32, 9, 3, torch.float32, lambda d: None),
                       QuantSpec(2, 16, "channel", widths=widths(2, 64, 3)),
                       QuantSpec(3, 32, "token"), 32),
}


@pytest.mark.parametrize("name", SPECS)
def test_paged_reads_equal_the_contiguous_segment(cpp_calls, name: str) -> None:
    case, ks, vs, block = SPECS[name]
    nb = 5
    args, kw = decode_case(case, ks, vs, tk=nb * block, tf=19, seed=len(name))
    q, pk, pv, _, _, fk, fv = args
    g = torch.Generator().manual_seed(1)
    n_pages = 2 * nb + 3
    table = torch.randperm(n_pages, generator=g)[: 2 * nb].view(2, nb)
    k_pages, v_pages = paged(pk, ks, block, table, n_pages), paged(pv, vs, block, table,
                                                                   n_pages)
    for x, y in zip(gather_pages(k_pages, table), pk, strict=True):
        assert torch.equal(x, y)  # the pool holds the segment

    before = len(cpp_calls)
    out, lse = tb.decode_attention(q, k_pages, v_pages, ks, vs, fk, fv, block_table=table,
                                   **kw)
    assert len(cpp_calls) == before + 1, "the C++ kernel did not serve the paged step"
    want_out, want_lse = ref.decode_attention(*args, **kw)
    torch.testing.assert_close(out, want_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse, want_lse, atol=1e-5, rtol=1e-5)
    # the reference backend gathers the pages: the same answer as over the segment
    r_out, r_lse = ref.decode_attention(q, k_pages, v_pages, ks, vs, fk, fv,
                                        block_table=table, **kw)
    assert torch.equal(r_out, want_out) and torch.equal(r_lse, want_lse)


def test_a_block_outside_the_pages_is_refused(cpp_calls) -> None:
    case, ks, vs, block = SPECS["bits2-meta8"]
    args, kw = decode_case(case, ks, vs, tk=2 * block, tf=3, seed=0)
    q, pk, pv, _, _, fk, fv = args
    table = torch.tensor([[0, 1], [2, 3]])
    k_pages, v_pages = paged(pk, ks, block, table, 4), paged(pv, vs, block, table, 4)
    with pytest.raises(CacheError, match="outside the 4 pages"):
        tb.decode_attention(q, k_pages, v_pages, ks, vs, fk, fv,
                            block_table=torch.tensor([[0, 1], [2, 4]]), **kw)
    with pytest.raises(CacheError, match=r"block_table must be \[B=2, blocks\]"):
        tb.decode_attention(q, k_pages, v_pages, ks, vs, fk, fv,
                            block_table=table[:1], **kw)
