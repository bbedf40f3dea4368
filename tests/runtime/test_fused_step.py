"""The fused C++ decode step (kernels.cpu_step, what PagedKV runs for decode steps) against
the step's torch path (``PagedKV(fused=False)``), the oracle here; the torch path is held
to the contiguous cache by test_paged.py.

Both caches get the same tokens: a ragged prefill (chunked, several sequences of other
lengths, block tables in shuffled order, int32 like vLLM's), then decode steps that cross
key groups, chunks and blocks. What must hold after every step:

- the packed bytes (codes, scales, zeros), the sinks and the live stage rows are
  bit-identical: the step un-RoPEs and stores keys with the torch path's arithmetic, and
  packing is the torch quantizer in both; with a Hadamard value rotation (a matmul whose
  summation order differs) values may differ by a rounding of the storage dtype, so there
  the bytes are compared through the outputs only;
  vector-quantized values are packed by the torch quantizer after the step (the C++
  packing covers uniform scalar codes), and read from the pages by the C++ kernel;
- the outputs agree to within 2e-6 of their scale in fp32 storage (the kernel sums the
  same terms, cut to the visible tokens, so sums group differently) and within one
  rounding of the output dtype (bf16 / fp16) otherwise.
"""

from __future__ import annotations

import math

import pytest
import torch

from kvpolicy.errors import CacheError
from kvpolicy.kernels.layout import Codebook, QuantSpec
from kvpolicy.runtime.paged import PagedKV, PagedLayout, SeqBatch
from kvpolicy.zoo.tiny import rope_spec

pytest.importorskip("kvpolicy.kernels.cpu_ext")


