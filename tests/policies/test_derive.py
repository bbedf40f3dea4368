"""Deriving a policy from synthetic facts (kvpolicy/policies/derive.py), and the errors
build_policy raises and blames on a rule."""

from __future__ import annotations

import pytest
from policy_factories import (
    build,
    key_facts,
    layer_facts,
    model_facts,
    raises,
    rope_facts,
    value_facts,
)

from kvpolicy.errors import PolicyError
from kvpolicy.passes.facts import Contracted, RopeStyle
from kvpolicy.policies import (
    Axis,
    Defaults,
    PolicySpec,
    TensorKind,
    build_policy,
    list_presets,
    load_spec,
)

# --------------------------------------------------------------------------- derivation


def test_derived_axes_rope_and_reasons():
    policy = build()
    assert policy.num_layers == 4 and policy.layers == (0, 1, 2, 3)
    assert [t.tensor for t in policy.tensors[:2]] == [TensorKind.KEY, TensorKind.VALUE]
    key, value = policy.get(2, "key"), policy.get(2, TensorKind.VALUE)
    assert (key.layer, key.axis, key.pre_rope, key.derived_pre_rope) == (
        2,
        Axis.CHANNEL,
        True,
        True,
    )
    assert (value.axis, value.pre_rope, value.derived_pre_rope) == (Axis.TOKEN, False, False)
    # meta_bits auto at 2 bits: 8-bit metadata, keys in groups of 12 tokens (3.33 stored
    # bits), values in groups of 32 channels, rotated (2.5): 2.92 on average.
    assert (key.group_size, key.rotation, key.fit) == (12, "none", "mse")
    assert (value.group_size, value.rotation, value.fit) == (32, "hadamard", "minmax")
    assert policy.avg_stored_bits() == pytest.approx((2 + 16 / 12 + 2 + 16 / 32) / 2)
    for t in (key, value):
        assert (t.bits, t.meta_bits, t.residual, t.sinks) == (2, 8, 128, 4)
        assert ("the 3.0 stored bits per element of groups of 32 with fp16 metadata split "
                "toward the keys") in t.reason
        assert "keys in groups of 12 (3.33 bits), values in groups of 32 (2.50" in t.reason
        assert not t.overridden and t.derived_axis is t.axis and t.head_dim == 64
    assert "Walsh-Hadamard" in value.reason and "Walsh-Hadamard" not in key.reason
    assert (key.rope, key.rope_style, key.rotary_dim) == ("rotate_half 64/64", "rotate_half", 64)
    assert value.rope is None and value.rotary_dim is None
    assert key.contraction.startswith("q·kᵀ over head_dim=64")
    assert "q·kᵀ sums over channels" in key.reason
    assert "each channel gets its own scale (groups of 12 tokens)" in key.reason
    assert "quantized before rotate_half RoPE, which smears outlier channels" in key.reason
    assert "softmax·V sums over tokens" in value.reason
    assert "each token gets its own scale (groups of 32 channels)" in value.reason
    assert policy.model == "tiny" and policy.source == "kvpolicy-2" and policy.version == 1


def test_no_rope_means_nothing_to_move():
    key = build(facts=model_facts(rope=None)).get(0, "key")
    assert not key.pre_rope and not key.derived_pre_rope and key.rope is None
    assert not key.overridden
    assert "no RoPE on the key path" in key.reason and "nothing to move" in key.reason


def test_partial_and_interleaved_rope_are_described():
    rope = rope_facts(64, rotary_dim=16, style=RopeStyle.INTERLEAVED)
    key = build(facts=model_facts(rope=rope)).get(0, "key")
    assert key.rope == "interleaved 16/64" and key.rotary_dim == 16
    assert "interleaved RoPE on 16 of 64 channels" in key.reason


def test_axis_follows_the_facts_not_the_tensor_name():
    # A key that the analysis found contracted over tokens gets per-token scales.
    odd = [layer_facts(0, key=key_facts(contracted=Contracted.TOKEN))]
    key = build(facts=odd).get(0, "key")
    assert key.axis is Axis.TOKEN and key.derived_axis is Axis.TOKEN and not key.overridden
    assert "q·kᵀ sums over tokens" in key.reason


