"""Bit budgets (kvpolicy.calibrate.budget): the allocator, the calibration and the way through
derive_policy / compile_model / YAML."""

from __future__ import annotations

import itertools
import random

import pytest
import torch

import kvpolicy
from kvpolicy.calibrate import budget
from kvpolicy.calibrate.capture import capture_activations
from kvpolicy.calibrate.metrics import expand_heads, relative_error
from kvpolicy.errors import KVPolicyError, PolicyError
from kvpolicy.kernels.layout import QuantSpec
from kvpolicy.kernels.masks import causal_mask
from kvpolicy.policies import BUDGET_WIDTHS, is_budget, load_spec
from kvpolicy.runtime.layer import PackedKVLayer
from kvpolicy.zoo.tiny import tiny_model

# A window and groups small enough for 96 calibration tokens to be packed.
SMALL = {"group_size": 16, "residual": 16, "sinks": 2}


def small_spec(bits, **extra):
    return {"defaults": {"bits": bits, **SMALL}, **extra}


def calibration_ids(seed=1, t=96):
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(3, 120, (1, t), generator=gen)


# --------------------------------------------------------------------------- allocate


def curve(scale=1.0):
    """A convex error curve over BUDGET_WIDTHS (each extra bit buys less)."""
    return {1: 8.0 * scale, 2: 4.0 * scale, 3: 2.0 * scale, 4: 1.0 * scale, 8: 0.01 * scale}


def brute_force(errors, sizes, budget_bits, pinned):
    best, best_widths = None, None
    total = sum(sizes)
    free = [i for i in range(len(sizes)) if i not in pinned]
    for combo in itertools.product(*(sorted(errors[i]) for i in free)):
        widths = dict(pinned)
        widths.update(zip(free, combo, strict=True))
        if sum(widths[i] * sizes[i] for i in widths) > budget_bits * total + 1e-9:
            continue
        err = sum(errors[i][widths[i]] for i in free)
        if best is None or err < best - 1e-12:
            best, best_widths = err, widths
    return best, best_widths


@pytest.mark.parametrize("seed", range(12))
def test_allocate_is_exact_and_never_exceeds_the_budget(seed):
    rng = random.Random(seed)
    n = rng.randint(2, 5)
    sizes = [rng.choice([64, 128, 192]) for _ in range(n)]
    errors = []
    for _ in range(n):
        widths = sorted(rng.sample(BUDGET_WIDTHS, rng.randint(2, 5)))
        errors.append({w: rng.random() / w for w in widths})
    pinned = {0: 4} if seed % 3 == 0 else {}
    free_bits = sum(min(errors[i]) * sizes[i] for i in range(n) if i not in pinned)
    lowest = (free_bits + sum(w * sizes[i] for i, w in pinned.items())) / sum(sizes)
    for b in (lowest, lowest + 0.3, 2.5, 3.7, 6.0, 8.0):
        if b < lowest:
            continue
        widths = budget.allocate(errors, sizes, b, pinned)
        used = sum(w * s for w, s in zip(widths, sizes, strict=True)) / sum(sizes)
        assert used <= b + 1e-9
        assert all(widths[i] == w for i, w in pinned.items())
        assert all(widths[i] in errors[i] for i in range(n) if i not in pinned)
        best, _ = brute_force(errors, sizes, b, pinned)
        got = sum(errors[i][widths[i]] for i in range(n) if i not in pinned)
        assert got == pytest.approx(best, rel=1e-12, abs=1e-15)


@pytest.mark.parametrize("b, expect", [(2.5, {2: 5, 3: 5}), (3.0, {3: 10}),
                                       (2.2, {2: 8, 3: 2}), (6.0, {4: 5, 8: 5})])
def test_allocate_spreads_a_uniform_sensitivity_evenly(b, expect):
    widths = budget.allocate([curve()] * 10, [192] * 10, b)
    assert {w: widths.count(w) for w in set(widths)} == expect
    assert sum(widths) / 10 <= b


def test_allocate_moves_bits_to_the_sensitive_tensors():
    errors = [curve(10.0), curve(1.0), curve(10.0), curve(1.0)]
    widths = budget.allocate(errors, [64] * 4, 2.5)
    assert widths[0] > widths[1] and widths[2] > widths[3]
    assert sum(widths) / 4 <= 2.5


