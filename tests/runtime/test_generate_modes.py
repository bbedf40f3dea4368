"""Every generate mode of a compiled model at 2 bits, with packed groups, against an
independent reference.

The reference is :class:`FakeQuantCache`, a plain ``transformers`` cache written here and
run on the *uncompiled* copy of the model. It keeps every token in fp32 and applies the
policy to the tensors the model hands it: the first ``S`` tokens (sinks) and the recent
ones (residual) are read as stored in the cache (fp16: ``runtime.cache.storage_dtype``
stores the full-precision tokens and the scales/zeros of an fp32 model in fp16); once the
residual holds ``R + chunk`` tokens its oldest ``chunk`` tokens are replaced, once and for
good, by their quantize-dequantize value (``kernels.reference``: keys per channel, values
per token, groups of ``G``). Which tokens a call reads follows ``runtime.attend``:

* a prefill (several tokens onto an empty cache) attends over its own tokens as the
  model computed them (fp32), and the cache stores them afterwards;
* several tokens onto a non-empty cache (a new turn) read the cache as it stood plus
  their own tokens as stored (fp16), then are appended;
* a single token is appended first (which may pack a chunk) and then attends.

Only the schedule and the grouping are written here; the per-group math is the oracle's.
The compiled model and the reference then differ only in fp32 accumulation order
(SDPA / the eager softmax against the cache's log-sum-exp merge of segments): observed
below 1e-5 on these logits, while 2 bits moves them by more than 1e-2.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import pytest
import torch
from transformers import PreTrainedModel
from transformers.cache_utils import Cache, DynamicLayer

import kvpolicy
from kvpolicy.kernels import reference
from kvpolicy.kernels.layout import QuantSpec
from kvpolicy.policies import levels_at
from kvpolicy.zoo.tiny import tiny_model

BITS, RESIDUAL, SINKS = 2, 8, 2
# Per architecture: key/value group size and pre_rope. A DynamicCache sees keys after RoPE,
# so on RoPE models the comparison runs with pre_rope False (keys quantized after RoPE, as
# the reference sees them): un-rotating them in the reference would add float error, and
# quantization turns any error into whole code steps. gpt2 has no RoPE, so it runs the
# default pre_rope True, where pre- and post-RoPE keys are the same tensor.
ARCHS: dict[str, tuple[int, bool]] = {"llama": (8, False), "qwen2": (8, False), "gpt2": (16, True)}
ATOL = RTOL = 1e-4  # fp32 accumulation order only (see the module docstring)
FP_GAP = 1e-2  # 2 bits must move the logits by at least this (a cache that skips packing)


def _specs(arch: str) -> tuple[QuantSpec, QuantSpec]:
    g = ARCHS[arch][0]
    # The default levels (auto) at this width: uniform without a budget.
    levels = levels_at("auto", BITS)
    return QuantSpec(BITS, g, "channel", levels), QuantSpec(BITS, g, "token", levels)


def _fake_quant(x: torch.Tensor, lo: int, hi: int, spec: QuantSpec) -> torch.Tensor:
    """``x`` with tokens ``[lo, hi)`` replaced by their quantize-dequantize value, quantized
    from fp16 with fp16 scales/zeros and dequantized in fp32, as the cache stores them."""
    packed = reference.quantize(x[:, :, lo:hi].half(), spec, torch.float16)
    out = x.clone()
    out[:, :, lo:hi] = reference.dequantize(packed, spec, torch.float32)
    return out


class FakeQuantLayer(DynamicLayer):
    """One layer of the reference: every token, as a later call reads it (fp32)."""

    def __init__(self, key_spec: QuantSpec, value_spec: QuantSpec) -> None:
        super().__init__()
        self.key_spec, self.value_spec = key_spec, value_spec
        self.chunk = math.lcm(key_spec.token_group, value_spec.token_group)
        self.n_packed = 0  # tokens S .. S + n_packed - 1 are fake-quantized

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        before = (self.keys, self.values) if self.get_seq_length() else None
        new_k, new_v = key_states.half().float(), value_states.half().float()
        super().update(new_k, new_v)
        # The residual is every token after the sinks that is not packed; pack its oldest
        # chunk while it holds R + chunk tokens.
        while self.get_seq_length() - SINKS - self.n_packed >= RESIDUAL + self.chunk:
            lo = SINKS + self.n_packed
            self.keys = _fake_quant(self.keys, lo, lo + self.chunk, self.key_spec)
            self.values = _fake_quant(self.values, lo, lo + self.chunk, self.value_spec)
            self.n_packed += self.chunk
        if key_states.shape[2] == 1:  # a decode step: appended, then attended
            return self.keys, self.values
        if before is None:  # a prefill: its own tokens as computed
            return key_states, value_states
        return torch.cat((before[0], new_k), dim=2), torch.cat((before[1], new_v), dim=2)


class FakeQuantCache(Cache):
    """The reference cache of ``arch``'s policy, one :class:`FakeQuantLayer` per layer."""

    def __init__(self, arch: str, n_layers: int) -> None:
        super().__init__(layers=[FakeQuantLayer(*_specs(arch)) for _ in range(n_layers)])