def test_overrides_apply_in_order_and_mark_what_they_change():
    spec = {
        "defaults": {"bits": 2},
        "overrides": [
            {"layers": "0-1", "tensor": "key", "bits": 4},
            {"layers": [1, 3], "tensor": "*", "bits": 8},
            {"layers": 2, "tensor": "value", "bits": 2},  # same as the defaults: no override
            {"layers": "*", "tensor": "value", "axis": "channel"},
        ],
    }
    policy = build(spec)
    bits = [(t.layer, t.tensor.value, t.bits) for t in policy.tensors]
    assert bits == [
        (0, "key", 4), (0, "value", 2), (1, "key", 8), (1, "value", 8),
        (2, "key", 2), (2, "value", 2), (3, "key", 8), (3, "value", 8),
    ]  # fmt: skip
    assert policy.get(0, "key").overridden and not policy.get(2, "key").overridden
    assert "rule 1 sets bits 4 (defaults: 2)" in policy.get(0, "key").reason
    assert "rule 2 sets bits 8 (defaults: 2)" in policy.get(1, "key").reason
    value = policy.get(2, "value")
    assert value.axis is Axis.CHANNEL and value.derived_axis is Axis.TOKEN and value.overridden
    assert "per-token scales were derived" in value.reason
    assert "rule 4 sets axis channel" in value.reason


def test_layer_selector_forms():
    spec = {
        "overrides": [
            {"layers": "2", "tensor": "key", "bits": 4},
            {"layers": " 0 - 1 ", "tensor": "value", "bits": 8},
            {"layers": [3, "0-0"], "tensor": "key", "bits": 3},
        ]
    }
    policy = build(spec)
    assert [t.bits for t in policy.tensors] == [3, 8, 2, 8, 4, 2, 3, 2]


def test_override_equal_to_derived_is_not_an_override():
    policy = build({"overrides": [{"layers": "*", "tensor": "key", "axis": "channel"}]})
    assert not any(t.overridden for t in policy.tensors)


def test_defaults_axis_counts_as_override_where_it_differs():
    policy = build({"defaults": {"axis": "channel"}})
    assert not policy.get(0, "key").overridden
    value = policy.get(0, "value")
    assert value.overridden and value.axis is Axis.CHANNEL
    assert "the defaults set axis channel" in value.reason


def test_post_rope_keys_are_an_override_with_the_derived_reason():
    policy = build({"defaults": {"pre_rope": False}})
    key = policy.get(0, "key")
    assert not key.pre_rope and key.derived_pre_rope and key.overridden
    assert "quantized after rotate_half RoPE" in key.reason
    assert "pre-RoPE was derived" in key.reason
    # Without RoPE, pre_rope false is what was derived anyway.
    assert (
        not build({"defaults": {"pre_rope": False}}, facts=model_facts(rope=None))
        .get(0, "key")
        .overridden
    )


def test_defaults_pre_rope_means_where_rope_exists():
    facts = [layer_facts(0, rope=None), layer_facts(1)]
    policy = build({"defaults": {"pre_rope": True}}, facts=facts)
    assert not policy.get(0, "key").pre_rope and policy.get(1, "key").pre_rope


# head_dim, bits -> the largest G <= the default group (32 for values) that divides
# head_dim with G*bits a multiple of 8, among powers of two and head_dim itself (20 would
# fit 80 at 2 bits, but the kernels pad a group to the next power of two).
@pytest.mark.parametrize(
    "head_dim, bits, expected",
    [(80, 2, 16), (16, 2, 16), (40, 2, 8), (24, 2, 24), (80, 3, 16), (12, 4, 12), (80, 4, 16)],
)
@pytest.mark.parametrize("policy", [None, "kvpolicy-2", {"defaults": {"sinks": 0}}])
def test_default_group_size_shrinks_to_fit_head_dim(policy, head_dim, bits, expected):
    if policy == "kvpolicy-2":
        policy = f"kvpolicy-{bits}" if f"kvpolicy-{bits}" in list_presets() else None
    facts = model_facts(2, head_dim=head_dim, rope=None)
    built = build(policy, bits=bits, facts=facts)
    key, value = built.get(1, "key"), built.get(1, "value")
    default = 32
    assert {key.meta_bits, value.meta_bits} == {8 if bits == 2 else 16}
    assert (value.axis, value.group_size, value.overridden) == (Axis.TOKEN, expected, False)
    assert f"groups of {expected} channels" in value.reason
    shrunk = f"group {expected}: the default {default} does not divide head_dim={head_dim}"
    assert (shrunk in value.reason) == (expected != default)
    # Per-channel keys group tokens, so head_dim does not constrain them (12 at 2 bits with
    # 8-bit metadata).
    assert (key.group_size, key.overridden) == (12 if bits == 2 else 32, False)
    assert "does not divide" not in key.reason


