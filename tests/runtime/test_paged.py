"""The paged cache (runtime.paged) against the contiguous one (runtime.layer).

Sequences are fed in steps of several tokens (chunked prefill) and single tokens (decode),
interleaved in one batch with block tables in shuffled order, and every step's output is
compared with a ``PackedKVLayer`` per sequence fed the same tokens.
"""

from __future__ import annotations

import math

import pytest
import torch

from kvpolicy.errors import CacheError
from kvpolicy.kernels.layout import Codebook, QuantSpec, RotarySpec
from kvpolicy.kernels.reference import apply_rope
from kvpolicy.runtime.layer import PackedKVLayer
from kvpolicy.runtime.paged import PagedKV, PagedLayout, SeqBatch, sdpa_prefill

H, HQ, D = 2, 4, 16


def _rope(n: int) -> RotarySpec:
    inv = 1.0 / (10000 ** (torch.arange(0, D, 2).float() / D))
    f = torch.arange(n).float()[:, None] * inv[None]
    f = torch.cat((f, f), dim=-1)
    return RotarySpec("rotate_half", D, f.cos(), f.sin())


def _run(kspec, vspec, *, sinks, steps, block_size=32, rope=None, window=None,
         rotation="none", seed=0):
    """Feed ``steps`` (per step: tokens per sequence) to the paged cache and to one
    PackedKVLayer per sequence; return the largest output difference and the outputs'
    scale."""
    g = torch.Generator().manual_seed(seed)
    n_seq = len(steps[0])
    total = [sum(s[i] for s in steps) for i in range(n_seq)]
    layout = PagedLayout(kspec, vspec, num_kv_heads=H, head_dim=D, block_size=block_size,
                         sinks=sinks, store_dtype=torch.float32)
    nb = [math.ceil(t / block_size) for t in total]
    ids = torch.randperm(sum(nb) + 3, generator=g)[: sum(nb)]  # blocks in any order
    table = torch.zeros(n_seq, max(nb), dtype=torch.long)
    at = 0
    for i, n in enumerate(nb):
        table[i, :n] = ids[at : at + n]
        at += n
    pages = torch.zeros(sum(nb) + 3, layout.page_bytes, dtype=torch.uint8)
    paged = PagedKV(layout, scale=D ** -0.5, rope=rope, window=window,
                    value_rotation=rotation, backend="torch")
    refs = [PackedKVLayer(kspec, vspec, residual=0, sinks=sinks, rope=rope,
                          dtype=torch.float32, window=window) for _ in range(n_seq)]
    seen = [0] * n_seq
    worst = scale = 0.0
    for step in steps:
        n_tok = sum(step)
        q = torch.randn(n_tok, HQ, D, generator=g)
        k = torch.randn(n_tok, H, D, generator=g) * 2 + 1
        v = torch.randn(n_tok, H, D, generator=g)
        pos = torch.cat([torch.arange(seen[i], seen[i] + n) for i, n in enumerate(step)])
        k_in = k if rope is None else apply_rope(
            k.transpose(0, 1)[None], pos[None], rope)[0].transpose(0, 1)
        start = [0]
        for n in step:
            start.append(start[-1] + n)
        lens = [seen[i] + n for i, n in enumerate(step)]
        out = paged.forward(pages, q, k_in, v, SeqBatch(start, lens, table))
        for i, n in enumerate(step):
            if n == 0:
                continue
            sl = slice(start[i], start[i + 1])
            kk = k[sl].transpose(0, 1)[None]
            vv = v[sl].transpose(0, 1)[None]
            if rotation == "hadamard":
                from kvpolicy.kernels.rotation import rotation_matrix
                r = rotation_matrix("hadamard", D)
                vv = vv @ r
            p = torch.arange(seen[i], seen[i] + n)[None]
            mask = None
            if window is not None:  # the model's window mask over the held tokens
                kpos = torch.arange(refs[i].n_evicted, seen[i] + n)
                see = (kpos[None] <= p[0][:, None]) & (kpos[None] > p[0][:, None] - window)
                mask = see[None, None]
            want = refs[i].attend(q[sl].transpose(0, 1)[None], pending=(kk, vv, p),
                                  attn_mask=mask)
            if rotation == "hadamard":
                want = want @ r.T
            refs[i].append(kk, vv, p)
            refs[i].slide()
            got = out[sl].transpose(0, 1)[None]
            worst = max(worst, (got - want).abs().max().item())
            scale = max(scale, want.abs().max().item())
        seen = lens
    return worst, scale


