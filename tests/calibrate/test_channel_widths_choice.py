"""``channel_widths: auto``: the cost per key channel, the per-head allocation, the policy
that records it and the cache that runs it."""

from __future__ import annotations

import logging

import pytest
import torch

import kvpolicy
from kvpolicy import zoo
from kvpolicy.calibrate.budget import calibration_ids
from kvpolicy.calibrate.capture import LayerActivations
from kvpolicy.calibrate.channels import _pairs, allocate_widths, channel_costs
from kvpolicy.errors import KVPolicyError, PolicyError
from kvpolicy.zoo.tiny import tiny_model

SPEC = {"defaults": {"bits": 2, "channel_widths": "auto", "residual": 16, "sinks": 2}}


@pytest.fixture(scope="module")
def ids() -> torch.Tensor:
    return torch.randint(3, 128, (1, 96), generator=torch.Generator().manual_seed(0))


def _acts(q: torch.Tensor, k: torch.Tensor) -> LayerActivations:
    return LayerActivations(layer=0, query=q, key_pre=k, key=k, value=k, scale=1.0)


def test_cost_is_query_energy_times_key_range():
    g = torch.Generator().manual_seed(1)
    q = torch.randn(1, 4, 64, 8, generator=g)
    k = torch.randn(1, 2, 64, 8, generator=g)
    q[:, 0:2, :, 3] *= 10  # kv head 0's queries look hard at channel 3
    k[:, 0, :, 5] *= 10  # kv head 0's key spreads in channel 5
    cost = channel_costs(_acts(q, k), group_size=16)
    assert cost.shape == (2, 8)
    assert cost[0].topk(2).indices.sort().values.tolist() == [3, 5]
    # A flat head has no channel that stands out.
    assert cost[1].max() / cost[1].min() < 10


def test_allocation_follows_the_cost_and_keeps_the_total():
    cost = torch.ones(16)
    cost[[2, 10]] = 1e4  # one planted RoPE pair (c, c + 8)
    cost[[5, 13]] = 1e2
    pairs = _pairs(16, 16, "rotate_half")
    w = allocate_widths(cost, 2, pairs)
    assert sum(w) == 32
    assert w[2] == w[10] == 4 and w[5] == w[13] >= 3
    assert max(w[c] for c in range(8) if c not in (2, 5)) <= 2
    assert all(w[c] == w[c + 8] for c in range(8))  # a pair shares its width
    assert min(w) == 1


def test_flat_costs_keep_the_uniform_width():
    w = allocate_widths(torch.ones(8), 2, _pairs(8, None, None))
    assert w == (2,) * 8


def test_interleaved_pairs_and_unrotated_channels():
    assert _pairs(6, 4, "interleaved") == [[0, 1], [2, 3], [4], [5]]
    assert _pairs(6, 4, "rotate_half") == [[0, 2], [1, 3], [4], [5]]


def test_an_unreachable_total_is_reported():
    # The single channel takes every bit it can first; an odd bit is left for the pair.
    assert allocate_widths(torch.tensor([1.0, 1.0, 100.0]), 3, [[0, 1], [2]]) is None


PLANTED = 3  # channel 3 of kv head 0 in layer 0, and its RoPE partner 3 + 16


def _planted_model() -> torch.nn.Module:
    """The tiny llama (4 query heads, 2 kv heads, head_dim 32) with one outlier RoPE pair:
    kv head 0's key and the queries that read it (query heads 0-1) 8x larger in channels
    3 and 19 of layer 0."""
    model = tiny_model("llama")
    attn = model.model.layers[0].self_attn
    with torch.no_grad():
        for c in (PLANTED, PLANTED + 16):
            attn.k_proj.weight[c] *= 8
            for head in (0, 1):
                attn.q_proj.weight[32 * head + c] *= 8
    return model


@pytest.fixture(scope="module")
def policy(ids):
    return kvpolicy.derive_policy(_planted_model(), policy=SPEC, calibration=ids,
                                  progress=False)


def test_policy_records_widths_per_key(policy):
    for t in policy.tensors:
        if t.tensor.value == "value":
            assert t.channel_widths == "uniform" and t.widths == ()
            continue
        assert t.channel_widths == "auto"
        assert len(t.widths) == t.num_kv_heads
        assert all(len(r) == t.head_dim and sum(r) == 2 * t.head_dim for r in t.widths)
        assert t.quant_spec().widths == t.widths
        assert "channel widths 1/2/3/4 bits on" in t.reason
    planted = policy.get(0, "key").widths
    assert planted[0][PLANTED] == planted[0][PLANTED + 16] == 4
    assert min(planted[0]) == 1  # paid for by the channels the queries barely read
    # The random-weight heads are flat: no channel stands out, every one keeps 2 bits.
    assert planted[1] == (2,) * 32 and policy.get(1, "key").widths == ((2,) * 32,) * 2


def test_policy_round_trips_through_yaml(policy):
    back = type(policy).from_yaml(policy.to_yaml())
    assert back == policy


