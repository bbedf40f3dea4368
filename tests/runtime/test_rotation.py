"""A policy's value rotation (kernels.rotation): orthogonal, exact at 16 bits, applied to
what is stored and undone on the attention output, refused where it cannot be exact."""

from __future__ import annotations

import pytest
import torch

import kvpolicy
from kvpolicy import CacheError, PolicyError
from kvpolicy.kernels import reference
from kvpolicy.kernels.layout import QuantSpec
from kvpolicy.kernels.rotation import rotation_matrix
from kvpolicy.zoo.tiny import tiny_model


def _policy(bits: int, rotation: str = "hadamard") -> dict:
    return {"defaults": {"bits": bits, "group_size": 16, "residual": 16, "sinks": 2,
                         "rotation": rotation}}


@pytest.mark.parametrize("n", [2, 32, 64, 128])
def test_hadamard_is_orthogonal_and_mixes_every_channel(n):
    r = rotation_matrix("hadamard", n)
    torch.testing.assert_close(r @ r.T, torch.eye(n), atol=1e-6, rtol=0)
    assert torch.all(r.abs() > 0) and not torch.equal(r, r.T.flip(0))  # dense, sign-flipped
    assert rotation_matrix("none", n) is None


def test_a_rotation_that_cannot_apply_is_refused():
    with pytest.raises(CacheError, match="power-of-two head_dim, got 48"):
        rotation_matrix("hadamard", 48)
    with pytest.raises(CacheError, match="not one of none, hadamard"):
        rotation_matrix("givens", 64)


def test_rotation_spreads_an_outlier_channel_and_cuts_the_2_bit_error():
    """One large channel per token sets every group's range; rotated, it is shared."""
    g = torch.Generator().manual_seed(0)
    v = torch.randn(1, 2, 64, 64, generator=g)
    v[..., 5] *= 30.0
    spec = QuantSpec(2, 32, "token")
    r = rotation_matrix("hadamard", 64)

    def error(x, rot=None):
        y = x @ rot if rot is not None else x
        dq = reference.dequantize(reference.quantize(y, spec), spec)
        return ((dq @ rot.T if rot is not None else dq) - x).norm() / x.norm()

    assert error(v, r) < 0.85 * error(v)  # 0.26 against 0.34 measured
    well_behaved = torch.randn(1, 2, 64, 64, generator=g)  # nothing to spread: no gain
    assert error(well_behaved, r) > 0.9 * error(well_behaved)


@torch.no_grad()
def test_rotated_values_are_exact_at_16_bits_and_stored_rotated():
    ref = tiny_model("llama")
    model = kvpolicy.compile_model(tiny_model("llama"), policy=_policy(16), progress=False)
    ids = torch.randint(3, 128, (2, 40), generator=torch.Generator().manual_seed(0))
    want = ref.generate(ids, max_new_tokens=30, do_sample=False, pad_token_id=0)
    out = model.generate(ids, max_new_tokens=30, do_sample=False, pad_token_id=0,
                         return_dict_in_generate=True)
    assert torch.equal(out.sequences, want)
    # What the cache holds is v R, not v: compare with the plain model's stored values.
    plain = kvpolicy.compile_model(tiny_model("llama"), policy=_policy(16, "none"),
                                   progress=False)
    cache = plain.generate(ids, max_new_tokens=30, do_sample=False, pad_token_id=0,
                           return_dict_in_generate=True).past_key_values
    v_plain = cache.layers[0].packed.dequantized()[1].float()
    v_rot = out.past_key_values.layers[0].packed.dequantized()[1].float()
    r = rotation_matrix("hadamard", v_plain.shape[-1])
    assert not torch.allclose(v_rot, v_plain, atol=1e-3)
    torch.testing.assert_close(v_rot, v_plain @ r, atol=1e-5, rtol=1e-5)


