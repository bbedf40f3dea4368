"""levels: auto under a budget: the calibration measures uniform and normal levels, the
allocator pays the cheaper, the policy records the choice and says why."""

from __future__ import annotations

import pytest
import torch

import kvpolicy
from kvpolicy.calibrate.apply import LEVELS_GAIN
from kvpolicy.errors import PolicyError
from kvpolicy.zoo.tiny import tiny_model

SMALL = {"group_size": 16, "residual": 16, "sinks": 2}


@pytest.fixture(scope="module")
def ids() -> torch.Tensor:
    return torch.randint(3, 128, (1, 192), generator=torch.Generator().manual_seed(0))


@pytest.fixture(scope="module")
def measured(ids):
    spec = {"defaults": {"bits": 2.5, **SMALL}}
    return kvpolicy.derive_policy(tiny_model("llama"), policy=spec, calibration=ids,
                                  progress=False)


def test_the_calibration_measures_both_levels_where_a_width_has_a_table(measured):
    cal = measured.calibration
    assert cal.widths == (1, 2, 3, 4, 8)
    for layer in cal.layers:
        for plain, normal in ((layer.key, layer.key_normal), (layer.value, layer.value_normal)):
            assert normal is not None and len(normal) == len(plain)
            assert all(e is not None for e in normal[:4]) and normal[4] is None  # no 8-bit table
            assert normal[:4] != plain[:4]
    # Each tensor's choice is written into its policy, with both costs behind it.
    for t in measured.tensors:
        assert t.levels in ("uniform", "normal")
        assert f"levels: auto chose {t.levels} (at {t.bits} bits" in t.reason
        plain = cal.errors(t.layer, t.tensor)[t.bits]
        normal = cal.errors(t.layer, t.tensor, normal=True).get(t.bits)
        assert (t.levels == "normal") == (normal is not None and normal < LEVELS_GAIN * plain)


def _scaled(cal, layer: int, tensor: str, factor: float):
    """``cal`` with one tensor's normal-level errors set to ``factor`` x its uniform ones."""
    layers = []
    for ls in cal.layers:
        if ls.layer == layer:
            plain = getattr(ls, tensor)
            row = tuple(None if n is None else e * factor
                        for e, n in zip(plain, getattr(ls, f"{tensor}_normal"), strict=True))
            ls = ls.model_copy(update={f"{tensor}_normal": row})
        layers.append(ls)
    return cal.model_copy(update={"layers": tuple(layers)})


def test_normal_levels_where_they_cost_less_and_the_cheaper_cost_is_what_is_allocated(measured):
    cal = measured.calibration
    # Normal levels dearer everywhere, then far cheaper for the widest tensor's.
    for ls in cal.layers:
        for tensor in ("key", "value"):
            cal = _scaled(cal, ls.layer, tensor, 3.0)
    spec = {"defaults": {"bits": 2.5, **SMALL}}
    uniform = kvpolicy.derive_policy(tiny_model("llama"), policy=spec, calibration=cal,
                                     progress=False)
    assert all(t.levels == "uniform" for t in uniform.tensors)
    wide = max(uniform.tensors, key=lambda t: t.bits)
    cheap = _scaled(cal, wide.layer, wide.tensor.value, 1e-4)
    policy = kvpolicy.derive_policy(tiny_model("llama"), policy=spec, calibration=cheap,
                                    progress=False)
    chosen = policy.get(wide.layer, wide.tensor)
    assert chosen.levels == "normal" and "levels: auto chose normal" in chosen.reason
    assert all(t.levels == "uniform" for t in policy.tensors if t is not chosen)
    # The allocator paid the normal cost: that tensor gets fewer bits than it did.
    assert chosen.bits < wide.bits
    # A tie keeps the uniform grid (LEVELS_GAIN).
    tie = _scaled(cal, wide.layer, wide.tensor.value, 0.99)
    policy = kvpolicy.derive_policy(tiny_model("llama"), policy=spec, calibration=tie,
                                    progress=False)
    assert policy.get(wide.layer, wide.tensor).levels == "uniform"


def test_a_calibration_without_normal_errors_is_refused_for_levels_auto(measured):
    layers = tuple(ls.model_copy(update={"key_normal": None, "value_normal": None})
                   for ls in measured.calibration.layers)
    cal = measured.calibration.model_copy(update={"layers": layers})
    spec = {"defaults": {"bits": 2.5, **SMALL}}
    with pytest.raises(PolicyError, match="levels: auto, but the calibration has no errors "
                                          "with normal levels"):
        kvpolicy.derive_policy(tiny_model("llama"), policy=spec, calibration=cal,
                               progress=False)


def test_fixed_levels_are_measured_as_given_and_not_chosen(ids):
    spec = {"defaults": {"bits": 2.5, **SMALL, "levels": "normal"}}
    policy = kvpolicy.derive_policy(tiny_model("llama"), policy=spec, calibration=ids,
                                    progress=False)
    assert all(ls.key_normal is None for ls in policy.calibration.layers)
    assert {t.code_levels for t in policy.tensors if t.bits <= 4} == {"normal"}
    assert all("levels: auto chose" not in t.reason for t in policy.tensors)


def test_a_stored_bits_budget_chooses_levels_per_group_and_the_cache_runs_it(ids):
    # fp16 metadata: 8-bit metadata has uniform levels only (test_meta8_choice.py).
    spec = {"defaults": {"stored_bits": 3.0, "residual": 16, "sinks": 2, "meta_bits": 16}}
    model = tiny_model("llama")
    policy = kvpolicy.derive_policy(model, policy=spec, calibration=ids, progress=False)
    cal = policy.calibration
    assert cal.groups and all(ls.key_normal_groups is not None for ls in cal.layers)
    for t in policy.tensors:
        assert t.levels in ("uniform", "normal") and "levels: auto chose" in t.reason
    compiled = kvpolicy.compile_model(model, policy=spec, calibration=cal, progress=False)
    with torch.no_grad():
        cache = compiled(ids[:, :100], use_cache=True).past_key_values
    for i, layer in enumerate(cache.layers):
        assert layer.packed.key_spec.levels == policy.get(i, "key").code_levels
        assert layer.packed.value_spec.levels == policy.get(i, "value").code_levels
