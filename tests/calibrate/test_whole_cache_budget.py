"""A stored-bits budget over the whole cache (``defaults.budget_context``): the joint
allocator, the policy it writes, and the bytes a compiled cache then holds."""

from __future__ import annotations

import itertools
import random

import pytest
import torch

import kvpolicy
from kvpolicy.calibrate import allocate_joint
from kvpolicy.errors import PolicyError
from kvpolicy.policies.derive import WINDOW_CHOICES
from kvpolicy.policies.footprint import held_tokens, whole_cache
from kvpolicy.runtime.paged import PagedLayout
from kvpolicy.zoo.tiny import tiny_model

SMALL = {"residual": 16, "sinks": 2}
TOKENS = 300


def _ids(seed: int, t: int) -> torch.Tensor:
    return torch.randint(3, 120, (1, t), generator=torch.Generator().manual_seed(seed))


def _held_bytes(model, tokens: int) -> float:
    ids = _ids(0, tokens)
    with torch.no_grad():
        cache = model(ids[:, : tokens - 24], use_cache=True).past_key_values
        for i in range(tokens - 24, tokens):  # decode steps (local layers evict)
            cache = model(ids[:, i : i + 1], past_key_values=cache,
                          use_cache=True).past_key_values
    report = cache.memory_report()
    return report["bytes"] - report["position_bytes"] - report["rope_bytes"]


# --------------------------------------------------------------------------- allocator


@pytest.mark.parametrize("seed", range(4))
def test_allocate_joint_finds_the_least_error_within_the_capacity(seed):
    """Against brute force over every choice: three groups of two tensors whose size is
    not the sum of per-tensor sizes (a coupling term, as the key group's chunk is)."""
    rng = random.Random(seed)
    tables = [[{(w, g): rng.random() / w for w in (1, 2, 4) for g in (1, 2)}
               for _ in range(2)] for _ in range(3)]

    def size(group: int, opts) -> int:
        (wa, ga), (wb, gb) = opts
        return 10 * (wa + wb) + 7 * max(ga, gb) + group

    capacity = rng.randint(150, 220)
    got = allocate_joint(tables, size, capacity, resolution=capacity)  # one-bit units
    total = sum(size(g, o) for g, o in enumerate(got))
    assert total <= capacity
    err = sum(tables[g][j][o] for g, opts in enumerate(got) for j, o in enumerate(opts))
    best = min(
        sum(tables[g][j][o] for g, opts in enumerate(pick) for j, o in enumerate(opts))
        for pick in itertools.product(*(list(itertools.product(*(sorted(t) for t in grp)))
                                        for grp in tables))
        if sum(size(g, o) for g, o in enumerate(pick)) <= capacity)
    assert err == pytest.approx(best, rel=1e-12)


def test_allocate_joint_leaves_out_options_that_do_not_go_together():
    # (2, 2) would be the least error within the capacity, but does not go together.
    tables = [[{(1, 1): 1.0, (2, 1): 0.1}, {(1, 2): 1.0, (2, 2): 0.1}]]

    def size(g, opts):
        (wa, _), (wb, _) = opts
        return None if (wa, wb) == (2, 2) else 10 * (wa + wb)

    assert allocate_joint(tables, size, 100) in ([((2, 1), (1, 2))], [((1, 1), (2, 2))])
    with pytest.raises(PolicyError, match="layer 0: no choice of its tensors' options"):
        allocate_joint(tables, lambda g, o: None, 100)


def test_allocate_joint_refuses_a_capacity_below_the_smallest_choices():
    tables = [[{(1, 1): 1.0, (2, 1): 0.5}]]
    with pytest.raises(PolicyError, match="needs 10"):
        allocate_joint(tables, lambda g, o: 10 * o[0][0], 9)


# --------------------------------------------------------------------------- end to end


@pytest.mark.parametrize("arch", ["llama", "gemma3_text"])
def test_the_budget_holds_over_the_whole_cache_the_model_then_holds(arch):
    # Gemma3's layers are local: a window of 160 holds 159 tokens at 300, of which the
    # residual and the incomplete chunk wait in full precision (4.2 bits at the least).
    local = arch == "gemma3_text"
    model = tiny_model(arch, max_position_embeddings=512,
                       **({"sliding_window": 160} if local else {}))
    budget = 5.0 if local else 4.0
    spec = {"defaults": {"stored_bits": budget, "budget_context": TOKENS, **SMALL}}
    kvpolicy.compile_model(model, policy=spec, calibration=_ids(1, 160), progress=False)
    pol = kvpolicy.inspect(model)
    assert pol.budget_context == TOKENS and pol.budget_unit == "stored"
    whole = whole_cache(pol, TOKENS)
    # The budget is per element of what an fp16 cache keeps: every token of a global
    # layer, the last window - 1 of a local one (which may hold a few more, whole chunks).
    kept = sum(held_tokens(TOKENS, 0, TOKENS, 1, w).total * 128
               for w in (pol.windows or (None, None)))
    assert 0.97 * budget * kept < 8 * whole.bytes <= budget * kept  # used, never exceeded
    # What the compiled cache holds after 300 tokens is what the budget counted.
    assert whole.bytes == pytest.approx(_held_bytes(model, TOKENS), rel=0.02)
    # The body alone is cheaper than the whole: full-precision tokens are counted.
    assert pol.avg_stored_bits() < whole.bits
    value = pol.get(0, "value")
    assert f"stored-bits budget {budget:g} over the whole cache at {TOKENS} tokens" \
        in value.reason
    assert "the layer holds" in value.reason
    footer = str(pol).splitlines()
    assert any(f"whole cache at {TOKENS} tokens" in line and f"{whole.bits:.2f}" in line
               for line in footer)
    assert len(pol.tensors) == 4 and pol.get(0, "key").elements_per_token == 64


