"""vLLM's CPU kernel for first prefills (kvpolicy.vllm.prefill) against torch's SDPA,
which the paged cache uses without an engine: several sequences in one call, GQA, a
sliding window and soft-capping (no engine started)."""

from __future__ import annotations

import math

import pytest
import torch

from kvpolicy.vllm.prefill import FusedPrefill

HQ, HKV, D = 6, 2, 64


def _reference(q, k, v, lens, scale, window, softcap):
    outs, a = [], 0
    for n in lens:
        qi, ki, vi = (x[a : a + n].transpose(0, 1).float() for x in (q, k, v))
        ki, vi = ki.repeat_interleave(HQ // HKV, 0), vi.repeat_interleave(HQ // HKV, 0)
        s = qi @ ki.transpose(1, 2) * scale
        if softcap:
            s = softcap * torch.tanh(s / softcap)
        t = torch.arange(n)
        see = t[None] <= t[:, None]
        if window is not None:
            see &= t[None] > t[:, None] - window
        s = s.masked_fill(~see, -math.inf)
        outs.append((s.softmax(-1) @ vi).transpose(0, 1))
        a += n
    return torch.cat(outs)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window,softcap", [(None, None), (40, None), (None, 30.0)])
def test_fused_prefill_is_causal_attention_per_sequence(dtype, window, softcap):
    g = torch.Generator().manual_seed(0)
    lens = [70, 3, 300, 129]
    n = sum(lens)
    q, k, v = (torch.randn(n, h, D, generator=g).to(dtype) for h in (HQ, HKV, HKV))
    prefill = FusedPrefill()
    got = prefill(q, k, v, lens, scale=D ** -0.5, window=window, softcap=softcap)
    want = _reference(q, k, v, lens, D ** -0.5, window, softcap)
    assert got.shape == (n, HQ, D) and got.dtype == torch.float32
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    assert (got - want).abs().max().item() <= tol
    # a second call with other lengths reuses the scratch cache and its tables correctly
    again = prefill(q[:73], k[:73], v[:73], lens[:2], scale=D ** -0.5, window=window,
                    softcap=softcap)
    assert (again - want[:73]).abs().max().item() <= tol


def _reference_cached(q, k, v, lens, cached, scale, window, softcap):
    """Each sequence's queries are its last lens[i] rows of cached[i] + lens[i] in k/v."""
    outs, a, r = [], 0, 0
    for n, c in zip(lens, cached, strict=True):
        qi = q[a : a + n].transpose(0, 1).float()
        ki, vi = (x[r : r + c + n].transpose(0, 1).float() for x in (k, v))
        ki, vi = ki.repeat_interleave(HQ // HKV, 0), vi.repeat_interleave(HQ // HKV, 0)
        s = qi @ ki.transpose(1, 2) * scale
        if softcap:
            s = softcap * torch.tanh(s / softcap)
        qp, kp = c + torch.arange(n), torch.arange(c + n)
        see = kp[None] <= qp[:, None]
        if window is not None:
            see &= kp[None] > qp[:, None] - window
        outs.append((s.masked_fill(~see, -math.inf).softmax(-1) @ vi).transpose(0, 1))
        a, r = a + n, r + c + n
    return torch.cat(outs)


@pytest.mark.parametrize("window,softcap", [(None, None), (40, None), (None, 30.0)])
def test_fused_prefill_continues_cached_sequences(window, softcap):
    """With cached=: the chunk's queries attend over the sequence's earlier rows and their
    own, causally from their positions (a prefill chunk continuing a cached sequence)."""
    g = torch.Generator().manual_seed(1)
    lens, cached = [90, 64], [200, 0]
    rows = sum(lens) + sum(cached)
    q = torch.randn(sum(lens), HQ, D, generator=g)
    k, v = (torch.randn(rows, HKV, D, generator=g) for _ in range(2))
    got = FusedPrefill()(q, k, v, lens, scale=D ** -0.5, window=window, softcap=softcap,
                         cached=cached)
    want = _reference_cached(q, k, v, lens, cached, D ** -0.5, window, softcap)
    assert (got - want).abs().max().item() <= 1e-4
    with pytest.raises(ValueError, match="cached"):
        FusedPrefill()(q, k[:-1], v[:-1], lens, scale=D ** -0.5, window=None, softcap=None,
                       cached=cached)


@pytest.mark.parametrize("softcap", [None, 30.0])
def test_a_long_chunk_of_a_paged_layer_through_the_engine_kernel(softcap, monkeypatch):
    """PagedKV with this kernel as its prefill: a 90-token chunk continuing a cached
    sequence attends over the dequantized cache with it (runtime.paged_dense), as the
    packed attention kernel would (to bf16 rounding), soft-capped too."""
    from kvpolicy.kernels.layout import QuantSpec
    from kvpolicy.runtime import paged
    from kvpolicy.runtime.paged import PagedKV, PagedLayout, SeqBatch
    from kvpolicy.zoo.tiny import rope_spec

    lay = PagedLayout(QuantSpec(2, 12, "channel", meta_bits=8, fit="mse"),
                      QuantSpec(2, 32, "token", meta_bits=8), num_kv_heads=HKV, head_dim=D,
                      block_size=48, sinks=4, store_dtype=torch.bfloat16)
    g = torch.Generator().manual_seed(2)
    table = torch.randperm(12, generator=g)[:8].view(1, 8).int()
    kvs = [PagedKV(lay, scale=D ** -0.5, rope=rope_spec("rotate_half", D, 256),
                   softcap=softcap, value_rotation="hadamard", fused=False,
                   prefill=FusedPrefill()) for _ in range(2)]
    pages = [torch.zeros(12, lay.page_bytes, dtype=torch.uint8) for _ in range(2)]
    for n, lens in ((101, [101]), (90, [191])):
        x = [torch.randn(n, h, D, generator=g).bfloat16() for h in (HQ, HKV, HKV)]
        outs = []
        for kv, p, dense in zip(kvs, pages, (True, False), strict=True):
            monkeypatch.setattr(paged, "DENSE_FROM", 64 if dense else 10**9)
            outs.append(kv.forward(p, *x, SeqBatch([0, n], lens, table)).float())
    scale = outs[1].abs().max().item()
    assert (outs[0] - outs[1]).abs().max().item() <= 2e-2 * max(scale, 1.0)
    assert torch.equal(pages[0], pages[1])
