"""Logit soft-capping (``softcap * tanh(s / softcap)`` before the mask) in every backend's
attention: the reference against a direct softmax, the torch backend (C++ kernel and eager
path) and Triton against the reference, segment merges exact, the packed layer's attend
(decode, row blocks, pending tokens) and the soft-capped prefill against one softmax."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from kvpolicy.errors import CacheError
from kvpolicy.kernels import cpu_ext, torch_backend, triton_backend
from kvpolicy.kernels import reference as ref
from kvpolicy.kernels.layout import QuantSpec
from kvpolicy.kernels.masks import causal_mask, to_additive
from kvpolicy.runtime.attend import _prefill_attention
from kvpolicy.runtime.layer import PackedKVLayer
from kvpolicy.zoo.tiny import rope_spec

KS, VS = QuantSpec(2, 16, "channel"), QuantSpec(4, 16, "token")
ROPE = rope_spec("rotate_half", 32, 512)
# Scores of the cases below reach a few units: a cap of 1.5 is far from linear.
SCALE, CAP = 0.5, 1.5


def _randn(*shape, g):
    return torch.randn(*shape, generator=g)


def _capped(q, k, v, scale, softcap, mask=None):
    """One softmax written out directly: the formula the kernels promise."""
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    s = scale * q @ k.transpose(-1, -2)
    s = softcap * torch.tanh(s / softcap)
    if mask is not None:
        s = s + mask
    return torch.softmax(s, dim=-1) @ v


def _case(tq=3, tk=40, hq=4, hkv=2, d=32, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = _randn(2, hq, tq, d, g=g)
    k, v = _randn(2, 2, hkv, tk, d, g=g).unbind(0)
    k[..., 3] += 4.0  # an outlier channel, as real keys have (and large scores)
    mask = torch.zeros(2, 1, tq, tk)
    mask[0, 0, :, ::3] = float("-inf")
    mask[1, 0, -1, 7:] = float("-inf")
    return q, k, v, mask


# --------------------------------------------------------------------------- reference


def test_reference_is_the_formula_and_the_cap_matters():
    q, k, v, mask = _case()
    out, lse = ref.attention_partial(q, k, v, scale=SCALE, mask=mask, softcap=CAP)
    torch.testing.assert_close(out, _capped(q, k, v, SCALE, CAP, mask), atol=1e-5, rtol=1e-5)
    s = CAP * torch.tanh(SCALE * q @ k.repeat_interleave(2, 1).transpose(-1, -2) / CAP)
    torch.testing.assert_close(lse, torch.logsumexp(s + mask, -1), atol=1e-5, rtol=1e-5)
    plain, _ = ref.attention_partial(q, k, v, scale=SCALE, mask=mask)
    assert (out - plain).abs().max() > 0.05, "the cap left the output unchanged"
    # A cap far above every score is the identity.
    wide, _ = ref.attention_partial(q, k, v, scale=SCALE, mask=mask, softcap=1e4)
    torch.testing.assert_close(wide, plain, atol=1e-4, rtol=1e-4)


def test_segments_merge_exactly_under_the_cap():
    """Soft-capping acts per score, so segments attended apart merge to one softmax."""
    q, k, v, mask = _case(tk=48)
    whole, whole_lse = ref.attention_partial(q, k, v, scale=SCALE, mask=mask, softcap=CAP)
    parts = [
        ref.attention_partial(q, k[:, :, a:b], v[:, :, a:b], scale=SCALE,
                              mask=mask[..., a:b], softcap=CAP)
        for a, b in ((0, 5), (5, 37), (37, 48))
    ]
    out, lse = ref.merge_partials_lse(parts)
    torch.testing.assert_close(out, whole, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse, whole_lse, atol=1e-5, rtol=1e-5)


# --------------------------------------------------------------------------- torch backend


@pytest.fixture(params=("cpp", "eager"))
def path(request, monkeypatch) -> str:
    """The C++ kernel (built strictly: a build error fails) and the eager fallback."""
    if request.param == "eager":
        monkeypatch.setenv("KVPOLICY_NO_CPP", "1")
    else:
        if cpu_ext.compiler() is None:
            pytest.skip("no C++ compiler: the C++ path cannot be built here")
        monkeypatch.delenv("KVPOLICY_NO_CPP", raising=False)
        monkeypatch.setattr(cpu_ext, "load", cpu_ext.build)
    return request.param


@pytest.mark.parametrize("tk", (1, 31, 257))
@pytest.mark.parametrize("hq,hkv", ((4, 2), (3, 1)))
def test_torch_attention_partial(tk, hq, hkv):
    q, k, v, mask = _case(tk=tk, hq=hq, hkv=hkv)
    for m in (None, mask):
        got = torch_backend.attention_partial(q, k, v, scale=SCALE, mask=m, softcap=CAP)
        want = ref.attention_partial(q, k, v, scale=SCALE, mask=m, softcap=CAP)
        for a, b in zip(got, want, strict=True):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def _packed_case(tq, seed=1, tk=64):
    q, k, v, mask = _case(tq=tq, tk=tk, seed=seed)
    pos = torch.stack((torch.arange(tk) + 3, torch.randperm(512)[:tk]))
    return q, ref.quantize(k, KS), ref.quantize(v, VS), mask, pos


@pytest.mark.parametrize("tq", (1, 5))
@pytest.mark.parametrize("with_rope", (True, False), ids=("rope", "no-rope"))
def test_torch_packed_attention_partial(path, tq, with_rope):
    q, pk, pv, mask, pos = _packed_case(tq)
    kw = dict(scale=SCALE, mask=mask, rope=ROPE if with_rope else None,
              k_positions=pos if with_rope else None, softcap=CAP)
    got = torch_backend.packed_attention_partial(q, pk, pv, KS, VS, **kw)
    want = ref.packed_attention_partial(q, pk, pv, KS, VS, **kw)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    plain = ref.packed_attention_partial(q, pk, pv, KS, VS, **{**kw, "softcap": None})
    assert (got[0] - plain[0]).abs().max() > 0.05, "the cap left the output unchanged"


# --------------------------------------------------------------------------- decode_attention


def _decode_case(tq: int, segments: str, device: str = "cpu"):
    """A packed segment and a full-precision one (sinks + residual), pre-RoPE keys."""
    g = torch.Generator().manual_seed(tq + len(segments))
    tk, tf = 32, 7
    q, k, v, _ = _case(tq=tq, tk=tk, seed=tq)
    fk, fv = _randn(2, 2, 2, tf, 32, g=g).unbind(0)
    fk[..., 3] += 4.0
    positions = torch.stack([torch.randperm(512, generator=g)[: tk + tf] for _ in range(2)])
    args = dict(q=q, k=ref.quantize(k, KS), v=ref.quantize(v, VS), fk=fk, fv=fv,
                mask=None, fp_mask=None, kpos=positions[:, :tk], fpos=positions[:, tk:])
    if tq > 1:
        args["mask"] = torch.zeros(2, 1, tq, tk)
        args["mask"][0, 0, 0, ::2] = float("-inf")
        args["fp_mask"] = torch.zeros(2, 1, tq, tf)
        args["fp_mask"][1, 0, 1:, :3] = float("-inf")
    if segments == "fp":
        args.update(k=None, v=None, mask=None)
    if segments == "packed":
        args.update(fk=None, fv=None, fp_mask=None)
    # The oracle: one softmax over every key, dequantized and rotated, joined by hand.
    ks, vs, ms, ps = [], [], [], []
    if args["k"] is not None:
        ks.append(ref.dequantize(args["k"], KS))
        vs.append(ref.dequantize(args["v"], VS))
        ms.append(torch.zeros(2, 1, tq, tk) if args["mask"] is None else args["mask"])
        ps.append(args["kpos"])
    if args["fk"] is not None:
        ks.append(fk)
        vs.append(fv)
        ms.append(torch.zeros(2, 1, tq, tf) if args["fp_mask"] is None else args["fp_mask"])
        ps.append(args["fpos"])
    kr = ref.apply_rope(torch.cat(ks, 2), torch.cat(ps, 1), ROPE)
    want = _capped(q, kr, torch.cat(vs, 2), SCALE, CAP, torch.cat(ms, -1))

    def move(x):
        if isinstance(x, torch.Tensor):
            return x.to(device)
        if isinstance(x, tuple):
            return type(x)(*(move(t) for t in x))
        return x

    return {n: move(x) for n, x in args.items()}, want


def _decode(rec, a, rope=ROPE, softcap=CAP):
    if rope is not None and a["q"].device != rope.cos.device:
        rope = dataclasses.replace(rope, cos=rope.cos.to(a["q"].device),
                                   sin=rope.sin.to(a["q"].device))
    return rec.decode_attention(
        a["q"], a["k"], a["v"], KS, VS, a["fk"], a["fv"], scale=SCALE, mask=a["mask"],
        fp_mask=a["fp_mask"], rope=rope, k_positions=a["kpos"], fp_positions=a["fpos"],
        softcap=softcap,
    )


DECODE_CASES = [(1, "both"), (3, "both"), (1, "packed"), (2, "fp")]


@pytest.mark.parametrize("tq,segments", DECODE_CASES)
def test_reference_decode_attention(tq, segments):
    args, want = _decode_case(tq, segments)
    out, _ = _decode(ref.BACKEND, args)
    torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("tq,segments", DECODE_CASES)
def test_torch_decode_attention(path, tq, segments):
    args, want = _decode_case(tq, segments)
    out, lse = _decode(torch_backend.BACKEND, args)
    torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)
    _, want_lse = _decode(ref.BACKEND, args)
    torch.testing.assert_close(lse, want_lse, atol=1e-5, rtol=1e-5)
    plain, _ = _decode(torch_backend.BACKEND, args, softcap=None)
    assert (out - plain).abs().max() > 0.05, "the cap left the output unchanged"


# --------------------------------------------------------------------------- Triton


def _triton_device() -> str:
    from kvpolicy.kernels import triton_attention  # after conftest set TRITON_INTERPRET

    return "cpu" if triton_attention._INTERPRET else "cuda"


@pytest.mark.triton
@pytest.mark.parametrize("with_rope", (True, False), ids=("rope", "no-rope"))
def test_triton_packed_and_full_precision_attention(with_rope):
    from kvpolicy.kernels import triton_attention as ta

    dev = _triton_device()
    q, pk, pv, mask, pos = _packed_case(3, tk=48)
    rope = ROPE if with_rope else None
    want = ref.packed_attention_partial(q, pk, pv, KS, VS, scale=SCALE, mask=mask, rope=rope,
                                        k_positions=pos if with_rope else None, softcap=CAP)
    if with_rope:
        rope = dataclasses.replace(ROPE, cos=ROPE.cos.to(dev), sin=ROPE.sin.to(dev))
    got = ta.packed_attention_partial(
        q.to(dev), *(type(p)(*(t.to(dev) for t in p)) for p in (pk, pv)), KS, VS,
        scale=SCALE, mask=mask.to(dev), rope=rope, k_positions=pos.to(dev) if with_rope
        else None, softcap=CAP, num_splits=2,
    )
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a.cpu(), b, atol=1e-5, rtol=1e-5)
    q, k, v, mask = _case(tq=2, tk=33)
    got = ta.attention_partial(q.to(dev), k.to(dev), v.to(dev), scale=SCALE,
                               mask=mask.to(dev), softcap=CAP)
    want = ref.attention_partial(q, k, v, scale=SCALE, mask=mask, softcap=CAP)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a.cpu(), b, atol=1e-5, rtol=1e-5)


@pytest.mark.triton
def test_triton_saturated_scores_stay_finite():
    """Scores hundreds of times the cap: the kernel's tanh saturates at +-cap (no NaN,
    no inf), as torch.tanh does."""
    from kvpolicy.kernels import triton_attention as ta

    dev = _triton_device()
    q, k, v, mask = _case(tq=2, tk=20)
    kw = dict(scale=200.0, mask=mask, softcap=0.5)
    got = ta.attention_partial(q.to(dev), k.to(dev), v.to(dev),
                               **{**kw, "mask": mask.to(dev)})
    want = ref.attention_partial(q, k, v, **kw)
    assert torch.isfinite(got[0]).all()
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a.cpu(), b, atol=1e-5, rtol=1e-5)


@pytest.mark.triton
@pytest.mark.parametrize("tq,segments", [(1, "both"), (3, "both")])
def test_triton_decode_attention(tq, segments):
    args, want = _decode_case(tq, segments, _triton_device())
    out, _ = _decode(triton_backend.load(), args)
    torch.testing.assert_close(out.cpu(), want, atol=1e-5, rtol=1e-5)


# --------------------------------------------------------------------------- runtime


def _layer_oracle(layer, q, softcap, pending=None, mask=None):
    """One softmax of ``q`` over the layer's keys as attention sees them (+ pending)."""
    k, v = layer.dequantized(torch.float32)
    pos = layer.positions()
    if pending is not None:
        k, v = torch.cat((k, pending[0]), 2), torch.cat((v, pending[1]), 2)
        new = torch.arange(layer.n_seen, layer.n_seen + pending[0].shape[2])
        pos = torch.cat((pos, new.expand(pos.shape[0], -1)), 1)
    k = ref.apply_rope(k, pos, ROPE)
    mask = None if mask is None else to_additive(mask)
    return _capped(q, k, v, 1 / 32**0.5, softcap, mask)


