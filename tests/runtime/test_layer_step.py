"""The fused decode step of a transformers layer (runtime.layer_step, what KVAttend runs for a
decode step) against the layer's general path, ``append`` then ``attend``, the oracle here
(test_layer.py holds that path to the fp reference).

Two layers get the same tokens: a prefill appended in one call, then decode steps that cross
key groups, chunks (a chunk-completing step takes the general path in both) and, with a
window, evictions. What must hold after every step:

- the held tokens (sinks, packed codes through ``dequantized``, residual) and positions are
  identical: the fused step stores keys and values with the cast the general path makes;
  with a Hadamard value rotation (a matmul whose summation order differs) values may differ
  by a rounding of the storage dtype, so there the state is compared through the outputs;
- the outputs agree within 2e-6 of their scale (fp32 storage: the kernel sums the same
  terms, grouped differently) or one rounding of the storage dtype (fp16 / bf16);
- the fused step did run (every step but those that complete a chunk or add a sink), and
  the chunks completed by decode steps were packed in C++ (uniform levels): the states'
  equality then says the C++ packing is bit-identical to the torch quantizer.
"""

from __future__ import annotations

import copy
import pickle

import pytest
import torch

from kvpolicy.errors import CacheError
from kvpolicy.kernels.layout import Codebook, QuantSpec
from kvpolicy.kernels.rotation import rotation_matrix
from kvpolicy.runtime import layer_step
from kvpolicy.runtime.layer import PackedKVLayer
from kvpolicy.runtime.positions import TokenPositions
from kvpolicy.zoo.tiny import rope_spec

pytest.importorskip("kvpolicy.kernels.cpu_ext")