KEY2 = QuantSpec(2, 8, "channel")
VAL2 = QuantSpec(2, 8, "token")
FP = QuantSpec(16, 1, "token")
VQ2 = QuantSpec(2, 8, "token", "vq", 8, codebook=Codebook.from_tensor(
    torch.randn(H, 256, 4, generator=torch.Generator().manual_seed(5))))
# Two sequences, both chunked prefill first, then decode interleaved with a third chunk.
STEPS = [[13, 5], [20, 1], [1, 1], [1, 30], [1, 1], [1, 1], [7, 1]] + [[1, 1]] * 9


@pytest.mark.parametrize("kspec,vspec", [(KEY2, VAL2), (QuantSpec(4, 16, "channel"), VAL2),
                                         (KEY2, FP), (FP, FP),
                                         (QuantSpec(2, 8, "channel", meta_bits=8, fit="mse"),
                                          QuantSpec(2, 8, "token", meta_bits=8)),
                                         (KEY2, VQ2)])
def test_paged_matches_contiguous_cache(kspec, vspec):
    worst, scale = _run(kspec, vspec, sinks=0, steps=STEPS)
    assert worst <= 1e-5 * max(scale, 1.0), f"paged vs contiguous: {worst:.3g}"


def test_paged_pre_rope_keys_round_trip():
    """Keys arrive rotated and are stored rotated back: the same as a cache handed the
    pre-RoPE keys, up to the rounding of one rotation and its inverse."""
    worst, scale = _run(KEY2, VAL2, sinks=0, steps=STEPS, rope=_rope(128))
    assert worst <= 1e-4 * max(scale, 1.0), f"pre-RoPE round trip: {worst:.3g}"


def test_paged_sliding_window_and_rotation():
    worst, scale = _run(KEY2, VAL2, sinks=0, steps=STEPS, window=24, rotation="hadamard")
    assert worst <= 1e-5 * max(scale, 1.0), f"window 24, hadamard: {worst:.3g}"


def test_paged_sinks_read_in_full_precision():
    """With sinks, the first tokens are read exactly: a query that sees only the sinks
    and itself matches exact attention, though the sinks' chunk is packed."""
    layout = PagedLayout(KEY2, VAL2, num_kv_heads=H, head_dim=D, block_size=16, sinks=3,
                         store_dtype=torch.float32)
    pages = torch.zeros(2, layout.page_bytes, dtype=torch.uint8)
    paged = PagedKV(layout, scale=D ** -0.5, window=None, backend="torch")
    g = torch.Generator().manual_seed(1)
    k, v = torch.randn(9, H, D, generator=g) * 5, torch.randn(9, H, D, generator=g)
    table = torch.tensor([[1]])
    paged.forward(pages, torch.randn(9, HQ, D, generator=g), k, v, SeqBatch([0, 9], [9], table))
    views = layout.views(pages)
    assert torch.equal(views["sink_k"][1].transpose(0, 1), k[:3])
    # the packed chunk 0 (tokens 0-7) was built with the sink rows replaced by token 3
    from kvpolicy.kernels.layout import Packed
    from kvpolicy.kernels.torch_backend import dequantize
    pk = Packed(views["k_codes"][1:2, :, :1], views["k_scale"][1:2, :, :1],
                views["k_zero"][1:2, :, :1])
    got = dequantize(pk, KEY2, torch.float32)[0].transpose(0, 1)  # [8, H, D]
    lo = k[3:8].amin(dim=0)
    hi = k[3:8].amax(dim=0)
    assert bool((got >= lo - 1e-4).all() and (got <= hi + 1e-4).all()), \
        "the sink rows widened the first chunk's groups"
    # a query at position 9 sees all 10 tokens: sinks exact, 3-7 packed, 8-9 staged
    q = torch.randn(1, HQ, D, generator=g)
    k9, v9 = torch.randn(1, H, D, generator=g), torch.randn(1, H, D, generator=g)
    out = paged.forward(pages, q, k9, v9, SeqBatch([0, 1], [10], table))
    assert out.shape == (1, HQ, D) and torch.isfinite(out).all()


