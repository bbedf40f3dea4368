"""The where-consumed axis study (kvpolicy.evaluation.axis_study)."""

from __future__ import annotations

import pytest
import torch

from kvpolicy.errors import KVPolicyError
from kvpolicy.evaluation.axis_study import METRICS, axis_study
from kvpolicy.zoo.tiny import tiny_model


def _ids(batch: int, tokens: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(3, 128, (batch, tokens), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("arch, n", [("llama", 8), ("gpt2", 4)])
def test_axis_study(arch: str, n: int) -> None:
    model = tiny_model(arch)
    study = axis_study(model, _ids(1, 64), bits=2)
    assert len(study["policies"]) == n and study["tokens"] == 64
    derived = "K-channel-pre/V-token" if arch == "llama" else "K-channel/V-token"
    assert study["derived"] == derived
    assert all(set(p) == set(METRICS) for p in study["policies"].values())
    assert study["summary"].startswith("values: reconstruction prefers")
    order = list(study["rankings"]["output_err"])
    again = axis_study(model, _ids(1, 64), bits=2, reference_order=order)
    assert again["tau"]["output_err"] == 1.0 and "output_err" in again["summary"]
    with pytest.raises(KVPolicyError, match="reference_order"):
        axis_study(model, _ids(1, 64), reference_order=["K-nothing/V-token", derived])
