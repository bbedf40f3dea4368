"""Command line: argument parsing, output formats, exit codes.

``kvpolicy.api``, ``kvpolicy.zoo`` and ``kvpolicy.testing`` are replaced by stand-in
modules here, so these tests need neither a model nor the analysis; the full
``inspect`` run on SmolLM2 lives with the end-to-end tests.
"""

from __future__ import annotations

import json
import subprocess
import sys
import types

import pytest

from kvpolicy.cli import main
from kvpolicy.facts import Contracted, LayerFacts, RopeFacts, RopeStyle, TensorFacts
from kvpolicy.policy import ModelPolicy, build_policy, load_spec


def _facts(n: int = 3) -> list[LayerFacts]:
    rope = RopeFacts(RopeStyle.ROTATE_HALF, 64, 64, "cos", "sin", "k", "rotate-half RoPE")
    key = TensorFacts("key", Contracted.CHANNEL, 64, 3, "q·kᵀ over head_dim=64", "k", "sdpa", rope)
    value = TensorFacts("value", Contracted.TOKEN, 64, 3, "softmax·V over tokens", "v", "sdpa")
    return [LayerFacts(i, "Attn", key, value) for i in range(n)]


@pytest.fixture
def fake(monkeypatch):
    """Stand-ins for api/zoo/testing; records the calls made to them."""
    calls: dict[str, object] = {}

    def derive_policy(model, bits=2, policy=None):
        calls["derive"] = (model, bits, policy)
        return build_policy(_facts(), load_spec(policy, bits=bits), model_name=str(model))

    def load(name):
        calls["zoo"] = name
        return (f"model:{name}", "tokenizer")

    def tiny_model(arch):
        calls["tiny"] = arch
        if arch != "llama":
            raise KeyError(f"no tiny model for architecture {arch!r}; known: llama")
        return f"tiny:{arch}"

    for name, attrs in {
        "kvpolicy.api": {"derive_policy": derive_policy},
        "kvpolicy.zoo": {"load": load},
        "kvpolicy.testing": {"tiny_model": tiny_model},
    }.items():
        module = types.ModuleType(name)
        module.__dict__.update(attrs)
        monkeypatch.setitem(sys.modules, name, module)
    return calls


def test_inspect_prints_the_table(fake, capsys):
    assert main(["inspect", "--model", "smollm2-135m"]) == 0
    out = capsys.readouterr().out
    assert fake["zoo"] == "smollm2-135m"
    assert fake["derive"] == ("model:smollm2-135m", 2, None)
    assert "policy kvpolicy-2: 3 attention layers" in out
    assert "0-2     key     channel  2" in out and "q·kᵀ sums over channels" in out


def test_inspect_passes_bits_and_policy(fake, capsys):
    assert main(["inspect", "--model", "smollm2-135m", "--bits", "4", "--policy", "kivi-4"]) == 0
    assert fake["derive"] == ("model:smollm2-135m", 4, "kivi-4")
    assert "policy kivi-4" in capsys.readouterr().out


def test_inspect_tiny_architecture(fake, capsys):
    assert main(["inspect", "--model", "tiny-llama"]) == 0
    assert fake["tiny"] == "llama" and "zoo" not in fake
    assert fake["derive"][0] == "tiny:llama"


@pytest.mark.parametrize(
    "fmt, load", [("yaml", ModelPolicy.from_yaml), ("json", ModelPolicy.from_json)]
)
def test_inspect_formats_round_trip(fake, capsys, fmt, load):
    assert main(["inspect", "--model", "m", "--format", fmt, "--bits", "3"]) == 0
    policy = load(capsys.readouterr().out)
    assert policy.model == "model:m" and policy.get(1, "value").bits == 3
    if fmt == "json":
        assert json.loads(policy.to_json())["version"] == 1


def test_policy_error_exits_2_with_the_message(fake, capsys, tmp_path):
    missing = tmp_path / "missing.yaml"
    assert main(["inspect", "--model", "m", "--policy", str(missing)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kvpolicy: error: ")
    assert str(missing) in err and "not found" in err and "kivi-2" in err


def test_bad_rule_in_file_exits_2(fake, capsys, tmp_path):
    path = tmp_path / "p.yaml"
    path.write_text("overrides:\n  - {layers: '0-9', tensor: key, bits: 4}\n")
    assert main(["inspect", "--model", "m", "--policy", str(path)]) == 2
    err = capsys.readouterr().err
    assert f"{path}, rule 1, field 'layers'" in err and "the model has 3 layers (0-2)" in err


def test_unknown_tiny_architecture_exits_2(fake, capsys):
    assert main(["inspect", "--model", "tiny-nope"]) == 2
    err = capsys.readouterr().err
    assert "kvpolicy: error: --model tiny-nope: no tiny model for architecture 'nope'" in err


@pytest.mark.parametrize(
    "argv, fragment",
    [
        (["inspect"], "--model"),
        (["inspect", "--model", "m", "--bits", "5"], "5 is not a width; use one of 1, 2"),
        (["inspect", "--model", "m", "--bits", "0.5"], "a budget of 0.5 bits is outside"),
        (["inspect", "--model", "m", "--bits", "two"], "'two' is not a number of bits"),
        (["inspect", "--model", "m", "--format", "xml"], "invalid choice: 'xml'"),
        ([], "COMMAND"),
        (["frobnicate"], "invalid choice: 'frobnicate'"),
    ],
)
def test_usage_errors_exit_2(argv, fragment, capsys):
    assert main(argv) == 2
    assert fragment in capsys.readouterr().err


def test_help_exits_0(capsys):
    assert main(["--help"]) == 0
    assert "inspect" in capsys.readouterr().out
    assert main(["inspect", "--help"]) == 0
    assert "--policy FILE_OR_PRESET" in capsys.readouterr().out


def test_presets_command(capsys):
    assert main(["presets"]) == 0
    assert {"kivi-2", "kivi-4", "kvpolicy-2", "kvpolicy-4"} <= set(capsys.readouterr().out.split())


def test_python_dash_m_entry_point():
    done = subprocess.run(
        [sys.executable, "-m", "kvpolicy", "--help"], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0 and "inspect" in done.stdout


def test_inspect_end_to_end_on_a_tiny_model(capsys):
    assert main(["inspect", "--model", "tiny-gpt_neox", "--bits", "4"]) == 0
    out = capsys.readouterr().out
    assert "q·kᵀ over head_dim=32" in out and "softmax·V over tokens" in out
    assert "rotate_half RoPE on 8 of 32 channels" in out  # partial rotary, derived


@pytest.mark.real_model
def test_inspect_end_to_end_on_smollm2(capsys):
    assert main(["inspect", "--model", "smollm2-135m", "--format", "json"]) == 0
    policy = ModelPolicy.from_json(capsys.readouterr().out)
    assert policy.num_layers == 30
    assert policy.get(0, "key").pre_rope and policy.get(29, "value").axis == "token"