@pytest.mark.parametrize("tq", (1, 300))  # 300 rows: two blocks of _ROWS rows
def test_layer_attend_with_softcap(path, tq):
    g = torch.Generator().manual_seed(tq)
    layer = PackedKVLayer(KS, VS, residual=8, sinks=2, rope=ROPE)
    k, v = _randn(2, 1, 2, 75, 32, g=g).unbind(0)
    k[..., 3] += 4.0
    layer.append(k, v)
    assert layer.n_packed == 64 and layer.n_sinks == 2 and layer.n_residual == 9
    q = 2 * _randn(1, 4, tq, 32, g=g)
    out = layer.attend(q, softcap=CAP, causal=False)  # every row sees every cached key
    torch.testing.assert_close(out, _layer_oracle(layer, q, CAP), atol=1e-5, rtol=1e-5)
    plain = layer.attend(q, causal=False)
    assert (out - plain).abs().max() > 0.05, "the cap left the output unchanged"


def test_layer_attend_pending_with_softcap(path):
    """A prompt chunk onto a filled cache: cached segments and pending tokens all capped."""
    g = torch.Generator().manual_seed(5)
    layer = PackedKVLayer(KS, VS, residual=8, sinks=2, rope=ROPE)
    k, v = _randn(2, 1, 2, 50, 32, g=g).unbind(0)
    k[..., 3] += 4.0
    layer.append(k, v)
    nk, nv = _randn(2, 1, 2, 6, 32, g=g).unbind(0)
    q = 2 * _randn(1, 4, 6, 32, g=g)
    out = layer.attend(q, pending=(nk, nv, None), softcap=CAP)  # causal over 50 + 6 keys
    want = _layer_oracle(layer, q, CAP, pending=(nk, nv), mask=causal_mask(6, 56))
    torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("bad", (0.0, -1.0, float("inf"), "2"))
