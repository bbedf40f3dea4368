"""``kvpolicy.vllm.configure_engine`` on vLLM-shaped configs (duck-typed, so no engine and
no vLLM install): what it says about the parts of a policy vLLM's pages do not serve."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest

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
