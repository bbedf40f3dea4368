"""compile_model end to end: exactness, generation, decode loops, errors."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import kvpolicy
from kvpolicy import AnalysisError, KVPolicyError, PolicyError
from kvpolicy.runtime.cache import KVPolicyCache
from kvpolicy.state import compiled_of
from kvpolicy.zoo.tiny import TINY_ARCHITECTURES, GptFast, NanoGPT, tiny_model

# Small groups and window so that a few dozen tokens really get packed.
SMALL = {"defaults": {"bits": 2, "group_size": 16, "residual": 16, "sinks": 2}}


def _ids(batch=2, length=9, vocab=128, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (batch, length), generator=g)


@pytest.mark.parametrize("arch", sorted(TINY_ARCHITECTURES))
def test_full_precision_is_token_identical(arch):
    ref, model = tiny_model(arch), tiny_model(arch)
    kvpolicy.compile_model(model, bits=16)
    ids = _ids()
    with torch.no_grad():
        want = ref.generate(ids, max_new_tokens=24, do_sample=False, pad_token_id=0)
        got = model.generate(ids, max_new_tokens=24, do_sample=False, pad_token_id=0)
    assert torch.equal(want, got)


@pytest.mark.parametrize("arch", ["llama", "gpt_neox", "codegen", "gpt2", "qwen3"])
def test_eight_bits_stays_within_one_percent(arch):
    ref, model = tiny_model(arch), tiny_model(arch)
    kvpolicy.compile_model(model, policy={"defaults": {**SMALL["defaults"], "bits": 8}})
    ids = _ids(length=41)
    with torch.no_grad():
        want = ref(ids[:, :40]).logits
        out = model(ids[:, :40], use_cache=True)  # 40 >= R + G = 32: a group is packed
        step_ref = ref(ids).logits[:, -1]
        step = model(ids[:, 40:], past_key_values=out.past_key_values, use_cache=True)
    rel = (step.logits[:, -1] - step_ref).norm() / step_ref.norm()
    assert rel < 0.01, f"8-bit decode logits off by {rel:.4f} relative (limit 0.01)"
    assert (out.logits - want).norm() / want.norm() < 0.01
    assert out.past_key_values.layers[0].packed.n_packed > 0


def test_generate_packs_groups_and_reports_memory():
    model = kvpolicy.compile_model(tiny_model("llama"), policy=SMALL)
    ids = _ids()
    with torch.no_grad():
        out = model.generate(
            ids, max_new_tokens=48, do_sample=False, pad_token_id=0,
            return_dict_in_generate=True,
        )
    cache = out.past_key_values
    assert isinstance(cache, KVPolicyCache)
    report = cache.memory_report()
    assert report["tokens"] == ids.shape[1] + 48 - 1
    layer = cache.layers[0].packed
    assert layer.n_packed > 0 and layer.n_residual >= 16
    assert report["bytes"] < report["fp16_bytes"] * 2  # fp32 model: fp16 is the yardstick


def test_sampling_runs_and_is_seeded():
    model = kvpolicy.compile_model(tiny_model("qwen2"), policy=SMALL)
    ids = _ids()
    with torch.no_grad():
        torch.manual_seed(1)
        a = model.generate(ids, max_new_tokens=30, do_sample=True, top_k=20, pad_token_id=0)
        torch.manual_seed(1)
        b = model.generate(ids, max_new_tokens=30, do_sample=True, top_k=20, pad_token_id=0)
    assert torch.equal(a, b) and a.shape == (2, 39)


def test_left_padded_batch_matches_unpadded_rows():
    ref, model = tiny_model("llama"), tiny_model("llama")
    kvpolicy.compile_model(model, bits=16)
    ids = _ids(batch=2, length=9)
    padded = ids.clone()
    padded[0, :3] = 0
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    with torch.no_grad():
        want = ref.generate(padded, attention_mask=mask, max_new_tokens=20, do_sample=False,
                            pad_token_id=0)
        got = model.generate(padded, attention_mask=mask, max_new_tokens=20, do_sample=False,
                             pad_token_id=0)
    assert torch.equal(want, got)


def test_beam_search_reorders_the_cache():
    ref, model = tiny_model("llama"), tiny_model("llama")
    kvpolicy.compile_model(model, bits=16)
    ids = _ids(batch=1)
    with torch.no_grad():
        want = ref.generate(ids, max_new_tokens=20, num_beams=3, do_sample=False,
                            pad_token_id=0)
        got = model.generate(ids, max_new_tokens=20, num_beams=3, do_sample=False,
                             pad_token_id=0)
    assert torch.equal(want, got)


@pytest.mark.parametrize("keyword", ["past_key_values", "cache"])
def test_manual_decode_loop(keyword):
    ref, model = tiny_model("mistral"), tiny_model("mistral")
    kvpolicy.compile_model(model, bits=16)
    ids = _ids(length=12)
    with torch.no_grad():
        out = model(ids[:, :8], use_cache=True)
        cache = out.past_key_values
        assert isinstance(cache, KVPolicyCache)
        for t in range(8, 12):
            out = model(ids[:, t : t + 1], use_cache=True, **{keyword: cache})
            cache = out.past_key_values
        want = ref(ids).logits[:, -1]
    torch.testing.assert_close(out.logits[:, -1], want, atol=1e-4, rtol=1e-4)
    assert cache.get_seq_length() == 12


def test_hand_written_modules_without_a_cache_of_their_own_compile_and_stay_exact():
    """NanoGPT keeps no cache: each call recomputes its prefix, which a prefill attends over
    in full precision, so even at 2 bits the output is the original's. (A module with its
    own cache decodes from packed groups: tests/runtime/test_own_cache.py.)"""
    for make in (NanoGPT, GptFast):
        ref, model = make(), make()
        kvpolicy.compile_model(model, policy=SMALL, progress=False)
        ids = _ids(length=40)
        with torch.no_grad():
            torch.testing.assert_close(model(ids), ref(ids), atol=1e-4, rtol=1e-4)
        assert compiled_of(model).own_cache is None and not compiled_of(model).keeps_own_cache


def test_inspect_returns_the_policy_in_use():
    model = kvpolicy.compile_model(tiny_model("llama"), policy="kivi-2")
    policy = kvpolicy.inspect(model)
    key = policy.get(0, "key")
    assert key.axis == "channel" and not key.pre_rope and key.overridden


def test_a_copy_of_an_inspected_model_compiles_like_the_model():
    import copy

    from kvpolicy.state import state_of

    model = tiny_model("llama")
    kvpolicy.derive_policy(model, policy=SMALL, progress=False)  # caches the trace
    twin = copy.deepcopy(model)  # the cached trace holds fake tensors: not copied
    assert state_of(twin).analysis is None and state_of(model).analysis is not None
    assert state_of(twin).spec == state_of(model).spec
    kvpolicy.compile_model(model, policy=SMALL, progress=False)
    kvpolicy.compile_model(twin, policy=SMALL, progress=False)
    ids = _ids(length=41)
    with torch.no_grad():
        assert torch.equal(model(ids).logits, twin(ids).logits)


# --------------------------------------------------------------------------- errors


def test_compiling_twice_is_refused():
    model = kvpolicy.compile_model(tiny_model("llama"), bits=4)
    with pytest.raises(KVPolicyError, match="already compiled"):
        kvpolicy.compile_model(model, bits=2)


def test_a_non_module_is_refused_with_its_type():
    model = tiny_model("llama")
    with pytest.raises(KVPolicyError, match=r"needs a torch.nn.Module, got tuple \(zoo.load"):
        kvpolicy.compile_model((model, None), bits=2)


class _NoAttention(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(50, 16)
        self.fc = nn.Linear(16, 50)

    def forward(self, ids):
        return self.fc(self.emb(ids))


def test_model_without_attention_is_left_usable():
    model = _NoAttention()
    ids = _ids(vocab=50)
    before = model(ids)
    with pytest.raises(AnalysisError, match="no attention found"):
        kvpolicy.compile_model(model)
    torch.testing.assert_close(model(ids), before)
    assert compiled_of(model) is None


def test_policy_that_does_not_fit_leaves_model_usable():
    ref, model = tiny_model("llama"), tiny_model("llama")
    with pytest.raises(PolicyError, match="group_size"):
        kvpolicy.compile_model(model, policy={"defaults": {"group_size": 24}})
    ids = _ids()
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, ref(ids).logits)
        out = model(ids, use_cache=True)
    assert not isinstance(out.past_key_values, KVPolicyCache)


def test_input_longer_than_positions_is_a_clear_error():
    model = kvpolicy.compile_model(tiny_model("gpt2"), bits=4)
    ids = _ids(length=model.config.max_position_embeddings + 1)
    with pytest.raises(KVPolicyError, match="max_position_embeddings=256"):
        model(ids)


def test_unknown_backend_is_refused():
    with pytest.raises(KVPolicyError, match="backend='cuda'"):
        kvpolicy.compile_model(tiny_model("llama"), backend="cuda")


def test_foreign_cache_is_refused_with_the_fix():
    from transformers import DynamicCache

    model = kvpolicy.compile_model(tiny_model("llama"), bits=4)
    with pytest.raises(KVPolicyError, match="KVPolicyCache"):
        model(_ids(), past_key_values=DynamicCache(config=model.config), use_cache=True)


# --------------------------------------------------------------------------- real model


@pytest.mark.real_model
def test_smollm2_full_precision_is_token_identical_and_8_bits_close():
    from kvpolicy import zoo

    ref, _ = zoo.load("smollm2-135m")
    exact, _ = zoo.load("smollm2-135m")
    eight, _ = zoo.load("smollm2-135m")
    kvpolicy.compile_model(exact, bits=16)
    kvpolicy.compile_model(eight, bits=8)
    ids = _ids(batch=1, length=200, vocab=ref.config.vocab_size)
    with torch.no_grad():
        want = ref.generate(ids[:, :20], max_new_tokens=30, do_sample=False)
        got = exact.generate(ids[:, :20], max_new_tokens=30, do_sample=False)
        assert torch.equal(want, got)
        # 8 bits with 200 tokens cached: 4 sinks, R=128, so two groups of 32 are packed.
        out = eight(ids[:, :199], use_cache=True)
        assert out.past_key_values.layers[0].packed.n_packed == 64
        step = eight(ids[:, 199:], past_key_values=out.past_key_values, use_cache=True)
        step_ref = ref(ids).logits[:, -1]
    rel = ((step.logits[:, -1] - step_ref).norm() / step_ref.norm()).item()
    assert rel < 0.01, f"8-bit logits off by {rel:.4f} relative (limit 0.01)"


class _TiledGQA(nn.Module):
    """Two kv heads tiled (repeat) to four query heads: head h reads kv head h % 2."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(50, 64)
        self.q, self.k, self.v = nn.Linear(64, 64), nn.Linear(64, 32), nn.Linear(64, 32)
        self.out = nn.Linear(64, 50)

    def forward(self, ids):
        x = self.emb(ids)
        B, T, _ = x.shape
        q = self.q(x).view(B, T, 4, 16).transpose(1, 2)
        k = self.k(x).view(B, T, 2, 16).transpose(1, 2).repeat(1, 2, 1, 1)
        v = self.v(x).view(B, T, 2, 16).transpose(1, 2).repeat(1, 2, 1, 1)
        y = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out(y.transpose(1, 2).reshape(B, T, 64))


def test_tiled_heads_are_refused_not_silently_regrouped():
    model = _TiledGQA()
    with pytest.raises(KVPolicyError, match="tiled by .*repeat"):
        kvpolicy.compile_model(model, policy={"defaults": {"group_size": 16}})
    assert compiled_of(model) is None
