"""MLA (DeepSeek-V3): a key assembled in place from a per-head part and a rotated part
shared by the heads. The rotation on its trailing channels is found and reported; the key
is cached after it (the kernels re-apply RoPE to leading channels only)."""

from __future__ import annotations

import pytest
import torch

import kvpolicy
from kvpolicy import PolicyError
from kvpolicy.passes.analyse import analyse_model
from kvpolicy.passes.facts import RopeStyle
from kvpolicy.zoo.tiny import tiny_model


def test_rotation_on_the_trailing_slice_of_an_in_place_key_is_found():
    analysis = analyse_model(tiny_model("deepseek_v3"))
    key = analysis.layers[0].key
    rope = key.rope
    assert rope is not None and rope.style is RopeStyle.INTERLEAVED
    # qk_nope_head_dim=16 channels pass, qk_rope_head_dim=16 rotated: channels 16-31.
    assert (rope.first_channel, rope.rotary_dim, rope.head_dim) == (16, 16, 32)
    assert not rope.reapplicable
    assert "assembled in place from 2 parts" in rope.description
    assert analysis.layers[0].value.rope is None and analysis.layers[0].value.head_dim == 32


def test_inspect_reports_it_and_keeps_the_key_after_the_rotation():
    model = kvpolicy.compile_model(tiny_model("deepseek_v3"), bits=2, progress=False)
    key = kvpolicy.inspect(model).get(0, "key")
    assert key.rope == "interleaved 16-31/32" and not key.pre_rope
    assert "after interleaved RoPE on channels 16-31 of 32" in key.reason
    assert "MLA" in key.reason


def test_asking_for_pre_rope_keys_is_refused_with_the_reason():
    policy = {"defaults": {"bits": 2},
              "overrides": [{"layers": "*", "tensor": "key", "pre_rope": True}]}
    with pytest.raises(PolicyError, match=r"rule 1, field 'pre_rope'.*channels 16-31 of 32"):
        kvpolicy.compile_model(tiny_model("deepseek_v3"), policy=policy, progress=False)


def test_two_bit_decode_reads_packed_groups_of_the_assembled_key():
    ref = tiny_model("deepseek_v3")
    policy = {"defaults": {"bits": 2, "group_size": 16, "residual": 16, "sinks": 2}}
    model = kvpolicy.compile_model(tiny_model("deepseek_v3"), policy=policy, progress=False)
    ids = torch.randint(3, 128, (1, 61), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = ref(ids).logits[:, -1]
        out = model(ids[:, :60], use_cache=True)
        got = model(ids[:, 60:], past_key_values=out.past_key_values, use_cache=True)
    assert out.past_key_values.layers[0].packed.n_packed >= 32
    rel = ((got.logits[:, -1] - want).norm() / want.norm()).item()
    # Quantized for real (not exact), and close: 0.058 when measured, tiny Llama 0.083.
    assert 1e-3 < rel < 0.15
