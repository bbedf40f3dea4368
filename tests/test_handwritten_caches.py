"""Hand-written modules and the three ways they keep a past.

- a transformers ``Cache`` argument (``cache.update(k, v, layer_idx)``): kvpolicy passes
  its packed cache there, and the module's own loop decodes from packed groups;
- past keys and values passed in and returned (nanoGPT variants): refused at compile time,
  naming the pattern and the way out;
- buffers written at ``input_pos`` (gpt-fast): tests/runtime/test_own_cache.py.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from transformers import DynamicCache
from transformers.cache_utils import Cache

import kvpolicy
from kvpolicy import AnalysisError
from kvpolicy.runtime.cache import KVPolicyCache
from kvpolicy.state import compiled_of
from kvpolicy.zoo.tiny import NanoGPT


class _Attention(nn.Module):
    def __init__(self, dim: int, heads: int, layer_idx: int) -> None:
        super().__init__()
        self.heads, self.layer_idx = heads, layer_idx
        self.qkv, self.out = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor, mask: torch.Tensor, cache: Cache | None = None):
        B, T, C = x.shape
        q, k, v = (t.view(B, T, self.heads, -1).transpose(1, 2)
                   for t in self.qkv(x).split(C, dim=2))
        if cache is not None:
            k, v = cache.update(k, v, self.layer_idx)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.out(y.transpose(1, 2).reshape(B, T, C))


class CacheTakingLM(nn.Module):
    """A hand-written LM whose attention takes a transformers Cache (positions learned)."""

    def __init__(self, vocab: int = 128, dim: int = 128, heads: int = 4, layers: int = 2):
        super().__init__()
        torch.manual_seed(0)
        self.emb, self.pos = nn.Embedding(vocab, dim), nn.Embedding(256, dim)
        self.attn = nn.ModuleList(_Attention(dim, heads, i) for i in range(layers))
        self.head = nn.Linear(dim, vocab)
        self.eval()

    def forward(self, idx: torch.Tensor, cache: Cache | None = None) -> torch.Tensor:
        start = cache.get_seq_length() if cache is not None else 0
        positions = torch.arange(start, start + idx.shape[1])
        mask = torch.arange(start + idx.shape[1])[None] <= positions[:, None]  # [T, past+T]
        x = self.emb(idx) + self.pos(positions)
        for a in self.attn:
            x = x + a(x, mask, cache)
        return self.head(x)


@torch.no_grad()
def _loop(model, ids: torch.Tensor, cache, prompt: int = 20) -> torch.Tensor:
    out = [model(ids[:, :prompt], cache)[:, -1]]
    for t in range(prompt, ids.shape[1] - 1):
        out.append(model(ids[:, t : t + 1], cache)[:, -1])
    return torch.stack(out, 1)


@pytest.mark.parametrize("bits", [16, 2])
def test_a_module_taking_a_cache_argument_decodes_from_the_packed_cache(bits):
    ref = CacheTakingLM()
    ids = torch.randint(0, 128, (1, 80), generator=torch.Generator().manual_seed(0))
    want = _loop(ref, ids, DynamicCache())
    policy = {"defaults": {"bits": bits, "group_size": 16, "residual": 16, "sinks": 2}}
    model = kvpolicy.compile_model(CacheTakingLM(), policy=policy, progress=False)
    cache = KVPolicyCache.for_model(model)
    got = _loop(model, ids, cache)
    assert cache.get_seq_length() == 79 and cache.layers[0].packed.n_packed >= 48
    rel = ((got - want).norm() / want.norm()).item()
    if bits == 16:
        assert rel < 1e-5
    else:
        assert 1e-3 < rel < 0.2, rel  # read from packed 2-bit groups


def test_a_module_returning_its_past_is_refused_at_compile_time_with_the_way_out():
    model = NanoGPT(keeps_past=True)
    ids = torch.randint(0, 128, (1, 12))
    with pytest.raises(AnalysisError, match=r"returns the keys it attends over.*passed in, "
                       r"concatenated and returned.*Way out: take a transformers Cache"):
        kvpolicy.compile_model(model, bits=2, progress=False)
    assert compiled_of(model) is None
    logits, past = model(ids[:, :11])
    step, _ = model(ids[:, 11:], past)
    torch.testing.assert_close(step[:, -1], model(ids)[0][:, -1], atol=1e-5, rtol=1e-5)
