"""Stored-bits budgets (``compile_model(model, stored_bits=3.0)``): the allocator over
(width, group size) pairs, the calibration of each pair, the policy it writes and the
packed cache it builds, and the inputs it refuses."""

from __future__ import annotations

import itertools
import random
from fractions import Fraction

import pytest
import torch

import kvpolicy
from kvpolicy.calibrate import allocate_stored, apply_budget, budget
from kvpolicy.calibrate.capture import capture_activations
from kvpolicy.errors import PolicyError
from kvpolicy.policies import BUDGET_WIDTHS, load_spec, stored_bits
from kvpolicy.zoo.tiny import tiny_model

# Windows small enough for 160 calibration tokens to pack a chunk of 128 (the largest
# candidate group of keys, which group tokens).
SMALL = {"residual": 16, "sinks": 2}


def stored_spec(stored=3.0, **defaults):
    # fp16 metadata: these tests are about widths and groups (8-bit metadata as a choice:
    # test_meta8_choice.py).
    return {"defaults": {"stored_bits": stored, **SMALL, "meta_bits": 16, **defaults}}


def calibration_ids(seed=1, t=160):
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(3, 120, (1, t), generator=gen)


# --------------------------------------------------------------------------- allocate


def test_stored_bits_counts_a_scale_and_a_zero_per_group():
    assert stored_bits(2, 32) == 3.0 and stored_bits(2, 64) == 2.5
    assert stored_bits(2, 128) == 2.25 and stored_bits(16, 32) == 16.0
    assert stored_bits(4, 32, scale_bits=32) == 6.0


def brute_force(errors, sizes, budget_bits):
    """Least summed error over every combination whose exact stored size fits."""
    limit = Fraction(budget_bits) * sum(sizes) + Fraction(1, 10**6)  # float rounding of b
    best = None
    for combo in itertools.product(*(sorted(e) for e in errors)):
        size = sum(s * (w + Fraction(32, g)) for (w, g), s in zip(combo, sizes, strict=True))
        if size > limit:
            continue
        err = sum(e[o] for e, o in zip(errors, combo, strict=True))
        if best is None or err < best:
            best = err
    return best


@pytest.mark.parametrize("seed", range(10))
def test_allocate_stored_is_exact_and_never_exceeds_the_budget(seed):
    rng = random.Random(seed)
    n = rng.randint(2, 4)
    sizes = [rng.choice([32, 64, 96, 192]) for _ in range(n)]
    errors = []
    for _ in range(n):
        widths = sorted(rng.sample(BUDGET_WIDTHS, rng.randint(2, 3)))
        groups = sorted(rng.sample((32, 64, 128), rng.randint(1, 3)))
        errors.append({(w, g): rng.random() / w * (1 + rng.random() * g / 128)
                       for w in widths for g in groups})
    least = sum(min(stored_bits(*o) for o in e) * s for e, s in zip(errors, sizes, strict=True))
    least /= sum(sizes)
    checked = 0
    for b in (least, least + 0.2, 2.5, 3.0, 3.7, 6.0):
        if b < least:
            continue
        chosen = allocate_stored(errors, sizes, b)
        assert all(o in e for o, e in zip(chosen, errors, strict=True))
        used = sum(stored_bits(*o) * s for o, s in zip(chosen, sizes, strict=True))
        assert used <= b * sum(sizes) + 1e-9
        got = sum(e[o] for e, o in zip(errors, chosen, strict=True))
        assert got == pytest.approx(brute_force(errors, sizes, b), rel=1e-12, abs=1e-15)
        checked += 1
    assert checked >= 4


def test_a_larger_group_where_the_measured_cost_allows_a_smaller_where_not():
    """At 3.25 stored bits a tensor can have 2 bits in groups of 32 (3.00) or 3 bits in
    groups of 128 (3.25). One whose cost barely moves with the group takes the larger group
    and the extra bit; one whose cost grows fast with the group keeps groups of 32."""
    width_sensitive = {(2, 32): 1.0, (2, 64): 1.01, (2, 128): 1.02,
                       (3, 32): 0.10, (3, 64): 0.101, (3, 128): 0.102}
    group_sensitive = {(2, 32): 1.0, (2, 64): 4.0, (2, 128): 16.0,
                       (3, 32): 0.25, (3, 64): 1.0, (3, 128): 4.0}
    assert allocate_stored([width_sensitive], [64], 3.25) == [(3, 128)]
    assert allocate_stored([group_sensitive], [64], 3.25) == [(2, 32)]
    # Together, under the same average, each keeps its own choice.
    assert allocate_stored([width_sensitive, group_sensitive], [64, 64], 3.125) == [
        (3, 128), (2, 32)]
    # With room for more, the group-sensitive one gets 3 bits in groups of 32.
    assert allocate_stored([group_sensitive], [64], 4.0) == [(3, 32)]


