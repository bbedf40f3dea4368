"""Sliding-window layers evict what has left the window: whole packed chunks, sinks and
residual tokens are freed, held tokens stay bounded, and the output does not change."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import DynamicCache

import kvpolicy
from kvpolicy.errors import CacheError
from kvpolicy.kernels.layout import QuantSpec
from kvpolicy.runtime.checks import align_window_mask
from kvpolicy.runtime.growing import Growing
from kvpolicy.runtime.layer import PackedKVLayer
from kvpolicy.state import compiled_of
from kvpolicy.zoo.tiny import rope_spec, tiny_model

K2, V2 = QuantSpec(2, 32, "channel"), QuantSpec(2, 32, "token")
ROPE = rope_spec("rotate_half", 64, 4096)


def _window_mask(n_queries: int, first_key: int, n_keys: int, end: int, window: int):
    """bool ``[1, 1, n_queries, n_keys]``: query at ``end - n_queries + i`` sees key
    ``first_key + j`` when ``q - window < key <= q`` (transformers' sliding mask)."""
    q = torch.arange(end - n_queries, end)[:, None]
    k = torch.arange(first_key, first_key + n_keys)[None]
    return ((k <= q) & (k > q - window))[None, None]


def _kv(t: int, seed: int, b: int = 1, h: int = 2, d: int = 64):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(b, h, t, d, generator=g), torch.randn(b, h, t, d, generator=g))


# --------------------------------------------------------------------------- one layer


@pytest.mark.parametrize("window", [40, 100])  # below and above residual + chunk
def test_slide_bounds_held_tokens_and_keeps_their_positions(window):
    layer = PackedKVLayer(K2, V2, residual=48, sinks=4, rope=ROPE, window=window)
    for step in range(300):
        k, v = _kv(1, step)
        layer.append(k, v)
        layer.slide()
        assert layer.seq_len <= max(window - 1 + layer.chunk, layer.residual + layer.chunk)
    assert layer.n_seen == 300 and layer.n_evicted == 300 - layer.seq_len
    assert layer.n_sinks == 0  # the first tokens left the window; later ones never refill
    held = layer.positions()[0]
    assert torch.equal(held, torch.arange(layer.n_evicted, 300))
    # The window still reaches every held token's chunk: nothing the next query sees went.
    assert layer.n_evicted <= 300 - window + 1
    report = layer.memory_report()
    assert report["evicted_tokens"] == layer.n_evicted and report["window"] == window
    # Freed storage: the growing buffers stay near the live size, not the 300 tokens seen.
    assert report["allocated_bytes"] < 2 * report["bytes"]


@pytest.mark.parametrize("pre_rope", [False, True])
def test_attention_after_eviction_equals_a_full_cache_under_the_window_mask(pre_rope):
    """Evicted tokens are exactly those the window mask hides: a layer that evicts and one
    that keeps everything give the same attention at every step, at 2 bits."""
    window = 90
    kw = dict(residual=32, sinks=4, rope=ROPE if pre_rope else None)
    evicting = PackedKVLayer(K2, V2, window=window, **kw)
    full = PackedKVLayer(K2, V2, **kw)
    k, v = _kv(200, 0)
    for layer in (evicting, full):
        layer.append(k, v)
    evicting.slide()
    assert evicting.n_evicted > 0 and evicting.n_packed > 0
    g = torch.Generator().manual_seed(1)
    for step in range(70):
        k, v = _kv(1, 100 + step)
        q = torch.randn(1, 4, 1, 64, generator=g)
        outs = []
        for layer in (evicting, full):
            layer.append(k, v)
            n = layer.n_seen
            mask = _window_mask(1, n - layer.seq_len, layer.seq_len, n, window)
            outs.append(layer.attend(q, attn_mask=mask))
            layer.slide()
        torch.testing.assert_close(outs[0], outs[1], atol=2e-6, rtol=1e-5)
    assert evicting.seq_len < full.seq_len - 100


