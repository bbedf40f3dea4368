"""Errors measured where the cached tensor is consumed (kvpolicy.calibrate.metrics)."""

from __future__ import annotations

import pytest
import torch

from kvpolicy import derive_policy
from kvpolicy.calibrate.capture import capture_activations
from kvpolicy.calibrate.metrics import AxisChoice, consumed_errors
from kvpolicy.errors import KVPolicyError
from kvpolicy.zoo.tiny import tiny_model

B, T = 2, 40  # T is not a multiple of G=32: errors trim it to 32 tokens
KEY_METRICS = ("recon", "score_err", "prob_tv", "output_err")
VALUE_METRICS = ("recon", "output_err", "joint_output_err")


def _ids(batch: int = B, tokens: int = T, seed: int = 0) -> torch.Tensor:
    return torch.randint(3, 128, (batch, tokens), generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module")
def llama_acts() -> list:
    return capture_activations(tiny_model("llama"), _ids())


def test_full_precision_is_exact(llama_acts) -> None:
    """bits=16 stores the tensor as is: every error is 0, pre-RoPE round trip included."""
    rows = consumed_errors(llama_acts, AxisChoice("channel", "token", True), bits=16)
    assert len(rows) == 4 and [r["tensor"] for r in rows] == ["key", "value"] * 2
    for r in rows:
        for m in KEY_METRICS if r["tensor"] == "key" else VALUE_METRICS:
            assert r[m] < 1e-5, f"{r['tensor']} {m} = {r[m]:.2e} at 16 bits"


@pytest.mark.parametrize("choice", [AxisChoice(), AxisChoice("token", "channel", False)])
def test_errors_shrink_with_bits(llama_acts, choice: AxisChoice) -> None:
    by_bits = {b: consumed_errors(llama_acts, choice, bits=b) for b in (2, 3, 4, 8)}
    for i, row in enumerate(by_bits[2]):
        metrics = KEY_METRICS if row["tensor"] == "key" else VALUE_METRICS
        for m in metrics:
            e = [by_bits[b][i][m] for b in (2, 3, 4, 8)]
            assert e[0] > e[1] > e[2] > e[3], f"{row['tensor']} {m} not monotone in bits: {e}"
            assert e[3] < 0.02, f"{row['tensor']} {m} = {e[3]:.3g} at 8 bits"
        assert row["tokens"] == 32 and row["bits"] == 2


def test_rows_follow_the_policy(llama_acts) -> None:
    model = tiny_model("llama")
    policy = derive_policy(model, bits=2)
    rows = consumed_errors(llama_acts, policy)
    assert [(r["layer"], r["tensor"], r["axis"]) for r in rows] == [
        (0, "key", "channel"), (0, "value", "token"), (1, "key", "channel"), (1, "value", "token")
    ]
    assert rows[0]["pre_rope"] is True
    as_dict = consumed_errors(llama_acts, {"key_axis": "channel", "value_axis": "token"})
    assert as_dict == rows
    with pytest.raises(KVPolicyError, match="no whole group"):
        consumed_errors(llama_acts, AxisChoice(), group_size=64)



@pytest.mark.real_model
def test_smollm2_consumed_error_prefers_derived_axes(smollm2) -> None:
    """docs/design.md §1/§3 on SmolLM2 (128 pydoc tokens, 2 bits, G=32): per-channel keys have the
    lower score error, per-token values the lower output error even though per-channel
    values reconstruct better; every metric shrinks with bits."""
    from kvpolicy.zoo import text as data

    model, tokenizer = smollm2
    acts = capture_activations(model, data.segments(tokenizer, 128, 1))
    assert len(acts) == 30 and acts[0].key.shape == (1, 3, 128, 64)

    def mean(rows, tensor: str, metric: str) -> float:
        vals = [r[metric] for r in rows if r["tensor"] == tensor]
        return sum(vals) / len(vals)

    derived = {b: consumed_errors(acts, AxisChoice(), bits=b) for b in (2, 3, 4)}
    flipped = consumed_errors(acts, AxisChoice("token", "channel", True), bits=2)
    d2 = derived[2]
    k_chan, k_tok = mean(d2, "key", "score_err"), mean(flipped, "key", "score_err")
    assert k_chan < k_tok, f"key score error: channel {k_chan:.3f} vs token {k_tok:.3f}"
    v_tok, v_chan = mean(d2, "value", "output_err"), mean(flipped, "value", "output_err")
    assert v_tok < v_chan, f"value output error: token {v_tok:.3f} vs channel {v_chan:.3f}"
    r_tok, r_chan = mean(d2, "value", "recon"), mean(flipped, "value", "recon")
    assert r_chan < r_tok, f"value reconstruction: channel {r_chan:.3f} vs token {r_tok:.3f}"
    for tensor, metrics in (("key", KEY_METRICS), ("value", VALUE_METRICS)):
        for m in metrics:
            e = [mean(derived[b], tensor, m) for b in (2, 3, 4)]
            assert e[0] > e[1] > e[2], f"{tensor} {m} not monotone in bits: {e}"
