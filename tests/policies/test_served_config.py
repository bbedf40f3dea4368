"""``kvpolicy.vllm.configure_engine`` on vLLM-shaped configs (duck-typed, so no engine and
no vLLM install): what it says about the parts of a policy vLLM's pages do not serve."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest

from kvpolicy.errors import PolicyError
from kvpolicy.vllm.config import configure_engine
from kvpolicy.zoo.tiny import tiny_model

NOT_SERVED = "residual_bits below 16 is not served"


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    model = tiny_model("llama")
    path = tmp_path_factory.mktemp("tiny-llama")
    model.save_pretrained(path)
    return model.config, str(path)


def _engine(config, path: str, policy: dict) -> SimpleNamespace:
    model = SimpleNamespace(
        model=path, max_model_len=256, hf_config=config, hf_text_config=config,
        get_total_num_hidden_layers=lambda: config.num_hidden_layers,
        get_total_num_kv_heads=lambda: config.num_key_value_heads,
        get_head_size=lambda: config.hidden_size // config.num_attention_heads)
    cache = SimpleNamespace(enable_prefix_caching=False, user_specified_block_size=False,
                            block_size=16)
    return SimpleNamespace(additional_config={"kvpolicy": policy}, model_config=model,
                           cache_config=cache, speculative_config=None)


@pytest.mark.parametrize("residual_bits", [8, 16])
def test_a_packed_residual_window_is_said_to_be_served_at_16_bits(
        checkpoint, residual_bits, caplog, monkeypatch, tmp_path):
    monkeypatch.setenv("KVPOLICY_CACHE", str(tmp_path))  # derived afresh, in a child
    engine = _engine(*checkpoint, {"defaults": {"bits": 2, "residual_bits": residual_bits}})
    with caplog.at_level(logging.WARNING, logger="vllm.kvpolicy"):
        configure_engine(engine)
    said = [r.getMessage() for r in caplog.records if NOT_SERVED in r.getMessage()]
    assert len(said) == (residual_bits < 16)
    if said:
        assert "held in full precision whatever the policy says" in said[0]
    assert engine.cache_config.block_size % 32 == 0  # the packed policy's block size


def _refused(engine, monkeypatch, tmp_path) -> str:
    monkeypatch.setenv("KVPOLICY_CACHE", str(tmp_path))
    block = engine.cache_config.block_size
    with pytest.raises(PolicyError) as e:
        configure_engine(engine)
    assert engine.cache_config.block_size == block  # refused before changing the engine
    return str(e.value)


@pytest.mark.parametrize(("extra", "says"), [
    ({"kvpolicy_bits": 2}, "key 'kvpolicy_bits' is not one kvpolicy reads; name the policy "
                           "under 'kvpolicy'"),
    ({"KVPolicy": 2, "other_plugin": 1}, "key 'KVPolicy' is not one kvpolicy reads"),
    ({"kvpolicy": True}, "is True, which names no policy"),
    ({"kvpolicy": False}, "is False, which names no policy"),
    ({"kvpolicy": {"defaults": {"bitz": 2}}}, "field 'bitz': unknown field; did you mean "
                                              "'bits'?"),
    ({"kvpolicy": {"bits": 2}}, "field 'bits': unknown key; valid: version, defaults"),
    ({"kvpolicy": "kvpolicy-7"}, "policy file not found; did you mean the preset "
                                 "'kvpolicy-4'?"),
    ({"kvpolicy": 7}, "7 bits is not supported"),
])
def test_a_malformed_additional_config_is_refused_with_its_cause(
        checkpoint, extra, says, monkeypatch, tmp_path):
    engine = _engine(*checkpoint, 2)
    engine.additional_config = extra
    assert says in _refused(engine, monkeypatch, tmp_path)


def test_a_policy_for_another_model_is_refused(checkpoint, monkeypatch, tmp_path):
    config, path = checkpoint
    deeper = tmp_path / "deeper.yaml"
    deeper.write_text("version: 1\ndefaults: {bits: 2}\n"
                      "overrides:\n  - {layers: 40, tensor: key, bits: 4}\n")
    why = _refused(_engine(config, path, str(deeper)), monkeypatch, tmp_path)
    assert f"layer 40 is out of range; the model has {config.num_hidden_layers} layers" in why


def test_another_plugins_keys_are_left_alone(checkpoint, monkeypatch, tmp_path):
    monkeypatch.setenv("KVPOLICY_CACHE", str(tmp_path))
    engine = _engine(*checkpoint, 2)
    engine.additional_config["other_plugin"] = {"x": 1}
    configure_engine(engine)
    assert engine.cache_config.block_size % 32 == 0


@pytest.mark.parametrize("value", [2, "kvpolicy-2"])
def test_a_2_bit_page_holds_4_5x_the_tokens_of_a_bf16_one(checkpoint, value, monkeypatch,
                                                           tmp_path):
    """What vLLM's capacity is made of: its blocks are the KV memory over a page's bytes
    (every layer given the largest page), so tokens per byte against bf16 K/V are the
    capacity ratio it reports, stage and sinks included."""
    import torch

    from kvpolicy.vllm.policy import served_policy
    monkeypatch.setenv("KVPOLICY_CACHE", str(tmp_path))
    config, path = checkpoint
    served = served_policy(path, value, 256)
    d = config.hidden_size // config.num_attention_heads
    kw = dict(num_kv_heads=config.num_key_value_heads, head_dim=d, v_head_dim=d,
              block_size=served.default_block_size(), cache_dtype=torch.bfloat16)
    ratio = served.layout(0, **kw).fp_page_bytes() / served.page_bytes(**kw)
    assert ratio >= 4.5, f"{value!r}: {ratio:.2f}x bf16's tokens per page byte"


VQ = {"defaults": {"bits": 2, "levels": "vq", "residual": 0}}


def test_vq_values_are_served_with_each_ranks_codebook(monkeypatch, tmp_path):
    """``levels: vq`` values (codebooks fitted on the text of the tokenizer beside the
    checkpoint): a page holds one byte per sub-vector and a scale per group, no zero, and a
    tensor-parallel rank gets its own kv heads' centroids."""
    import torch

    from kvpolicy.vllm.policy import served_policy
    from kvpolicy.zoo.tiny import byte_tokenizer
    monkeypatch.setenv("KVPOLICY_CACHE", str(tmp_path / "cache"))
    model = tiny_model("llama", vocab_size=256)
    path = tmp_path / "tiny-llama"
    model.save_pretrained(path)
    byte_tokenizer().save_pretrained(path)
    served = served_policy(str(path), VQ, 256)
    _, whole = served.specs(0)
    assert whole.vq and whole.codebook.heads == 2
    for h in range(2):
        _, part = served.specs(0, range(h, h + 1))
        assert torch.equal(part.codebook.tensor(), whole.codebook.tensor()[h : h + 1])
    d = model.config.hidden_size // model.config.num_attention_heads
    kw = dict(num_kv_heads=2, head_dim=d, v_head_dim=d, block_size=served.default_block_size(),
              cache_dtype=torch.bfloat16)
    fields = {f.name: f for f in served.layout(0, **kw).fields}
    assert fields["v_codes"].shape == (2, kw["block_size"], d // whole.vq_dim)
    assert fields["v_zero"].nbytes == 0
    uniform = served_policy(str(path), {"defaults": {"bits": 2, "residual": 0}}, 256)
    assert served.page_bytes(**kw) < uniform.page_bytes(**kw)


def test_vq_values_without_text_to_fit_them_on_are_refused(checkpoint, monkeypatch, tmp_path):
    said = _refused(_engine(*checkpoint, VQ), monkeypatch, tmp_path)
    assert "levels: vq fits its codebooks on calibration text" in said
    assert "use levels: uniform" in said


def test_a_sliding_window_model_is_served_with_one_rope_table_per_layer_type(
        tmp_path, monkeypatch):
    """Gemma3 at 2 bits: configured (no longer refused), and its local and global layers'
    pre-RoPE keys carry the rotary tables of their own layer type, through the disk cache
    the engine's processes read."""
    import torch

    from kvpolicy.vllm import policy as served_mod
    model = tiny_model("gemma3_text", sliding_window=16, max_position_embeddings=256,
                       layer_types=["sliding_attention", "full_attention"])
    path = tmp_path / "gemma3"
    model.save_pretrained(path)
    engine = _engine(model.config, str(path), 2)
    monkeypatch.setenv("KVPOLICY_CACHE", str(tmp_path / "cache"))
    configure_engine(engine)
    assert engine.cache_config.block_size % 32 == 0
    served_mod._MEMO.clear()  # read back from disk, as the engine's workers do
    served = served_mod.served_policy(str(path), 2, 256)
    assert served.rope is None and "one table per layer type" in served.rope_why
    x, pos = torch.zeros(1), torch.arange(256)[None]
    for layer, kind in enumerate(model.config.layer_types):
        cos, sin = model.model.rotary_emb(x, pos, kind)
        got = served.rope_for(layer)
        torch.testing.assert_close(got.cos, cos[0].float())
        torch.testing.assert_close(got.sin, sin[0].float())
    assert not torch.equal(served.rope_for(0).cos, served.rope_for(1).cos)