@torch.no_grad()
def test_rotated_values_decode_from_packed_groups_at_2_bits():
    model = kvpolicy.compile_model(tiny_model("llama"), policy=_policy(2), progress=False)
    ref = tiny_model("llama")
    ids = torch.randint(3, 128, (1, 81), generator=torch.Generator().manual_seed(0))
    out = model(ids[:, :80], use_cache=True)
    step = model(ids[:, 80:], past_key_values=out.past_key_values, use_cache=True)
    want = ref(ids).logits[:, -1]
    rel = ((step.logits[:, -1] - want).norm() / want.norm()).item()
    assert out.past_key_values.layers[0].packed.n_packed >= 48
    assert 1e-3 < rel < 0.2  # quantized, and the rotation undone (0.081 measured)
    value = kvpolicy.inspect(model).get(0, "value")
    assert value.rotation == "hadamard" and "Walsh-Hadamard" in value.reason
    assert kvpolicy.inspect(model).get(0, "key").rotation == "none"


def test_rotating_keys_is_refused_naming_why():
    keys = {"defaults": {"bits": 2},
            "overrides": [{"layers": "*", "tensor": "key", "rotation": "hadamard"}]}
    with pytest.raises(PolicyError, match="keys are not rotated: their RoPE"):
        kvpolicy.compile_model(tiny_model("llama"), policy=keys, progress=False)


def test_a_budget_calibrates_the_rotated_values():
    """The calibration quantizes v R as the cache stores it: other value errors, and a
    calibration measured without the rotation is refused for a policy with one."""
    ids = torch.randint(3, 128, (1, 96), generator=torch.Generator().manual_seed(0))
    small = {"group_size": 16, "residual": 16, "sinks": 2}
    policies = {}
    for rot in ("none", "hadamard"):
        spec = {"defaults": {"bits": 2.5, **small, "rotation": rot}}
        policies[rot] = kvpolicy.derive_policy(tiny_model("llama"), policy=spec,
                                               calibration=ids, progress=False)
    plain, rotated = policies["none"].calibration, policies["hadamard"].calibration
    assert plain.settings != rotated.settings
    assert [la.key for la in plain.layers] == [la.key for la in rotated.layers]
    assert [la.value for la in plain.layers] != [la.value for la in rotated.layers]
    spec = {"defaults": {"bits": 2.5, **small, "rotation": "hadamard"}}
    with pytest.raises(PolicyError, match="settings"):
        kvpolicy.derive_policy(tiny_model("llama"), policy=spec, calibration=plain,
                               progress=False)


def test_auto_rotates_a_value_with_planted_outlier_channels_and_leaves_the_other_alone():
    model = tiny_model("llama")
    with torch.no_grad():  # layer 0: one large channel per KV head of its values
        weight = model.model.layers[0].self_attn.v_proj.weight  # [Hkv * D, hidden]
        weight[3] *= 40.0
        weight[32 + 17] *= 40.0
    ids = torch.randint(3, 128, (1, 128), generator=torch.Generator().manual_seed(0))
    spec = {"defaults": {"bits": 2.5, "group_size": 16, "residual": 16, "sinks": 2,
                         "rotation": "auto"}}
    policy = kvpolicy.derive_policy(model, policy=spec, calibration=ids, progress=False)
    planted, plain = policy.get(0, "value"), policy.get(1, "value")
    assert planted.rotation == "hadamard" and "rotation: auto chose hadamard" in planted.reason
    assert plain.rotation == "none" and "rotation: auto chose none" in plain.reason
    assert all(policy.get(i, "key").rotation == "none" for i in policy.layers)
    # The choice is a policy the cache runs: compile from it and decode.
    compiled = kvpolicy.compile_model(model, policy=spec, calibration=policy.calibration,
                                      progress=False)
    layers = compiled(ids[:, :80], use_cache=True).past_key_values.layers
    assert [la.value_rotation for la in layers] == ["hadamard", "none"]


def test_auto_without_a_budget_is_refused():
    spec = {"defaults": {"bits": 2, "rotation": "auto"}}
    with pytest.raises(PolicyError, match="rotation: auto is chosen per tensor from a bit"):
        kvpolicy.compile_model(tiny_model("llama"), policy=spec, progress=False)
