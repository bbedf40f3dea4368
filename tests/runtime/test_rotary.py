"""RoPE rows from positions (runtime.rotary) and implicit positions (runtime.positions):
no per-token side tables, appends that do not copy what is held, exact at 16 bits."""

from __future__ import annotations

import pytest
import torch

import kvpolicy
from kvpolicy.runtime.positions import Positions, TokenPositions
from kvpolicy.runtime.rotary import RotaryGroup
from kvpolicy.zoo.tiny import tiny_model

# One layer, one KV head, head_dim 64: the model where a per-token RoPE table costs the most
# against the cache (an fp16 token is 256 bytes).
ONE_HEAD = dict(num_hidden_layers=1, hidden_size=128, num_attention_heads=2,
                num_key_value_heads=1, head_dim=64, max_position_embeddings=8192)


def _ids(batch: int, length: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 128, (batch, length), generator=g)


def _fill(model, ids, chunk: int):
    cache = None
    with torch.no_grad():
        for s in range(0, ids.shape[1], chunk):
            kw = {} if cache is None else {"past_key_values": cache}
            cache = model(ids[:, s : s + chunk], use_cache=True, **kw).past_key_values
    return cache


def test_long_cache_holds_no_per_token_rope_or_position_bytes():
    """4K tokens on the one-head model: the RoPE group and the positions hold a few bytes
    whatever the length, and the cache's compression is the packed body's."""
    model = kvpolicy.compile_model(tiny_model("llama", **ONE_HEAD), bits=2)
    ids = _ids(1, 4096)
    cache = _fill(model, ids[:, :2048], 2048)
    short = cache.memory_report()
    with torch.no_grad():
        for t in range(2048, 2048 + 64):  # decode steps, then a long chunk
            cache = model(ids[:, t : t + 1], past_key_values=cache, use_cache=True).past_key_values
        cache = model(ids[:, 2112:], past_key_values=cache, use_cache=True).past_key_values
    rep = cache.memory_report()
    assert rep["tokens"] == 4096
    assert [g["rows"] for g in rep["rope_groups"]] == ["computed"]
    held = rep["rope_bytes"] + rep["position_bytes"]
    assert held == short["rope_bytes"] + short["position_bytes"], "side data grew with T"
    assert held < 1024, f"{held} bytes of RoPE/positions at 4K tokens"
    assert rep["rope_transient_bytes"] == 0  # the step's table is dropped once read
    layer = rep["layers"][0]
    body = layer["bytes"] - layer["position_bytes"]
    assert rep["bytes"] == body + held
    assert rep["compression"] > 0.999 * layer["fp16_bytes"] / body
    assert rep["compression"] > 4.5  # 2 bits, G=32, R=128, 4 sinks at 4K tokens


def test_decode_steps_keep_one_run_and_no_rope_storage():
    model = kvpolicy.compile_model(tiny_model("llama", max_position_embeddings=1024), bits=2)
    ids = _ids(2, 600)
    cache = _fill(model, ids[:, :100], 100)
    groups = cache.rotary
    with torch.no_grad():
        for t in range(100, 600):
            cache = model(ids[:, t : t + 1], past_key_values=cache, use_cache=True).past_key_values
    assert cache.rotary == groups and len(groups) == 1 and groups[0].computed
    assert groups[0].cos.data is None  # nothing stored per token
    for layer in cache.layers:
        runs = layer.packed.held_positions().runs
        assert len(runs) == 1 and runs[0].n == 600 and isinstance(runs[0].base, int)


def test_stored_rows_grow_amortised():
    """Rows no buffer reproduces are stored in a growing table: 2,000 single-token appends
    reallocate it a few dozen times, never once per step."""
    held = Positions()
    inv = 1.0 / 1e4 ** (torch.arange(0, 64, 2) / 64)
    rows = []
    for p in range(2001):
        f = torch.full((1, 1, 32), float(p)) * inv
        rows.append((torch.cat((f, f), -1).cos(), torch.cat((f, f), -1).sin()))
    group, pos = RotaryGroup.fit(*rows[0], "rotate_half", held, 0, 1, sources=())
    assert not group.computed
    held = held.appended(pos, "cpu")
    ptrs = {group.cos.data.data_ptr()}
    for p in range(1, 2001):
        pos = group.resolve(held, *rows[p], p, 1)
        held = held.appended(pos, "cpu")
        ptrs.add(group.cos.data.data_ptr())
    assert group.cos.n == 2001 and len(ptrs) < 40
    assert len(held.runs) == 1  # table rows of one sequence are contiguous
    spec = group.spec()
    assert torch.equal(spec.cos[held.tensor("cpu")[0]], torch.cat([c[0] for c, _ in rows]))


def _same_greedy(ref, model, ids, mask=None, steps: int = 30):
    """``model``'s greedy generation of ``ids`` (left-padded where ``mask`` says), checked
    token-identical to ``ref``'s; the generate output (with its cache)."""
    with torch.no_grad():
        want = ref.generate(ids, attention_mask=mask, max_new_tokens=steps, do_sample=False,
                            pad_token_id=0)
        out = model.generate(ids, attention_mask=mask, max_new_tokens=steps, do_sample=False,
                             pad_token_id=0, return_dict_in_generate=True)
    assert torch.equal(want, out.sequences)
    return out


