"""The ``levels`` setting (uniform, normal, auto) from the spec to the cache's QuantSpec."""

from __future__ import annotations

import torch
from policy_factories import build, raises

import kvpolicy
from kvpolicy.policies import levels_at
from kvpolicy.zoo.tiny import tiny_model


def _levels(policy) -> set[tuple[str, int, str]]:
    return {(t.tensor.value, t.bits, t.code_levels) for t in policy.tensors}


def test_auto_is_uniform_without_a_budget_and_normal_is_opt_in():
    assert {levels_at("auto", b) for b in (1, 2, 3, 4, 8, 16)} == {"uniform"}
    assert levels_at("normal", 16) == levels_at("normal", 8) == "uniform"  # no table
    assert levels_at("normal", 2) == "normal"
    assert _levels(build(bits=2)) == {("key", 2, "uniform"), ("value", 2, "uniform")}
    assert "levels" not in build(bits=2).tensors[0].reason
    keys = build({"overrides": [{"layers": "*", "tensor": "key", "levels": "normal"}]})
    assert _levels(keys) == {("key", 2, "normal"), ("value", 2, "uniform")}


def test_defaults_and_rules_set_levels_per_tensor():
    policy = build({
        "defaults": {"levels": "uniform"},
        "overrides": [{"layers": "1-2", "tensor": "key", "levels": "normal", "bits": 3}],
    })
    got = {(t.layer, t.tensor.value): t.code_levels for t in policy.tensors}
    assert got[(0, "key")] == got[(0, "value")] == got[(1, "value")] == "uniform"
    assert got[(1, "key")] == got[(2, "key")] == "normal"
    assert "normal levels (Lloyd-Max levels for a Gaussian" in policy.get(1, "key").reason
    assert "levels" not in policy.get(0, "key").reason
    # A saved calibration is refused once the levels change.
    assert policy.calibration_key() != build({"defaults": {"levels": "uniform"}}
                                             ).calibration_key()


def test_normal_levels_at_a_width_without_a_table_is_refused():
    raises({"defaults": {"bits": 8, "levels": "normal"}}, "'levels'", "normal levels have "
           "tables for [1, 2, 3, 4] bits, not 8", "use levels: uniform (or auto)")
    raises({"defaults": {"levels": "lloyd"}}, "levels")


def test_the_cache_quantizes_with_the_policy_levels():
    torch.manual_seed(0)
    model = tiny_model("llama")
    ids = torch.randint(0, 100, (1, 201))
    out = {}
    for levels in ("uniform", "normal"):
        compiled = kvpolicy.compile_model(
            tiny_model("llama"), policy={"defaults": {"bits": 2, "levels": levels}},
            progress=False)
        with torch.no_grad():
            cache = compiled(ids[:, :200], use_cache=True).past_key_values
            # A decode step reads the packed cache (the prefill attends exactly).
            step = compiled(ids[:, 200:], past_key_values=cache, use_cache=True)
        packed = cache.layers[0].packed
        assert packed.key_spec.levels == packed.value_spec.levels == levels
        assert packed.n_packed > 0
        out[levels] = step.logits
    with torch.no_grad():
        exact = model(ids).logits[:, -1:]
    # Normal levels store other codes than uniform ones: the outputs differ; both stay close
    # to the exact model's.
    assert not torch.equal(out["uniform"], out["normal"])
    for logits in out.values():
        assert (logits - exact).abs().max() < 0.2 * exact.abs().max()
