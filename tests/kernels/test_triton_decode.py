"""The fused Triton decode attention (one launch for both segments) against the reference.

Runs compiled on a GPU, in the interpreter elsewhere (see conftest.py); shapes are tiny
because the interpreter costs a few ms per program and key tile. The interpreter cannot
do bf16 arithmetic (``_triton_util.dots_in_fp32``): there bf16 inputs are loaded and
converted by the kernel, and dotted in fp32; the compiled bf16 dots are checked by the
sm_90 compile at the end of this file and on a GPU.

Also here: at most two Triton launches per call and no eager torch op in between, no host
read with ``check_positions=False``, the warm-up, and the sm_90 compile of the kernel.
"""

from __future__ import annotations

import collections
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import triton
from torch.utils._python_dispatch import TorchDispatchMode

from kvpolicy.errors import CacheError
from kvpolicy.kernels import reference as ref
from kvpolicy.kernels import triton_backend
from kvpolicy.kernels._triton_util import interpreting
from kvpolicy.kernels.layout import Packed, QuantSpec, RotarySpec

pytestmark = pytest.mark.triton

INTERPRET = interpreting()
DEVICE = "cpu" if INTERPRET else "cuda"
KS, VS = QuantSpec(2, 16, "channel"), QuantSpec(4, 16, "token")
# fp32: IEEE dots, only the summation order differs. Half: the rounding of the dequantized
# keys, of p and of the values to the dot dtype (bf16 on a GPU: 2**-8 relative).
TOL = {torch.float32: 1e-5, torch.float16: 5e-3, torch.bfloat16: 3e-2}


def _td():
    from kvpolicy.kernels import triton_decode  # after conftest set TRITON_INTERPRET

    return triton_decode


def _rope(style: str, rotary_dim: int, positions: int = 128, dtype=torch.float32) -> RotarySpec:
    """Tables in the layout the model multiplies with (RotarySpec's contract)."""
    inv = 1.0 / (10000.0 ** (torch.arange(0, rotary_dim, 2).float() / rotary_dim))
    ang = torch.arange(positions).float()[:, None] * inv[None, :]
    ang = torch.cat((ang, ang), -1) if style == "rotate_half" else ang.repeat_interleave(2, -1)
    return RotarySpec(style, rotary_dim, ang.cos().to(DEVICE, dtype), ang.sin().to(DEVICE, dtype))


def _case(*, dtype=torch.float32, segments="both", rope=None, hq=4, hkv=1, tq=1, tk=32,
          tf=5, d=32, k_spec=KS, v_spec=VS, seed=0) -> dict:
    """Arguments of one decode call: q, a packed and a full-precision segment in ``dtype``
    (keys with an outlier channel, as real keys have), distinct positions per batch row."""
    g = torch.Generator().manual_seed(seed)
    b = 2
    q = torch.randn(b, hq, tq, d, generator=g)
    k, v = torch.randn(2, b, hkv, tk, d, generator=g).unbind(0)
    fk, fv = torch.randn(2, b, hkv, tf, d, generator=g).unbind(0)
    k[..., 1] += 6.0
    fk[..., 1] += 6.0
    pos = torch.stack([torch.randperm(128, generator=g)[: tk + tf] for _ in range(b)])
    a = dict(
        q=q.to(DEVICE, dtype), k=ref.quantize(k.to(DEVICE), k_spec, dtype),
        v=ref.quantize(v.to(DEVICE), v_spec, dtype), k_spec=k_spec, v_spec=v_spec,
        fk=fk.to(DEVICE, dtype), fv=fv.to(DEVICE, dtype), scale=1.0 / math.sqrt(d), rope=rope,
        k_positions=pos[:, :tk].to(DEVICE), fp_positions=pos[:, tk:].to(DEVICE),
    )
    if segments == "fp":
        a.update(k=None, v=None)
    if segments == "packed":
        a.update(fk=None, fv=None)
    return a


def _call(fn, a: dict, **kw):
    a = {**a, **kw}
    return fn(a.pop("q"), a.pop("k"), a.pop("v"), a.pop("k_spec"), a.pop("v_spec"),
              a.pop("fk"), a.pop("fv"), **a)