def test_multi_token_query_after_eviction_sees_its_pending_tokens():
    window = 60
    evicting = PackedKVLayer(K2, V2, residual=32, sinks=0, window=window)
    full = PackedKVLayer(K2, V2, residual=32, sinks=0)
    k, v = _kv(150, 0)
    for layer in (evicting, full):
        layer.append(k, v)
    evicting.slide()
    nk, nv = _kv(20, 1)
    q = torch.randn(1, 4, 20, 64, generator=torch.Generator().manual_seed(2))
    outs = []
    for layer in (evicting, full):
        n = layer.n_seen + 20
        mask = _window_mask(20, n - layer.seq_len - 20, layer.seq_len + 20, n, window)
        outs.append(layer.attend(q, attn_mask=mask, pending=(nk, nv, None)))
    torch.testing.assert_close(outs[0], outs[1], atol=2e-6, rtol=1e-5)


def test_slide_without_window_keeps_everything_and_a_bad_window_is_refused():
    layer = PackedKVLayer(K2, V2, residual=32, sinks=4)
    layer.append(*_kv(300, 0))
    assert layer.slide() == 0 and layer.seq_len == 300
    for bad in (0, -3, 2.5, True):
        with pytest.raises(CacheError, match="window"):
            PackedKVLayer(K2, V2, residual=32, sinks=4, window=bad)


def test_failed_append_after_eviction_leaves_the_layer_as_it_was():
    layer = PackedKVLayer(K2, V2, residual=32, sinks=4, window=64)
    layer.append(*_kv(200, 0))
    layer.slide()
    before = (layer.seq_len, layer.n_evicted, layer.dequantized())
    k, v = _kv(1, 1)
    k[0, 0, 0, 0] = float("nan")
    with pytest.raises(CacheError, match="NaN"):
        layer.append(k, v)
    assert (layer.seq_len, layer.n_evicted) == before[:2]
    for a, b in zip(layer.dequantized(), before[2], strict=True):
        assert torch.equal(a, b)


def test_growing_buffer_frees_a_dropped_front_when_it_moves():
    buf = Growing(1)
    for i in range(2000):
        buf = buf.appended(torch.full((2, 1), float(i)))
        if buf.n > 50:
            buf = buf.dropped(buf.n - 50)
    assert buf.n == 50
    assert torch.equal(buf.view()[0], torch.arange(1950, 2000, dtype=torch.float32))
    assert buf.allocated_bytes <= 2 * 2 * 64 * 4  # bounded by the live size, not 2,000


def test_window_mask_is_aligned_on_its_last_columns():
    m = torch.tensor([True, False, True, True])[None, None, None]
    assert torch.equal(align_window_mask(m, 2), m[..., 2:])
    padded = align_window_mask(m, 6)
    assert padded.shape[-1] == 6 and not padded[..., :2].any()
    assert torch.equal(padded[..., 2:], m)
    f = torch.zeros(1, 1, 1, 3)
    assert torch.isneginf(align_window_mask(f, 5)[..., :2]).all()
    assert align_window_mask(None, 5) is None


# --------------------------------------------------------------------------- models


