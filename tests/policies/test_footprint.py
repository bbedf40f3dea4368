"""Whole-cache accounting (kvpolicy/policies/footprint.py) against what a compiled cache
actually holds (``memory_report()``), global and sliding-window layers."""

from __future__ import annotations

import pytest
import torch

import kvpolicy
from kvpolicy.passes.config import sliding_windows
from kvpolicy.policies.footprint import held_tokens, whole_cache
from kvpolicy.zoo.tiny import tiny_model


def test_held_tokens_follows_the_packing_schedule():
    # 4 sinks, residual 16, chunks of 32: a chunk packs once the residual holds 48.
    h = held_tokens(51, 4, 16, 32)
    assert (h.sinks, h.packed, h.residual) == (4, 0, 47)
    h = held_tokens(52, 4, 16, 32)
    assert (h.sinks, h.packed, h.residual) == (4, 32, 16)
    assert held_tokens(3, 4, 16, 32).total == 3


def test_a_window_drops_sinks_then_whole_chunks():
    h = held_tokens(1000, 4, 16, 32, window=100)
    # The next query reaches the last 99 tokens; chunks reaching into them stay whole.
    assert h.sinks == 0 and h.residual >= 16
    assert 99 <= h.total < 99 + 32
    assert h.packed % 32 == 0


def _run(model, tokens: int):
    ids = torch.randint(3, 120, (1, tokens), generator=torch.Generator().manual_seed(0))
    cache = None
    with torch.no_grad():
        out = model(ids[:, : tokens - 40], use_cache=True)
        cache = out.past_key_values
        for i in range(tokens - 40, tokens):  # decode steps, which evict in local layers
            cache = model(ids[:, i : i + 1], past_key_values=cache, use_cache=True).past_key_values
    return cache.memory_report()


@pytest.mark.parametrize("residual_bits", [16, 8])
@pytest.mark.parametrize("arch", ["llama", "gemma3_text"])
def test_whole_cache_agrees_with_what_the_cache_holds(arch, residual_bits):
    model = tiny_model(arch, max_position_embeddings=512)
    spec = {"defaults": {"bits": 2, "residual": 32, "sinks": 4, "residual_bits": residual_bits}}
    kvpolicy.compile_model(model, policy=spec, progress=False)
    policy = kvpolicy.inspect(model)
    n_layers = len(policy.tensors) // 2
    local = sliding_windows(model, n_layers)
    windows = [local.get(i) for i in range(n_layers)]
    tokens = 300
    report = _run(model, tokens)
    held = report["bytes"] - report["position_bytes"] - report["rope_bytes"]
    fp = whole_cache(policy, tokens, windows)
    assert fp.bytes == pytest.approx(held, rel=0.02)
    assert fp.fp16_bytes == report["fp16_bytes"]
    # The residual's bytes at its width: codes, and a scale and a zero per token and head.
    d, h = policy.tensors[0].head_dim, policy.tensors[0].num_kv_heads
    per_token = 2 * d if residual_bits == 16 else d + 4
    assert sum(r["residual_bytes"] for r in report["layers"]) == sum(
        r["residual_tokens"] * 2 * h * per_token for r in report["layers"])  # K and V
    # The policy carries the windows: the whole-cache figure inspect prints uses them.
    assert policy.windows == (tuple(windows) if any(windows) else ())
    assert whole_cache(policy, tokens).bytes == fp.bytes
    if arch == "gemma3_text":  # local layers hold about a window: less compressed
        as_global = whole_cache(policy, tokens, [None] * n_layers)
        assert any(windows) and fp.compression < as_global.compression
        assert "(local layers at their window)" in str(policy)
    # The packed body alone is what avg_stored_bits prices; the whole cache costs more.
    assert fp.body_bits == pytest.approx(policy.avg_stored_bits(), rel=1e-6)
    assert fp.bits > fp.body_bits


def test_windows_must_name_every_layer():
    model = tiny_model("llama")
    policy = kvpolicy.derive_policy(model, bits=2, progress=False)
    with pytest.raises(ValueError, match="windows names 1 layers"):
        whole_cache(policy, 100, [None])


def _mostly_local():
    types = ["sliding_attention"] * 5 + ["full_attention"]
    return tiny_model("gemma3_text", num_hidden_layers=6, layer_types=types,
                      sliding_window=512, max_position_embeddings=1024)


def test_a_local_layer_keeps_its_share_of_the_window_unless_written():
    model = _mostly_local()
    pol = kvpolicy.derive_policy(model, bits=2, progress=False)
    assert pol.windows == (512,) * 5 + (None,)
    # 128 of 4,096 tokens in a global layer: 16 of a 512-token window.
    assert [pol.get(i, "key").residual for i in range(6)] == [16] * 5 + [128]
    assert pol.get(0, "value").residual == 16
    assert "residual 16, not 128: a local layer (window 512)" in pol.get(0, "key").reason
    assert "a local layer" not in pol.get(5, "key").reason
    # A written residual is the user's, in the defaults or in a rule.
    written = kvpolicy.derive_policy(
        model, policy={"defaults": {"bits": 2, "residual": 128}}, progress=False)
    assert {t.residual for t in written.tensors} == {128}
    ruled = kvpolicy.derive_policy(model, policy={"defaults": {"bits": 2}, "overrides": [
        {"layers": 5, "tensor": "*", "residual": 64}]}, progress=False)
    assert [ruled.get(i, "key").residual for i in range(6)] == [128] * 5 + [64]