def _check(a: dict, tol: float = 1e-5, **kw) -> tuple[torch.Tensor, torch.Tensor]:
    out, lse = _call(_td().decode_attention, a, **kw)
    ref_kw = {n: x for n, x in kw.items() if n not in ("num_splits", "fp_splits")}
    want, want_lse = _call(ref.decode_attention, a, **ref_kw)
    assert out.dtype == torch.float32 and lse.dtype == torch.float32
    assert out.shape == want.shape and lse.shape == want_lse.shape
    torch.testing.assert_close(out.cpu(), want.cpu(), atol=tol, rtol=tol)
    torch.testing.assert_close(lse.cpu(), want_lse.cpu(), atol=tol, rtol=tol)
    return out, lse


# --------------------------------------------------------------------------- results


@pytest.mark.parametrize("segments", ["both", "packed", "fp"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16],
                         ids=["fp32", "fp16", "bf16"])
def test_segments_and_dtypes(dtype, segments):
    # Queries, scales, the full-precision segment and the rotary tables all in `dtype`;
    # partial rotary (16 of 32 channels, rotate_half), GQA 4.
    a = _case(dtype=dtype, segments=segments, rope=_rope("rotate_half", 16, dtype=dtype))
    _check(a, TOL[dtype])


@pytest.mark.parametrize(
    "style, rotary_dim",
    [(None, 0), ("rotate_half", 32), ("interleaved", 32), ("interleaved", 8)],
    ids=["none", "rotate_half", "interleaved", "partial_interleaved"],
)
def test_rope_styles(style, rotary_dim):
    rope = None if style is None else _rope(style, rotary_dim)
    _check(_case(rope=rope, seed=rotary_dim))


def test_pages_named_by_a_block_table():
    # Two pages of 16 tokens per row in a pool of 5, in shuffled order: the kernel gathers
    # them (no paged reads in Triton yet) and answers as over the segment they hold.
    a = _case(rope=_rope("rotate_half", 32), tk=32)
    table = torch.tensor([[3, 0], [4, 1]], device=DEVICE)

    def pages(p: Packed, spec: QuantSpec) -> Packed:
        rows = 16 // spec.token_group
        out = []
        for x in p:
            pool = torch.zeros(5, *x.shape[1:2], rows, *x.shape[3:], dtype=x.dtype,
                               device=x.device)
            for b in range(2):
                for j in range(2):
                    pool[table[b, j]] = x[b, :, j * rows : (j + 1) * rows]
            out.append(pool)
        return Packed(*out)

    want, want_lse = _call(ref.decode_attention, a)
    got, lse = _call(_td().decode_attention, {**a, "k": pages(a["k"], KS),
                                              "v": pages(a["v"], VS)}, block_table=table)
    torch.testing.assert_close(got.cpu(), want.cpu(), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse.cpu(), want_lse.cpu(), atol=1e-5, rtol=1e-5)


def test_fp32_queries_over_a_half_precision_cache():
    # What the runtime hands over today: fp32 queries, fp16 scales and window.
    a = _case(dtype=torch.float16, rope=_rope("rotate_half", 32, dtype=torch.float16))
    a["q"] = a["q"].float()
    _check(a, 1e-5)


@pytest.mark.parametrize("hq, hkv", [(2, 2), (4, 1)], ids=["gqa1", "gqa4"])
def test_masks_softcap_and_splits(hq, hkv):
    # Three query rows, masks over both segments: row 0 sees only full-precision keys
    # (every packed key hidden), row 1 nothing at all (out 0, lse -inf), row 2 a few keys
    # of each hidden for one head. Three packed splits and two full-precision ones cover
    # the merge of five splits, one of them empty for row 0.
    a = _case(hq=hq, hkv=hkv, tq=3, tk=48, tf=20, rope=_rope("rotate_half", 32), seed=7)
    mask = torch.zeros(1, hq, 3, 48)
    mask[:, :, 0] = float("-inf")
    mask[:, :, 1] = float("-inf")
    mask[:, 0, 2, ::5] = float("-inf")
    fp_mask = torch.zeros(3, 20)  # broadcast over batch and heads (stride 0)
    fp_mask[1] = float("-inf")
    fp_mask[2, 3:7] = float("-inf")
    a.update(mask=mask.to(DEVICE), fp_mask=fp_mask.to(DEVICE), softcap=2.0)
    out, lse = _check(a, num_splits=3, fp_splits=2)
    assert torch.all(out[:, :, 1] == 0) and torch.all(lse[:, :, 1] == float("-inf"))
    # The split counts change nothing but the summation order.
    out1, lse1 = _call(_td().decode_attention, a, num_splits=1, fp_splits=1)
    torch.testing.assert_close(out1, out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse1, lse, atol=1e-5, rtol=1e-5)