def _widths(bits: int, d: int, heads: int) -> tuple[tuple[int, ...], ...]:
    return (tuple([bits - 1, bits + 1] * (d // 4) + [bits] * (d // 2)),) * heads


def _vq(bits: int, group: int, heads: int, meta_bits: int) -> QuantSpec:
    g = torch.Generator().manual_seed(5)
    book = Codebook.from_tensor(torch.randn(heads, 256, 8 // bits, generator=g))
    return QuantSpec(bits, group, "token", "vq", meta_bits, codebook=book)


# name: key spec, value spec, kv heads, query heads, head dim, block, sinks, storage dtype,
# rope (style, rotary dim) or None, window, softcap, rotation
CASES = {
    "bits2-served": (QuantSpec(2, 12, "channel", meta_bits=8, fit="mse"),
                     QuantSpec(2, 32, "token", meta_bits=8), 3, 9, 64, 48, 4, torch.bfloat16,
                     ("rotate_half", 64), None, None, "none"),
    "fp32-meta16-no-rope": (QuantSpec(4, 16, "channel"), QuantSpec(3, 16, "token"), 2, 4, 32,
                            32, 0, torch.float32, None, None, None, "none"),
    "fp32-interleaved-partial": (QuantSpec(2, 8, "channel"), QuantSpec(2, 16, "token"), 2, 6,
                                 32, 32, 3, torch.float32, ("interleaved", 16), None, None,
                                 "none"),
    "mqa-normal-levels-fp16": (QuantSpec(3, 16, "channel", "normal"),
                               QuantSpec(2, 16, "token", "normal"), 1, 4, 32, 32, 2,
                               torch.float16, ("rotate_half", 32), None, None, "none"),
    "channel-widths": (QuantSpec(2, 16, "channel", widths=_widths(2, 32, 2)),
                       QuantSpec(4, 32, "token"), 2, 4, 32, 32, 4, torch.float32,
                       ("rotate_half", 32), None, None, "none"),
    "sliding-window-softcap": (QuantSpec(2, 8, "channel"), QuantSpec(2, 16, "token"), 2, 4,
                               32, 16, 2, torch.float32, ("rotate_half", 32), 21, 30.0,
                               "none"),
    "hadamard-values": (QuantSpec(2, 12, "channel", meta_bits=8, fit="mse"),
                        QuantSpec(2, 32, "token", meta_bits=8), 2, 4, 64, 48, 4,
                        torch.float32, ("rotate_half", 64), None, None, "hadamard"),
    # 3-bit codes straddle bytes; 16-bit metadata rounded to bf16 before the codes
    "bits3-bf16-meta16": (QuantSpec(3, 8, "channel"), QuantSpec(3, 16, "token"), 2, 4, 32,
                          32, 2, torch.bfloat16, ("rotate_half", 32), None, None, "none"),
    # fit "mse" on values too (per token), 4-bit values, fp16 storage
    "mse-values-fp16": (QuantSpec(2, 16, "channel", meta_bits=8, fit="mse"),
                        QuantSpec(4, 16, "token", meta_bits=8, fit="mse"), 2, 6, 32, 32, 3,
                        torch.float16, ("interleaved", 32), None, None, "none"),
    # vector-quantized values: 2 bits (sub-vectors of 4 channels) with 8-bit scales and a
    # Hadamard rotation as a budget picks them; 1 bit (8 channels), 16-bit scales, MQA
    "vq-values-bits2": (QuantSpec(2, 12, "channel", meta_bits=8, fit="mse"), _vq(2, 32, 2, 8),
                        2, 6, 64, 48, 4, torch.bfloat16, ("rotate_half", 64), None, None,
                        "hadamard"),
    "vq-values-bits1-mqa": (QuantSpec(2, 16, "channel"), _vq(1, 16, 1, 16), 1, 4, 32, 32, 2,
                            torch.float32, ("rotate_half", 32), None, None, "none"),
}


class Pair:
    """A fused and a torch-path PagedKV over pages of their own, fed the same tokens."""

    def __init__(self, name: str, n_seq: int, most: int, seed: int = 0) -> None:
        (ks, vs, hkv, hq, d, block, sinks, store, rope, window, cap, rot) = CASES[name]
        self.hkv, self.hq, self.d, self.store = hkv, hq, d, store
        self.g = torch.Generator().manual_seed(seed)
        self.layout = PagedLayout(ks, vs, num_kv_heads=hkv, head_dim=d, block_size=block,
                                  sinks=sinks, store_dtype=store)
        self.rope = None if rope is None else rope_spec(rope[0], rope[1], most + 8)
        nb = math.ceil(most / block)
        n_pages = n_seq * nb + 2
        self.table = torch.randperm(n_pages, generator=self.g)[: n_seq * nb].view(n_seq, nb)
        self.table = self.table.int()
        self.pages = [torch.zeros(n_pages, self.layout.page_bytes, dtype=torch.uint8)
                      for _ in range(2)]
        self.kv = [PagedKV(self.layout, scale=d ** -0.5, rope=self.rope, window=window,
                           softcap=cap, value_rotation=rot, backend="torch", fused=f)
                   for f in (True, False)]
        self.lens = [0] * n_seq
        self.rotated = rot != "none"

    def step(self, adds: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        n = sum(adds)
        g, dt = self.g, self.store
        q = torch.randn(n, self.hq, self.d, generator=g).to(dt)
        k = (torch.randn(n, self.hkv, self.d, generator=g) * 2 + 0.5).to(dt)
        v = torch.randn(n, self.hkv, self.d, generator=g).to(dt)
        start = [0]
        for a in adds:
            start.append(start[-1] + a)
        self.lens = [x + a for x, a in zip(self.lens, adds, strict=True)]
        batch = [SeqBatch(start, list(self.lens), self.table) for _ in range(2)]
        out = [kv.forward(p, q, k, v, b) for kv, p, b in zip(self.kv, self.pages, batch,
                                                               strict=True)]
        return out[0], out[1]

    def assert_same_cache(self) -> None:
        a, b = (self.layout.views(p) for p in self.pages)
        names = [n for n in a if not n.startswith("stage")]
        if self.rotated:
            names = [n for n in names if n.startswith("k")]
        for name in names:
            assert torch.equal(a[name], b[name]), f"{name} differs"
        c, bs = self.layout.chunk, self.layout.block_size
        for i, n in enumerate(self.lens):  # the live stage rows: the incomplete chunk
            live = n % c
            if live == 0:
                continue
            blk = int(self.table[i, (n - 1) // bs])
            for name in ("stage_k",) + (() if self.rotated else ("stage_v",)):
                assert torch.equal(a[name][blk, :, :live], b[name][blk, :, :live]), name


def _close(got: torch.Tensor, want: torch.Tensor, store: torch.dtype) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape
    tol = 2e-6 if store == torch.float32 else (8e-3 if store == torch.bfloat16 else 1e-3)
    scale = want.float().abs().max().item()
    err = (got.float() - want.float()).abs().max().item()
    assert err <= tol * max(scale, 1.0), f"outputs differ by {err:.3g} (scale {scale:.3g})"


@pytest.mark.parametrize("name", CASES)
def test_fused_step_equals_the_torch_path(name: str) -> None:
    pair = Pair(name, 3, 220)
    fused, ref = pair.step([5, 61, 100])  # a ragged prefill: no decode step yet
    assert torch.equal(fused, ref)
    for _ in range(90):  # crosses groups, chunks and a block in every sequence
        fused, ref = pair.step([1, 1, 1])
        _close(fused, ref, pair.store)
        pair.assert_same_cache()
    assert pair.kv[0].step_path == "the fused C++ step"
    assert pair.kv[1].step_path == "the torch path (fused=False)"


def test_sequences_joining_and_a_mixed_step() -> None:
    """A sequence that joins later (its prefill beside others' decode tokens, which the
    torch path serves) and ragged decode steps afterwards."""
    pair = Pair("bits2-served", 3, 300, seed=1)
    pair.step([30, 2, 0])
    for _ in range(15):
        pair.step([1, 1, 0])
    fused, ref = pair.step([1, 1, 70])  # mixed: the torch path
    assert torch.equal(fused, ref)
    for _ in range(40):
        fused, ref = pair.step([1, 1, 1])
        _close(fused, ref, pair.store)
        pair.assert_same_cache()


def test_output_written_in_place_in_the_engine_dtype() -> None:
    pair = Pair("bits2-served", 2, 200)
    pair.step([40, 13])
    q = torch.randn(2, pair.hq, pair.d, dtype=torch.bfloat16)
    k = torch.randn(2, pair.hkv, pair.d, dtype=torch.bfloat16)
    v = torch.randn(2, pair.hkv, pair.d, dtype=torch.bfloat16)
    out = torch.full((2, pair.hq, pair.d), float("nan"), dtype=torch.bfloat16)
    pair.lens = [x + 1 for x in pair.lens]
    got = pair.kv[0].forward(pair.pages[0], q, k, v, SeqBatch([0, 1, 2], pair.lens, pair.table),
                             out=out)
    assert got is out and not out.isnan().any()
    want = pair.kv[1].forward(pair.pages[1], q, k, v,
                              SeqBatch([0, 1, 2], pair.lens, pair.table))
    _close(out, want, torch.bfloat16)


def test_threads_give_the_same_step() -> None:
    """Past the token count where helper threads start (4,096 in all), the step splits work
    items over them; the result does not depend on the split."""
    pair = Pair("bits2-served", 2, 2600)
    pair.step([2500, 2300])
    before = torch.get_num_threads()
    q = torch.randn(2, pair.hq, pair.d, dtype=torch.bfloat16)
    k = torch.randn(2, pair.hkv, pair.d, dtype=torch.bfloat16)
    v = torch.randn(2, pair.hkv, pair.d, dtype=torch.bfloat16)
    lens = [x + 1 for x in pair.lens]
    outs = []
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            pages = pair.pages[0].clone()  # the same cache for both
            outs.append(pair.kv[0].forward(pages, q, k, v, SeqBatch([0, 1, 2], lens,
                                                                    pair.table)))
    finally:
        torch.set_num_threads(before)
    assert torch.equal(outs[0], outs[1])


def test_a_refused_step_leaves_the_cache_as_it_was() -> None:
    """A block id outside the pages, or a position past the rotary table: CacheError
    naming it, and no byte of the pages written."""
    pair = Pair("bits2-served", 2, 100)
    pair.step([20, 30])
    kv, pages = pair.kv[0], pair.pages[0]
    q = torch.randn(2, pair.hq, pair.d, dtype=torch.bfloat16)
    k = torch.randn(2, pair.hkv, pair.d, dtype=torch.bfloat16)
    v = torch.randn(2, pair.hkv, pair.d, dtype=torch.bfloat16)
    before = pages.clone()
    bad = pair.table.clone()
    bad[1, 0] = pages.shape[0] + 5
    with pytest.raises(CacheError, match="block outside the pages"):
        kv.forward(pages, q, k, v, SeqBatch([0, 1, 2], [21, 31], bad))
    assert torch.equal(pages, before)
    far = pair.rope.max_positions + 1
    table = torch.zeros(2, far // pair.layout.block_size + 1, dtype=torch.int32)
    with pytest.raises(CacheError, match="past the rotary table"):
        kv.forward(pages, q, k, v, SeqBatch([0, 1, 2], [21, far], table))
    assert torch.equal(pages, before)


@pytest.mark.parametrize(("name", "packs"), [("bits2-served", True), ("channel-widths", True),
                                             ("mqa-normal-levels-fp16", False)])
def test_who_packs_a_completed_chunk(name: str, packs: bool) -> None:
    """Uniform levels: the step packs the chunk it completes in the same call (the torch
    quantizer is not called); normal levels: the torch quantizer packs it after the step."""
    pair = Pair(name, 1, 80)
    pair.step([pair.layout.chunk - 1])  # the next token closes the first chunk
    kv = pair.kv[0]
    calls = []
    real = kv._pack

    def spy(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    kv._pack = spy
    fused, ref = pair.step([1])
    assert kv._step[1].packs is packs
    assert bool(calls) is not packs
    _close(fused, ref, pair.store)
    pair.assert_same_cache()


def test_prefill_chunks_pack_in_cpp_and_bad_blocks_are_refused() -> None:
    """A prefill's whole chunks are packed by the fused step's C++ packer (the torch path's
    bytes, checked above); a block outside the pages or an offset that is not a whole
    chunk is refused before any byte is written."""
    pair = Pair("bits2-served", 1, 80)
    pair.step([pair.layout.chunk * 3 + 1])
    pair.assert_same_cache()
    step = pair.kv[0].fused_step
    assert step is not None and step.packs
    pages = pair.pages[0]
    before = pages.clone()
    c, h, d = pair.layout.chunk, pair.hkv, pair.d
    k = torch.randn(1, h, c, d).to(pair.store)
    for blk, off, why in ((pages.shape[0], 0, "block outside the pages"),
                          (0, 1, "not a whole chunk")):
        with pytest.raises(CacheError, match=why):
            step.pack_chunks(k, k, torch.tensor([blk]), torch.tensor([off]))
        assert torch.equal(pages, before)