def test_allocate_honours_pins_and_spreads_the_rest():
    widths = budget.allocate([{}, curve(), curve(), curve()], [64] * 4, 3.0, pinned={0: 8})
    assert widths[0] == 8
    assert widths[1:] == [1, 1, 2]  # 12 bits in all: 8 pinned, 4 left for three tensors
    assert sum(widths) <= 12


def test_allocate_refuses_a_budget_it_cannot_hold():
    with pytest.raises(PolicyError, match="cannot be met.*raise the budget to at least 1.000"):
        budget.allocate([{1: 1.0, 2: 0.5}] * 2, [64, 64], 0.9)
    with pytest.raises(PolicyError, match="pinned tensors take 4.00"):
        budget.allocate([{}, curve()], [64, 64], 4.2, pinned={0: 8})


def test_allocate_is_deterministic_with_ties():
    errors = [curve()] * 7
    first = budget.allocate(errors, [128] * 7, 2.5)
    assert all(budget.allocate(errors, [128] * 7, 2.5) == first for _ in range(3))


# --------------------------------------------------------------------------- bits / spec


def test_bits_argument_width_or_budget():
    assert load_spec(None, 3).defaults.bits == 3 and not is_budget(3)
    assert load_spec(None, 2.5).budget == 2.5
    assert load_spec(None, 3.0).budget == 3.0  # a float is a budget, an int a width
    assert load_spec({"defaults": {"bits": 2.25}}).budget == 2.25
    for bad, message in ((0.5, "outside \\[1, 16\\].*smallest width is 1 bit"),
                         (16.5, "outside \\[1, 16\\]"), (float("nan"), "not a number"),
                         (5, "5 bits is not supported.*5.0 for a budget")):
        with pytest.raises(PolicyError, match=message):
            load_spec(None, bad)
    with pytest.raises(PolicyError, match="defaults, field 'bits'.*outside"):
        load_spec({"defaults": {"bits": 0.25}})


def test_rule_bits_must_be_a_width():
    with pytest.raises(PolicyError, match="rule 1, field 'bits'"):
        load_spec({"defaults": {"bits": 2.5}, "overrides": [
            {"layers": 0, "tensor": "key", "bits": 2.5}]})


# --------------------------------------------------------------------------- calibrate


@pytest.mark.parametrize("sinks, residual, chunk", [(2, 16, 16), (4, 128, 32), (0, 0, 8)])
def test_packed_counts_follow_the_cache(sinks, residual, chunk):
    """The schedule the calibration models is the one PackedKVLayer runs."""
    layer = PackedKVLayer(QuantSpec(2, chunk, "channel"), QuantSpec(2, chunk, "token"),
                          residual=residual, sinks=sinks)
    t = sinks + residual + 3 * chunk + 5
    counts = budget._packed_counts(t, sinks, residual, chunk)
    for i in range(t):
        layer.append(torch.randn(1, 1, 1, chunk), torch.randn(1, 1, 1, chunk))
        assert layer.n_packed == int(counts[i]), i


@pytest.mark.parametrize("tensor, key_bits, levels", [
    ("key", 2, "uniform"), ("key", 2, "normal"), ("key", 2, "meta8"), ("value", 8, "uniform"),
    ("value", 8, "meta8"), ("value", 16, "uniform"), ("value", 16, "normal")])