def test_allocate_stored_counts_fixed_tensors_and_refuses_what_it_cannot_hold():
    free = {(2, 32): 1.0, (2, 128): 1.5, (1, 128): 3.0}
    fixed = {(16, 32): 0.0}  # a tensor kept at 16 bits: one option, 16 stored bits
    # 2 x 8.625 bits per element: 16 for the fixed one leaves 1.25, groups of 128 at 1 bit.
    assert allocate_stored([fixed, free], [64, 64], 8.625) == [(16, 32), (1, 128)]
    assert allocate_stored([fixed, free], [64, 64], 9.125) == [(16, 32), (2, 128)]
    assert allocate_stored([fixed, free], [64, 64], 9.5) == [(16, 32), (2, 32)]
    with pytest.raises(PolicyError, match="1 tensors fixed by rules take 8.00.*need 8.625"):
        allocate_stored([fixed, free], [64, 64], 8.5)
    with pytest.raises(PolicyError, match="cannot be met.*need 1.250"):
        allocate_stored([free], [64], 1.2)


# --------------------------------------------------------------------------- spec / errors


def test_stored_bits_argument_and_yaml_key():
    spec = load_spec(None, stored_bits=3.0)
    assert spec.budget == 3.0 and spec.budget_unit == "stored"
    assert load_spec(None, stored_bits=3).defaults.stored_bits == 3.0  # always a budget
    assert load_spec({"defaults": {"stored_bits": 2.5}}).budget_unit == "stored"
    assert load_spec(None, 2.5).budget_unit == "code"  # bits=2.5 keeps its meaning
    assert load_spec(None, 2).budget_unit is None
    assert "stored_bits: 3.0" in spec.to_yaml() and "bits: 2" not in spec.to_yaml()


@pytest.mark.parametrize("call, message", [
    (lambda: load_spec(None, 2.5, stored_bits=3.0),
     "bits=2.5 is a budget of code bits and stored_bits=3.0 a budget of stored bits"),
    (lambda: load_spec(None, 4, stored_bits=3.0), "bits=4 sets one width.*give one of them"),
    (lambda: load_spec(None, stored_bits=0.5), "stored_bits=0.5.*outside \\[1, 16\\]"),
    (lambda: load_spec(None, stored_bits="3"), "stored_bits='3'.*not a number"),
    (lambda: load_spec({"defaults": {"bits": 2.5, "stored_bits": 3.0}}),
     "defaults, field 'bits': bits 2.5 is a budget of code bits.*drop bits"),
    (lambda: load_spec({"defaults": {"bits": 2, "stored_bits": 3.0}}),
     "defaults, field 'bits': bits 2 sets one width"),
    (lambda: load_spec({"defaults": {"bits": 2.5}}, stored_bits=3.0),
     "bits 2.5 is a budget of code bits, and stored_bits=3 allocates"),
    (lambda: load_spec({"defaults": {"group_size": "auto"}}),
     "defaults, field 'group_size': group_size auto is chosen per tensor by a stored-bits"),
    (lambda: load_spec({"defaults": {"bits": 2.5, "group_size": [32, 64]}}),
     "group_size \\[32, 64\\] is chosen per tensor.*add stored_bits"),
    (lambda: load_spec({"defaults": {"stored_bits": 3.0, "group_size": "big"}}),
     "group_size 'big': give an int"),
    (lambda: load_spec({"defaults": {"stored_bits": 3.0, "group_size": []}}),
     "the list of group sizes is empty"),
])
def test_contradictory_or_bad_inputs_are_refused_naming_the_fix(call, message):
    with pytest.raises(PolicyError, match=message):
        call()


def test_compile_model_refuses_both_budgets():
    with pytest.raises(PolicyError, match="give one of them: stored_bits=3.0 alone, or bits"):
        kvpolicy.compile_model(tiny_model("llama"), bits=2.5, stored_bits=3.0)


def test_group_choice_in_a_rule_needs_a_stored_budget_and_a_fitting_size():
    model = tiny_model("llama")
    auto_rule = {"defaults": {"bits": 2.5, **SMALL},
                 "overrides": [{"layers": 0, "tensor": "key", "group_size": "auto"}]}
    with pytest.raises(PolicyError, match="rule 1, field 'group_size'.*stored-bits budget"):
        kvpolicy.derive_policy(model, policy=auto_rule)
    # Values group channels: no candidate of [64, 128] divides head_dim 32.
    too_big = {**stored_spec(), "overrides": [
        {"layers": "*", "tensor": "value", "group_size": [64, 128]}]}
    with pytest.raises(PolicyError, match="rule 1, field 'group_size'.*head_dim=32"):
        kvpolicy.derive_policy(model, policy=too_big)


