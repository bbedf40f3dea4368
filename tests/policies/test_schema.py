"""The policy schema (kvpolicy/policies/schema.py): round trips and loading a ModelPolicy."""

from __future__ import annotations

import pytest
import yaml
from policy_factories import build, layer_facts, write

from kvpolicy.errors import PolicyError
from kvpolicy.policies import ModelPolicy, PolicySpec, TensorPolicy

# --------------------------------------------------------------------------- round trips


def test_yaml_and_json_round_trip(tmp_path):
    policy = build(
        {
            "overrides": [
                {"layers": "0-1", "tensor": "key", "bits": 4},
                {"layers": 3, "tensor": "*", "bits": 16, "residual": 64},
            ]
        },
        facts=[layer_facts(0), layer_facts(1, rope=None), layer_facts(2), layer_facts(3)],
    )
    assert ModelPolicy.from_yaml(policy.to_yaml()) == policy
    assert ModelPolicy.from_json(policy.to_json()) == policy
    assert ModelPolicy.from_json(policy.to_json(indent=None)) == policy
    assert ModelPolicy.from_yaml(write(tmp_path, policy.to_yaml())) == policy
    assert ModelPolicy.from_json(str(write(tmp_path, policy.to_json(), "p.json"))) == policy
    data = yaml.safe_load(policy.to_yaml())
    assert data["version"] == 1 and data["tensors"][0]["axis"] == "channel"


def test_policy_is_frozen():
    policy = build()
    with pytest.raises(Exception, match="frozen"):
        policy.tensors[0].bits = 4  # type: ignore[misc]


# --------------------------------------------------------------------------- errors: loading


def test_model_policy_loading_goes_through_the_schema():
    data = build().model_dump(mode="json")
    data["tensors"][1]["bits"] = 5
    with pytest.raises(PolicyError) as info:
        ModelPolicy.from_yaml(yaml.safe_dump(data, allow_unicode=True))
    assert "tensors[1] (layer 0 value), field 'bits'" in str(info.value)
    assert "5 bits is not supported" in str(info.value)

    data = build().model_dump(mode="json")
    data["tensors"][0]["colour"] = "red"
    with pytest.raises(PolicyError, match=r"tensors\[0\] \(layer 0 key\), field 'colour'"):
        ModelPolicy.from_json(__import__("json").dumps(data))

    data = build().model_dump(mode="json")
    data["tensors"][2]["sinks"] = 0
    with pytest.raises(PolicyError, match="layer 1: key has sinks 0 but value has 4"):
        ModelPolicy.from_yaml(yaml.safe_dump(data, allow_unicode=True))

    data = build().model_dump(mode="json")
    data["tensors"] = data["tensors"][2:] + data["tensors"][:2]
    with pytest.raises(PolicyError, match="break the order"):
        ModelPolicy.from_yaml(yaml.safe_dump(data, allow_unicode=True))


def test_model_policy_loading_errors(tmp_path):
    with pytest.raises(PolicyError, match="empty policy"):
        ModelPolicy.from_yaml("\n\n")
    with pytest.raises(PolicyError, match="cannot parse JSON at line 1"):
        ModelPolicy.from_json("{not json")
    with pytest.raises(PolicyError, match="not found"):
        ModelPolicy.from_yaml(tmp_path / "missing.yaml")
    with pytest.raises(PolicyError, match="field 'tensors'"):
        ModelPolicy.from_yaml("version: 1\nmodel: x\ntensors: []\n")


def test_tensor_policy_validators():
    good = build().get(0, "key").model_dump()
    with pytest.raises(Exception, match="rotary_dim=80 exceeds head_dim=64"):
        TensorPolicy(**{**good, "rotary_dim": 80})
    with pytest.raises(Exception, match="set together"):
        TensorPolicy(**{**good, "rope": None})
    assert isinstance(PolicySpec(), PolicySpec)
