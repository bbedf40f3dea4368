"""PackedKVLayer: segmentation, attention over the cache, streaming, validation, memory."""

from __future__ import annotations

import sys

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvpolicy.errors import CacheError
from kvpolicy.kernels import reference as ref
from kvpolicy.kernels.layout import QuantSpec, RotarySpec
from kvpolicy.runtime import layer as layer_module
from kvpolicy.runtime.layer import PackedKVLayer
from kvpolicy.zoo.tiny import rope_spec

K2 = QuantSpec(2, 32, "channel")
V2 = QuantSpec(2, 32, "token")


def make_rope(style: str, rotary_dim: int, positions: int = 2048) -> RotarySpec:
    return rope_spec(style, rotary_dim, positions)


ROPES = {
    "none": None,
    "half": make_rope("rotate_half", 64),
    "interleaved": make_rope("interleaved", 64),
    "partial": make_rope("rotate_half", 32),
}


def expected_attention(layer: PackedKVLayer, q: torch.Tensor, mask=None, causal=True):
    """fp attention over the dequantized cache, keys rotated at their stored positions."""
    k, v = layer.dequantized(torch.float32)
    if layer.rope is not None:
        k = ref.apply_rope(k, layer.positions(), layer.rope)
    tq, total = q.shape[2], k.shape[2]
    if mask is None and causal:
        i, j = torch.arange(tq)[:, None], torch.arange(total)[None]
        mask = torch.zeros(tq, total).masked_fill(j > total - tq + i, float("-inf"))
    elif mask is not None and mask.dtype == torch.bool:
        mask = torch.zeros(mask.shape).masked_fill(~mask, float("-inf"))
    out, _ = ref.attention_partial(q.float(), k, v, scale=q.shape[-1] ** -0.5, mask=mask)
    return out


def snapshot(layer: PackedKVLayer):
    if layer.seq_len == 0:
        return (0,)
    k, v = layer.dequantized()
    report = dict(layer.memory_report())
    del report["allocated_bytes"], report["spare_bytes"]  # capacity: the append history
    return (layer.seq_len, k.clone(), v.clone(), report, layer.positions())


def same(a, b) -> bool:
    if len(a) != len(b):
        return False
    for x, y in zip(a, b, strict=True):
        if isinstance(x, torch.Tensor):
            if not torch.equal(x, y):
                return False
        elif x != y:
            return False
    return True


# --------------------------------------------------------------------------- attention