@functools.cache
def _models(arch: str) -> tuple[PreTrainedModel, PreTrainedModel]:
    """(uncompiled reference, compiled copy) of the same tiny model (read-only in tests)."""
    g, pre_rope = ARCHS[arch]
    policy = {"defaults": {"bits": BITS, "group_size": g, "residual": RESIDUAL,
                           "sinks": SINKS, "pre_rope": pre_rope}}
    return tiny_model(arch), kvpolicy.compile_model(tiny_model(arch), policy=policy)


def _ref_cache(arch: str) -> FakeQuantCache:
    return FakeQuantCache(arch, _models(arch)[0].config.num_hidden_layers)


def _ids(batch: int, length: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 128, (batch, length), generator=g)


def _generate(model: PreTrainedModel, ids: torch.Tensor, cache: Cache | None = None,
              seed: int | None = None, **kwargs: Any) -> Any:
    """``model.generate`` (onto ``cache`` if given) returning the raw logits of every step."""
    if seed is not None:
        torch.manual_seed(seed)
    if cache is not None:
        kwargs["cache"] = cache
    kwargs.setdefault("do_sample", False)
    # No early end of sequence: every run packs the chunks _assert_same_cache asks for.
    kwargs.setdefault("min_new_tokens", kwargs.get("max_new_tokens"))
    with torch.no_grad():
        return model.generate(ids, pad_token_id=0, return_dict_in_generate=True,
                              output_logits=True, **kwargs)


def _assert_same_cache(cache: Cache, ref: FakeQuantCache, min_chunks: int = 3) -> None:
    """The compiled cache packed exactly the reference's tokens, several chunks of them,
    and (layer 0, whose keys and values both models compute from the same embeddings)
    holds the same values."""
    for i, (layer, want) in enumerate(zip(cache.layers, ref.layers, strict=True)):
        packed = layer.packed
        assert (packed.key_spec, packed.value_spec) == (want.key_spec, want.value_spec)
        assert packed.n_packed == want.n_packed >= min_chunks * want.chunk, (
            f"layer {i}: {packed.n_packed} packed, reference {want.n_packed}"
        )
        assert packed.n_sinks == SINKS and packed.seq_len == want.get_seq_length()
    k, v = cache.layers[0].packed.dequantized(torch.float32)
    torch.testing.assert_close(k, ref.layers[0].keys, atol=1e-6, rtol=0)
    torch.testing.assert_close(v, ref.layers[0].values, atol=1e-6, rtol=0)


def _assert_logits(got: list[torch.Tensor] | torch.Tensor,
                   want: list[torch.Tensor] | torch.Tensor,
                   fp: list[torch.Tensor] | torch.Tensor) -> None:
    """``got`` matches the reference ``want``, and 2 bits moved it away from ``fp``."""
    got, want, fp = (torch.stack(list(x)) for x in (got, want, fp))
    torch.testing.assert_close(got, want, atol=ATOL, rtol=RTOL)
    n = min(len(got), len(fp))
    gap = (got[:n] - fp[:n]).abs().max().item()
    assert gap > FP_GAP, f"2-bit logits within {gap:.2e} of full precision (want > {FP_GAP})"


def _check_generate(arch: str, ids: torch.Tensor, **kwargs: Any) -> None:
    """Compiled generate == reference generate: tokens, every step's logits, the cache."""
    ref, model = _models(arch)
    got = _generate(model, ids, **kwargs)
    want = _generate(ref, ids, cache=_ref_cache(arch), **kwargs)
    fp = _generate(ref, ids, **kwargs)
    assert torch.equal(got.sequences, want.sequences)
    _assert_logits(got.logits, want.logits, fp.logits)
    _assert_same_cache(got.past_key_values, want.past_key_values)


