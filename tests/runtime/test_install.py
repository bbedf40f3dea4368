"""The installed runtime: where a compiled block finds its cache, and what it refuses."""

from __future__ import annotations

import pytest
import torch

import kvpolicy
from kvpolicy.errors import KVPolicyError
from kvpolicy.runtime.cache import KVPolicyCache
from kvpolicy.runtime.install import CompiledModel, flatten_call, layer_graph_module
from kvpolicy.state import compiled_of, state_of
from kvpolicy.zoo.tiny import NanoGPT, tiny_model


@pytest.fixture
def counted_caches(monkeypatch):
    """Count the caches a compiled model builds for itself."""
    built: list[KVPolicyCache] = []
    original = CompiledModel.new_cache

    def new_cache(self):
        built.append(original(self))
        return built[-1]

    monkeypatch.setattr(CompiledModel, "new_cache", new_cache)
    return built


def test_a_decode_step_with_a_cache_builds_no_other(counted_caches):
    model = kvpolicy.compile_model(tiny_model("llama"), bits=4)
    ids = torch.randint(3, model.config.vocab_size, (1, 9))
    with torch.no_grad():
        out = model(ids[:, :8], use_cache=True)
        assert len(counted_caches) == 1  # the prefill's, returned to the caller
        step = model(ids[:, 8:], past_key_values=out.past_key_values, use_cache=True)
    assert len(counted_caches) == 1
    assert step.past_key_values is out.past_key_values
    assert out.past_key_values.get_seq_length() == 9


def test_blocks_called_without_a_cache_share_one_per_model_call(counted_caches):
    model = kvpolicy.compile_model(NanoGPT(n_layer=3), bits=4)
    ids = torch.randint(0, 128, (2, 12))
    with torch.no_grad():
        model(ids)
        model(ids)
    # One cache per whole-model call, shared by its three blocks.
    assert len(counted_caches) == 2
    assert all(c.get_seq_length() == 12 for c in counted_caches)


def test_state_lives_in_one_record():
    model = tiny_model("llama")
    kvpolicy.derive_policy(model, bits=2)
    st = state_of(model)
    assert st.analysis is not None and st.spec is not None
    assert st.compiled is None and compiled_of(model) is None
    kvpolicy.compile_model(model, bits=2)
    assert compiled_of(model) is st.compiled and st.policy is kvpolicy.inspect(model)
    assert [k for k in vars(model) if k.startswith("_kvpolicy")] == ["_kvpolicy"]


def test_rewritten_graph_outside_its_wrapper_is_refused():
    model = kvpolicy.compile_model(tiny_model("llama"), bits=4)
    compiled = compiled_of(model)
    call = compiled.analysis.calls[0]
    kg = next(iter(compiled.kinds[compiled.layer_kind[0]].values()))
    gm = layer_graph_module(kg, call.module)
    _, leaves, _ = flatten_call(call.args, call.kwargs)
    with pytest.raises(KVPolicyError, match="outside its model wrapper"):
        gm(*[x for x in leaves if isinstance(x, torch.Tensor)])