def test_layer_refuses_a_softcap_that_is_not_positive(bad):
    layer = PackedKVLayer(KS, VS, residual=8, sinks=2)
    layer.append(*torch.randn(2, 1, 2, 4, 32).unbind(0))
    with pytest.raises(CacheError, match="softcap"):
        layer.attend(torch.randn(1, 2, 1, 32), softcap=bad)


@pytest.mark.parametrize("with_mask", (False, True), ids=("causal", "caller-mask"))
def test_capped_prefill_in_row_blocks(with_mask):
    """The soft-capped prefill (SDPA cannot cap) in blocks of rows against one softmax."""
    g = torch.Generator().manual_seed(7)
    t = 300  # two row blocks
    q = 2 * _randn(2, 4, t, 32, g=g)
    k, v = _randn(2, 2, 2, t, 32, g=g).unbind(0)
    mask = None
    want_mask = causal_mask(t, t)
    if with_mask:  # left padding of row 1, as transformers builds it
        mask = torch.ones(t, t, dtype=torch.bool).tril().expand(2, 1, t, t).clone()
        mask[1, :, :, :4] = False
        want_mask = to_additive(mask)
    got = _prefill_attention(q, k, v, mask, True, SCALE, None, None, CAP)
    want = _capped(q, k, v, SCALE, CAP, want_mask).nan_to_num(0.0)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    plain = _prefill_attention(q, k, v, mask, True, SCALE, None, None)
    assert (got - plain).abs().max() > 0.05, "the cap left the output unchanged"