def test_a_body_budget_is_exceeded_over_the_whole_cache():
    """The same budget read as before (the packed body): the whole cache holds more, which
    is why budget_context exists."""
    model = tiny_model("llama")
    cal = kvpolicy.derive_policy(model, policy={"defaults": {"stored_bits": 4.0, **SMALL}},
                                 calibration=_ids(1, 160), progress=False)
    assert cal.budget_context is None
    assert cal.avg_stored_bits() <= 4.0 < whole_cache(cal, TOKENS).bits
    whole = kvpolicy.derive_policy(
        model, policy={"defaults": {"stored_bits": 4.0, "budget_context": TOKENS, **SMALL}},
        calibration=cal.calibration, progress=False)
    assert whole_cache(whole, TOKENS).bits <= 4.0
    assert whole.avg_stored_bits() < cal.avg_stored_bits()  # the body pays for the rest


def test_a_packed_residual_gives_the_bytes_it_saves_to_the_body():
    """A whole-cache budget holds its residual at 8 bits unless ``residual_bits`` is
    written: the residual costs half, the allocator spends the difference on the packed
    body, and the compiled cache holds what the budget counted."""
    model = tiny_model("llama", max_position_embeddings=512)
    plain = kvpolicy.derive_policy(
        model, policy={"defaults": {"stored_bits": 4.0, "budget_context": TOKENS,
                                    "residual_bits": 16, **SMALL}},
        calibration=_ids(1, 160), progress=False)
    assert {t.residual_bits for t in plain.tensors} == {16}
    spec = {"defaults": {"stored_bits": 4.0, "budget_context": TOKENS, **SMALL}}
    kvpolicy.compile_model(model, policy=spec, calibration=plain.calibration, progress=False)
    packed = kvpolicy.inspect(model)
    assert {t.residual_bits for t in packed.tensors} == {8}
    assert "the residual window held at 8 bits per token, not 16: a whole-cache budget" \
        in packed.get(0, "value").reason
    a, b = whole_cache(plain, TOKENS), whole_cache(packed, TOKENS)
    assert a.bits <= 4.0 and b.bits <= 4.0
    assert b.body_bits > a.body_bits  # the body got what the residual gave up
    assert b.bytes == pytest.approx(_held_bytes(model, TOKENS), rel=0.02)


def test_a_whole_cache_budget_keeps_a_short_residual_unless_one_is_written():
    model = tiny_model("gemma3_text", max_position_embeddings=1024, sliding_window=512,
                       layer_types=["sliding_attention", "full_attention"])
    cal = _ids(1, 260)
    whole = kvpolicy.derive_policy(
        model, policy={"defaults": {"stored_bits": 4.0, "budget_context": TOKENS, "sinks": 2}},
        calibration=cal, progress=False)
    assert whole.windows == (512, None)
    # 64 in the global layer (held at 8 bits, the bytes of 32 at 16), and the local layer's
    # share of its window: 64 * 512 // 4096; no window chosen unless residual: auto
    assert [t.residual for t in whole.tensors] == [8, 8, 64, 64]
    assert whole.window_choices == () and whole.calibration.recent == ()
    assert "a whole-cache budget pays every token kept out of the packed body" \
        in whole.get(1, "key").reason
    auto = kvpolicy.derive_policy(
        model, policy={"defaults": {"stored_bits": 4.0, "budget_context": TOKENS, "sinks": 2,
                                    "residual": "auto"}},
        calibration=cal, progress=False)
    # the local layer keeps its share; the budget chose the global layer's window
    # (tests/calibrate/test_window_choice.py)
    assert [t.residual for t in auto.tensors[:2]] == [8, 8]
    key = auto.get(1, "key")
    assert (key.residual, key.residual_bits) in WINDOW_CHOICES
    assert f"recent window {key.residual} tokens" in key.reason
    assert "residual: auto then chooses each global layer's" in key.reason
    at16 = kvpolicy.derive_policy(
        model, policy={"defaults": {"stored_bits": 4.0, "budget_context": TOKENS, "sinks": 2,
                                    "residual_bits": 16}},
        calibration=cal, progress=False)
    assert [t.residual for t in at16.tensors] == [4, 4, 32, 32]
    written = kvpolicy.derive_policy(
        model, policy={"defaults": {"stored_bits": 4.0, "budget_context": TOKENS, "sinks": 2,
                                    "residual": 16}},
        calibration=cal, progress=False)
    assert [t.residual for t in written.tensors] == [16] * 4
    body = kvpolicy.derive_policy(
        model, policy={"defaults": {"stored_bits": 4.0, "sinks": 2}}, calibration=cal,
        progress=False)
    assert [t.residual for t in body.tensors] == [16, 16, 128, 128]