def test_widths_on_values_are_refused(ids):
    spec = {"defaults": {"bits": 2}, "overrides": [
        {"layers": "*", "tensor": "value", "channel_widths": "auto"}]}
    with pytest.raises(PolicyError, match="keys grouped per channel"):
        kvpolicy.derive_policy(tiny_model("llama"), policy=spec, calibration=ids,
                               progress=False)


def test_four_bits_leave_nothing_to_trade(ids):
    spec = {"defaults": {"bits": 4, "channel_widths": "auto"}}
    pol = kvpolicy.derive_policy(tiny_model("llama"), policy=spec, calibration=ids,
                                 progress=False)
    key = pol.get(0, "key")
    assert key.widths == () and "leave no width to trade" in key.reason


def test_compiled_cache_runs_the_widths(ids):
    model = _planted_model()
    with torch.no_grad():
        fp = model(ids[:, :64]).logits
    kvpolicy.compile_model(model, policy=SPEC, calibration=ids, progress=False)
    with torch.no_grad():
        out = model(ids[:, :48], use_cache=True)
        step = out.logits
        for i in range(48, 64):
            out = model(ids[:, i:i + 1], past_key_values=out.past_key_values, use_cache=True)
            step = torch.cat([step, out.logits], 1)
    cache = out.past_key_values
    layer = cache.layers[0].packed
    assert layer.key_spec.widths == kvpolicy.inspect(model).get(0, "key").widths
    assert min(layer.key_spec.widths[0]) == 1  # mixed widths, not the uniform layout
    assert layer.n_packed > 0
    # Quantized, so not exact; a broken layout would scramble the keys entirely.
    agree = (step.argmax(-1) == fp.argmax(-1)).float().mean()
    assert agree > 0.8


def test_default_without_calibration_text_keeps_one_width_and_says_so(caplog):
    # The tiny model has no tokenizer beside it: kvpolicy's default cannot measure. It
    # says so once, naming what it did instead and how to get the default.
    with caplog.at_level(logging.WARNING, logger="kvpolicy"):
        pol = kvpolicy.derive_policy(_planted_model(), progress=False)
    key = pol.get(0, "key")
    assert key.channel_widths == "uniform" and key.widths == ()
    assert "one width for every channel: no calibration text" in key.reason
    said = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(said) == 1, said
    assert "one width for every key channel instead" in said[0]
    assert "calibration=<a tokenizer>" in said[0]


def test_a_model_loaded_from_a_folder_without_tokenizer_is_told(tmp_path, caplog):
    from transformers import AutoModelForCausalLM

    _planted_model().save_pretrained(tmp_path)
    model = AutoModelForCausalLM.from_pretrained(tmp_path)
    with caplog.at_level(logging.WARNING, logger="kvpolicy"):
        kvpolicy.compile_model(model, bits=2, progress=False)
    said = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(said) == 1 and "has no tokenizer saved at config._name_or_path" in said[0]


def test_a_gguf_model_finds_the_tokenizer_in_its_file(caplog):
    # from_pretrained(folder, gguf_file=name) keeps only the folder; the tokenizer is in the
    # GGUF file there, so the default's calibration text is found and nothing is said.
    from transformers import AutoModelForCausalLM

    gguf = zoo.gguf_path("smollm2-135m")
    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    ids, where = calibration_ids(model)
    _, tok = zoo.load("smollm2-135m")
    assert torch.equal(ids, calibration_ids(model, tokenizer=tok)[0]) and "pydoc" in where
    with caplog.at_level(logging.WARNING, logger="kvpolicy"):
        pol = kvpolicy.derive_policy(model, bits=2, progress=False)
    assert not [r for r in caplog.records if r.levelno == logging.WARNING]
    assert pol.get(0, "key").widths  # per-channel widths, measured


def test_default_with_calibration_ids_places_widths(ids):
    pol = kvpolicy.derive_policy(_planted_model(), calibration=ids, progress=False)
    assert pol.get(0, "key").widths[0][PLANTED] == 4


def test_written_auto_without_calibration_text_is_an_error():
    with pytest.raises(KVPolicyError, match="has no tokenizer saved"):
        kvpolicy.derive_policy(_planted_model(), policy=SPEC, progress=False)


def test_kivi_presets_keep_one_width(ids):
    pol = kvpolicy.derive_policy(_planted_model(), policy="kivi-2", calibration=ids,
                                 progress=False)
    assert all(t.channel_widths == "uniform" and not t.widths for t in pol.tensors)


def test_post_rope_keys_are_measured_as_stored():
    g = torch.Generator().manual_seed(2)
    q = torch.randn(1, 2, 32, 4, generator=g)
    pre = torch.randn(1, 1, 32, 4, generator=g)
    post = pre.clone()
    post[..., 2] *= 20  # only the stored (post-RoPE) key spreads in channel 2
    act = LayerActivations(layer=0, query=q, key_pre=pre, key=post, value=pre, scale=1.0)
    stored, before = channel_costs(act, 8, pre_rope=False), channel_costs(act, 8)
    assert int(stored[0].argmax()) == 2
    torch.testing.assert_close(stored[0, 2] / before[0, 2], torch.tensor(400.0))
    torch.testing.assert_close(stored[0, :2], before[0, :2])