# --------------------------------------------------------------------------- end to end


@pytest.fixture(scope="module")
def compiled():
    model = kvpolicy.compile_model(tiny_model("llama"), policy=stored_spec(3.0),
                                   calibration=calibration_ids(), progress=False)
    return model, kvpolicy.inspect(model)


def test_the_calibration_measures_every_width_at_every_candidate_group(compiled):
    _, pol = compiled
    cal = pol.calibration
    assert cal.groups == (32, 64, 128)
    for t in pol.tensors:
        if t.tensor.value == "key":  # keys group tokens: every candidate fits
            assert t.group_sizes == (32, 64, 128)
            assert set(cal.errors(t.layer, "key", group=128)) == set(BUDGET_WIDTHS)
        else:  # values group the 32 channels of a head: only 32 fits, a fixed group
            assert t.group_sizes == () and t.group_size == 32
    ls = cal.layers[0]
    assert ls.key_groups is not None and ls.value_groups is None
    assert ls.key == ls.key_groups[0]  # the starting group is the first candidate
    assert len(set(ls.key_groups)) == 3  # each group measured on its own
    # Every candidate is measured on the schedule of the largest (chunks of 128 tokens):
    # at group 128 the table is what a policy with that one group fixed measures.
    act = capture_activations(tiny_model("llama"), calibration_ids(), loss_grad=True)[0]
    kp, vp = pol.get(0, "key"), pol.get(0, "value")
    # As calibrated: levels auto, whose plain rows are uniform levels.
    fixed = kp.model_copy(update={"group_size": 128, "group_sizes": (), "levels": "auto"})
    vp = vp.model_copy(update={"levels": "auto"})
    keys, values, _ = budget._layer_errors(act, fixed, vp, cal.widths, torch.float16)
    assert tuple(keys) == ls.key_groups[2] and tuple(values) == ls.value


def test_policy_honours_the_stored_budget_and_explains_each_choice(compiled):
    _, pol = compiled
    assert pol.budget == 3.0 and pol.budget_unit == "stored"
    assert pol.avg_stored_bits() <= 3.0 + 1e-9
    assert pol.avg_stored_bits() > 2.9  # the budget is used, not wasted
    assert {t.bits_from for t in pol.tensors} == {"budget"}
    assert any(t.group_size != 32 for t in pol.tensors)  # the group is a real choice here
    key = pol.get(0, "key")
    w, g = key.bits, key.group_size
    assert (f"stored-bits budget 3: {w} bit{'s' if w > 1 else ''}, group {g}: "
            f"{stored_bits(w, g):.2f} stored bits per element") in key.reason
    assert "group 32 " in key.reason and f"({stored_bits(w, 128):.2f})" in key.reason
    assert f"at group {g}: 1 b " in key.reason
    footer = str(pol).splitlines()[-2]
    assert f"{pol.avg_stored_bits():.3f} stored bits" in footer
    assert "stored-bits budget 3" in footer and "widths and group sizes allocated" in footer


def test_the_packed_cache_stores_what_the_policy_claims(compiled):
    """The cache's own bytes (codes, scales, zeros over packed elements) against the
    stored bits of the policy, per layer and over the model."""
    model, pol = compiled
    gen = torch.Generator().manual_seed(5)
    ids = torch.randint(3, 120, (2, 2 + 16 + 128), generator=gen)  # 128 packed per layer
    cache = model(ids, use_cache=True).past_key_values
    report = cache.memory_report()
    bits = elements = 0
    for layer, rep in zip(pol.layers, report["layers"], strict=True):
        k, v = pol.get(layer, "key"), pol.get(layer, "value")
        assert rep["packed_tokens"] == 128
        packed = rep["packed_tokens"] * ids.shape[0]
        layer_bits = 8 * (rep["code_bytes"] + rep["scale_bytes"] + rep["zero_bytes"])
        claimed = k.stored_bits() * k.elements_per_token + v.stored_bits() * v.elements_per_token
        assert layer_bits == pytest.approx(claimed * packed, rel=1e-12)
        bits += layer_bits
        elements += packed * (k.elements_per_token + v.elements_per_token)
    assert bits / elements == pytest.approx(pol.avg_stored_bits(), rel=1e-12)
    assert bits / elements <= 3.0
    out = model.generate(ids[:1, :40], max_new_tokens=4, min_new_tokens=4, do_sample=False)
    assert out.shape == (1, 44)