# ------------------------------------------------------------------------------ tests


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_greedy_matches_reference(arch: str) -> None:
    _check_generate(arch, _ids(2, 12), max_new_tokens=48)


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_sampling_matches_reference_under_the_same_seed(arch: str) -> None:
    # Same seed, logits equal to 1e-5: the same draws pick the same tokens.
    _check_generate(arch, _ids(2, 12, seed=1), max_new_tokens=48, do_sample=True, top_k=20,
                    seed=7)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_left_padded_batch_matches_reference(arch: str) -> None:
    # Row 0 has 5 pads: its sinks are pads (masked), as in the reference (sinks are the
    # first tokens of the cache, not of the text).
    ids = _ids(2, 14, seed=2)
    ids[0, :5] = 0
    mask = torch.ones_like(ids)
    mask[0, :5] = 0
    _check_generate(arch, ids, attention_mask=mask, max_new_tokens=48)


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_beam_search_matches_reference(arch: str) -> None:
    # Beam bookkeeping is deterministic given the logits, so the reference (whose layers
    # are reordered by DynamicLayer.reorder_cache) gives the same beams step by step.
    ref, model = _models(arch)
    ids = _ids(1, 12, seed=3)
    kw: dict[str, Any] = dict(max_new_tokens=48, num_beams=3, output_scores=True)
    got = _generate(model, ids, **kw)
    want = _generate(ref, ids, cache=_ref_cache(arch), **kw)
    fp = _generate(ref, ids, **kw)
    assert torch.equal(got.sequences, want.sequences)
    torch.testing.assert_close(got.sequences_scores, want.sequences_scores, atol=ATOL, rtol=RTOL)
    _assert_logits(got.logits, want.logits, fp.logits)
    _assert_same_cache(got.past_key_values, want.past_key_values)


def _decode_loop(model: PreTrainedModel, ids: torch.Tensor, prefill: int, keyword: str,
                 cache: Cache | None = None) -> tuple[torch.Tensor, Cache]:
    """Prefill ``ids[:, :prefill]``, then one token per call through ``keyword``; returns
    the logits of every position ``[T, B, V]`` and the cache."""
    with torch.no_grad():
        kw = {} if cache is None else {keyword: cache}
        out = model(ids[:, :prefill], use_cache=True, **kw)
        logits = list(out.logits.transpose(0, 1))
        for t in range(prefill, ids.shape[1]):
            out = model(ids[:, t : t + 1], use_cache=True, **{keyword: out.past_key_values})
            logits.append(out.logits[:, -1])
    return torch.stack(logits), out.past_key_values


@pytest.mark.parametrize("keyword", ["cache", "past_key_values"])
@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_manual_decode_loop_matches_reference(arch: str, keyword: str) -> None:
    ref, model = _models(arch)
    ids = _ids(2, 60, seed=4)
    got, cache = _decode_loop(model, ids, 16, keyword)
    want, ref_cache = _decode_loop(ref, ids, 16, keyword, _ref_cache(arch))
    with torch.no_grad():
        fp = ref(ids).logits.transpose(0, 1)
    _assert_logits(got, want, fp)
    _assert_same_cache(cache, ref_cache)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gpt2"])
def test_multi_turn_reuse_matches_reference(arch: str) -> None:
    """generate, a 10-token user turn onto the returned cache, generate again: the turn
    is one multi-token call onto a cache that already holds packed groups."""
    ref, model = _models(arch)
    prompt, turn = _ids(2, 12, seed=5), _ids(2, 10, seed=6)
    runs = []
    for m, cache in ((model, None), (ref, _ref_cache(arch)), (ref, None)):
        first = _generate(m, prompt, cache, max_new_tokens=24)
        if m is model:  # 35 tokens held: the turn lands on packed groups
            assert first.past_key_values.layers[0].packed.n_packed > 0
        ids = torch.cat((first.sequences, turn), dim=1)
        second = _generate(m, ids, first.past_key_values, max_new_tokens=24)
        runs.append((first, second))
    (g1, g2), (w1, w2), (f1, f2) = runs
    assert torch.equal(g2.sequences, w2.sequences)
    _assert_logits([*g1.logits, *g2.logits], [*w1.logits, *w2.logits],
                   [*f1.logits, *f2.logits])
    _assert_same_cache(g2.past_key_values, w2.past_key_values)