def _widths(bits: int, d: int, heads: int) -> tuple[tuple[int, ...], ...]:
    return (tuple([bits - 1, bits + 1] * (d // 4) + [bits] * (d // 2)),) * heads


def _vq(bits: int, group: int, heads: int) -> QuantSpec:
    g = torch.Generator().manual_seed(5)
    book = Codebook.from_tensor(torch.randn(heads, 256, 8 // bits, generator=g))
    return QuantSpec(bits, group, "token", "vq", 8, codebook=book)


# name: key spec, value spec, kv heads, query heads, head dim, residual, sinks, storage
# dtype, rope (style, rotary dim) or None, window, softcap, rotation, mask
CASES = {
    "served-bits2-gqa": (QuantSpec(2, 12, "channel", meta_bits=8, fit="mse"),
                         QuantSpec(2, 32, "token", meta_bits=8), 2, 6, 64, 16, 4,
                         torch.float16, ("rotate_half", 64), None, None, "none", None),
    "fp32-meta16-no-rope": (QuantSpec(4, 16, "channel"), QuantSpec(3, 16, "token"), 2, 4, 32,
                            8, 0, torch.float32, None, None, None, "none", None),
    "interleaved-partial-bf16": (QuantSpec(2, 8, "channel"), QuantSpec(2, 16, "token"), 2, 2,
                                 64, 16, 2, torch.bfloat16, ("interleaved", 32), None, None,
                                 "none", None),
    "mqa-normal-levels": (QuantSpec(3, 16, "channel", "normal"),
                          QuantSpec(2, 16, "token", "normal"), 1, 4, 32, 8, 4, torch.float16,
                          ("rotate_half", 32), None, None, "none", None),
    "channel-widths": (QuantSpec(2, 16, "channel", widths=_widths(2, 32, 2)),
                       QuantSpec(4, 32, "token"), 2, 4, 32, 16, 4, torch.float32,
                       ("rotate_half", 32), None, None, "none", None),
    "vq-values": (QuantSpec(2, 16, "channel", meta_bits=8), _vq(2, 32, 2), 2, 4, 32, 16, 0,
                  torch.float16, ("rotate_half", 32), None, None, "none", None),
    "window-softcap-sinks": (QuantSpec(2, 8, "channel"), QuantSpec(2, 16, "token"), 2, 4, 32,
                             8, 4, torch.float32, ("rotate_half", 32), 40, 20.0, "none",
                             "window"),
    "window-no-mask": (QuantSpec(2, 8, "channel"), QuantSpec(2, 16, "token"), 1, 2, 32, 4, 0,
                       torch.float32, ("rotate_half", 32), 24, None, "none", None),
    "hadamard-values": (QuantSpec(2, 12, "channel", meta_bits=8, fit="mse"),
                        QuantSpec(2, 32, "token", meta_bits=8), 2, 4, 64, 16, 4,
                        torch.float16, ("rotate_half", 64), None, None, "hadamard", None),
    "padding-mask": (QuantSpec(2, 16, "channel"), QuantSpec(2, 16, "token"), 2, 4, 32, 8, 0,
                     torch.float32, ("rotate_half", 32), None, None, "none", "padding"),
    "mask-with-holes": (QuantSpec(2, 16, "channel"), QuantSpec(2, 16, "token"), 2, 4, 32, 8,
                        2, torch.float32, ("rotate_half", 32), None, None, "none", "holes"),
}

B, PREFILL, STEPS = 2, 37, 70


def _layers(case):
    ks, vs, hkv, hq, d, res, sinks, store, rope, window, *_ = case
    spec = None if rope is None else rope_spec(rope[0], rope[1], 4096)
    make = lambda: PackedKVLayer(ks, vs, residual=res, sinks=sinks, rope=spec,  # noqa: E731
                                 dtype=store, window=window)
    fused, oracle = make(), make()
    oracle._step._never = "the oracle"
    return fused, oracle, spec


def _mask(kind, b, total, window, pad):
    """A boolean [B, 1, 1, total] mask over the held tokens and the new one."""
    if kind is None:
        return None
    m = torch.ones(b, 1, 1, total, dtype=torch.bool)
    if kind == "padding":  # row 1's first `pad` tokens are padding
        m[1, ..., :pad] = False
    if kind == "holes":  # tokens hidden inside the packed body and a sink: an additive mask
        m[0, ..., 10:13] = False
        m[1, ..., 0] = False
    return m


def _step(layer, q, k, v, pos, mask, spec, softcap, rot):
    out = layer.decode_step(q, k, v, pos, mask, rope=spec, softcap=softcap, rotation=rot)
    fused = out is not None
    if out is None:
        vr = v if rot is None else (v.float() @ rot).to(v.dtype)
        layer.append(k, vr, pos)
        out = layer.attend(q, attn_mask=mask, rope=spec, softcap=softcap)
        if rot is not None:
            out = (out.float() @ rot.T).to(out.dtype)
    layer.slide()
    return out, fused


def _run(name: str, dtype=torch.float32):
    case = CASES[name]
    ks, vs, hkv, hq, d, res, sinks, store, rope, window, softcap, rotation, mask_kind = case
    fused, oracle, spec = _layers(case)
    rot = rotation_matrix(rotation, d)
    g = torch.Generator().manual_seed(hash(name) % 1000)
    k0 = torch.randn(B, hkv, PREFILL, d, generator=g).to(dtype)
    v0 = torch.randn(B, hkv, PREFILL, d, generator=g).to(dtype)
    for lay in (fused, oracle):
        lay.append(k0, v0 if rot is None else (v0.float() @ rot).to(dtype))
        lay.slide()
    taken = 0
    for i in range(STEPS):
        q = torch.randn(B, hq, 1, d, generator=g).to(dtype)
        k = torch.randn(B, hkv, 1, d, generator=g).to(dtype)
        v = torch.randn(B, hkv, 1, d, generator=g).to(dtype)
        n = PREFILL + i
        pos = TokenPositions.contiguous(B, n, 1, n, n) if spec is not None else None
        mask = _mask(mask_kind, B, fused.seq_len + 1, window, pad=5)
        if mask_kind == "window":  # the model's mask: keys within the window
            first = n - window + 1 - fused.n_evicted
            mask[..., : max(0, first)] = False
        got, ran = _step(fused, q, k, v, pos, mask, spec, softcap, rot)
        want, _ = _step(oracle, q, k, v, pos, mask, spec, softcap, rot)
        taken += ran
        tol = 2e-6 if store == torch.float32 else {torch.float16: 1e-3, torch.bfloat16: 8e-3}[store]
        if rot is not None:
            tol = max(tol, 2e-3)
        scale = want.abs().max().item()
        assert got.dtype == want.dtype and got.shape == want.shape
        assert (got - want).abs().max().item() <= tol * max(scale, 1.0), (name, i)
        assert fused.seq_len == oracle.seq_len and fused.n_seen == oracle.n_seen
        if rot is None:
            fk, fv = fused.dequantized()
            ok, ov = oracle.dequantized()
            assert torch.equal(fk, ok) and torch.equal(fv, ov), (name, i)
        if spec is not None:
            assert torch.equal(fused.positions(), oracle.positions())
    return fused, taken


@pytest.mark.parametrize("name", list(CASES))
def test_fused_layer_step_equals_the_general_path(name: str) -> None:
    fused, taken = _run(name)
    # every step runs fused but those that complete a chunk (and, at the start, sinks)
    assert taken >= STEPS - STEPS // fused.chunk - 2 - 1, (taken, fused.chunk)
    assert fused._step.steps == taken
    # the chunks those steps complete are packed in C++ (uniform levels), bit-identical
    # to the oracle's torch quantizer (the states compared after every step)
    uniform = fused.key_spec.uniform and fused.value_spec.uniform and not fused.value_spec.vq
    assert (fused._step.chunks_packed >= B) == uniform, fused._step.chunks_packed


def test_model_dtype_bf16_steps() -> None:
    fused, taken = _run("served-bits2-gqa", torch.bfloat16)
    assert taken > STEPS // 2


def test_spare_bytes_count_the_buffer_and_a_copy_steps_on_its_own() -> None:
    fused, _ = _run("served-bits2-gqa")
    report = fused.memory_report()
    assert fused._step.spare_bytes > 0
    assert report["spare_bytes"] >= fused._step.spare_bytes
    # a copy has its own buffer: stepping it leaves the original untouched
    for clone in (copy.deepcopy(fused), pickle.loads(pickle.dumps(fused))):
        before = [t.clone() for t in fused.dequantized()]
        d, hq = 64, 6
        q = torch.randn(B, hq, 1, d)
        k, v = torch.randn(B, 2, 1, d), torch.randn(B, 2, 1, d)
        n = clone.n_seen
        out = clone.decode_step(q, k, v, TokenPositions.contiguous(B, n, 1, n, n))
        assert out is not None and clone.seq_len == fused.seq_len + 1
        after = fused.dequantized()
        assert all(torch.equal(a, b) for a, b in zip(before, after, strict=True))


def test_a_non_finite_token_is_refused_and_the_layer_left_as_it_was() -> None:
    fused, _ = _run("served-bits2-gqa")
    before = (fused.seq_len, *[t.clone() for t in fused.dequantized()], fused.positions())
    d = 64
    n = fused.n_seen
    q, k, v = torch.randn(B, 6, 1, d), torch.randn(B, 2, 1, d), torch.randn(B, 2, 1, d)
    v[1, 0, 0, 3] = float("nan")
    with pytest.raises(CacheError, match="NaN or Inf"):
        fused.decode_step(q, k, v, TokenPositions.contiguous(B, n, 1, n, n))
    after = (fused.seq_len, *fused.dequantized(), fused.positions())
    assert before[0] == after[0]
    assert all(torch.equal(a, b) for a, b in zip(before[1:], after[1:], strict=True))


def test_steps_it_does_not_cover_change_nothing() -> None:
    fused, _ = _run("served-bits2-gqa")
    d, n = 64, fused.n_seen
    q, k, v = torch.randn(B, 6, 1, d), torch.randn(B, 2, 1, d), torch.randn(B, 2, 1, d)
    pos = TokenPositions.contiguous(B, n, 1, n, n)
    state = (fused.seq_len, fused._res_k, fused._pos)
    # a jump in positions, a float mask, two tokens, the switch off: None, nothing changed
    jump = TokenPositions.contiguous(B, n + 3, 1, n + 3, n + 3)
    float_mask = torch.zeros(B, 1, 1, fused.seq_len + 1)
    assert fused.decode_step(q, k, v, jump) is None
    assert fused.decode_step(q, k, v, pos, float_mask) is None
    assert fused.decode_step(torch.randn(B, 6, 2, d), torch.randn(B, 2, 2, d),
                             torch.randn(B, 2, 2, d), pos) is None
    layer_step.ENABLED = False
    try:
        assert fused.decode_step(q, k, v, pos) is None
    finally:
        layer_step.ENABLED = True
    assert state == (fused.seq_len, fused._res_k, fused._pos)
    assert fused.decode_step(q, k, v, pos) is not None


def test_a_residual_held_at_8_bits_keeps_the_general_path() -> None:
    lay = PackedKVLayer(QuantSpec(2, 16, "channel"), QuantSpec(2, 16, "token"), residual=8,
                        sinks=0, residual_bits=8)
    assert "residual_bits" in layer_step.why_not(lay)
    lay.append(torch.randn(1, 2, 20, 32), torch.randn(1, 2, 20, 32))
    assert lay.decode_step(torch.randn(1, 2, 1, 32), torch.randn(1, 2, 1, 32),
                           torch.randn(1, 2, 1, 32), None) is None


def test_a_layer_built_for_triton_keeps_its_kernels() -> None:
    lay = PackedKVLayer(QuantSpec(2, 16, "channel"), QuantSpec(2, 16, "token"), residual=8,
                        sinks=0, backend="triton")
    pytest.importorskip("triton")
    lay.append(torch.randn(1, 2, 20, 32), torch.randn(1, 2, 20, 32))
    assert lay.decode_step(torch.randn(1, 2, 1, 32), torch.randn(1, 2, 1, 32),
                           torch.randn(1, 2, 1, 32), None) is None