@pytest.mark.parametrize("t", (1, 33, 257))
@pytest.mark.parametrize("tq", (1, 7))
@pytest.mark.parametrize("hq,hkv", ((9, 3), (4, 1)))
@pytest.mark.parametrize("rope", ROPES)
def test_attend_equals_fp_attention_over_dequantized(t, tq, hq, hkv, rope) -> None:
    layer = PackedKVLayer(K2, V2, residual=16, sinks=4, rope=ROPES[rope], backend="torch")
    torch.manual_seed(t * 7 + tq)
    layer.append(torch.randn(2, hkv, t, 64), torch.randn(2, hkv, t, 64))
    if t == 257:
        assert layer.n_packed == 224 and layer.n_sinks == 4 and layer.n_residual == 29
    q = torch.randn(2, hq, tq, 64)
    torch.testing.assert_close(layer.attend(q), expected_attention(layer, q), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("rope", ("none", "half"))
def test_chunked_prefill_then_decode(rope: str) -> None:
    layer = PackedKVLayer(K2, V2, residual=32, sinks=4, rope=ROPES[rope], backend="torch")
    torch.manual_seed(0)
    for n in (50, 1, 70, 33, 1, 1, 100):
        k, v, q = torch.randn(1, 3, n, 64), torch.randn(1, 3, n, 64), torch.randn(1, 9, n, 64)
        layer.append(k, v)
        torch.testing.assert_close(layer.attend(q), expected_attention(layer, q),
                                   atol=1e-5, rtol=1e-5)
    assert layer.n_packed == 192 and layer.n_residual == 60


def test_mask_bool_and_float_agree_with_reference() -> None:
    layer = PackedKVLayer(K2, QuantSpec(4, 32, "token"), residual=8, sinks=2,
                          rope=ROPES["half"], backend="torch")
    torch.manual_seed(1)
    layer.append(torch.randn(2, 3, 100, 64), torch.randn(2, 3, 100, 64))
    q = torch.randn(2, 9, 3, 64)
    keep = torch.rand(2, 1, 3, 100) > 0.3
    keep[1, :, 2] = False  # one row sees nothing -> zeros, no NaN
    additive = torch.zeros(keep.shape).masked_fill(~keep, float("-inf"))
    out_b = layer.attend(q, attn_mask=keep)
    out_f = layer.attend(q, attn_mask=additive)
    torch.testing.assert_close(out_b, out_f, atol=0, rtol=0)
    torch.testing.assert_close(out_b, expected_attention(layer, q, mask=keep), atol=1e-5, rtol=1e-5)
    assert torch.equal(out_b[1, :, 2], torch.zeros(9, 64))


def test_non_causal_sees_everything() -> None:
    layer = PackedKVLayer(K2, V2, residual=8, sinks=0, backend="torch")
    layer.append(torch.randn(1, 1, 70, 64), torch.randn(1, 1, 70, 64))
    q = torch.randn(1, 2, 5, 64)
    torch.testing.assert_close(layer.attend(q, causal=False),
                               expected_attention(layer, q, causal=False), atol=1e-5, rtol=1e-5)


def test_full_precision_specs_equal_plain_attention() -> None:
    fp = QuantSpec(16, 32, "channel")
    layer = PackedKVLayer(fp, QuantSpec(16, 32, "token"), residual=4, sinks=1, backend="torch")
    k, v, q = torch.randn(1, 2, 40, 16), torch.randn(1, 2, 40, 16), torch.randn(1, 4, 1, 16)
    layer.append(k, v)
    assert layer.n_packed == 35
    expected, _ = ref.attention_partial(q, k, v, scale=0.25)
    torch.testing.assert_close(layer.attend(q), expected, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("dtype", (torch.bfloat16, torch.float16))
@pytest.mark.parametrize("tq", (1, 3))
def test_half_precision_cache(dtype: torch.dtype, tq: int) -> None:
    """Scales, zeros and fp tokens stored in half precision are read as stored: the fp32
    attention over the dequantized cache matches closely; the output is in the query dtype."""
    layer = PackedKVLayer(K2, V2, residual=16, sinks=4, rope=ROPES["half"], backend="torch")
    layer.append(torch.randn(1, 3, 100, 64, dtype=dtype), torch.randn(1, 3, 100, 64, dtype=dtype))
    q = torch.randn(1, 9, tq, 64)
    torch.testing.assert_close(layer.attend(q), expected_attention(layer, q), atol=1e-5, rtol=1e-5)
    out = layer.attend(q.to(dtype))
    assert out.dtype == dtype
    torch.testing.assert_close(out.float(), expected_attention(layer, q.to(dtype)),
                               atol=1e-2, rtol=1e-2)


# --------------------------------------------------------------------------- segmentation


@settings(max_examples=15, deadline=None)
@given(
    sizes=st.lists(st.integers(1, 40), min_size=1, max_size=5),
    residual=st.sampled_from((0, 5, 32)),
    sinks=st.sampled_from((0, 3)),
    vbits=st.sampled_from((2, 3, 16)),
)
def test_streaming_equals_bulk(sizes, residual, sinks, vbits) -> None:
    total = sum(sizes)
    g = torch.Generator().manual_seed(total)
    k, v = torch.randn(2, 2, 3, total, 64, generator=g).unbind(0)
    vs = QuantSpec(vbits, 32, "token")
    bulk = PackedKVLayer(K2, vs, residual=residual, sinks=sinks, rope=ROPES["half"])
    bulk.append(k, v)
    stream = PackedKVLayer(K2, vs, residual=residual, sinks=sinks, rope=ROPES["half"])
    one = PackedKVLayer(K2, vs, residual=residual, sinks=sinks, rope=ROPES["half"])
    start = 0
    for n in sizes:
        stream.append(k[:, :, start : start + n], v[:, :, start : start + n])
        start += n
    for i in range(total):
        one.append(k[:, :, i : i + 1], v[:, :, i : i + 1])
        r = one.n_residual
        assert r < residual + one.chunk + (0 if one.seq_len > sinks else 1)
        if one.seq_len > sinks + residual + one.chunk:
            assert r >= residual, "residual dropped below R"
    assert same(snapshot(bulk), snapshot(stream)) and same(snapshot(bulk), snapshot(one))
    for a, b in zip((*bulk._pk, *bulk._pv), (*one._pk, *one._pv), strict=True):
        va, vb = a.view(), b.view()
        assert (va is None and vb is None) or torch.equal(va, vb)


def test_packed_tokens_are_never_requantized() -> None:
    layer = PackedKVLayer(K2, V2, residual=32, sinks=0, backend="torch")
    layer.append(torch.randn(1, 1, 64, 64), torch.randn(1, 1, 64, 64))
    assert layer.n_packed == 32
    before = [b.view().clone() for b in (*layer._pk, *layer._pv)]
    # Later tokens with a far larger range must not change the groups already packed.
    layer.append(100 * torch.randn(1, 1, 200, 64), 100 * torch.randn(1, 1, 200, 64))
    for old, buf in zip(before, (*layer._pk, *layer._pv), strict=True):
        assert torch.equal(buf.view()[:, :, : old.shape[2]], old)


def test_segment_sizes() -> None:
    layer = PackedKVLayer(K2, QuantSpec(4, 16, "token"), residual=128, sinks=4)
    layer.append(torch.randn(1, 3, 1000, 64), torch.randn(1, 3, 1000, 64))
    # 996 after the sinks; chunks of 32 packed while residual >= 160 -> 27 chunks.
    assert (layer.n_sinks, layer.n_packed, layer.n_residual) == (4, 864, 132)
    assert layer.chunk == 32


# --------------------------------------------------------------------------- validation


def _bad_inputs():
    good = torch.randn(1, 3, 5, 64)
    nan = good.clone()
    nan[0, 1, 2, 3] = float("nan")
    inf = good.clone()
    inf[0, 0, 0, 0] = float("inf")
    return [
        ("nan key", (nan, good), {}, "NaN or Inf"),
        ("inf value", (good, inf), {}, "NaN or Inf"),
        ("rank", (good[0], good[0]), {}, r"\[batch, kv_heads, tokens, head_dim\]"),
        ("heads", (torch.randn(1, 2, 5, 64), torch.randn(1, 2, 5, 64)), {}, "kv_heads 2"),
        ("batch", (torch.randn(2, 3, 5, 64), torch.randn(2, 3, 5, 64)), {}, "batch 2"),
        ("head_dim", (torch.randn(1, 3, 5, 32), torch.randn(1, 3, 5, 64)), {}, "head_dim 32"),
        ("kv mismatch", (good, torch.randn(1, 3, 4, 64)), {}, "disagree"),
        ("dtype", (good.double(), good.double()), {}, "cache dtype"),
        ("kv dtype", (good, good.half()), {}, "value dtype"),
        ("int", (good.long(), good.long()), {}, "floating"),
        ("positions shape", (good, good), {"positions": torch.zeros(1, 4, dtype=torch.long)},
         r"\[batch, tokens\]"),
        ("positions range", (good, good), {"positions": torch.full((1, 5), 5000)}, "rotary table"),
    ]


@pytest.mark.parametrize("name,args,kwargs,match", _bad_inputs(), ids=lambda x: None)
def test_bad_append_raises_and_leaves_cache_unchanged(name, args, kwargs, match) -> None:
    layer = PackedKVLayer(K2, V2, residual=8, sinks=2, rope=ROPES["half"])
    layer.append(torch.randn(1, 3, 60, 64), torch.randn(1, 3, 60, 64))
    before = snapshot(layer)
    with pytest.raises(CacheError, match=match):
        layer.append(*args, **kwargs)
    assert same(before, snapshot(layer)), f"{name}: cache changed by a rejected append"


def test_bad_query_raises() -> None:
    layer = PackedKVLayer(K2, V2, residual=8, sinks=2)
    with pytest.raises(CacheError, match="empty"):
        layer.attend(torch.randn(1, 3, 1, 64))
    layer.append(torch.randn(1, 3, 10, 64), torch.randn(1, 3, 10, 64))
    with pytest.raises(CacheError, match="multiple"):
        layer.attend(torch.randn(1, 4, 1, 64))
    with pytest.raises(CacheError, match="NaN"):
        layer.attend(torch.full((1, 3, 1, 64), float("nan")))
    with pytest.raises(CacheError, match="broadcast"):
        layer.attend(torch.randn(1, 3, 1, 64), attn_mask=torch.ones(1, 1, 1, 9, dtype=torch.bool))


def test_triton_backend_missing_is_a_clear_error(monkeypatch) -> None:
    import kvpolicy.kernels

    # Make the import fail even if an earlier test imported the module.
    monkeypatch.setitem(sys.modules, "kvpolicy.kernels.triton_attention", None)
    monkeypatch.delattr(kvpolicy.kernels, "triton_attention", raising=False)
    layer = PackedKVLayer(K2, V2, residual=8, sinks=0, backend="triton")
    with pytest.raises(CacheError, match="backend='torch'"):
        layer.append(torch.randn(1, 1, 4, 64), torch.randn(1, 1, 4, 64))
    assert layer.seq_len == 0


def test_backend_is_selected_once_per_device(monkeypatch) -> None:
    calls = []
    select = layer_module.select

    def counting(backend, device):
        calls.append((backend, device))
        return select(backend, device)

    monkeypatch.setattr(layer_module, "select", counting)
    layer = PackedKVLayer(K2, V2, residual=8, sinks=2, rope=ROPES["half"], backend="auto")
    for _ in range(3):
        layer.append(torch.randn(1, 3, 40, 64), torch.randn(1, 3, 40, 64))
        layer.attend(torch.randn(1, 6, 1, 64))
    layer.dequantized()
    assert calls == [("auto", torch.device("cpu"))]


def test_reorder_matches_a_cache_built_from_reordered_rows() -> None:
    k, v = torch.randn(2, 3, 2, 90, 64).unbind(0)
    idx = torch.tensor([2, 0, 0])
    a = PackedKVLayer(K2, V2, residual=16, sinks=4, rope=ROPES["half"])
    a.append(k, v)
    a.reorder(idx)
    b = PackedKVLayer(K2, V2, residual=16, sinks=4, rope=ROPES["half"])
    b.append(k[idx], v[idx])
    assert same(snapshot(a), snapshot(b))
    q = torch.randn(3, 6, 1, 64)
    assert torch.equal(a.attend(q), b.attend(q))


# --------------------------------------------------------------------------- memory


def test_memory_report_matches_hand_count() -> None:
    b, h, d, t = 2, 3, 64, 1000
    layer = PackedKVLayer(K2, QuantSpec(3, 32, "token"), residual=128, sinks=4,
                          rope=ROPES["half"])
    layer.append(torch.randn(b, h, t, d, dtype=torch.bfloat16),
                 torch.randn(b, h, t, d, dtype=torch.bfloat16))
    s, p, r = layer.n_sinks, layer.n_packed, layer.n_residual
    assert (s, p, r) == (4, 864, 132)
    fp = 2 * b * h * d * 2  # bytes of one token's key + value in bf16
    key_codes = b * h * p * d * 2 // 8
    val_codes = b * h * p * d * 3 // 8
    key_sz = 2 * b * h * (p // 32) * d * 2  # scale + zero per (token group, channel), bf16
    val_sz = 2 * b * h * p * (d // 32) * 2  # scale + zero per (token, channel group)
    positions = 0  # the running index: one int base for the run, nothing per token
    expected = (s + r) * fp + key_codes + val_codes + key_sz + val_sz + positions
    rep = layer.memory_report()
    assert rep["bytes"] == expected, f"{rep['bytes']} != hand count {expected}"
    assert rep["fp16_bytes"] == t * fp and rep["tokens"] == t
    assert rep["position_bytes"] == positions and rep["allocated_bytes"] >= rep["bytes"]


def test_rope_table_given_at_attend_time() -> None:
    """pre_rope=True stores positions; a (growing) table handed to attend() rotates keys."""
    rope = ROPES["half"]
    fixed = PackedKVLayer(K2, V2, residual=16, sinks=4, rope=rope, backend="torch")
    late = PackedKVLayer(K2, V2, residual=16, sinks=4, pre_rope=True, backend="torch")
    k, v, q = torch.randn(1, 3, 300, 64), torch.randn(1, 3, 300, 64), torch.randn(1, 9, 1, 64)
    pos = torch.randint(0, 2048, (1, 300))
    fixed.append(k, v, pos)
    late.append(k, v, pos)
    grown = RotarySpec("rotate_half", 64, rope.cos[:2048].clone(), rope.sin[:2048].clone())
    assert torch.equal(fixed.attend(q), late.attend(q, rope=grown))
    assert late.memory_report()["position_bytes"] == 300 * 4
    short = RotarySpec("rotate_half", 64, rope.cos[:100], rope.sin[:100])
    with pytest.raises(CacheError, match="covers every stored position"):
        late.attend(q, rope=short)
    # a table of rows from a position on (RotarySpec.offset) reads the same rows ...
    lo = int(pos.min())
    tail = RotarySpec("rotate_half", 64, rope.cos[lo:2048], rope.sin[lo:2048], offset=lo)
    assert torch.equal(late.attend(q, rope=grown), late.attend(q, rope=tail))
    # ... and one that starts after a held position is refused
    later = RotarySpec("rotate_half", 64, rope.cos[lo + 1 : 2048], rope.sin[lo + 1 : 2048],
                       offset=lo + 1)
    with pytest.raises(CacheError, match=f"starts at position {lo + 1}"):
        late.attend(q, rope=later)
    post = PackedKVLayer(K2, V2, residual=16, sinks=4)
    post.append(k, v)
    with pytest.raises(CacheError, match="pre_rope"):
        post.attend(q, rope=grown)


@pytest.mark.parametrize("tq", (1, 4))
def test_attend_without_the_cpp_kernel(monkeypatch, tq: int) -> None:
    """The eager segment-by-segment path (no compiler) gives the same attention."""
    monkeypatch.setenv("KVPOLICY_NO_CPP", "1")
    layer = PackedKVLayer(K2, V2, residual=16, sinks=4, rope=ROPES["partial"], backend="torch")
    layer.append(torch.randn(1, 3, 150, 64), torch.randn(1, 3, 150, 64))
    q = torch.randn(1, 9, tq, 64)
    torch.testing.assert_close(layer.attend(q), expected_attention(layer, q), atol=1e-5, rtol=1e-5)


def test_long_query_is_attended_in_row_blocks() -> None:
    """400 query rows (3 x 400 per kv head, above the C++ kernel's row limit) are attended
    in blocks of rows, each within the limit; the result is the same."""
    layer = PackedKVLayer(K2, V2, residual=32, sinks=4, rope=ROPES["half"], backend="torch")
    layer.append(torch.randn(1, 3, 400, 64), torch.randn(1, 3, 400, 64))
    q = torch.randn(1, 9, 400, 64)
    torch.testing.assert_close(layer.attend(q), expected_attention(layer, q), atol=1e-5, rtol=1e-5)
