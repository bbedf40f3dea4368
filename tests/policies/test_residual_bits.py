"""``residual_bits`` in a policy: derived per tensor, refused where it means nothing, shown
by inspect, and carried to the compiled cache."""

from __future__ import annotations

import pytest
import torch

import kvpolicy
from kvpolicy.errors import PolicyError
from kvpolicy.policies.schema import TensorPolicy
from kvpolicy.zoo.tiny import tiny_model


def test_the_defaults_set_it_and_a_full_precision_tensor_keeps_16():
    model = tiny_model("llama")
    pol = kvpolicy.derive_policy(model, policy={
        "defaults": {"bits": 2, "residual_bits": 8},
        "overrides": [{"layers": 0, "tensor": "value", "bits": 16}],
    }, progress=False)
    assert [(t.layer, t.tensor.value, t.residual_bits) for t in pol.tensors] == [
        (0, "key", 8), (0, "value", 16), (1, "key", 8), (1, "value", 8)]
    assert "the 128 recent tokens held at 8 bits per token" in pol.get(1, "key").reason
    assert "held at" not in pol.get(0, "value").reason
    assert "128 at 8b" in str(pol)
    assert "residual and incomplete chunks at 16 or 8 bits, included" in str(pol)
    # Left out, the residual stays in full precision (the cache is then exact there).
    plain = kvpolicy.derive_policy(model, bits=2, progress=False)
    assert {t.residual_bits for t in plain.tensors} == {16}
    assert "at 8b" not in str(plain)
    assert "residual and incomplete chunks in full precision, included" in str(plain)


def test_a_rule_sets_it_per_tensor_and_the_cache_follows():
    model = tiny_model("llama")
    kvpolicy.compile_model(model, policy={
        "defaults": {"bits": 2, "residual": 16, "sinks": 2},
        "overrides": [{"layers": "*", "tensor": "key", "residual_bits": 4}],
    }, progress=False)
    ids = torch.randint(3, 120, (1, 60), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        cache = model(ids, use_cache=True).past_key_values
    layers = cache.memory_report()["layers"]
    assert [r["residual_bits"] for r in layers] == [(4, 16)] * 2


def test_a_width_it_cannot_hold_is_refused_by_name():
    with pytest.raises(PolicyError, match="residual_bits"):
        kvpolicy.derive_policy(tiny_model("llama"),
                               policy={"defaults": {"bits": 2, "residual_bits": 2}})


def test_a_full_precision_tensor_with_a_packed_residual_is_refused():
    pol = kvpolicy.derive_policy(tiny_model("llama"), bits=2, progress=False)
    data = pol.get(0, "key").model_dump()
    data.update(bits=16, residual_bits=8)
    with pytest.raises(ValueError, match="full-precision tensor .* keeps every token at 16"):
        TensorPolicy.model_validate(data)
