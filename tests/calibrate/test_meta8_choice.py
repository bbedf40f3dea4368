"""meta_bits: auto under a stored-bits budget: the calibration measures every width and
candidate group with 8-bit scales and zeros too, the allocator prices each option by its own
stored bits, the policy records the choice and the cache runs it."""

from __future__ import annotations

import pytest
import torch

import kvpolicy
from kvpolicy.errors import PolicyError
from kvpolicy.zoo.tiny import tiny_model

SPEC = {"defaults": {"stored_bits": 3.0, "residual": 16, "sinks": 2}}


@pytest.fixture(scope="module")
def ids() -> torch.Tensor:
    return torch.randint(3, 128, (1, 192), generator=torch.Generator().manual_seed(0))


@pytest.fixture(scope="module")
def measured(ids):
    return kvpolicy.derive_policy(tiny_model("llama"), policy=SPEC, calibration=ids,
                                  progress=False)


def _planted(cal, factor: float):
    """``cal`` with every 8-bit-metadata error set to ``factor`` x the 16-bit one."""
    def scaled(plain, meta8):
        if meta8 is None:
            return None
        return tuple(tuple(None if e is None else e * factor for e in row) for row in plain)

    layers = tuple(ls.model_copy(update={
        "key_meta8_groups": scaled(ls.key_groups, ls.key_meta8_groups),
        "value_meta8_groups": scaled(ls.value_groups, ls.value_meta8_groups),
    }) for ls in cal.layers)
    return cal.model_copy(update={"layers": layers})


def test_the_calibration_measures_8_bit_metadata_at_every_candidate_group(measured):
    cal = measured.calibration
    assert cal.groups == (16, 32, 64, 128)
    for ls in cal.layers:
        assert ls.key_meta8_groups is not None
        for plain, meta8 in zip(ls.key_groups, ls.key_meta8_groups, strict=True):
            assert [e is None for e in plain] == [e is None for e in meta8]
            assert plain != meta8  # measured, not copied
    for t in measured.tensors:
        assert t.meta_bits in (8, 16) and f"meta_bits: auto chose {t.meta_bits}" in t.reason
    assert measured.avg_stored_bits() <= 3.0 + 1e-9


def test_cheap_8_bit_metadata_is_chosen_and_the_cache_runs_it(measured, ids):
    cheap = _planted(measured.calibration, 0.01)
    model = tiny_model("llama")
    policy = kvpolicy.derive_policy(model, policy=SPEC, calibration=cheap, progress=False)
    keys = [t for t in policy.tensors if t.tensor.value == "key"]
    assert {t.meta_bits for t in keys} == {8}
    # Half the metadata buys a finer group or a wider code within the same stored bits.
    assert all(t.group_size <= 64 for t in keys)
    assert policy.avg_stored_bits() <= 3.0 + 1e-9
    assert all(t.code_levels == "uniform" for t in keys)
    assert {t.fit for t in keys} == {"mse"}  # fit: auto fits keys with 8-bit metadata
    compiled = kvpolicy.compile_model(model, policy=SPEC, calibration=cheap, progress=False)
    with torch.no_grad():
        cache = compiled(ids[:, :160], use_cache=True).past_key_values
        compiled(ids[:, 160:161], past_key_values=cache, use_cache=True)
    for i, layer in enumerate(cache.layers):
        assert layer.packed.key_spec.meta_bits == 8
        assert layer.packed.key_spec == policy.get(i, "key").quant_spec()
        assert layer.packed.key_spec.fit == "mse"
        assert layer.packed.n_packed > 0


def test_dear_8_bit_metadata_is_left_alone(measured):
    dear = _planted(measured.calibration, 50.0)
    policy = kvpolicy.derive_policy(tiny_model("llama"), policy=SPEC, calibration=dear,
                                    progress=False)
    assert {t.meta_bits for t in policy.tensors} == {16}
    assert all("meta_bits: auto chose 16" in t.reason for t in policy.tensors)
    assert {t.fit for t in policy.tensors} == {"minmax"}  # nothing to fit at 16 bits


def test_the_calibration_measures_keys_8_bit_grids_as_fitted(measured, ids):
    """fit: auto (mse for keys) is what the 8-bit key rows measure; a min-max calibration
    measures other key errors and the same value errors."""
    spec = {"defaults": {**SPEC["defaults"], "fit": "minmax"}}
    minmax = kvpolicy.derive_policy(tiny_model("llama"), policy=spec, calibration=ids,
                                    progress=False).calibration
    assert minmax.settings != measured.calibration.settings
    for a, b in zip(measured.calibration.layers, minmax.layers, strict=True):
        assert a.key_meta8_groups != b.key_meta8_groups
        assert a.value_meta8_groups == b.value_meta8_groups
        assert a.key_groups == b.key_groups  # 16-bit metadata has no fit


def test_a_calibration_without_8_bit_errors_is_refused_for_meta_bits_auto(measured):
    layers = tuple(ls.model_copy(update={"key_meta8_groups": None, "value_meta8_groups": None})
                   for ls in measured.calibration.layers)
    cal = measured.calibration.model_copy(update={"layers": layers})
    with pytest.raises(PolicyError, match="meta_bits: auto, but the calibration has no errors "
                                          "with 8-bit metadata"):
        kvpolicy.derive_policy(tiny_model("llama"), policy=SPEC, calibration=cal,
                               progress=False)


def test_fixed_group_and_auto_metadata_measure_the_own_group(ids):
    spec = {"defaults": {"stored_bits": 2.5, "group_size": 32, "residual": 16, "sinks": 2}}
    policy = kvpolicy.derive_policy(tiny_model("llama"), policy=spec, calibration=ids,
                                    progress=False)
    ls = policy.calibration.layers[0]
    assert ls.key_meta8 is not None and ls.key_meta8_groups is None
    # 2.5 stored bits at a fixed group of 32: 2-bit codes with 8-bit metadata fit, 16-bit
    # metadata needs 1-bit codes somewhere.
    assert policy.avg_stored_bits() <= 2.5 + 1e-9
    assert {t.meta_bits for t in policy.tensors} <= {8, 16}