def _ids(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(3, 128, (1, n), generator=torch.Generator().manual_seed(seed))


WINDOW_MODELS = {
    # window below the residual (Gemma3's local layers: every layer of a 2-layer model)
    "gemma3_text": ("gemma3_text", dict(sliding_window=24)),
    # window above residual + group (Mistral: every layer)
    "mistral": ("mistral", dict(sliding_window=170)),
    # one full layer, one window layer (Qwen2's max_window_layers)
    "qwen2": ("qwen2", dict(use_sliding_window=True, sliding_window=40, max_window_layers=1)),
    # windows shorter than the default probes (7 and 11 tokens): traced from shorter ones
    "gemma3_text-window6": ("gemma3_text", dict(sliding_window=6)),
    "mistral-window9": ("mistral", dict(sliding_window=9)),
}


@pytest.mark.parametrize("name", list(WINDOW_MODELS))
def test_greedy_output_is_identical_at_16_bits_and_window_layers_stay_bounded(name):
    arch, config = WINDOW_MODELS[name]
    model = tiny_model(arch, max_position_embeddings=1024, **config)
    window = config["sliding_window"]
    compiled = kvpolicy.compile_model(copy.deepcopy(model), bits=16, progress=False)
    ids = _ids(120)
    gen = dict(max_new_tokens=140, min_new_tokens=140, do_sample=False)
    want = model.generate(ids, **gen)
    out = compiled.generate(ids, **gen, return_dict_in_generate=True)
    assert torch.equal(out.sequences, want)
    windows = compiled_of(compiled).windows
    for layer in out.past_key_values.layers:
        packed = layer.packed
        assert layer.is_sliding == (layer.layer_idx in windows)
        if layer.is_sliding:
            assert packed.window == window and packed.n_evicted > 0
            assert packed.seq_len <= max(window - 1 + packed.chunk, packed.residual + packed.chunk)
        else:
            assert packed.n_evicted == 0 and packed.seq_len == 259


def test_packed_chunks_evicted_at_2_bits_change_nothing():
    """Eviction drops only tokens the mask hides: with and without it, a 2-bit model
    gives the same greedy tokens and logits, and a second sliding layer whose policy packs
    differently from the first (the one transformers sizes the mask from) is aligned."""
    model = tiny_model("gemma3_text", max_position_embeddings=1024, sliding_window=100)
    policy = {"defaults": {"bits": 2, "group_size": 32, "residual": 48, "sinks": 4},
              "overrides": [{"layers": 1, "tensor": "*", "residual": 16, "group_size": 16}]}
    compiled = kvpolicy.compile_model(model, policy=policy, progress=False)
    ids = _ids(200)
    gen = dict(max_new_tokens=80, min_new_tokens=80, do_sample=False,
               return_dict_in_generate=True, output_logits=True)
    evicting = compiled.generate(ids, **gen)
    layers = evicting.past_key_values.layers
    assert all(la.packed.n_evicted > 0 and la.packed.n_packed > 0 for la in layers)
    assert layers[0].packed.n_evicted != layers[1].packed.n_evicted
    compiled_of(compiled).windows = {}
    keeping = compiled.generate(ids, **gen)
    assert keeping.past_key_values.layers[0].packed.n_evicted == 0
    assert torch.equal(evicting.sequences, keeping.sequences)
    torch.testing.assert_close(torch.stack(evicting.logits), torch.stack(keeping.logits),
                               atol=1e-5, rtol=1e-4)


def test_a_window_too_small_to_trace_is_refused_and_the_model_left_usable():
    model = tiny_model("mistral", sliding_window=3)
    ids = _ids(12)
    want = model(ids).logits
    with pytest.raises(kvpolicy.AnalysisError, match="sliding window of 3 tokens is too small"):
        kvpolicy.compile_model(model, bits=2, progress=False)
    assert compiled_of(model) is None
    torch.testing.assert_close(model(ids).logits, want)


def test_multi_turn_after_eviction_matches_the_uncompiled_model_at_16_bits():
    model = tiny_model("mistral", max_position_embeddings=1024, sliding_window=50)
    compiled = kvpolicy.compile_model(copy.deepcopy(model), bits=16, progress=False)
    turns = [_ids(90, 1), None, _ids(30, 2), None]  # prompt, 40 steps, a new turn, 40 steps
    caches = (DynamicCache(config=model.config), compiled_of(compiled).new_cache())
    logits = [[], []]
    for i, (m, cache) in enumerate(zip((model, compiled), caches, strict=True)):
        last = None
        for turn in turns:
            if turn is not None:
                last = m(turn, cache=cache, use_cache=True).logits[:, -1]
                logits[i].append(last)
                continue
            for _ in range(40):
                last = m(last.argmax(-1, keepdim=True), cache=cache, use_cache=True).logits[:, -1]
                logits[i].append(last)
    assert caches[1].layers[0].packed.n_evicted > 0
    torch.testing.assert_close(torch.stack(logits[1]), torch.stack(logits[0]),
                               atol=1e-4, rtol=1e-4)