def test_head_dim_not_a_power_of_two():
    # head_dim 48: padded channel blocks, the generic value path; 3-bit keys straddle bytes.
    a = _case(d=48, rope=_rope("rotate_half", 32), k_spec=QuantSpec(3, 16, "channel"),
              v_spec=QuantSpec(2, 16, "token"), seed=3)
    _check(a)


def test_empty_segments():
    td = _td()
    a = _case()
    empty_k = Packed(a["k"].codes[:, :, :0], a["k"].scale[:, :, :0], a["k"].zero[:, :, :0])
    empty_v = Packed(a["v"].codes[:, :, :0], a["v"].scale[:, :, :0], a["v"].zero[:, :, :0])
    # An empty packed segment is no segment: the full-precision one alone.
    out, lse = _call(td.decode_attention, a, k=empty_k, v=empty_v)
    want, want_lse = _call(ref.decode_attention, a, k=None, v=None)
    torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse, want_lse, atol=1e-5, rtol=1e-5)
    # No key at all: out 0, lse -inf, like the reference.
    out, lse = _call(td.decode_attention, a, k=empty_k, v=empty_v, fk=a["fk"][:, :, :0],
                     fv=a["fv"][:, :, :0], fp_positions=a["fp_positions"][:, :0])
    assert torch.all(out == 0) and torch.all(lse == float("-inf"))


def test_errors_name_the_problem():
    td = _td()
    a = _case(rope=_rope("rotate_half", 16))
    with pytest.raises(CacheError, match="segment"):
        _call(td.decode_attention, a, k=None, v=None, fk=None, fv=None)
    with pytest.raises(CacheError, match="come together"):
        _call(td.decode_attention, a, fv=None)
    with pytest.raises(CacheError, match="fp_positions"):
        _call(td.decode_attention, a, fp_positions=None)
    with pytest.raises(CacheError, match="k_positions"):
        _call(td.decode_attention, a, k_positions=None)
    with pytest.raises(CacheError, match="rotary table"):
        _call(td.decode_attention, a, fp_positions=a["fp_positions"] + 1000)
    with pytest.raises(CacheError, match="kv heads"):
        _call(td.decode_attention, a, fk=a["fk"].repeat(1, 2, 1, 1),
              fv=a["fv"].repeat(1, 2, 1, 1))
    with pytest.raises(CacheError, match="broadcast"):
        _call(td.decode_attention, a, fp_mask=torch.zeros(3, 5, device=DEVICE))


def test_the_triton_backend_decodes_with_this_kernel():
    assert triton_backend.load().decode_attention is _td().decode_attention


# --------------------------------------------------------------------------- launches