def test_calibration_error_is_what_the_decode_cache_gives(tensor, key_bits, levels):
    """The calibration's emulation (which tokens a query reads quantized, pre-RoPE keys
    rotated after dequantization) against the real cache, decoding one token at a time,
    for every row levels: auto and meta_bits: auto measure (uniform and normal levels,
    8-bit metadata).

    Values beside keys at 8 bits pack in the keys' chunks of 16 tokens (the 8-bit keys are
    nearly exact); beside keys a rule pins at 16 bits, token by token."""
    model = tiny_model("llama")
    base = kvpolicy.derive_policy(model, policy=small_spec(2))
    act = capture_activations(model, calibration_ids(), loss_grad=True)[1]
    kp, vp = base.get(1, "key"), base.get(1, "value")
    assert kp.levels == vp.levels == "auto"
    kp, vp = (t.model_copy(update={"meta_bits": "auto"}) for t in (kp, vp))
    if key_bits == 16:
        kp = kp.model_copy(update={"bits": 16, "bits_from": "rule"})
    expected = {}
    for metric in budget.CALIBRATION_METRICS:
        got = budget._layer_errors_by_group(act, kp, vp, (2,), torch.float32, metric)
        ke, ve = {"uniform": (got.key, got.value), "normal": (got.key_normal, got.value_normal),
                  "meta8": (got.key_meta8, got.value_meta8)}[levels]
        expected[metric] = ke[kp.group_size][0] if tensor == "key" else ve[vp.group_size][0]

    rope, positions = act.rotary()
    value_bits = 16 if tensor == "key" else 2  # the other tensor exact or nearly
    lv, meta = ("uniform", 8) if levels == "meta8" else (levels, 16)
    key_levels, key_meta = (lv, meta) if tensor == "key" else ("uniform", 16)  # (near) exact
    value_levels, value_meta = (lv, meta) if tensor == "value" else ("uniform", 16)
    layer = PackedKVLayer(QuantSpec(key_bits, 16, "channel", key_levels, key_meta),
                          QuantSpec(value_bits, 16, "token", value_levels, value_meta),
                          residual=16, sinks=2, rope=rope)
    assert layer.chunk == (1 if key_bits == 16 else 16)
    t = act.query.shape[2]
    outs = []
    for i in range(t):
        layer.append(act.key_pre[:, :, i : i + 1], act.value[:, :, i : i + 1],
                     positions[:, i : i + 1])
        outs.append(layer.attend(act.query[:, :, i : i + 1], scale=act.scale))
    got = torch.cat(outs, dim=2)
    hq = act.query.shape[1]
    scores = act.query @ expand_heads(act.key, hq).transpose(-1, -2) * act.scale
    probs = torch.softmax(scores + causal_mask(t, t), dim=-1)
    exact = probs @ expand_heads(act.value, hq)
    rows = budget._packed_counts(t, 2, 16, layer.chunk) > 0
    relative = relative_error(got[..., rows, :], exact[..., rows, :])
    assert expected["relative"] > 1e-3  # a real quantization error, far above fp32 rounding
    assert relative == pytest.approx(expected["relative"], rel=2e-3)
    fisher = budget._fisher(got - exact, act.out_grad)
    assert expected["fisher"] > 0
    assert fisher == pytest.approx(expected["fisher"], rel=5e-3)


@pytest.fixture(scope="module")
def tiny_calibrated():
    model = tiny_model("llama")
    base = kvpolicy.derive_policy(model, policy=small_spec(2))
    return model, base, budget.calibrate(model, base, calibration_ids(), progress=False)


def test_calibration_covers_every_tensor_and_falls_with_width(tiny_calibrated):
    model, base, cal = tiny_calibrated
    assert cal.widths == BUDGET_WIDTHS
    assert [ls.layer for ls in cal.layers] == list(base.layers)
    assert cal.source == "user token ids" and cal.tokens == 96
    for ls in cal.layers:
        for row in (ls.key, ls.value):
            assert all(e is not None and e >= 0 for e in row)
            assert row[0] > row[1] > row[3] > row[4]  # 1 > 2 > 4 > 8 bits
            assert row[4] < 0.05 * row[1]  # 8-bit steps are 85x finer than 2-bit ones


def test_calibration_is_deterministic(tiny_calibrated):
    model, base, cal = tiny_calibrated
    again = budget.calibrate(model, base, calibration_ids(), progress=False)
    assert again.model_copy(update={"seconds": 0}) == cal.model_copy(update={"seconds": 0})
    other = budget.calibrate(model, base, calibration_ids(seed=2), progress=False)
    assert other.layers != cal.layers


def test_rows_calibrate_one_at_a_time_and_add(tiny_calibrated):
    """The loss-weighted errors sum over rows: a two-row calibration (measured a row at a
    time) is the sum of the two one-row ones, entry by entry."""
    model, base, cal = tiny_calibrated
    other = calibration_ids(seed=2)
    both = budget.calibrate(model, base, torch.cat([calibration_ids(), other]), progress=False)
    alone = budget.calibrate(model, base, other, progress=False)
    assert both.rows == 2 and both.tokens == 96
    for b, one, two in zip(both.layers, cal.layers, alone.layers, strict=True):
        for row in ("key", "value"):
            got, a, c = getattr(b, row), getattr(one, row), getattr(two, row)
            assert got == pytest.approx([x + y for x, y in zip(a, c, strict=True)], rel=1e-4)
            assert all(g > max(x, y) for g, x, y in zip(got, a, c, strict=True))