@pytest.mark.parametrize("head_dim", [16, 80])
def test_default_group_size_shrinks_for_presets(head_dim):
    facts = model_facts(2, head_dim=head_dim)
    # kivi-2 pins fp16 metadata, so its default group is 32 and shrinks; so does
    # kvpolicy-2's value group of 32 with 8-bit metadata (its keys group tokens: any fits).
    # Only a power-of-two head_dim has a Hadamard rotation.
    value = build("kivi-2", facts=facts).get(0, "value")
    assert (value.group_size, value.meta_bits, value.overridden) == (16, 16, False)
    assert f"the default 32 does not divide head_dim={head_dim}" in value.reason
    policy = build("kvpolicy-2", facts=facts)
    value = policy.get(0, "value")
    assert (value.group_size, value.meta_bits, value.overridden) == (16, 8, False)
    assert f"the default 32 does not divide head_dim={head_dim}" in value.reason
    assert value.rotation == ("hadamard" if head_dim == 16 else "none")
    assert policy.get(0, "key").group_size == 12
    # A preset's rules that pin the derived axis leave the fallback alone; an axis rule that
    # makes keys per-token shrinks their (default) group too, and only the axis overrides.
    spec = {"defaults": {"meta_bits": 16},
            "overrides": [{"layers": "*", "tensor": "key", "axis": "token"}]}
    key = build(spec, facts=facts).get(0, "key")
    assert (key.axis, key.group_size, key.overridden) == (Axis.TOKEN, 16, True)
    assert "rule 1 sets axis token" in key.reason and "the default 32 does not" in key.reason
    assert "group_size" not in key.reason


def test_default_group_size_shrinks_only_for_the_tensors_no_rule_sets():
    facts = model_facts(2, head_dim=80)
    # A group size written for the keys says nothing about the values' group size.
    spec = {"overrides": [{"layers": "*", "tensor": "key", "group_size": 64}]}
    policy = build(spec, facts=facts)
    assert policy.get(0, "key").group_size == 64 and policy.get(0, "value").group_size == 16
    # Written for the values, it is the user's and stays an error.
    spec = {"overrides": [{"layers": 1, "tensor": "value", "group_size": 32}]}
    raises(spec, "rule 1, field 'group_size'", "32 does not divide head_dim=80", facts=facts)
    # A rule that writes the fallback's value is an override like any other.
    spec = {"overrides": [{"layers": 1, "tensor": "value", "group_size": 16}]}
    policy = build(spec, facts=facts)
    shrunk, written = policy.get(0, "value"), policy.get(1, "value")
    assert (shrunk.group_size, shrunk.overridden) == (16, False)
    assert (written.group_size, written.overridden) == (16, True)
    assert "rule 1 sets group_size 16 (defaults: 32)" in written.reason
    assert "does not divide" not in written.reason


def test_spec_objects_tell_a_given_group_size_from_the_default():
    facts = model_facts(1, head_dim=80)
    for spec in (PolicySpec(), PolicySpec(defaults=Defaults(bits=2, sinks=0))):
        assert build_policy(facts, spec).get(0, "value").group_size == 16
    with pytest.raises(PolicyError, match=r"32 does not divide head_dim=80 .*; use 16 or 80"):
        build_policy(facts, PolicySpec(defaults=Defaults(group_size=32)))
    # Presets load with nothing marked as given; a user's document marks what it writes.
    assert "group_size" not in load_spec("kvpolicy-2").defaults.model_fields_set
    assert "group_size" in load_spec({"defaults": {"group_size": 32}}).defaults.model_fields_set


def test_default_group_size_without_a_fitting_size_is_still_an_error():
    # 6 channels at 2 bits: 6 and 3 do not fill whole bytes, 2 and 1 neither.
    raises(
        None,
        "kvpolicy-2, defaults, field 'group_size'",
        "32 does not divide head_dim=6",
        facts=model_facts(1, head_dim=6, rope=None),
    )


def test_full_precision_and_avg_bits():
    policy = build({"overrides": [{"layers": 0, "tensor": "*", "bits": 16}]})
    key = policy.get(0, "key")
    assert key.full_precision and key.overridden and "kept in full precision" in key.reason
    assert "cached before rotate_half RoPE" in key.reason
    assert policy.avg_bits == pytest.approx((16 * 2 + 2 * 6) / 8)


def test_avg_bits_weights_by_head_dim():
    facts = [layer_facts(0, key=key_facts(128), value=value_facts(64))]
    policy = build({"overrides": [{"layers": 0, "tensor": "key", "bits": 4}]}, facts=facts)
    assert policy.avg_bits == pytest.approx((4 * 128 + 2 * 64) / 192)