class _Launches(TorchDispatchMode):
    """Triton launches by kernel name, the torch ops run outside them, and host reads.

    Wraps the ``run`` of the class of the kernels (the interpreter's or the JIT's), so it
    counts every Triton kernel that runs, whatever launched it."""

    HOST_READS = {
        torch.ops.aten._local_scalar_dense.default,
        torch.ops.aten.equal.default,
        torch.ops.aten.is_nonzero.default,
    }

    def __init__(self, monkeypatch) -> None:
        super().__init__()
        self.kernels: list[tuple[str, dict]] = []
        self.ops: collections.Counter = collections.Counter()
        self.host_reads = 0
        self._inside = False
        cls = type(_td()._decode_kernel.fn)
        run = cls.run

        def counted(fn, *args, **kwargs):
            self.kernels.append((fn.fn.__name__, kwargs))
            self._inside = True
            try:
                return run(fn, *args, **kwargs)
            finally:
                self._inside = False

        monkeypatch.setattr(cls, "run", counted)

    def names(self) -> list[str]:
        return [name for name, _ in self.kernels]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in self.HOST_READS:
            self.host_reads += 1
        if not self._inside:  # the interpreter's own copies are not the launcher's
            self.ops[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


# Torch ops that launch nothing on a GPU: allocations and views.
_NO_KERNEL = {"empty", "empty_strided", "view", "expand", "squeeze", "as_strided", "alias",
              "_reshape_alias", "unsqueeze", "slice", "select", "detach", "t", "reshape"}


@pytest.mark.parametrize(
    "segments, splits, launches",
    [("packed", (1, 1), ["_decode_kernel"]), ("fp", (1, 1), ["_decode_kernel"]),
     ("both", (1, 1), ["_decode_kernel", "merge_splits_kernel"]),
     ("both", (3, 2), ["_decode_kernel", "merge_splits_kernel"]),
     ("packed", (2, 1), ["_decode_kernel", "merge_splits_kernel"])],
    ids=["packed", "fp", "both", "both-5-splits", "packed-2-splits"],
)
def test_one_launch_plus_at_most_one_merge(monkeypatch, segments, splits, launches):
    a = _case(segments=segments, tk=48, tf=20, rope=_rope("interleaved", 32))
    a["mask"] = torch.zeros(1, 1, 1, 48, device=DEVICE)
    a["fp_mask"] = torch.zeros(20, device=DEVICE)
    with _Launches(monkeypatch) as seen:
        _call(_td().decode_attention, a, check_positions=False, num_splits=splits[0],
              fp_splits=splits[1])
    assert seen.names() == launches
    assert set(seen.ops) <= _NO_KERNEL, f"eager torch ops around the kernels: {seen.ops}"


def test_no_host_read_without_position_checks(monkeypatch):
    a = _case(rope=_rope("rotate_half", 32), tq=2)
    a["mask"] = torch.zeros(1, 1, 2, 32, device=DEVICE)
    a["fp_mask"] = torch.zeros(1, 1, 2, 5, device=DEVICE)
    reads = {}
    for check in (False, True):
        with _Launches(monkeypatch) as seen:
            _call(_td().decode_attention, a, check_positions=check)
        reads[check] = seen.host_reads
    assert reads[False] == 0, "check_positions=False must not read device data on the host"
    assert reads[True] > 0, "the position checks read min/max: this test would see a sync"


def test_warm_up_launches_each_layout_and_merge(monkeypatch):
    td = _td()
    rope = _rope("rotate_half", 32)
    with _Launches(monkeypatch) as seen:
        warmed = td.warm_up_decode(
            KS, VS, n_kv_heads=1, gqa=2, head_dim=32, dtype=torch.float16, device=DEVICE,
            query_dtype=torch.float32, rope=rope, softcap=2.0, packed_tokens=(16,),
            fp_tokens=2, max_splits=4,
        )
    assert warmed == ("packed+fp", "fp")
    decode = [kw for name, kw in seen.kernels if name == "_decode_kernel"]
    assert [(kw["HAS_PACKED"], kw["HAS_FP"]) for kw in decode] == [(True, True), (False, True)]
    assert all(kw["SOFTCAP"] and kw["ROPE"] == 1 and kw["DOT_F32"] for kw in decode)
    # packed+fp merges its two splits; then the merge for 2 and 4 splits.
    merges = [kw["BLOCK_S"] for name, kw in seen.kernels if name == "merge_splits_kernel"]
    assert merges == [2, 2, 4]
    with pytest.raises(CacheError, match="layout"):
        td.warm_up_decode(KS, VS, n_kv_heads=1, gqa=1, head_dim=32, dtype=torch.float32,
                          device=DEVICE, layouts=("sinks",))


# --------------------------------------------------------------------------- sm_90 compile

_PTXAS = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
_VARIANTS = 4


@pytest.mark.skipif(not _PTXAS.exists(), reason="this triton wheel ships no ptxas")
def test_decode_kernel_compiles_for_sm90():
    """The interpreter accepts programs the compiler rejects and runs no bf16 dot: compile
    the kernel for sm_90 (this file as a script, without TRITON_INTERPRET)."""
    root = Path(__file__).resolve().parents[2]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(root), env.get("PYTHONPATH")]))
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    proc = subprocess.run([sys.executable, __file__], env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, f"sm_90 compile failed:\n{proc.stdout}\n{proc.stderr[-4000:]}"
    assert proc.stdout.count("compiled for sm_90") == _VARIANTS, proc.stdout


def _compile_decode(qdt: str, fdt: str, tdt: str, kb: int, kaxis: str, vb: int, vaxis: str,
                    rope: int, rot: int, *, d: int = 128, gqa: int = 4, packed: bool = True,
                    fp: bool = True, masks: bool = False, softcap: bool = False):
    """One variant with the runtime's specialisation (``_triton_util.compile_ahead``)."""
    from kvpolicy.kernels import triton_decode as td
    from kvpolicy.kernels._triton_util import channel_blocks, compile_ahead, fast_layout

    g = 32
    ints = {n: 64 for n in td._decode_kernel.arg_names}  # strides, sizes
    ints.update(q_len=1, sq_d=1, skc_2=1, sks_1=1, svc_2=1, svs_1=1, sp_t=1, sfk_d=1, sfv_d=1,
                sfp_t=1, sr_d=1, n_rows=gqa)
    ptrs = dict(
        q_ptr=f"*{qdt}", kc_ptr="*u8", ks_ptr=f"*{fdt}", kz_ptr=f"*{fdt}", vc_ptr="*u8",
        vs_ptr=f"*{fdt}", vz_ptr=f"*{fdt}", pos_ptr="*i64", mask_ptr="*fp32", fk_ptr=f"*{fdt}",
        fv_ptr=f"*{fdt}", fpos_ptr="*i64", fmask_ptr="*fp32", cos_ptr=f"*{tdt}",
        sin_ptr=f"*{tdt}", out_ptr="*fp32", lse_ptr="*fp32",
    )
    kspec, vspec = QuantSpec(kb, g, kaxis), QuantSpec(vb, g, vaxis)
    consts = dict(
        GQA=gqa, DK=d, DV=d, K_BITS=kb, K_GROUP=g, K_CHANNEL=kaxis == "channel",
        V_BITS=vb, V_GROUP=g, V_CHANNEL=vaxis == "channel",
        K_FAST=fast_layout(kspec, "channel", d), V_FAST=fast_layout(vspec, "token", d),
        ROPE=rope, ROT_DIM=rot, HAS_PACKED=packed, HAS_FP=fp, HAS_MASK=masks,
        HAS_FP_MASK=masks, SOFTCAP=softcap, DOT_F32=qdt == "fp32", MATH_F16=qdt == "fp16",
        BLOCK_M=16, BLOCK_N=64, **channel_blocks(rot, d, d),
    )
    return compile_ahead(td._decode_kernel, ints, ptrs, consts, floats=("scale", "softcap"))


def _main() -> int:
    variants = [
        ("fp16 K2ch V2tok rotate_half, both segments",
         lambda: _compile_decode("fp16", "fp16", "fp16", 2, "channel", 2, "token", 1, 128)),
        ("bf16 K4ch V1tok partial interleaved, masks, softcap",
         lambda: _compile_decode("bf16", "bf16", "bf16", 4, "channel", 1, "token", 2, 32,
                                 d=64, gqa=3, masks=True, softcap=True)),
        ("fp32 queries, fp16 cache, K3ch V3ch d80 no rope",
         lambda: _compile_decode("fp32", "fp16", "fp32", 3, "channel", 3, "channel", 0, 0,
                                 d=80, masks=True)),
        ("bf16 full-precision segment only",
         lambda: _compile_decode("bf16", "bf16", "fp32", 2, "channel", 2, "token", 1, 128,
                                 packed=False)),
    ]
    assert len(variants) == _VARIANTS
    for name, build in variants:
        build()
        print(f"compiled for sm_90: {name}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(_main())
