"""A hand-written module that keeps its own KV cache (gpt-fast: preallocated buffers
written at ``input_pos``) is compiled so that its own decode loop reads and writes the
packed cache: exact at 16 bits, quantized for real at 2 and 4 bits, restarted at
position 0, and the module's buffers are no longer written."""

from __future__ import annotations

import pytest
import torch

import kvpolicy
from kvpolicy import KVPolicyError
from kvpolicy.state import compiled_of
from kvpolicy.zoo.tiny import GptFast

POSITIONS = {"probe_kwargs": lambda ids: {"input_pos": torch.arange(ids.shape[1])}}


def _gpt_fast() -> GptFast:
    model = GptFast()
    model.setup_caches(max_batch=4, max_seq=128)  # the probes run 2 and 3 rows
    return model


def _own_loop(model, ids: torch.Tensor, prompt: int) -> torch.Tensor:
    """gpt-fast's own decode loop: a prefill at positions 0..P-1, then one token a call;
    the logits of every step after the prefill."""
    out = [model(ids[:, :prompt], torch.arange(prompt))[:, -1]]
    for t in range(prompt, ids.shape[1] - 1):
        out.append(model(ids[:, t : t + 1], torch.tensor([t]))[:, -1])
    return torch.stack(out, 1)


def _compiled(bits: int) -> GptFast:
    policy = {"defaults": {"bits": bits, "group_size": 16, "residual": 16, "sinks": 2}}
    return kvpolicy.compile_model(_gpt_fast(), policy=policy, progress=False, **POSITIONS)


@torch.no_grad()
def test_own_decode_loop_is_exact_at_16_bits_and_restarts_at_position_zero():
    ref, model = _gpt_fast(), _compiled(16)
    ids = torch.randint(0, 128, (1, 70), generator=torch.Generator().manual_seed(0))
    want = _own_loop(ref, ids, 20)
    torch.testing.assert_close(_own_loop(model, ids, 20), want, atol=1e-5, rtol=1e-5)
    cache = compiled_of(model).own_cache
    assert cache.get_seq_length() == 69 and cache.layers[0].packed.n_packed > 0
    # A second sequence from position 0 starts the packed cache again.
    other = torch.randint(0, 128, (1, 40), generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(_own_loop(model, other, 10), _own_loop(ref, other, 10),
                               atol=1e-5, rtol=1e-5)
    assert cache.get_seq_length() == 39
    # The rewritten blocks no longer write the module's buffers.
    k_cache = model.layers[0].attention.kv_cache.k_cache
    before = k_cache.clone()
    model(other[:, :5], torch.arange(5))
    assert torch.equal(k_cache, before)


@torch.no_grad()
@pytest.mark.parametrize("bits, low, high", [(4, 1e-4, 0.03), (2, 1e-3, 0.15)])
def test_own_decode_loop_reads_packed_groups(bits, low, high):
    ref, model = _gpt_fast(), _compiled(bits)
    ids = torch.randint(0, 128, (1, 80), generator=torch.Generator().manual_seed(0))
    want, got = _own_loop(ref, ids, 20), _own_loop(model, ids, 20)
    assert compiled_of(model).own_cache.layers[0].packed.n_packed >= 48
    rel = ((got - want).norm() / want.norm()).item()
    assert low < rel < high, rel  # quantized for real, and close (measured 0.005 / 0.023)


@torch.no_grad()
def test_writing_into_the_middle_of_a_sequence_is_refused():
    model = _compiled(16)
    ids = torch.randint(0, 128, (1, 20), generator=torch.Generator().manual_seed(0))
    model(ids[:, :10], torch.arange(10))
    with pytest.raises(KVPolicyError, match="writes its keys at position 5.*next position is 10"):
        model(ids[:, 10:11], torch.tensor([5]))