def test_full_precision_pin_is_part_of_the_calibration(tiny_calibrated):
    """A key pinned at 16 bits makes the cache pack that layer's values token by token: the
    calibration measures that schedule, and a table measured without the pin is refused."""
    model, base, cal = tiny_calibrated
    spec = small_spec(6.0, overrides=[{"layers": 0, "tensor": "key", "bits": 16}])
    pol = kvpolicy.derive_policy(model, policy=spec, calibration=calibration_ids())
    pinned = pol.calibration
    assert pinned.settings != cal.settings
    assert pinned.layers[1] == cal.layers[1]  # layer 1 is unchanged
    assert pinned.layers[0].value != cal.layers[0].value
    assert pinned.layers[0].key == (None,) * len(BUDGET_WIDTHS)  # not quantized: not measured
    assert pol.get(0, "key").bits == 16 and pol.avg_bits <= 6.0
    with pytest.raises(PolicyError, match="delete the 'calibration' block"):
        kvpolicy.derive_policy(model, policy=spec, calibration=cal)


def test_calibration_metrics(tiny_calibrated):
    """The relative currency needs no backward and ranks on its own scale; an unknown one is
    refused with the choices."""
    model, base, cal = tiny_calibrated
    assert cal.metric == budget.CALIBRATION_METRICS["fisher"]
    rel = budget.calibrate(model, base, calibration_ids(), metric="relative", progress=False)
    assert rel.metric == budget.CALIBRATION_METRICS["relative"]
    assert rel.settings == cal.settings and rel.layers != cal.layers
    for ls in rel.layers:
        assert 0 < ls.key[1] < 1 and 0 < ls.value[1] < 1  # a relative error at 2 bits
    with pytest.raises(KVPolicyError, match="choose from \\['fisher', 'relative'\\]"):
        budget.calibrate(model, base, calibration_ids(), metric="mse", progress=False)


def test_calibration_needs_tokens_past_the_windows():
    model = tiny_model("llama")
    base = kvpolicy.derive_policy(model, policy=small_spec(2))
    with pytest.raises(KVPolicyError, match="calibrate on at least 34 tokens"):
        budget.calibrate(model, base, calibration_ids(t=30), progress=False)


def test_budget_without_text_or_tokenizer_says_what_to_pass():
    with pytest.raises(KVPolicyError, match="pass calibration=<\\[B, T\\] token ids>"):
        kvpolicy.derive_policy(tiny_model("llama"), bits=2.5)


# --------------------------------------------------------------------------- end to end


def test_compile_with_a_budget(tmp_path, monkeypatch):
    model = kvpolicy.compile_model(tiny_model("llama"), policy=small_spec(2.5),
                                   calibration=calibration_ids(), progress=False)
    pol = kvpolicy.inspect(model)
    assert pol.budget == 2.5 and pol.avg_bits <= 2.5
    assert {t.bits_from for t in pol.tensors} == {"budget"}
    assert all(t.bits in BUDGET_WIDTHS for t in pol.tensors)
    assert "budget 2.5: " in pol.tensors[0].reason and " b " in pol.tensors[0].reason
    footer = str(pol).splitlines()[-2]
    assert footer.startswith(f"average {pol.avg_bits:.3f} code bits") and "budget 2.5" in footer
    ids = calibration_ids(seed=3, t=40)
    out = model.generate(ids, max_new_tokens=6, min_new_tokens=6, do_sample=False)
    assert out.shape == (1, 46)

    # Saved with its calibration, the file compiles to the same policy without measuring.
    path = kvpolicy.save_policy(model, tmp_path / "budget.yaml")
    text = path.read_text()
    assert "calibration:" in text and "bits: 2.5" in text

    def no_calibration(*a, **k):
        raise AssertionError("calibrated again")

    monkeypatch.setattr(budget, "calibrate", no_calibration)
    again = kvpolicy.compile_model(tiny_model("llama"), policy=str(path))
    assert [t.bits for t in kvpolicy.inspect(again).tensors] == [t.bits for t in pol.tensors]
    regenerated = again.generate(ids, max_new_tokens=6, min_new_tokens=6, do_sample=False)
    assert torch.equal(regenerated, out)

    # Change what the errors depend on and the saved table is refused, not reused.
    stale = tmp_path / "stale.yaml"
    stale.write_text(text.replace("residual: 16", "residual: 32"))
    with pytest.raises(PolicyError, match="delete the 'calibration' block"):
        kvpolicy.derive_policy(tiny_model("llama"), policy=str(stale))


