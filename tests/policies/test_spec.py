"""The spec models (kvpolicy/policies/spec.py): every field error, as load_spec reports it."""

from __future__ import annotations

import pytest
from policy_factories import raises, write

# --------------------------------------------------------------------------- errors: fields


@pytest.mark.parametrize(
    "spec, fragments",
    [
        ({"defaults": {"bitz": 2}}, ["<dict>, defaults, field 'bitz'", "did you mean 'bits'"]),
        (
            {
                "overrides": [
                    {"layers": 0, "tensor": "key", "bits": 4},
                    {"layers": 0, "groupsize": 8},
                ]
            },
            ["rule 2, field 'groupsize'", "unknown field", "did you mean 'group_size'"],
        ),
        ({"defaults": {"bits": 5}}, ["defaults, field 'bits'", "5 bits is not supported"]),
        (
            {"overrides": [{"layers": 0, "tensor": "key", "bits": 6}]},
            ["rule 1, field 'bits'", "use one of 1, 2, 3, 4, 8, 16"],
        ),
        (
            {"overrides": [{"layers": 0, "tensor": "key", "bits": "4"}]},
            ["rule 1, field 'bits'", "valid integer", "'4'"],
        ),
        ({"defaults": {"pre_rope": "maybe"}}, ["defaults, field 'pre_rope'", "valid boolean"]),
        ({"defaults": {"residual": -1}}, ["defaults, field 'residual'", "greater than or equal"]),
        ({"defaults": {"group_size": 0}}, ["defaults, field 'group_size'", "greater than 0"]),
        ({"defaults": {"axis": "chanel"}}, ["defaults, field 'axis'", "'channel' or 'token'"]),
        ({"defaults": [1, 2]}, ["<dict>, defaults: expected a mapping"]),
        ({"overrides": {"layers": 0}}, ["field 'overrides'", "a list"]),
        ({"overrides": None}, ["field 'overrides'", "a list"]),
        ({"overrides": ["bits: 4"]}, ["rule 1", "expected a mapping of fields"]),
        ({"version": 2, "defaults": {}}, ["top level, field 'version'", "Input should be 1"]),
        (
            {"overrides": [{"layers": 0, "tensor": "keys", "bits": 4}]},
            ["rule 1, field 'tensor'", "'key', 'value' or '*'", "'keys'"],
        ),
        ({"overrides": [{"tensor": "key", "bits": 4}]}, ["rule 1, field 'layers'", "missing"]),
        ({"overrides": [{"layers": 0, "bits": 4}]}, ["rule 1, field 'tensor'", "missing"]),
        (
            {"overrides": [{"layers": 0, "tensor": "key"}]},
            ["rule 1, field 'layers'", "sets nothing"],
        ),
        (
            {"defaults": {"bits": 3, "group_size": 12}},
            ["defaults, field 'group_size'", "byte boundary", "use 8 or 16"],
        ),
        (
            {"overrides": [{"layers": 0, "tensor": "key", "bits": 1, "group_size": 4}]},
            ["rule 1, field 'group_size'", "multiple of 8", "use 8"],
        ),
    ],
)
def test_error_spec_fields(spec, fragments):
    raises(spec, *fragments)


@pytest.mark.parametrize(
    "layers, fragment",
    [
        ("0..3", "cannot read '0..3'"),
        ("3-1", "runs backwards"),
        (-1, "negative"),
        (True, "got True"),
        ([], "the list is empty"),
        (["*"], "'*' cannot be inside a list"),
        ([0, 1.5], "list item 1.5"),
        (2.0, "got a float"),
    ],
)
def test_error_layer_selector_syntax(layers, fragment):
    spec = {"overrides": [{"layers": 0, "tensor": "key", "bits": 4}]}
    spec["overrides"].append({"layers": layers, "tensor": "key", "bits": 4})
    raises(spec, "rule 2, field 'layers'", fragment, 'a range "a-b" or "*"')


def test_errors_name_the_file_of_a_bad_rule(tmp_path):
    path = write(
        tmp_path,
        "defaults: {bits: 2}\noverrides:\n"
        "  - {layers: '0-3', tensor: key, bits: 4}\n"
        "  - {layers: '*', tensor: value, bits: 3, group_size: 12}\n",
    )
    raises(path, f"{path}, rule 2, field 'group_size'", "byte boundary")
