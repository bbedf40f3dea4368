"""8-bit metadata as a policy choice: ``meta_bits`` in YAML, the spec the cache runs, the
stored bits it costs and the budget's accounting of it."""

from __future__ import annotations

import pytest
from policy_factories import build

from kvpolicy.errors import PolicyError
from kvpolicy.kernels.layout import QuantSpec


def test_meta_bits_default_is_8_bits_at_2_bits_only_with_groups_split_toward_keys():
    policy = build()
    assert {t.meta_bits for t in policy.tensors} == {8}
    assert policy.tensors[0].quant_spec() == QuantSpec(2, 12, "channel", "uniform", 8, "mse")
    assert policy.tensors[1].quant_spec() == QuantSpec(2, 32, "token", "uniform", 8, "minmax")
    assert policy.tensors[1].rotation == "hadamard"
    # Under the 3.0 stored bits of groups of 32 with fp16 metadata.
    assert policy.avg_stored_bits() == pytest.approx(35 / 12)
    assert policy.avg_stored_bits() < build({"defaults": {"meta_bits": 16}}).avg_stored_bits()
    # A rotation written anywhere is the user's: none stays none.
    assert build({"defaults": {"rotation": "none"}}).tensors[1].rotation == "none"
    # Other widths, a written group size, normal levels, fp16 pinned: the cache dtype.
    for spec in ({"defaults": {"bits": 3}}, {"defaults": {"bits": 4}},
                 {"defaults": {"group_size": 32}}, {"defaults": {"levels": "normal"}},
                 {"defaults": {"meta_bits": 16}}, "kivi-2"):
        tensors = build(spec).tensors
        assert {t.meta_bits for t in tensors} == {16}, spec
        assert {t.group_size for t in tensors} == {32}, spec
    # A rule's width decides per tensor: 2 bits under a 4-bit default takes 8-bit metadata
    # and groups of 12, a 4-bit rule under the 2-bit default fp16 metadata and groups of 32.
    mixed = build({"defaults": {"bits": 4},
                   "overrides": [{"layers": 0, "tensor": "key", "bits": 2}]})
    assert (mixed.get(0, "key").meta_bits, mixed.get(0, "key").group_size) == (8, 12)
    assert (mixed.get(0, "value").meta_bits, mixed.get(0, "value").group_size) == (16, 32)
    assert mixed.get(0, "value").rotation == "none"
    mixed = build({"overrides": [{"layers": 0, "tensor": "key", "bits": 4}]})
    assert (mixed.get(0, "key").meta_bits, mixed.get(0, "key").group_size) == (16, 32)
    assert (mixed.get(1, "key").meta_bits, mixed.get(1, "key").group_size) == (8, 12)


def test_meta_bits_8_halves_the_metadata_in_spec_bytes_and_table():
    policy = build({"defaults": {"bits": 2, "group_size": 16, "meta_bits": 8}})
    key = policy.tensors[0]
    assert key.quant_spec() == QuantSpec(2, 16, "channel", "uniform", 8, "mse")
    # 2-bit codes plus a one-byte scale and zero per group of 16: 3.0 stored bits, what
    # groups of 32 cost with fp16 metadata.
    assert key.stored_bits() == pytest.approx(3.0)
    assert policy.avg_stored_bits() == pytest.approx(
        build({"defaults": {"meta_bits": 16}}).avg_stored_bits())
    assert "scale and zero in 8 bits" in key.reason
    table = str(policy)
    row = table.splitlines()[3].split()
    assert row[4:7] == ["16", "uniform", "8"]
    assert "5.33x smaller" in table.splitlines()[-2]


def test_meta_bits_override_per_tensor():
    policy = build({"defaults": {"meta_bits": 16},
                    "overrides": [{"layers": "*", "tensor": "value", "meta_bits": 8}]})
    assert [t.meta_bits for t in policy.tensors[:2]] == [16, 8]
    assert policy.tensors[1].stored_bits() == pytest.approx(2.5)


def test_meta_bits_8_with_auto_levels_is_uniform_and_normal_is_refused():
    policy = build({"defaults": {"bits": 2, "meta_bits": 8, "levels": "auto"}})
    assert {t.code_levels for t in policy.tensors} == {"uniform"}
    with pytest.raises(PolicyError, match="normal levels do not have"):
        build({"defaults": {"bits": 2, "meta_bits": 8, "levels": "normal"}})


def test_meta_bits_other_widths_are_refused():
    with pytest.raises(PolicyError, match="meta_bits"):
        build({"defaults": {"bits": 2, "meta_bits": 4}})


def test_meta_bits_change_the_calibration_key():
    assert build().calibration_key != build({"defaults": {"meta_bits": 16}}).calibration_key
    assert (build({"defaults": {"group_size": 32}}).calibration_key
            != build({"defaults": {"group_size": 32, "meta_bits": 8}}).calibration_key)