def test_budget_compiles_inside_inference_mode(tiny_calibrated):
    """The calibration's backward runs even when compile_model is called under
    torch.inference_mode(), and measures what it measures outside."""
    _, _, cal = tiny_calibrated
    model = tiny_model("llama")
    with torch.inference_mode():
        model = kvpolicy.compile_model(model, policy=small_spec(2.5),
                                       calibration=calibration_ids(), progress=False)
    assert kvpolicy.inspect(model).calibration.layers == cal.layers


def test_pinned_rule_is_honoured_and_counted(tiny_calibrated):
    model, _, cal = tiny_calibrated
    assert len(cal.layers) == 2  # four tensors
    spec = small_spec(3.5, overrides=[{"layers": 0, "tensor": "key", "bits": 8}])
    pol = kvpolicy.derive_policy(model, policy=spec, calibration=cal)
    key0 = pol.get(0, "key")
    assert key0.bits == 8 and key0.bits_from == "rule" and "pinned" in key0.reason
    assert pol.avg_bits <= 3.5
    free = [t for t in pol.tensors if t is not key0]
    assert {t.bits_from for t in free} == {"budget"}
    assert sum(t.bits for t in free) == 6  # 14 bits in all, 8 of them pinned
    # Without the pin the same budget buys more for the others.
    plain = kvpolicy.derive_policy(model, policy=small_spec(3.5), calibration=cal)
    others = [t for t in plain.tensors if (t.layer, t.tensor.value) != (0, "key")]
    assert sum(t.bits for t in others) > 6


# --------------------------------------------------------------------------- SmolLM2


def test_smollm2_budget_allocation(smollm2):
    model, tokenizer = smollm2
    # One width per key: what this allocation was measured with (per-channel widths make
    # 2-bit keys cheaper: below).
    pol = kvpolicy.derive_policy(
        model, policy={"defaults": {"bits": 2.5, "channel_widths": "uniform"}}, progress=False)
    cal = pol.calibration
    assert cal.source == "pydoc text, last 2048 tokens as 4 rows of 512"
    assert (cal.rows, cal.tokens) == (4, 512)
    assert (budget.CALIBRATION_ROWS, budget.CALIBRATION_TOKENS) == (4, 512)
    assert 2.45 <= pol.avg_bits <= 2.5
    assert cal.metric == "loss-weighted attention-output error"
    keys = [t.bits for t in pol.tensors[::2]]
    values = [t.bits for t in pol.tensors[1::2]]
    # Measured (levels auto: 9 keys and 9 values chose normal levels): keys get more bits
    # than values on 14 of 30 layers, fewer on 2.
    more = sum(k > v for k, v in zip(keys, values, strict=True))
    fewer = sum(k < v for k, v in zip(keys, values, strict=True))
    assert more >= 2 * fewer + 2
    # Weighted by the loss, 2-bit keys (uniform levels) cost more than 2-bit values on 28 of
    # 30 layers (the relative output error says 23), up to 140x.
    k2 = [cal.errors(i, "key")[2] for i in pol.layers]
    v2 = [cal.errors(i, "value")[2] for i in pol.layers]
    assert sum(k > v for k, v in zip(k2, v2, strict=True)) >= 25
    # Model parameters are left as they were: no gradients kept.
    assert all(p.grad is None for p in model.parameters())
    # channel_widths: auto (the default) prices each key width with the widths the cache
    # will place: 2-bit keys cost less than with one width in most layers.

    spread = kvpolicy.derive_policy(model, bits=2.5, progress=False)
    k2_spread = [spread.calibration.errors(i, "key")[2] for i in pol.layers]
    cheaper = sum(a < b for a, b in zip(k2_spread, k2, strict=True))
    assert cheaper >= 20, (cheaper, sum(k2_spread) / sum(k2))
    assert sum(k2_spread) < 0.6 * sum(k2), sum(k2_spread) / sum(k2)
    assert any(t.widths for t in spread.tensors)
