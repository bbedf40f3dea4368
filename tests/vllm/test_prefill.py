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
