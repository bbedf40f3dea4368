"""A long prefill chunk over a paged cache (runtime.paged_dense: the sequence's cache
dequantized once, then SDPA) against the packed attention kernel it replaces, the oracle
here: the same pages, the same tokens, outputs within the storage dtype's rounding."""

from __future__ import annotations

import pytest
import torch

from kvpolicy.kernels.layout import Codebook, QuantSpec
from kvpolicy.runtime import paged
from kvpolicy.runtime.paged import PagedKV, PagedLayout, SeqBatch
from kvpolicy.zoo.tiny import rope_spec

# key spec, value spec, kv heads, query heads, head dim, block, sinks, storage, rope style,
# window, value rotation
CASES = {
    "bits2-served": (QuantSpec(2, 12, "channel", meta_bits=8, fit="mse"),
                     QuantSpec(2, 32, "token", meta_bits=8), 3, 9, 64, 48, 4, torch.float32,
                     "rotate_half", None, "hadamard"),
    "window-interleaved-gqa": (QuantSpec(3, 8, "channel"), QuantSpec(4, 16, "token"), 2, 4,
                               32, 32, 3, torch.float32, "interleaved", 50, "none"),
    "bf16-no-sinks": (QuantSpec(2, 16, "channel"), QuantSpec(2, 16, "token", "normal"), 1, 4,
                      32, 32, 0, torch.bfloat16, "rotate_half", None, "none"),
    "vq-values": (QuantSpec(2, 12, "channel", meta_bits=8, fit="mse"),
                  QuantSpec(2, 32, "token", "vq", 8, codebook=Codebook.from_tensor(
                      torch.randn(3, 256, 4, generator=torch.Generator().manual_seed(5)))),
                  3, 9, 64, 48, 4, torch.float32, "rotate_half", None, "hadamard"),
    "16-bit": (QuantSpec(16, 1, "token"), QuantSpec(16, 1, "token"), 2, 4, 32, 32, 0,
               torch.float32, None, None, "none"),
}


@pytest.mark.parametrize("name", CASES)
@pytest.mark.parametrize("first", [7, 100])  # a cache of the stage (and sinks) only; blocks
def test_long_chunk_matches_the_packed_kernel(name: str, first: int,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    ks, vs, hkv, hq, d, block, sinks, store, style, window, rot = CASES[name]
    lay = PagedLayout(ks, vs, num_kv_heads=hkv, head_dim=d, block_size=block, sinks=sinks,
                      store_dtype=store)
    g = torch.Generator().manual_seed(0)
    lens = (first, 90)  # then a chunk of 90 query tokens, and a sequence of 3 beside it
    table = torch.randperm(24, generator=g)[:16].view(2, 8).int()
    rope = None if style is None else rope_spec(style, d, 256)
    kvs = [PagedKV(lay, scale=d ** -0.5, rope=rope, window=window, value_rotation=rot,
                   backend="torch", fused=False) for _ in range(2)]
    pages = [torch.zeros(24, lay.page_bytes, dtype=torch.uint8) for _ in range(2)]

    def qkv(n: int) -> tuple[torch.Tensor, ...]:
        return (torch.randn(n, hq, d, generator=g).to(store),
                (torch.randn(n, hkv, d, generator=g) * 2 + 0.5).to(store),
                torch.randn(n, hkv, d, generator=g).to(store))

    x = qkv(first + 5)
    b0 = SeqBatch([0, first, first + 5], [first, 5], table)
    for kv, p in zip(kvs, pages, strict=True):
        kv.forward(p, *x, b0)
    x = qkv(lens[1] + 3)
    b1 = SeqBatch([0, lens[1], lens[1] + 3], [first + lens[1], 8], table)
    calls = []
    real = paged.attend_chunk
    monkeypatch.setattr(paged, "attend_chunk", lambda *a, **k: calls.append(1) or real(*a, **k))
    got = kvs[0].forward(pages[0], *x, b1)
    assert calls == [1]  # the 90-token chunk, not the 3-token one
    monkeypatch.setattr(paged, "DENSE_FROM", 10**9)  # the packed kernel for every chunk
    want = kvs[1].forward(pages[1], *x, b1)
    assert len(calls) == 1
    tol = 2e-5 if store == torch.float32 else 2e-2
    scale = want.float().abs().max().item()
    err = (got.float() - want.float()).abs().max().item()
    assert err <= tol * max(scale, 1.0), f"outputs differ by {err:.3g} (scale {scale:.3g})"
    # appended the same way: the pages after the step are equal
    assert torch.equal(pages[0], pages[1])
