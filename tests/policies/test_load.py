"""Loading a spec (kvpolicy/policies/load.py): presets, files, dicts, and every error of
reading them."""

from __future__ import annotations

import pytest
import yaml
from policy_factories import build, raises, write

from kvpolicy.errors import PolicyError
from kvpolicy.policies import Axis, Defaults, list_presets, load_spec

# --------------------------------------------------------------------------- presets


def test_presets_ship_and_differ_where_they_should():
    assert {"kvpolicy-2", "kvpolicy-4", "kivi-2", "kivi-4"} <= set(list_presets())
    kv2, kv4 = load_spec("kvpolicy-2"), load_spec("kvpolicy-4")
    kivi2, kivi4 = load_spec("kivi-2"), load_spec("kivi-4")
    assert kv2.defaults == Defaults(bits=2, group_size=32, residual=128, sinks=4, pre_rope=True)
    assert kv4.defaults == kv2.defaults.model_copy(update={"bits": 4})
    assert kivi2.defaults == Defaults(bits=2, group_size=32, residual=128, sinks=0, pre_rope=False,
                                      levels="uniform", meta_bits=16,
                                      channel_widths="uniform")  # KIVI: fp16 min-max grids
    assert kv2.defaults.meta_bits == "auto" and kv2.defaults.channel_widths == "auto"
    assert kv2.defaults.levels == "auto"
    assert kivi4.defaults.bits == 4 and kivi4.overrides == kivi2.overrides
    assert kivi2.source == "kivi-2"


def test_bits_without_policy_means_kvpolicy_defaults():
    assert load_spec(None, bits=2) == load_spec("kvpolicy-2")
    assert load_spec(None, bits=4).defaults == load_spec("kvpolicy-4").defaults
    three = load_spec(None, bits=3)
    assert three.source == "kvpolicy-3" and three.defaults.bits == 3
    assert three.defaults.model_copy(update={"bits": 2}) == load_spec("kvpolicy-2").defaults
    assert build(None, bits=16).avg_bits == 16


def test_kivi_preset_keeps_keys_post_rope_and_no_sinks():
    policy = build("kivi-2")
    key, value = policy.get(0, "key"), policy.get(0, "value")
    assert (key.axis, key.pre_rope, key.sinks, key.residual) == (Axis.CHANNEL, False, 0, 128)
    assert key.overridden and "pre-RoPE was derived" in key.reason
    assert value.axis is Axis.TOKEN and not value.overridden
    assert build("kivi-4").get(0, "value").bits == 4


def test_file_dict_and_spec_inputs(tmp_path):
    text = """
defaults: {bits: 2, group_size: 32, residual: 128, sinks: 4}
overrides:
  - {layers: "0-3", tensor: key, bits: 4}
  - {layers: "*", tensor: value, axis: channel}
"""
    path = write(tmp_path, text)
    from_file = load_spec(path)
    from_str = load_spec(str(path))
    from_dict = load_spec(yaml.safe_load(text))
    assert from_file.source == str(path) and from_dict.source == "<dict>"
    assert from_file.overrides == from_str.overrides == from_dict.overrides
    assert load_spec(from_file) is from_file
    assert build(from_file).get(3, "key").bits == 4


def test_missing_defaults_fields_come_from_kvpolicy_bits():
    spec = load_spec({"defaults": {"sinks": 0}}, bits=4)
    assert (spec.defaults.bits, spec.defaults.sinks, spec.defaults.group_size) == (4, 0, 32)


# --------------------------------------------------------------------------- errors: files


def test_error_empty_file(tmp_path):
    path = write(tmp_path, "")
    raises(path, str(path), "empty policy file")
    raises(write(tmp_path, "# only a comment\n", "c.yaml"), "c.yaml", "empty policy file")


def test_error_unparsable_yaml_names_line(tmp_path):
    path = write(tmp_path, "defaults:\n  bits: 2\noverrides: [\n  {layers: 1, tensor: key\n")
    message = raises(path, str(path), "cannot parse YAML at line")
    assert "line 4" in message or "line 5" in message


def test_error_unparsable_yaml_quotes_offending_line(tmp_path):
    path = write(tmp_path, "defaults: {bits: 2}\noverrides:\n  - {layers: '*', tensor: *}\n")
    raises(path, str(path), "line 3", "tensor: *")


def test_error_duplicate_key(tmp_path):
    path = write(tmp_path, "defaults:\n  bits: 2\n  bits: 4\n")
    raises(path, str(path), "duplicate key 'bits'", "line 2")


def test_error_top_level_not_mapping(tmp_path):
    raises(write(tmp_path, "- bits: 2\n"), "policy.yaml", "top level must be a mapping", "list")


def test_error_unknown_top_level_key(tmp_path):
    path = write(tmp_path, "overides: []\n")
    raises(path, str(path), "top level, field 'overides'", "did you mean 'overrides'")


def test_error_full_model_policy_given_as_spec(tmp_path):
    path = write(tmp_path, build().to_yaml())
    raises(path, "field 'model'", "unknown key")


def test_error_file_not_found_lists_presets(tmp_path):
    raises(str(tmp_path / "nope.yaml"), "nope.yaml", "not found", "kivi-2", "kvpolicy-4")
    raises("kivi2", "did you mean the preset 'kivi-2'")


def test_error_empty_dict_and_wrong_policy_type():
    raises({}, "<dict>", "empty policy")
    with pytest.raises(PolicyError, match="policy must be a preset name"):
        load_spec(3)  # type: ignore[arg-type]


@pytest.mark.parametrize("bits", [0, 5, 32, True, "2"])
def test_error_bits_argument(bits):
    with pytest.raises(PolicyError, match="use one of 1, 2, 3, 4, 8, 16"):
        load_spec(None, bits=bits)