def test_paged_layout_is_smaller_and_refuses_bad_blocks():
    lay = PagedLayout(QuantSpec(2, 12, "channel", meta_bits=8, fit="mse"),
                      QuantSpec(2, 32, "token", meta_bits=8), num_kv_heads=3, head_dim=64,
                      block_size=384, sinks=4, store_dtype=torch.bfloat16)
    assert lay.fp_page_bytes() / lay.page_bytes > 4.0
    with pytest.raises(CacheError, match="multiple of the policy's key group of 12"):
        PagedLayout(QuantSpec(2, 12, "channel"), VAL2, num_kv_heads=3, head_dim=64,
                    block_size=128, sinks=4, store_dtype=torch.bfloat16)


def test_an_engine_prefill_gets_every_fresh_sequence_of_a_step_in_one_call():
    """``prefill`` (an engine's fused kernel) is called once per step with every sequence
    whose cache is empty, in token order, also when a decoding sequence lies between them;
    its rows land where SDPA's would (two caches fed the same steps agree)."""
    import torch.nn.functional as F

    calls = []

    def prefill(q, k, v, lens, **kw):
        calls.append(list(lens))
        return sdpa_prefill(q, k, v, lens, **kw)

    layout = PagedLayout(KEY2, VAL2, num_kv_heads=H, head_dim=D, block_size=16, sinks=2,
                         store_dtype=torch.float32)
    pages = [torch.zeros(8, layout.page_bytes, dtype=torch.uint8) for _ in range(2)]
    caches = [PagedKV(layout, scale=D ** -0.5, backend="torch", prefill=prefill),
              PagedKV(layout, scale=D ** -0.5, backend="torch")]
    table = torch.tensor([[0, 1], [2, 3], [4, 5], [6, 7]])
    g = torch.Generator().manual_seed(3)
    # step 1: sequences 0 and 1 start; step 2: 2 starts, 0 decodes, 3 starts
    for start, lens, rows in (([0, 10, 16], [10, 6], table[:2]),
                              ([0, 7, 8, 13], [7, 11, 5], table[[2, 0, 3]])):
        n = start[-1]
        q, k, v = (torch.randn(n, h, D, generator=g) for h in (HQ, H, H))
        outs = [c.forward(p, q, k, v, SeqBatch(start, lens, rows))
                for c, p in zip(caches, pages, strict=True)]
        assert (outs[0] - outs[1]).abs().max().item() <= 1e-5
        assert torch.equal(pages[0], pages[1]), "the engine path appended differently"
        for a, b, m in zip(start[:-1], start[1:], lens, strict=True):  # fresh: own tokens
            if b - a == m:
                qi, ki, vi = (x[a:b].transpose(0, 1)[None] for x in (q, k, v))
                want = F.scaled_dot_product_attention(qi, ki, vi, is_causal=True,
                                                      scale=D ** -0.5, enable_gqa=True)
                got = outs[0][a:b].transpose(0, 1)[None]
                assert (got - want).abs().max().item() <= 1e-5, "a fresh row went astray"
    assert calls == [[10, 6], [7, 5]]