def test_a_stored_budget_with_8_bit_metadata_chooses_among_halved_groups():
    def groups(**defaults):
        return build({"defaults": {"stored_bits": 3.0, **defaults}}).tensors[0].group_sizes

    assert groups(meta_bits=8) == (16, 32, 64)
    assert groups(meta_bits=16) == (32, 64, 128)
    # auto (the default) measures both widths of metadata, at both sets of groups.
    assert groups() == (16, 32, 64, 128)


def test_auto_is_16_bits_under_a_code_budget_and_chosen_under_a_stored_one():
    budget = build({"defaults": {"bits": 2.5}}).tensors
    assert {t.meta_bits for t in budget} == {16} and {t.group_size for t in budget} == {32}
    stored = build({"defaults": {"stored_bits": 3.0}})
    assert {t.meta_bits for t in stored.tensors} == {"auto"}
    assert stored.tensors[0].quant_spec().meta_bits == 16


def test_the_cache_stores_one_byte_scales_and_zeros_and_decodes_close_to_fp16_metadata():
    import torch

    import kvpolicy
    from kvpolicy.zoo.tiny import tiny_model

    torch.manual_seed(0)
    ids = torch.randint(0, 100, (1, 201))
    out, stats = {}, {}
    for meta in (16, 8):
        compiled = kvpolicy.compile_model(
            tiny_model("llama"),
            policy={"defaults": {"bits": 2, "group_size": 32, "meta_bits": meta}},
            progress=False)
        with torch.no_grad():
            cache = compiled(ids[:, :200], use_cache=True).past_key_values
            step = compiled(ids[:, 200:], past_key_values=cache, use_cache=True)
        packed = cache.layers[0].packed
        assert packed.key_spec.meta_bits == packed.value_spec.meta_bits == meta
        k, v = packed._packed()
        want = (torch.uint8, torch.int8) if meta == 8 else (torch.float16, torch.float16)
        assert (k.scale.dtype, k.zero.dtype) == (v.scale.dtype, v.zero.dtype) == want
        out[meta], stats[meta] = step.logits, packed.memory_report()
    with torch.no_grad():
        exact = tiny_model("llama")(ids).logits[:, -1:]
    assert not torch.equal(out[8], out[16])
    for logits in out.values():
        assert (logits - exact).abs().max() < 0.2 * exact.abs().max()
    # Half the metadata bytes, the same code bytes.
    assert stats[8]["scale_bytes"] * 2 == stats[16]["scale_bytes"]
    assert stats[8]["code_bytes"] == stats[16]["code_bytes"]


def test_fit_auto_is_mse_for_keys_with_8_bit_metadata_at_a_fixed_width():
    policy = build()
    key, value = policy.get(0, "key"), policy.get(0, "value")
    assert (key.fit, value.fit) == ("mse", "minmax")
    assert key.quant_spec().fit == "mse" and value.quant_spec().fit == "minmax"
    assert "grid fitted by least squared error" in key.reason
    assert "least squared error" not in value.reason
    # fp16 metadata (also a code-bits budget's): min-max.
    for spec in ({"defaults": {"meta_bits": 16}}, {"defaults": {"bits": 2.5}}):
        assert {t.fit for t in build(spec).tensors} == {"minmax"}, spec
    # 8-bit metadata under a budget, or metadata a stored-bits budget may make 8-bit: the
    # keys are fitted (the calibration measures the fitted grid), the values are not.
    for spec in ({"defaults": {"stored_bits": 3.0}},
                 {"defaults": {"bits": 2.5, "group_size": 16, "meta_bits": 8}}):
        policy = build(spec)
        assert {t.fit for t in policy.tensors if t.tensor.value == "key"} == {"mse"}, spec
        assert {t.fit for t in policy.tensors if t.tensor.value == "value"} == {"minmax"}
    assert "where the budget chooses 8-bit metadata" in build(
        {"defaults": {"stored_bits": 3.0}}).get(0, "key").reason


def test_fit_is_a_yaml_key_per_tensor_and_part_of_the_calibration_key():
    policy = build({"defaults": {"fit": "minmax"},
                    "overrides": [{"layers": 1, "tensor": "value", "fit": "mse"}]})
    assert policy.get(0, "key").fit == "minmax" and policy.get(1, "value").fit == "mse"
    assert policy.get(1, "value").quant_spec().fit == "mse"
    assert build().calibration_key != build({"defaults": {"fit": "minmax"}}).calibration_key
    with pytest.raises(PolicyError, match="fit: mse searches the 8-bit scale table"):
        build({"defaults": {"meta_bits": 16, "fit": "mse"}})
    with pytest.raises(PolicyError, match="fit"):
        build({"defaults": {"fit": "best"}})
