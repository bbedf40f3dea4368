"""Command line: argument parsing, output formats, exit codes.

``kvpolicy.api``, ``kvpolicy.zoo`` and ``kvpolicy.zoo.tiny`` are replaced by stand-in
modules here, so these tests need neither a model nor the analysis; the full
``inspect`` run on SmolLM2 lives with the end-to-end tests.
"""

from __future__ import annotations

import json
import subprocess
import sys
import types

import pytest
import torch
from torch import nn

from kvpolicy import cli
from kvpolicy.calibrate.budget import calibration_ids_from_file
from kvpolicy.cli import main
from kvpolicy.errors import KVPolicyError
from kvpolicy.passes.facts import Contracted, LayerFacts, RopeFacts, RopeStyle, TensorFacts
from kvpolicy.policies import ModelPolicy, build_policy, load_spec


def _facts(n: int = 3) -> list[LayerFacts]:
    rope = RopeFacts(RopeStyle.ROTATE_HALF, 64, 64, "cos", "sin", "k", "rotate-half RoPE")
    key = TensorFacts("key", Contracted.CHANNEL, 64, 3, "q·kᵀ over head_dim=64", "k", "sdpa", rope)
    value = TensorFacts("value", Contracted.TOKEN, 64, 3, "softmax·V over tokens", "v", "sdpa")
    return [LayerFacts(i, "Attn", key, value) for i in range(n)]


@pytest.fixture
def fake(monkeypatch):
    """Stand-ins for the api, zoo and tiny-model modules the CLI calls; records the calls."""
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

    for attr, fns in {
        "api": {"derive_policy": derive_policy},
        "zoo": {"load": load},
        "tiny": {"tiny_model": tiny_model},
    }.items():
        monkeypatch.setattr(cli, attr, types.SimpleNamespace(**fns))
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


# --------------------------------------------------------------------------- --calibration
# tiny-llama has no tokenizer beside it: before --calibration, no budget from the CLI.


def _ids(path, shape=(1, 256), seed=0):
    """Token ids of the tiny models' vocabulary saved with torch.save. 256 tokens: the
    default windows (sinks 4 + residual 128 + a group of 32) need at least 164."""
    gen = torch.Generator().manual_seed(seed)
    torch.save(torch.randint(3, 120, shape, generator=gen), path)
    return str(path)


def test_inspect_budget_calibrates_on_token_ids(capsys, tmp_path):
    ids = _ids(tmp_path / "ids.pt")
    assert main(["inspect", "--model", "tiny-llama", "--bits", "2.5", "--calibration", ids]) == 0
    out = capsys.readouterr().out
    assert "(budget 2.5" in out
    assert "measured on user token ids" in out and "pydoc" not in out


def test_inspect_calibration_ids_of_one_dimension_are_one_row(capsys, tmp_path):
    ids = _ids(tmp_path / "ids.pth", shape=(200,))
    argv = ["inspect", "--model", "tiny-llama", "--bits", "3.0", "--calibration", ids,
            "--format", "json"]
    assert main(argv) == 0
    policy = ModelPolicy.from_json(capsys.readouterr().out)
    assert policy.budget == 3.0
    assert policy.calibration.source == "user token ids"
    assert (policy.calibration.rows, policy.calibration.tokens) == (1, 200)  # all of it


def test_inspect_calibration_with_a_budget_in_the_policy_file(capsys, tmp_path):
    policy = tmp_path / "p.yaml"
    policy.write_text("defaults: {bits: 2.5, group_size: 16, residual: 16, sinks: 2}\n")
    ids = _ids(tmp_path / "ids.pt", shape=(2, 64))  # small windows: 64 tokens pack some
    saved = tmp_path / "saved.yaml"
    argv = ["inspect", "--model", "tiny-llama", "--policy", str(policy), "--calibration", ids,
            "--save", str(saved)]
    assert main(argv) == 0
    assert "measured on user token ids" in capsys.readouterr().out
    spec = load_spec(str(saved))
    assert spec.calibration.source == "user token ids"
    assert (spec.calibration.rows, spec.calibration.tokens) == (2, 64)


@pytest.mark.parametrize(
    "extra, given",
    [
        (["--bits", "2"], "--bits 2 sets fixed widths"),
        (["--bits", "2.5", "--policy", "kivi-2"], "--bits 2.5 with --policy kivi-2 sets fixed"),
    ],
)
def test_calibration_without_a_budget_exits_2(fake, capsys, tmp_path, extra, given):
    ids = _ids(tmp_path / "ids.pt")
    assert main(["inspect", "--model", "tiny-llama", *extra, "--calibration", ids]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kvpolicy: error: --calibration is only for a bit budget")
    assert given in err and "--bits 2.5" in err
    assert "tiny" not in fake and "derive" not in fake  # refused before loading the model


def test_calibration_text_without_a_tokenizer_exits_2(capsys, tmp_path):
    text = tmp_path / "notes.txt"
    text.write_text("Some text like the text the model will see.\n" * 50, encoding="utf-8")
    argv = ["inspect", "--model", "tiny-llama", "--bits", "2.5", "--calibration", str(text)]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"kvpolicy: error: calibration file {text} is text")
    assert "has no tokenizer" in err
    assert "pass token ids saved with torch.save as a .pt file instead" in err