def _shared_pages(kspec, vspec, steps_x, steps_y, *, rope=None):
    """Run two caches: ``steps_x`` and ``steps_y`` are lists of steps, each a list of
    ``(sequence, n_new)``; every sequence's tokens are the same in both. Returns both caches'
    outputs per sequence and their pages. Sequence 1 starts with its first 32 tokens
    cached (sequence 0's first two blocks, as a prefix cache hands them)."""
    layout = PagedLayout(kspec, vspec, num_kv_heads=H, head_dim=D, block_size=16, sinks=2,
                         store_dtype=torch.float32)
    g = torch.Generator().manual_seed(7)
    # sequence 1's first 32 tokens are sequence 0's: it holds sequence 0's two full blocks
    toks = [[torch.randn(1, h, D, generator=g) * (2 if h == H else 1) for h in (HQ, H, H)]
            for _ in range(48)]
    mine = {0: list(range(48)), 1: list(range(32)) + list(range(40, 48))}
    table = torch.tensor([[3, 5, 6], [3, 5, 1]])
    results = []
    for steps in (steps_x, steps_y):
        pages = torch.zeros(8, layout.page_bytes, dtype=torch.uint8)
        paged = PagedKV(layout, scale=D ** -0.5, rope=rope, backend="torch")
        seen, outs = {0: 0, 1: 32}, {0: [], 1: []}
        for step in steps:
            rows = [mine[i][seen[i] + j] for i, n in step for j in range(n)]
            q, k, v = (torch.cat([toks[r][x] for r in rows]) for x in range(3))
            if rope is not None:
                pos = torch.tensor([seen[i] + j for i, n in step for j in range(n)])
                k = apply_rope(k.transpose(0, 1)[None], pos[None], rope)[0].transpose(0, 1)
            start = [0]
            for _, n in step:
                start.append(start[-1] + n)
            lens = [seen[i] + n for i, n in step]
            batch = SeqBatch(start, lens, table[[i for i, _ in step]])
            o = paged.forward(pages, q, k, v, batch)
            for (i, n), a in zip(step, start, strict=False):
                outs[i].append(o[a : a + n])
                seen[i] += n
        results.append(({i: torch.cat(o) for i, o in outs.items() if o}, pages))
    return results


@pytest.mark.parametrize("kspec,vspec", [(KEY2, VAL2), (FP, FP)])
def test_a_block_shared_in_the_step_that_fills_it_is_read_written(kspec, vspec):
    """vLLM's prefix cache hands sequence 1 the blocks sequence 0 fills in the same step;
    the step runs sequence 0 first, so sequence 1 attends as if they had been filled a step
    earlier (the same outputs and pages), for a prefill and for a decode-shaped step."""
    rope = _rope(64) if not kspec.full_precision else None
    # prefill: 0 fills blocks 3 and 5 while 1, holding them, prefills its tail
    x, y = _shared_pages(kspec, vspec, [[(0, 40), (1, 2)], [(0, 1), (1, 4)]],
                         [[(0, 40)], [(1, 2)], [(0, 1), (1, 4)]], rope=rope)
    # decode-shaped: 0's token 31 fills block 5 while 1 computes its one token after 32
    xd, yd = _shared_pages(kspec, vspec, [[(0, 31)], [(0, 1), (1, 1)], [(0, 1), (1, 1)]],
                           [[(0, 31)], [(0, 1)], [(1, 1)], [(0, 1), (1, 1)]], rope=rope)
    for (ox, px), (oy, py) in ((x, y), (xd, yd)):
        for i in ox:
            assert (ox[i] - oy[i]).abs().max().item() <= 1e-6, f"sequence {i} differs"
        assert torch.equal(px, py), "the shared step wrote other pages"


def test_steps_without_shared_blocks_run_in_one_round():
    table = torch.tensor([[0, 1], [2, 3]])
    assert SeqBatch([0, 20, 25], [20, 5], table).rounds(16) is None
    # 1 holds 0's block 0, filled in an earlier step: nothing to order
    assert SeqBatch([0, 1, 4], [21, 19], torch.tensor([[0, 1], [0, 3]])).rounds(16) is None
    rounds = SeqBatch([0, 20, 23], [20, 19], torch.tensor([[0, 1], [0, 3]])).rounds(16)
    assert [r.tolist() for r, _ in rounds] == [list(range(20)), [20, 21, 22]]
    assert rounds[1][1].seq_lens == [19] and rounds[1][1].block_table.tolist() == [[0, 3]]
