"""Vector-quantized values (``QuantSpec.levels == "vq"``) in the Triton kernels.

Decode: :func:`triton_decode.decode_attention` gathers each value channel's centroid
(byte ``c // d`` of the token's codes, entry ``c % d`` of that centroid in the per-head
fp32 codebook) times its group's scale (``V_VQ``), against the reference's attention over
:func:`kvpolicy.kernels.reference.dequantize`; bits 1 and 2, 16- and 8-bit metadata, GQA,
a full-precision segment, splits, masks, pages named by a block table, and the warm-up.
:func:`triton_attention.packed_attention_partial` reads them the same way.

The Triton backend's record: quantize of a vq spec is the torch backend's (the shared
reference encoder, bit-identical), its packed-segment attention is Triton's kernel and
agrees with the torch backend's. Random codebooks, values quantized by
:func:`kvpolicy.kernels.reference.quantize`; the decode tests' tolerances. The sm_90
compile of the vq variants runs at the end of this file (as a script).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import triton
from test_triton_decode import TOL, _call, _case, _check, _Launches, _rope

from kvpolicy.errors import CacheError
from kvpolicy.kernels import reference as ref
from kvpolicy.kernels import torch_backend as tb
from kvpolicy.kernels._triton_util import interpreting
from kvpolicy.kernels.layout import Codebook, Packed, QuantSpec, vq_dim

pytestmark = pytest.mark.triton

DEVICE = "cpu" if interpreting() else "cuda"
KS = QuantSpec(2, 16, "channel")


def _td():
    from kvpolicy.kernels import triton_decode  # after conftest set TRITON_INTERPRET

    return triton_decode


def _ta():
    from kvpolicy.kernels import triton_attention

    return triton_attention


def _vq(bits: int, g: int, heads: int, meta_bits: int = 16, seed: int = 0) -> QuantSpec:
    g_ = torch.Generator().manual_seed(100 + seed)
    book = Codebook.from_tensor(torch.randn(heads, 256, vq_dim(bits), generator=g_))
    return QuantSpec(bits, g, "token", levels="vq", meta_bits=meta_bits, codebook=book)


def _vq_case(bits: int, g: int, meta_bits: int = 16, *, hq: int = 4, hkv: int = 2,
             seed: int = 0, **kw) -> dict:
    a = _case(hq=hq, hkv=hkv, v_spec=_vq(bits, g, hkv, meta_bits, seed), seed=seed, **kw)
    v = a["v"]
    if a["v"] is not None:  # not vacuous: the layout of vq values, many distinct codes
        d = vq_dim(bits)
        assert v.codes.shape[-1] == v.scale.shape[-1] * g // d and v.zero.shape[-1] == 0
        assert v.scale.dtype == (torch.uint8 if meta_bits == 8 else a["q"].dtype)
        assert v.codes.unique().numel() > 16
    return a


# --------------------------------------------------------------------------- decode


@pytest.mark.parametrize("bits, g", [(2, 8), (2, 32), (1, 16)])
@pytest.mark.parametrize("meta_bits", [16, 8])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16],
                         ids=["fp32", "fp16", "bf16"])
def test_decode_reads_vq_values(bits, g, meta_bits, dtype):
    # Both segments, GQA 2 over 2 kv heads (each its own codebook), pre-RoPE keys.
    a = _vq_case(bits, g, meta_bits, dtype=dtype, seed=bits * g + meta_bits,
                 rope=_rope("rotate_half", 16, dtype=dtype))
    _check(a, TOL[dtype])


@pytest.mark.parametrize("bits", [1, 2])
def test_decode_vq_splits_masks_softcap_gqa4(bits):
    # GQA 4 over one kv head, three query rows, masks over both segments, softcap, three
    # packed and two full-precision splits; head_dim 48 (padded value channels).
    a = _vq_case(bits, 16, 8, hq=4, hkv=1, tq=3, tk=48, tf=20, d=48, seed=bits,
                 rope=_rope("interleaved", 32))
    mask = torch.zeros(1, 4, 3, 48)
    mask[:, :, 1] = float("-inf")
    mask[:, 0, 2, ::5] = float("-inf")
    fp_mask = torch.zeros(3, 20)
    fp_mask[2, 3:7] = float("-inf")
    a.update(mask=mask.to(DEVICE), fp_mask=fp_mask.to(DEVICE), softcap=2.0)
    _check(a, num_splits=3, fp_splits=2)


def test_decode_vq_packed_segment_alone():
    _check(_vq_case(2, 16, segments="packed", seed=5))


def test_decode_vq_pages_named_by_a_block_table():
    # Two pages of 16 tokens per row in a pool of 5, shuffled: the gathered pages keep
    # the pool's empty zero, which the kernel never reads.
    a = _vq_case(2, 16, 8, tk=32, rope=_rope("rotate_half", 32), seed=9)
    table = torch.tensor([[3, 0], [4, 1]], device=DEVICE)

    def pages(p: Packed, spec: QuantSpec) -> Packed:
        rows = 16 // spec.token_group
        out = []
        for x in p:
            pool = torch.zeros(5, x.shape[1], rows, *x.shape[3:], dtype=x.dtype,
                               device=x.device)
            for b in range(2):
                for j in range(2):
                    pool[table[b, j]] = x[b, :, j * rows : (j + 1) * rows]
            out.append(pool)
        return Packed(*out)

    want, want_lse = _call(ref.decode_attention, a)
    got, lse = _call(_td().decode_attention,
                     {**a, "k": pages(a["k"], KS), "v": pages(a["v"], a["v_spec"])},
                     block_table=table)
    torch.testing.assert_close(got.cpu(), want.cpu(), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse.cpu(), want_lse.cpu(), atol=1e-5, rtol=1e-5)


def test_decode_launches_the_vq_variant(monkeypatch):
    # V_VQ is the sub-vector length and the codebook is this spec's; a uniform policy
    # launches without them (defaults), so it keeps its own variant.
    a = _vq_case(1, 16, seed=3)
    with _Launches(monkeypatch) as seen:
        _call(_td().decode_attention, a)
        _call(_td().decode_attention, {**a, "v_spec": QuantSpec(2, 16, "token"),
                                       "v": ref.quantize(torch.randn(2, 2, 32, 32, device=DEVICE),
                                                         QuantSpec(2, 16, "token"))})
    kw = [kw for name, kw in seen.kernels if name == "_decode_kernel"]
    assert kw[0]["V_VQ"] == 8 and not kw[0]["V_FAST"]
    assert kw[0]["vcb_ptr"] is a["v_spec"].codebook.tensor(DEVICE)
    assert "V_VQ" not in kw[1] and "vcb_ptr" not in kw[1]


def test_warm_up_launches_vq_values(monkeypatch):
    spec = _vq(2, 16, 2, 8)
    with _Launches(monkeypatch) as seen:
        _td().warm_up_decode(KS, spec, n_kv_heads=2, gqa=2, head_dim=32, dtype=torch.float16,
                             device=DEVICE, query_dtype=torch.float32, packed_tokens=(16,),
                             fp_tokens=2, max_splits=1)
    decode = [kw for name, kw in seen.kernels if name == "_decode_kernel"]
    # packed+fp reads the codebook; fp alone is the one variant of every policy.
    assert [kw.get("V_VQ", 0) for kw in decode] == [4, 0]
    assert decode[0]["V_M8"]


def test_decode_vq_errors_name_the_problem():
    a = _vq_case(2, 16, seed=1)
    other = _vq(2, 16, 3)  # a codebook of 3 kv heads for a segment of 2
    with pytest.raises(CacheError, match="codebook"):
        _call(_td().decode_attention, a, v_spec=other)
    v = a["v"]
    with pytest.raises(CacheError, match="empty zero"):
        _call(_td().decode_attention, a, v=Packed(v.codes, v.scale, v.scale))
    with pytest.raises(CacheError, match="uint8 index"):
        _call(_td().decode_attention, a, v_spec=_vq(2, 16, 2, 8, seed=1))


# --------------------------------------------------------------------------- packed segment


@pytest.mark.parametrize("bits, meta_bits", [(2, 8), (1, 16)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_packed_attention_reads_vq_values(bits, meta_bits, dtype):
    a = _vq_case(bits, 16, meta_bits, dtype=dtype, segments="packed", tk=48,
                 rope=_rope("rotate_half", 32), seed=bits + meta_bits)
    args = (a["q"], a["k"], a["v"], a["k_spec"], a["v_spec"])
    kw = dict(scale=a["scale"], rope=a["rope"], k_positions=a["k_positions"])
    got = _ta().packed_attention_partial(*args, **kw, num_splits=2)
    want = ref.packed_attention_partial(*args, **kw)
    for x, y in zip(got, want, strict=True):
        torch.testing.assert_close(x.cpu(), y.cpu(), atol=TOL[dtype], rtol=TOL[dtype])


def test_packed_attention_refuses_tables_it_does_not_read():
    # Per-channel key widths are the decode kernel's (K_WID): refused, not read as one width.
    a = _vq_case(2, 16, segments="packed", seed=2)
    keys = QuantSpec(2, 16, "channel", widths=((2,) * 32,) * 2)
    with pytest.raises(CacheError, match="per-channel widths"):
        _ta().packed_attention_partial(a["q"], a["k"], a["v"], keys, a["v_spec"], scale=0.2)


def test_the_triton_backend_on_vq_values():
    """Quantize: the torch backend's (the reference encoder), bit-identical; the packed
    segment: Triton's kernel, agreeing with the torch backend's."""
    from kvpolicy.kernels import triton_backend

    tr = triton_backend.load()
    spec = _vq(2, 16, 2, 8, seed=4)
    g = torch.Generator().manual_seed(4)
    k, v = torch.randn(2, 1, 2, 48, 32, generator=g).unbind(0)
    q = torch.randn(1, 4, 3, 32, generator=g)
    k, v, q = k.to(DEVICE), v.to(DEVICE), q.to(DEVICE)
    for dtype in (torch.float16, torch.float32):
        pv = tr.quantize(v, spec, dtype)
        for x, y in zip(pv, tb.quantize(v, spec, dtype), strict=True):
            assert x.dtype == y.dtype and torch.equal(x, y)
    pk = tr.quantize(k, KS, torch.float16)
    got = tr.packed_attention_partial(q, pk, pv, KS, spec, scale=0.2)
    want = tb.packed_attention_partial(q, pk, pv, KS, spec, scale=0.2)
    for x, y in zip(got, want, strict=True):
        torch.testing.assert_close(x.cpu(), y.cpu(), atol=1e-5, rtol=1e-5)


# --------------------------------------------------------------------------- sm_90 compile

_PTXAS = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
_VARIANTS = 3


@pytest.mark.skipif(not _PTXAS.exists(), reason="this triton wheel ships no ptxas")
def test_vq_variants_compile_for_sm90():
    """The interpreter accepts programs the compiler rejects: compile the vq variants of
    both attention kernels for sm_90 (this file as a script, without TRITON_INTERPRET)."""
    root = Path(__file__).resolve().parents[2]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(
        filter(None, [str(root), str(Path(__file__).parent), env.get("PYTHONPATH")]))
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    proc = subprocess.run([sys.executable, __file__], env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, f"sm_90 compile failed:\n{proc.stdout}\n{proc.stderr[-4000:]}"
    assert proc.stdout.count("compiled for sm_90") == _VARIANTS, proc.stdout


def _compile_vq(kernel: str, qdt: str, vq: int, m8: bool, g: int = 32, d: int = 128):
    """One variant with V_VQ set: 2-bit channel keys, the runtime's specialisation."""
    from _sm90_compile import _compile, _meta8

    from kvpolicy.kernels import triton_attention as ta
    from kvpolicy.kernels import triton_decode as td
    from kvpolicy.kernels._triton_util import channel_blocks

    fn = td._decode_kernel if kernel == "decode" else ta._packed_attention_kernel
    ints = {n: 64 for n in fn.arg_names}
    ints.update(q_len=1, sq_d=1, skc_2=1, sks_1=1, svc_2=1, svs_1=1, sp_t=1, sfk_d=1,
                sfv_d=1, sfp_t=1, sr_d=1, n_rows=4, kv_len=4096, split_len=1024)
    ptrs = dict(
        q_ptr=f"*{qdt}", kc_ptr="*u8", ks_ptr="*fp16", kz_ptr="*fp16", vc_ptr="*u8",
        vs_ptr="*fp16", vz_ptr="*fp16", pos_ptr="*i64", mask_ptr="*fp32", cos_ptr="*fp16",
        sin_ptr="*fp16", out_ptr="*fp32", lse_ptr="*fp32", vcb_ptr="*fp32",
    )
    consts = dict(
        GQA=4, DK=d, DV=d, K_BITS=2, K_GROUP=g, K_CHANNEL=True, V_BITS=8 // vq, V_GROUP=g,
        V_CHANNEL=False, K_FAST=True, V_FAST=False, ROPE=1, ROT_DIM=d, HAS_MASK=False,
        SOFTCAP=False, DOT_F32=qdt == "fp32", MATH_F16=qdt == "fp16", BLOCK_M=16,
        BLOCK_N=64, V_VQ=vq, **channel_blocks(d, d, d),
    )
    if kernel == "decode":
        ptrs.update(fk_ptr="*fp16", fv_ptr="*fp16", fpos_ptr="*i64", fmask_ptr="*fp32")
        consts.update(HAS_PACKED=True, HAS_FP=True, HAS_FP_MASK=False)
    _meta8(consts, ptrs, m8, m8)
    return _compile(fn, ints, ptrs, consts, floats=("scale", "softcap"))


def _main() -> int:
    variants = [
        ("decode fp16 K2ch V2tok vq, 8-bit metadata",
         lambda: _compile_vq("decode", "fp16", 4, True)),
        ("decode bf16 K2ch V1tok vq, 16-bit metadata",
         lambda: _compile_vq("decode", "bf16", 8, False)),
        ("attn fp32 K2ch V2tok vq, 8-bit metadata",
         lambda: _compile_vq("attn", "fp32", 4, True)),
    ]
    assert len(variants) == _VARIANTS
    for name, build in variants:
        build()
        print(f"compiled for sm_90: {name}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(_main())