def test_left_padded_positions_are_explicit_only_for_the_padding():
    ref, model = tiny_model("llama"), tiny_model("llama")
    kvpolicy.compile_model(model, bits=16)
    ids = _ids(2, 40)
    mask = torch.ones_like(ids)
    mask[0, :6] = 0
    out = _same_greedy(ref, model, ids, mask)
    rep = out.past_key_values.memory_report()
    assert [g["rows"] for g in rep["rope_groups"]] == ["computed"]
    layer = out.past_key_values.layers[0].packed
    runs = layer.held_positions().runs
    # The padded head (row 0's positions repeat there) is explicit, the rest one run.
    assert [r.contiguous for r in runs] == [False, True] and runs[0].n <= 6
    assert layer.positions()[0, -1] == 40 - 6 + 30 - 2 and layer.positions()[1, -1] == 40 + 28


@pytest.mark.parametrize("rope", [
    {"rope_type": "linear", "factor": 2.0},
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64},
])
def test_scaled_rope_is_computed_and_exact(rope):
    kw = {"rope_parameters": {"rope_theta": 10000.0, **rope}}
    ref, model = tiny_model("llama", **kw), tiny_model("llama", **kw)
    kvpolicy.compile_model(model, bits=16)
    ids = _ids(2, 30)
    out = _same_greedy(ref, model, ids, steps=60)
    assert out.past_key_values.rotary[0].computed


def test_frequencies_that_change_mid_sequence_fall_back_to_stored_rows():
    """longrope switches the model's frequencies once the sequence passes its original
    length: rows computed so far become table rows, later rows are stored as given, and
    greedy output stays identical at 16 bits."""
    rope = {"rope_type": "longrope", "rope_theta": 10000.0, "short_factor": [1.0] * 16,
            "long_factor": [1.0 + i / 4 for i in range(16)],
            "original_max_position_embeddings": 48}
    ref = tiny_model("llama", rope_parameters=rope)
    model = tiny_model("llama", rope_parameters=rope)
    kvpolicy.compile_model(model, bits=16)
    ids = _ids(2, 30)
    out = _same_greedy(ref, model, ids, steps=40)
    assert not out.past_key_values.rotary[0].computed


def test_token_positions_split_a_padded_head_from_a_contiguous_tail():
    vals = torch.tensor([[0, 0, 0, 0, 1, 2, 3, 4], [0, 1, 2, 3, 4, 5, 6, 7]])
    tp = TokenPositions.of(vals)
    assert [r.n for r in tp.runs] == [3, 5] and not tp.runs[0].contiguous
    assert torch.equal(tp.tensor("cpu"), vals) and (tp.lo, tp.hi) == (0, 7)
    held = Positions().appended(tp, "cpu")
    nxt = held.following()
    assert nxt is not None and torch.equal(nxt[0], torch.tensor([5, 8]))
    step = TokenPositions.contiguous(2, nxt[0], 1, nxt[1], nxt[2], nxt[3])
    held = held.appended(step, "cpu")  # joins the tail by identity, no comparison
    assert len(held.runs) == 2 and held.n == 9 and held.hi == 8
    assert torch.equal(held.select(torch.tensor([1, 1])).tensor("cpu")[:, -1],
                       torch.tensor([8, 8]))


def test_layers_with_other_angles_get_their_own_group():
    """Gemma3's local layers (rope_theta 10K) and global one (1M) each share one group,
    bound by the rows they are given; a left-padded batch stays exact at 16 bits."""
    ref = tiny_model("gemma3_text", num_hidden_layers=6)
    model = tiny_model("gemma3_text", num_hidden_layers=6)
    kvpolicy.compile_model(model, bits=16)
    ids = _ids(2, 30)
    mask = torch.ones_like(ids)
    mask[1, :4] = 0
    out = _same_greedy(ref, model, ids, mask)
    cache = out.past_key_values
    local = [t == "sliding_attention" for t in model.config.layer_types]
    assert len(cache.rotary) == 2 and all(g.computed for g in cache.rotary)
    for layer, is_local in zip(cache.layers, local, strict=True):
        assert layer.rotary is cache.rotary[0 if is_local else 1]


def test_a_local_groups_rows_start_near_its_window(monkeypatch):
    """Sliding-window layers whose rotation is their own (Gemma3's local base) build a
    step's rows from the least position they still hold (``RotarySpec.offset``), not from
    0, and attend exactly as with every row; the global layers' rows start at 0."""
    model = kvpolicy.compile_model(tiny_model(
        "gemma3_text", max_position_embeddings=1024, sliding_window=64,
        layer_types=["sliding_attention", "full_attention"]), bits=2)
    ids = _ids(1, 400)
    real = RotaryGroup.spec
    offsets: dict[int, list[int]] = {}

    def spy(self, dtype=torch.float32, lo=0):
        spec = real(self, dtype, lo)
        offsets.setdefault(id(self), []).append(spec.offset)
        return spec

    def from_zero(self, dtype=torch.float32, lo=0):
        return real(self, dtype, 0)

    def logits() -> torch.Tensor:
        out = []
        with torch.no_grad():
            cache = model(ids[:, :300], use_cache=True).past_key_values
            for t in range(300, 400):
                step = model(ids[:, t : t + 1], past_key_values=cache, use_cache=True)
                cache = step.past_key_values
                out.append(step.logits)
        return torch.cat(out, dim=1)

    monkeypatch.setattr(RotaryGroup, "spec", spy)
    windowed = logits()
    assert len(offsets) == 2
    local, other = sorted(offsets.values(), key=max, reverse=True)
    assert set(other) == {0}
    # the last step's rows start within a window and a chunk of the newest position
    assert 399 - 64 - 32 <= local[-1] <= 399 - 64
    monkeypatch.setattr(RotaryGroup, "spec", from_zero)
    assert torch.equal(windowed, logits())