def test_saved_file_compiles_again_without_calibrating(compiled, tmp_path, monkeypatch):
    model, pol = compiled
    path = kvpolicy.save_policy(model, tmp_path / "stored.yaml")
    text = path.read_text()
    assert "stored_bits: 3.0" in text and "groups: [32, 64, 128]" in text

    def no_calibration(*a, **k):
        raise AssertionError("calibrated again")

    monkeypatch.setattr(budget, "calibrate", no_calibration)
    again = kvpolicy.derive_policy(tiny_model("llama"), policy=str(path))
    assert [(t.bits, t.group_size) for t in again.tensors] == [
        (t.bits, t.group_size) for t in pol.tensors]


def test_a_calibration_with_other_group_options_is_refused(compiled):
    """The candidates are part of the calibration key: a table measured with other ones,
    or one measured for a code-bits budget (groups fixed), is not reused."""
    _, pol = compiled
    model = tiny_model("llama")
    fewer = stored_spec(3.0, group_size=[32, 64])
    with pytest.raises(PolicyError, match="candidate group sizes.*delete the 'calibration'"):
        kvpolicy.derive_policy(model, policy=fewer, calibration=pol.calibration)
    code = kvpolicy.derive_policy(model, policy={"defaults": {"bits": 2.5, **SMALL}},
                                  calibration=calibration_ids())
    assert code.calibration.groups == () and code.budget_unit == "code"
    assert all(t.group_size == 32 and not t.group_sizes for t in code.tensors)
    with pytest.raises(PolicyError, match="delete the 'calibration' block"):
        kvpolicy.derive_policy(model, policy=stored_spec(3.0), calibration=code.calibration)
    with pytest.raises(PolicyError, match="a code-bits budget does not choose group sizes"):
        apply_budget(pol, pol.calibration, 2.5)


def test_a_given_group_size_stays_fixed_and_is_counted():
    """Under stored_bits a written group_size is not chosen: the allocator spends the
    budget on widths alone, the scales and zeros of that group counted, and the table is
    the one a code-bits budget measures (the same calibration key)."""
    model = tiny_model("llama")
    pol = kvpolicy.derive_policy(model, policy=stored_spec(3.5, group_size=32),
                                 calibration=calibration_ids())
    assert {t.group_size for t in pol.tensors} == {32}
    assert not any(t.group_sizes for t in pol.tensors) and pol.calibration.groups == ()
    assert pol.avg_stored_bits() <= 3.5 and pol.avg_bits <= 2.5  # 1 bit of metadata
    code = kvpolicy.derive_policy(model, policy={"defaults": {"bits": 2.5, **SMALL}},
                                  calibration=pol.calibration)
    assert code.calibration.settings == pol.calibration.settings
    assert [t.bits for t in code.tensors] == [t.bits for t in pol.tensors]


def test_inspect_command_takes_stored_bits(tmp_path, capsys):
    from kvpolicy.cli import main

    ids, spec = tmp_path / "ids.pt", tmp_path / "small.yaml"
    torch.save(calibration_ids()[0], ids)
    spec.write_text("defaults: {residual: 16, sinks: 2}\n")
    argv = ["inspect", "--model", "tiny-llama", "--policy", str(spec), "--calibration", str(ids)]
    assert main([*argv, "--stored-bits", "2.75"]) == 0
    footer = capsys.readouterr().out.splitlines()[-2]
    assert "stored-bits budget 2.75" in footer
    assert main([*argv, "--bits", "2.5", "--stored-bits", "3"]) == 2
    assert "give one of them" in capsys.readouterr().err


def test_allocate_stored_counts_each_tensors_own_metadata_width():
    """A tensor with 8-bit metadata pays 1 stored bit per element for groups of 16 where one
    with fp16 metadata pays 2: at 3.0 stored bits the first affords groups of 16."""
    errs = {(2, 16): 0.5, (2, 32): 1.0, (2, 64): 2.0}
    assert allocate_stored([errs], [64], 3.0, 8) == [(2, 16)]
    assert allocate_stored([errs], [64], 3.0, 16) == [(2, 32)]
    assert allocate_stored([errs, errs], [64, 64], 3.0, [8, 16]) == [(2, 16), (2, 32)]
    with pytest.raises(ValueError, match="1 scale widths for 2 tensors"):
        allocate_stored([errs, errs], [64, 64], 3.0, [8])