def test_budget_context_needs_a_stored_bits_budget():
    with pytest.raises(PolicyError, match="budget_context 4096.*add stored_bits"):
        kvpolicy.derive_policy(tiny_model("llama"),
                               policy={"defaults": {"bits": 2, "budget_context": 4096}})


def test_a_whole_cache_budget_below_the_full_precision_tokens_is_refused():
    # 300 tokens with residual 16 + sinks 2 + an incomplete chunk at 16 bits cannot fit 1.2
    with pytest.raises(PolicyError, match="smallest choice of every layer needs"):
        kvpolicy.derive_policy(
            tiny_model("llama"),
            policy={"defaults": {"stored_bits": 1.2, "budget_context": TOKENS, **SMALL}},
            calibration=_ids(1, 160), progress=False)


# --------------------------------------------------------------------------- pages


def _page_bytes(pol, block: int) -> list[int]:
    out = []
    for layer in pol.layers:
        k, v = pol.get(layer, "key"), pol.get(layer, "value")
        lay = PagedLayout(k.quant_spec(), v.quant_spec(), num_kv_heads=k.num_kv_heads,
                          head_dim=k.head_dim, block_size=block, sinks=k.sinks,
                          store_dtype=torch.bfloat16)
        out.append(lay.page_bytes)
    return out


def test_a_budget_per_page_holds_for_every_layers_page():
    """What vLLM allocates: each layer's page (codes, scales, zeros, a stage of one chunk and
    the sink area in full precision) within the budget, where the body-only count lets the
    stage of groups of 128 take most of a page."""
    model = tiny_model("llama")
    block, budget = 128, 4.0
    body = kvpolicy.derive_policy(model, policy={"defaults": {"stored_bits": budget, **SMALL}},
                                  calibration=_ids(1, 160), progress=False)
    paged = kvpolicy.derive_policy(
        model, policy={"defaults": {"stored_bits": budget, "budget_pages": block, **SMALL}},
        calibration=body.calibration, progress=False)
    assert paged.budget_pages == block and paged.budget_context is None
    limit = budget * block * 128 / 8  # 128 elements per token (key + value)
    align = 16 * 10  # each field of a page starts on 16 bytes
    for got in _page_bytes(paged, block):
        assert 0.9 * limit < got <= limit + align
    assert max(_page_bytes(body, block)) > 1.5 * limit
    for t in paged.tensors:  # every chunk divides the page
        assert block % t.quant_spec().token_group == 0
    assert f"per page of {block} tokens" in paged.get(0, "value").reason
    assert "the layer's page holds" in paged.get(0, "value").reason


@pytest.mark.parametrize("defaults,message", [
    ({"bits": 2, "budget_pages": 512}, "budget_pages 512.*add stored_bits"),
    ({"stored_bits": 3.0, "budget_pages": 512, "budget_context": 4096}, "give one of them"),
    ({"stored_bits": 3.0, "budget_pages": 500}, "multiple of 16"),
])
def test_budget_pages_is_refused_where_it_means_nothing(defaults, message):
    with pytest.raises(PolicyError, match=message):
        kvpolicy.derive_policy(tiny_model("llama"), policy={"defaults": defaults})


def test_the_vllm_plugin_says_what_a_stored_budget_does_not_count():
    import kvpolicy.vllm.policy as served

    model = tiny_model("llama")
    body = kvpolicy.derive_policy(model, policy={"defaults": {"stored_bits": 4.0, **SMALL}},
                                  calibration=_ids(1, 160), progress=False)
    note = served.ServedPolicy(body, None, "", torch.float32).page_count_note()
    assert note is not None and "counts the packed body" in note
    assert f"write budget_pages: {served.MIN_BLOCK}" in note
    paged = kvpolicy.derive_policy(
        model, policy={"defaults": {"stored_bits": 4.0, "budget_pages": 128, **SMALL}},
        calibration=body.calibration, progress=False)
    for pol in (paged, kvpolicy.derive_policy(model, bits=2, progress=False)):
        assert served.ServedPolicy(pol, None, "", torch.float32).page_count_note() is None
    assert served.ServedPolicy(paged, None, "", torch.float32).default_block_size() == 128
