"""compile_model on a soft-capped architecture (Gemma2: ``cap * tanh(s / cap)`` between the
scores and the mask): the cap is read off the graph, applied in every path (prefill,
decode over packed groups, sinks and residual), and is the model's own."""

from __future__ import annotations

import torch

import kvpolicy
from kvpolicy.state import compiled_of
from kvpolicy.zoo.tiny import tiny_model

# 16-token groups and window: 69 tokens pack several chunks per layer.
FULL = {"defaults": {"bits": 16, "group_size": 16, "residual": 16, "sinks": 2}}
TWO_BITS = {"defaults": {**FULL["defaults"], "bits": 2}}


def _ids(batch=2, length=9, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 128, (batch, length), generator=g)


def _attends(model):
    compiled = compiled_of(model)
    return [kg.attend for graphs in compiled.kinds.values() for kg in graphs.values()]


def _generate(model, ids, n=60):
    return model.generate(ids, max_new_tokens=n, do_sample=False, pad_token_id=0,
                          return_dict_in_generate=True)


def test_cap_is_read_off_the_graph():
    model = kvpolicy.compile_model(tiny_model("gemma2"), bits=2)
    cfg = model.config
    attends = _attends(model)
    assert attends and all(a.softcap == cfg.attn_logit_softcapping for a in attends)
    # Gemma2 scales by query_pre_attn_scalar ** -0.5, not head_dim ** -0.5.
    assert all(abs(a.scale - cfg.query_pre_attn_scalar ** -0.5) < 1e-7 for a in attends)
    # The tiny model's scores really reach its cap (else tanh is linear and no test here
    # could tell a cap from none).
    assert cfg.attn_logit_softcapping <= 4.0


def test_full_precision_is_token_identical_past_the_residual():
    ref = tiny_model("gemma2")
    model = kvpolicy.compile_model(tiny_model("gemma2"), policy=FULL)
    ids = _ids()
    with torch.no_grad():
        want = _generate(ref, ids).sequences
        out = _generate(model, ids)
    assert torch.equal(want, out.sequences)
    layers = out.past_key_values.layers
    assert all(lay.packed.n_packed > 0 for lay in layers)  # packed groups were attended
    # Sinks on the global layer (the sliding one evicted its own once they left the window).
    assert [lay.packed.n_sinks for lay in layers if lay.packed.window is None] == [2]


def test_removing_the_cap_changes_the_output_to_the_uncapped_models():
    """The compiled cap is the model's own: without it the compiled model is exactly the
    uncapped model, whose tokens differ."""
    model = kvpolicy.compile_model(tiny_model("gemma2"), policy=FULL)
    for attend in _attends(model):
        attend.softcap = None
    ids = _ids()
    with torch.no_grad():
        capped = _generate(tiny_model("gemma2"), ids).sequences
        uncapped = _generate(tiny_model("gemma2", attn_logit_softcapping=None), ids).sequences
        got = _generate(model, ids).sequences
    assert not torch.equal(capped, uncapped), "the tiny model's cap changes no token"
    assert torch.equal(got, uncapped)


def test_two_bits_applies_the_cap():
    """At 2 bits (fused C++ decode over packed groups on CPU) the capped compiled model is
    far from the same compiled model without the cap, and closer to the reference."""
    ref = tiny_model("gemma2")
    model = kvpolicy.compile_model(tiny_model("gemma2"), policy=TWO_BITS)
    ids = _ids(length=41)
    with torch.no_grad():
        want = ref(ids).logits[:, -1]
        steps = {}
        for cap in (model.config.attn_logit_softcapping, None):
            for attend in _attends(model):
                attend.softcap = cap
            out = model(ids[:, :40], use_cache=True)
            assert out.past_key_values.layers[0].packed.n_packed > 0
            steps[cap] = model(ids[:, 40:], past_key_values=out.past_key_values,
                               use_cache=True).logits[:, -1]
    capped, uncapped = steps.values()
    err = {name: ((s - want).norm() / want.norm()).item()
           for name, s in (("capped", capped), ("uncapped", uncapped))}
    assert err["capped"] < err["uncapped"], err
    assert (capped - uncapped).norm() / uncapped.norm() > 0.1, err
