"""A whole-cache budget chooses each global layer's recent window (calibrate.whole_cache):
how a window choice is priced, that the allocator takes a larger window where attention
reads recent tokens and the cheapest where it does not, and what the policy then says."""

from __future__ import annotations

import copy
import math

import pytest
import torch

import kvpolicy
from kvpolicy.calibrate import whole_cache
from kvpolicy.calibrate.capture import LayerActivations
from kvpolicy.errors import PolicyError
from kvpolicy.policies.derive import WINDOW_CHOICES
from kvpolicy.policies.footprint import whole_cache as footprint
from kvpolicy.zoo.tiny import tiny_model

CONTEXT = 4096  # what the budget counts at (the tiny model need not reach it)
SPEC = {"defaults": {"stored_bits": 3.0, "budget_context": CONTEXT, "sinks": 2,
                     "residual": "auto"}}


def _ids(seed: int, t: int) -> torch.Tensor:
    return torch.randint(3, 120, (1, t), generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module")
def derived():
    model = tiny_model("llama", max_position_embeddings=512)
    return model, kvpolicy.derive_policy(model, policy=SPEC, calibration=_ids(1, 200),
                                         progress=False)


def _activations(reach: int | None, t: int = 512, d: int = 16) -> LayerActivations:
    """One head of random keys and values. With ``reach``, two channels carry the position
    at such an amplitude that the query at ``i`` reads the keys of about ``[i - reach,
    i]`` (scores ``A cos(θ (i - j))``, A θ² reach² = 2); without, random small queries
    read every key about alike."""
    g = torch.Generator().manual_seed(0)
    k = torch.randn(1, 1, t, d, generator=g)
    v = torch.randn(1, 1, t, d, generator=g)
    q = 0.3 * torch.randn(1, 1, t, d, generator=g)
    if reach is not None:
        theta = math.pi / (2 * t)
        amp = (2 / (theta * reach) ** 2 * d ** 0.5) ** 0.5
        angle = theta * torch.arange(t)
        for x in (q, k):
            x[..., 0], x[..., 1] = amp * angle.cos(), amp * angle.sin()
    return LayerActivations(layer=0, query=q, key_pre=k, key=k, value=v, scale=d ** -0.5)


def _policies(derived):
    """Layer 0's key and value shaped for :func:`_activations` (one head of 16)."""
    _, policy = derived
    shape = {"head_dim": 16, "num_kv_heads": 1, "residual": 64}
    return (policy.get(0, "key").model_copy(update={**shape, "group_size": 32}),
            policy.get(0, "value").model_copy(update={**shape, "group_size": 16}))


def test_a_window_is_worth_more_where_attention_reads_recent_tokens(derived):
    kp, vp = _policies(derived)
    choices = ((32, 8), (64, 8), (128, 8), (32, 16))
    near_k, near_v = whole_cache.measure(_activations(40), kp, vp, torch.float16, choices,
                                         "relative")
    far_k, far_v = whole_cache.measure(_activations(None), kp, vp, torch.float16, choices,
                                       "relative")
    for near, far in ((near_k, far_k), (near_v, far_v)):
        # 128 recent tokens hold nearly all a query reaching 40 back reads: its body error
        # falls a hundredfold from 32 recent tokens ...
        assert near[2][0] < 0.01 * near[0][0]
        # ... and by less than half where every key is read alike
        assert far[2][0] > 0.5 * far[0][0]
        for x in (near, far):
            # the window's own error: none at 16 bits, some at 8, below the body's
            assert x[3][1] == 0.0
            assert 0 < x[0][1] < x[0][0]
            # 32 recent tokens cost the body the same at 8 and at 16 bits
            assert x[0][0] == x[3][0]


def test_measure_refuses_too_few_tokens(derived):
    kp, vp = _policies(derived)
    act = _activations(10, t=150)
    with pytest.raises(kvpolicy.KVPolicyError, match="calibrate on at least"):
        whole_cache.measure(act, kp, vp, torch.float16, ((128, 8),), "relative")


def test_the_calibration_prices_every_choice_and_the_policy_says_what_it_chose(derived):
    model, policy = derived
    cal = policy.calibration
    assert policy.window_choices == WINDOW_CHOICES and cal.recent == WINDOW_CHOICES
    for layer in policy.layers:
        rows = cal.recent_errors(layer, "key")
        assert set(rows) == set(WINDOW_CHOICES)
        assert rows[(32, 16)][1] == 0.0 and rows[(32, 8)][1] > 0.0
    for k, v in zip(policy.tensors[::2], policy.tensors[1::2], strict=True):
        assert (k.residual, k.residual_bits) in WINDOW_CHOICES
        assert (v.residual, v.residual_bits) == (k.residual, k.residual_bits)
        # both costs of every choice, on the key's reason
        assert f"recent window {k.residual} tokens at {k.residual_bits} bits" in k.reason
        for r, b in WINDOW_CHOICES:
            assert f"{r} at {b} b " in k.reason
    assert footprint(policy, CONTEXT).bits <= 3.0
    model = copy.deepcopy(model)
    kvpolicy.compile_model(model, policy=SPEC, calibration=cal, progress=False)
    compiled = kvpolicy.inspect(model)
    assert [(t.residual, t.residual_bits) for t in compiled.tensors] == \
        [(t.residual, t.residual_bits) for t in policy.tensors]


def _planted(cal, near: set[int]):
    """``cal`` with the window measurements replaced: on the layers in ``near`` the body's
    error falls a hundredfold per doubling of the window, elsewhere it does not change."""
    layers = []
    for ls in cal.layers:
        def rows(layer=ls.layer):
            return tuple((1.0 / 100 ** {32: 0, 64: 1, 128: 2}[r] if layer in near else 1.0,
                          0.0 if b == 16 else 1e-12) for r, b in cal.recent)
        layers.append(ls.model_copy(update={"key_recent": rows(), "value_recent": rows()}))
    return cal.model_copy(update={"layers": tuple(layers)})


def test_the_budget_buys_a_larger_window_only_where_it_pays(derived):
    model, policy = derived
    cal = _planted(policy.calibration, near={0})
    got = kvpolicy.derive_policy(model, policy=SPEC, calibration=cal, progress=False)
    windows = [(t.residual, t.residual_bits) for t in got.tensors[::2]]
    assert windows[0] == (128, 8)  # the error falls ten-thousandfold for the bytes
    assert windows[1] == (32, 8)  # no error to buy back: the fewest bytes
    flat = kvpolicy.derive_policy(model, policy=SPEC, calibration=_planted(
        policy.calibration, near=set()), progress=False)
    assert {(t.residual, t.residual_bits) for t in flat.tensors} == {(32, 8)}


@pytest.mark.parametrize("written", [{}, {"residual": 16}])
def test_a_window_is_chosen_only_under_residual_auto(derived, written):
    model, _ = derived
    spec = {"defaults": {**SPEC["defaults"], "residual": 64, **written}}
    if not written:
        del spec["defaults"]["residual"]
    got = kvpolicy.derive_policy(model, policy=spec, calibration=_ids(1, 200),
                                 progress=False)
    assert got.window_choices == () and got.calibration.recent == ()
    assert all(ls.key_recent is None for ls in got.calibration.layers)
    assert "recent window" not in got.get(0, "key").reason


@pytest.mark.parametrize("defaults, rule, match", [
    ({"stored_bits": 3.0}, None, "needs stored_bits and budget_context"),
    ({**SPEC["defaults"], "residual_bits": 8}, None, "no residual_bits"),
    (SPEC["defaults"], {"layers": 0, "tensor": "*", "residual_bits": 16},
     "drop residual and residual_bits from the rules"),
])
def test_residual_auto_is_refused_where_the_budget_cannot_choose(defaults, rule, match):
    spec = {"defaults": {**defaults, "residual": "auto"}}
    if rule:
        spec["overrides"] = [rule]
    with pytest.raises(PolicyError, match=match):
        kvpolicy.derive_policy(tiny_model("llama"), policy=spec, progress=False)


def test_a_calibration_without_the_choices_is_refused(derived):
    model, policy = derived
    stale = policy.calibration.model_copy(update={"recent": ()})
    with pytest.raises(PolicyError, match="delete the 'calibration' block"):
        kvpolicy.derive_policy(model, policy=SPEC, calibration=stale, progress=False)


def test_measure_prices_only_the_last_rows_it_is_given(derived):
    """``rows``: the choices are priced on the last query rows alone (the joined
    calibration text's longest contexts); the loss-weighted errors add over rows."""
    kp, vp = _policies(derived)
    act = _activations(40)
    act.out_grad = torch.randn(act.query.shape, generator=torch.Generator().manual_seed(1))
    choices = ((32, 8), (128, 8))
    every = whole_cache.measure(act, kp, vp, torch.float16, choices)
    assert whole_cache.measure(act, kp, vp, torch.float16, choices, rows=512) == every
    last = whole_cache.measure(act, kp, vp, torch.float16, choices, rows=64)
    for a, b in zip(last, every, strict=True):
        for x, y in zip(a, b, strict=True):
            assert 0 < x[0] < y[0] and 0 < x[1] < y[1]


def test_the_calibration_prices_windows_on_its_rows_joined(derived, monkeypatch):
    model, _ = derived
    seen = []
    real = whole_cache.measure

    def spy(act, *args, **kwargs):
        seen.append((act.query.shape[0], act.query.shape[2], kwargs.get("rows")))
        return real(act, *args, **kwargs)

    monkeypatch.setattr(whole_cache, "measure", spy)
    ids = torch.cat([_ids(1, 200), _ids(2, 200)])
    kvpolicy.derive_policy(model, policy=SPEC, calibration=ids, progress=False)
    assert seen and set(seen) == {(1, 400, whole_cache.PRICED_ROWS)}


def test_the_joined_row_stops_at_the_models_positions(monkeypatch):
    model = tiny_model("llama", max_position_embeddings=256)
    seen = []
    real = whole_cache.measure

    def spy(act, *args, **kwargs):
        seen.append(act.query.shape[2])
        return real(act, *args, **kwargs)

    monkeypatch.setattr(whole_cache, "measure", spy)
    ids = torch.cat([_ids(1, 200), _ids(2, 200)])
    kvpolicy.derive_policy(model, policy=SPEC, calibration=ids, progress=False)
    assert set(seen) == {256}
