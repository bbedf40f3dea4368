"""Half-precision models compile and decode: the compile-time check allows the rounding of
the model's own dtype (a half block rounds where the rewrite keeps fp32), and at 16 bits
the compiled model decodes what the uncompiled one does."""

from __future__ import annotations

import pytest
import torch

import kvpolicy
from kvpolicy.errors import KVPolicyError
from kvpolicy.zoo.tiny import tiny_model


def _steps(model, ids: torch.Tensor, prompt: int) -> torch.Tensor:
    with torch.no_grad():
        out = model(ids[:, :prompt], use_cache=True)
        logits = [out.logits[:, -1].float()]
        for t in range(prompt, ids.shape[1]):
            out = model(ids[:, t : t + 1], past_key_values=out.past_key_values, use_cache=True)
            logits.append(out.logits[:, -1].float())
    return torch.stack(logits, 1)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("arch", ["llama", "gpt2", "gemma2"])
def test_half_model_compiles_and_decodes_at_16_bits(arch, dtype):
    ids = torch.randint(3, 128, (2, 24), generator=torch.Generator().manual_seed(0))
    want = _steps(tiny_model(arch).to(dtype), ids, 20)
    model = kvpolicy.compile_model(tiny_model(arch).to(dtype), bits=16)
    got = _steps(model, ids, 20)
    # NOTE: measured max differences 5e-4 - 6e-3 (fp16) and 4e-3 - 4e-2 (bf16), logits of
    # magnitude 0.8 (llama, gpt2) to 3.8 (gemma2).
    tol = 8 * torch.finfo(dtype).eps * max(1.0, want.abs().max().item())
    torch.testing.assert_close(got, want, atol=tol, rtol=0)


def test_the_check_still_refuses_a_wrong_rewrite_in_half_precision(monkeypatch):
    """The looser half-precision tolerance still catches an O(1) error (a wrong scale)."""
    import kvpolicy.runtime.attend as attend

    real = attend.KVAttend.forward

    def off_by_a_tenth(self, *args, **kwargs):
        return real(self, *args, **kwargs) * 1.1

    monkeypatch.setattr(attend.KVAttend, "forward", off_by_a_tenth)
    model = tiny_model("llama").to(torch.float16)
    with pytest.raises(KVPolicyError, match="differs from the original"):
        kvpolicy.compile_model(model, bits=16)