def test_calibration_file_missing_exits_2(capsys, tmp_path):
    missing = tmp_path / "missing.pt"
    argv = ["inspect", "--model", "tiny-llama", "--bits", "2.5", "--calibration", str(missing)]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert f"kvpolicy: error: calibration file {missing} not found" in err
    assert "torch.save" in err


def test_calibration_help_says_what_the_file_may_be(capsys):
    assert main(["inspect", "--help"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "--calibration FILE" in out
    assert "torch.save as a .pt/.pth file" in out and "UTF-8 text" in out


@pytest.mark.parametrize(
    "value, what",
    [
        (torch.rand(1, 256), "a torch.float32 tensor of shape [1, 256]"),
        (torch.zeros(1, 2, 256, dtype=torch.long), "a torch.int64 tensor of shape [1, 2, 256]"),
        (torch.zeros(0, dtype=torch.long), "a torch.int64 tensor of shape [0]"),
        ({"input_ids": torch.zeros(1, 8, dtype=torch.long)}, "holds a dict;"),
    ],
)
def test_calibration_ids_from_a_bad_pt_file(tmp_path, value, what):
    path = tmp_path / "ids.pt"
    torch.save(value, path)
    with pytest.raises(KVPolicyError, match="non-empty integer tensor of shape") as info:
        calibration_ids_from_file(nn.Linear(2, 2), path)
    assert what in str(info.value)


def test_calibration_ids_from_a_pt_file_are_int64_rows(tmp_path):
    path = tmp_path / "ids.pt"
    torch.save(torch.arange(600, dtype=torch.int32), path)
    ids = calibration_ids_from_file(nn.Linear(2, 2), path)
    assert ids.dtype == torch.int64 and ids.shape == (1, 600)  # not truncated
    assert torch.equal(ids[0], torch.arange(600))


def test_calibration_ids_from_an_unreadable_pt_file(tmp_path):
    path = tmp_path / "ids.pt"
    path.write_bytes(b"not a torch file")
    with pytest.raises(KVPolicyError, match="cannot load it with torch.load"):
        calibration_ids_from_file(nn.Linear(2, 2), path)


@pytest.mark.parametrize("content", [b"", b"  \n\t\n"])
def test_calibration_ids_from_empty_text(tmp_path, content):
    path = tmp_path / "empty.txt"
    path.write_bytes(content)
    with pytest.raises(KVPolicyError, match=r"empty\.txt is empty; give about 512 tokens"):
        calibration_ids_from_file(nn.Linear(2, 2), path)


def test_calibration_ids_from_text_that_is_not_utf8(tmp_path):
    path = tmp_path / "latin1.txt"
    path.write_bytes("café crème".encode("latin-1"))
    with pytest.raises(KVPolicyError, match="is not UTF-8 text"):
        calibration_ids_from_file(nn.Linear(2, 2), path)


@pytest.mark.real_model
def test_calibration_ids_from_text_use_the_first_tokens(smollm2, tmp_path):
    model, tokenizer = smollm2
    text = " ".join(f"word{i} of a calibration text." for i in range(150))
    path = tmp_path / "text.md"
    path.write_text(text, encoding="utf-8")
    expected = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert 3 * 512 > len(expected) > 2 * 512
    ids = calibration_ids_from_file(model, path)  # two whole rows of 512: the rest is dropped
    assert ids.dtype == torch.int64 and ids.shape == (2, 512)
    assert ids.flatten().tolist() == expected[:1024]
    rows = calibration_ids_from_file(model, path, tokens=100)  # rows from the start, at most 4
    assert rows.shape == (4, 100) and rows.flatten().tolist() == expected[:400]
    short = calibration_ids_from_file(model, path, tokens=len(expected) + 10)
    assert short.shape == (1, len(expected))
    assert short[0].tolist() == expected  # a shorter text gives all it has


@pytest.mark.real_model
def test_inspect_end_to_end_on_smollm2(capsys):
    assert main(["inspect", "--model", "smollm2-135m", "--format", "json"]) == 0
    policy = ModelPolicy.from_json(capsys.readouterr().out)
    assert policy.num_layers == 30
    assert policy.get(0, "key").pre_rope and policy.get(29, "value").axis == "token"
