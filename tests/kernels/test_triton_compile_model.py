"""compile_model with backend="triton" gives the logits of backend="torch" (interpreter
mode on CPU; see conftest.py)."""

from __future__ import annotations

import pytest
import torch

import kvpolicy
from kvpolicy.zoo.tiny import tiny_model

pytestmark = pytest.mark.triton

POLICY = {"defaults": {"bits": 2, "group_size": 16, "residual": 16, "sinks": 2}}


@pytest.mark.parametrize("arch", ["llama", "gpt_neox"])
def test_triton_backend_matches_torch_backend(arch):
    a = kvpolicy.compile_model(tiny_model(arch), policy=POLICY, backend="torch")
    b = kvpolicy.compile_model(tiny_model(arch), policy=POLICY, backend="triton")
    ids = torch.randint(3, 128, (1, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ca = a(ids[:, :36], use_cache=True).past_key_values
        cb = b(ids[:, :36], use_cache=True).past_key_values
        assert ca.layers[0].packed.n_packed > 0  # decode reads packed groups
        for t in range(36, 40):
            la = a(ids[:, t : t + 1], past_key_values=ca, use_cache=True)
            lb = b(ids[:, t : t + 1], past_key_values=cb, use_cache=True)
            ca, cb = la.past_key_values, lb.past_key_values
            torch.testing.assert_close(lb.logits, la.logits, atol=1e-4, rtol=1e-4)