def test_non_contiguous_layers_for_hybrid_models():
    facts = [layer_facts(3), layer_facts(7)]
    policy = build({"overrides": [{"layers": "0-5", "tensor": "key", "bits": 4}]}, facts=facts)
    assert policy.layers == (3, 7)
    assert policy.get(3, "key").bits == 4 and policy.get(7, "key").bits == 2
    with pytest.raises(KeyError, match="layer 5 is not in this policy"):
        policy.get(5, "key")
    raises(
        {"overrides": [{"layers": 5, "tensor": "key", "bits": 4}]},
        "rule 1, field 'layers'",
        "layer 5 is out of range",
        "2 attention layers (3, 7)",
        facts=facts,
    )


def test_pre_rope_false_on_values_and_layers_without_rope_is_fine():
    facts = [layer_facts(0, rope=None)]
    spec = {"overrides": [{"layers": "*", "tensor": "*", "pre_rope": False}]}
    assert not any(t.overridden for t in build(spec, facts=facts).tensors)


# --------------------------------------------------------------------------- errors: derivation


@pytest.mark.parametrize(
    "layers, fragment",
    [(4, "layer 4 is out of range"), ("2-9", "'2-9' reaches layer 9"), ([0, 7], "layer 7")],
)
def test_error_layers_out_of_range(layers, fragment):
    spec = {"overrides": [{"layers": layers, "tensor": "*", "bits": 4}]}
    raises(spec, "<dict>, rule 1, field 'layers'", fragment, "the model has 4 layers (0-3)")


def test_error_group_size_does_not_divide_head_dim():
    facts = model_facts(2, head_dim=48)
    # Written by the user, the group size is kept and refused; the default would shrink.
    raises(
        {"defaults": {"group_size": 32}},
        "<dict>, defaults, field 'group_size'",
        "32 does not divide head_dim=48",
        "use 16 or 48",
        "(layer 0 value)",
        facts=facts,
    )
    raises(
        {"defaults": {"group_size": 32}},
        "32 does not divide head_dim=80",
        "use 16 or 80",
        facts=model_facts(1, head_dim=80),
    )
    # A rule that makes keys per-token is blamed, not the defaults that were fine before.
    raises(
        {
            "defaults": {"group_size": 64},
            "overrides": [{"layers": 1, "tensor": "key", "axis": "token"}],
        },
        "rule 1, field 'axis'",
        "64 does not divide head_dim=48",
        "use 48",
        "(layer 1 key)",
        facts=[layer_facts(i, key=key_facts(48), value=value_facts(64)) for i in (0, 1)],
    )
    # Per-channel keys group tokens: any head_dim is fine for them.
    assert build({"defaults": {"group_size": 64}}, facts=model_facts(1, head_dim=64)).get(0, "key")


def test_error_pinned_axis_is_not_blamed_for_the_group_size():
    # Like kivi-2 (V pinned per-token by a rule) but with the group size written out: the
    # conflict is the group size, not the rule that restates the derived axis.
    spec = {
        "defaults": {"group_size": 32},
        "overrides": [{"layers": "*", "tensor": "value", "axis": "token"}],
    }
    raises(
        spec,
        "<dict>, defaults, field 'group_size'",
        "32 does not divide head_dim=16",
        "use 16",
        facts=model_facts(2, head_dim=16),
    )


def test_error_group_size_set_by_rule_is_blamed_on_the_rule():
    spec = {
        "overrides": [
            {"layers": "*", "tensor": "value", "bits": 4},
            {"layers": 1, "tensor": "value", "group_size": 48},
        ]
    }
    raises(spec, "rule 2, field 'group_size'", "48 does not divide head_dim=64", "use 32 or 64")


@pytest.mark.parametrize("field", ["residual", "sinks"])
def test_error_key_and_value_must_share_segmentation(field):
    spec = {"overrides": [{"layers": 2, "tensor": "key", field: 64}]}
    raises(
        spec,
        f"<dict>, rule 1, field '{field}'",
        f"layer 2: key has {field} 64",
        "must share residual and sinks",
        "one segmentation",
        "tensor: '*'",
    )
    same = {"overrides": [{"layers": 2, "tensor": "*", field: 64}]}
    assert getattr(build(same).get(2, "value"), field) == 64


def test_error_pre_rope_on_a_layer_without_rope():
    facts = [layer_facts(0, rope=None), layer_facts(1)]
    raises(
        {"overrides": [{"layers": "*", "tensor": "key", "pre_rope": True}]},
        "rule 1, field 'pre_rope'",
        "no RoPE",
        "(layer 0 key)",
        facts=facts,
    )
    raises(
        {"overrides": [{"layers": 1, "tensor": "*", "pre_rope": True}]},
        "rule 1, field 'pre_rope'",
        "values are never rotated",
        "(layer 1 value)",
        facts=facts,
    )
