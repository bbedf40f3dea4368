"""The kernel contract: every backend fills in the whole record, ``select`` picks one, and
every record's ``decode_attention`` equals the reference's segments merged by hand."""

from __future__ import annotations

import ast
import dataclasses
import sys
from pathlib import Path

import pytest
import torch

from kvpolicy.errors import CacheError
from kvpolicy.kernels import cpu_ext, torch_backend, triton_backend
from kvpolicy.kernels import reference as ref
from kvpolicy.kernels.backend import BACKENDS, Backend, select
from kvpolicy.kernels.layout import QuantSpec
from kvpolicy.zoo.tiny import rope_spec

NAMES = ("reference", "torch", pytest.param("triton", marks=pytest.mark.triton))
# warm_up is optional: None for a backend with nothing to compile ahead.
OPTIONAL_FIELDS = ("warm_up",)
KERNEL_FIELDS = [f.name for f in dataclasses.fields(Backend)
                 if f.name != "name" and f.name not in OPTIONAL_FIELDS]


def record(name: str) -> Backend:
    if name == "reference":
        return ref.BACKEND
    if name == "torch":
        return torch_backend.BACKEND
    return triton_backend.load()


def triton_device() -> str:
    from kvpolicy.kernels import triton_attention  # after conftest set TRITON_INTERPRET

    return "cpu" if triton_attention._INTERPRET else "cuda"


# --------------------------------------------------------------------------- records


@pytest.mark.parametrize("name", NAMES)
def test_every_field_is_set_and_callable(name: str) -> None:
    rec = record(name)
    assert rec.name == name
    missing = [f for f in KERNEL_FIELDS if getattr(rec, f) is None or not callable(getattr(rec, f))]
    assert not missing, f"{name} backend leaves {missing} unset"
    assert all(getattr(rec, f) is None or callable(getattr(rec, f)) for f in OPTIONAL_FIELDS)


def test_records_are_frozen() -> None:
    with pytest.raises(dataclasses.FrozenInstanceError):
        torch_backend.BACKEND.quantize = ref.quantize  # type: ignore[misc]


# --------------------------------------------------------------------------- select


@pytest.mark.parametrize("name", ("auto", "torch"))
def test_select_gives_the_torch_record_for_cpu_tensors(name: str) -> None:
    assert select(name, torch.device("cpu")) is torch_backend.BACKEND


def test_select_rejects_an_unknown_name_naming_the_choices() -> None:
    with pytest.raises(CacheError) as err:
        select("cuda", torch.device("cpu"))
    assert "'cuda'" in str(err.value)
    assert all(repr(choice) in str(err.value) for choice in BACKENDS), str(err.value)


def _hide_triton(monkeypatch) -> None:
    import kvpolicy.kernels

    monkeypatch.setitem(sys.modules, "kvpolicy.kernels.triton_attention", None)
    monkeypatch.delattr(kvpolicy.kernels, "triton_attention", raising=False)


def test_select_without_triton(monkeypatch, caplog) -> None:
    """"auto" on CUDA falls back to torch with a warning; "triton" is a clear error."""
    _hide_triton(monkeypatch)
    cuda = torch.device("cuda")  # only its type is read: no GPU needed
    with caplog.at_level("WARNING", logger="kvpolicy.kernels.backend"):
        assert select("auto", cuda) is torch_backend.BACKEND
    assert "Triton kernels unavailable" in caplog.text
    with pytest.raises(CacheError, match="backend='torch'"):
        select("triton", torch.device("cpu"))


@pytest.mark.triton
def test_select_triton() -> None:
    assert select("triton", torch.device("cpu")).name == "triton"


def test_runtime_does_not_call_the_reference() -> None:
    """The runtime runs the chosen backend's kernels; the reference is the tests' oracle."""
    runtime = Path(__file__).resolve().parents[2] / "kvpolicy" / "runtime"
    found = []
    for path in sorted(runtime.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom):
                names = [f"{node.module}.{a.name}" for a in node.names]
                found += [f"{path.name}:{node.lineno}" for n in names if "reference" in n]
    assert not found, f"runtime modules import kernels.reference: {found}"


# --------------------------------------------------------------------------- decode_attention


def _by_hand(q, pk, pv, ks, vs, fk, fv, *, scale, mask, fp_mask, rope, kpos, fpos):
    """The reference's segments, merged by the reference (what decode_attention promises)."""
    parts = []
    if pk is not None:
        parts.append(ref.packed_attention_partial(
            q, pk, pv, ks, vs, scale=scale, mask=mask, rope=rope,
            k_positions=None if rope is None else kpos.long(),
        ))
    if fk is not None:
        k = fk if rope is None else ref.apply_rope(fk.float(), fpos.long(), rope)
        parts.append(ref.attention_partial(q, k, fv, scale=scale, mask=fp_mask))
    return ref.merge_partials_lse(parts)


CASES = {  # segments present, rope, query length
    "both-rope": ("both", True, 1),
    "both-masked": ("both", False, 3),
    "packed-only": ("packed", True, 1),
    "fp-only": ("fp", True, 2),
}


def _case(case: str, device: str):
    segments, with_rope, tq = CASES[case]
    g = torch.Generator().manual_seed(len(case))
    ks, vs = QuantSpec(2, 16, "channel"), QuantSpec(4, 16, "token")
    tk, tf, hq, hkv, d = 32, 5, 2, 1, 32
    k, v = torch.randn(2, 1, hkv, tk, d, generator=g).unbind(0)
    fk, fv = torch.randn(2, 1, hkv, tf, d, generator=g).unbind(0)
    q = torch.randn(1, hq, tq, d, generator=g)
    pk, pv = ref.quantize(k, ks), ref.quantize(v, vs)
    positions = torch.randperm(64, generator=g)[: tk + tf].to(torch.int32)[None]
    mask = fp_mask = None
    if tq > 1:
        mask = torch.zeros(1, hq, tq, tk)
        mask[..., ::3] = float("-inf")
        fp_mask = torch.zeros(1, 1, tq, tf)
        fp_mask[0, 0, 0, 1:] = float("-inf")
    args = dict(
        q=q, pk=pk, pv=pv, ks=ks, vs=vs, fk=fk, fv=fv, scale=0.2, mask=mask, fp_mask=fp_mask,
        rope=rope_spec("rotate_half", 16, 64) if with_rope else None,
        kpos=positions[:, :tk], fpos=positions[:, tk:],
    )
    if segments == "fp":
        args.update(pk=None, pv=None, mask=None)
    if segments == "packed":
        args.update(fk=None, fv=None, fp_mask=None)
    want = _by_hand(**args)

    def move(x):
        if isinstance(x, torch.Tensor):
            return x.to(device)
        if isinstance(x, tuple):
            return type(x)(*(move(t) for t in x))
        if x is not None and hasattr(x, "cos"):
            return dataclasses.replace(x, cos=x.cos.to(device), sin=x.sin.to(device))
        return x

    return {n: move(x) for n, x in args.items()}, want


def _decode(rec: Backend, a: dict):
    return rec.decode_attention(
        a["q"], a["pk"], a["pv"], a["ks"], a["vs"], a["fk"], a["fv"], scale=a["scale"],
        mask=a["mask"], fp_mask=a["fp_mask"], rope=a["rope"], k_positions=a["kpos"],
        fp_positions=a["fpos"],
    )


def _check(rec: Backend, case: str, device: str = "cpu") -> None:
    args, (want, want_lse) = _case(case, device)
    out, lse = _decode(rec, args)
    torch.testing.assert_close(out.cpu(), want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse.cpu(), want_lse, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("case", CASES)
def test_reference_decode_attention(case: str) -> None:
    _check(ref.BACKEND, case)


@pytest.mark.parametrize("cpp", (True, False), ids=("cpp", "eager"))
@pytest.mark.parametrize("case", CASES)
def test_torch_decode_attention(monkeypatch, case: str, cpp: bool) -> None:
    """Through the fused C++ call (built strictly: a build error fails) and the eager path."""
    if not cpp:
        monkeypatch.setenv("KVPOLICY_NO_CPP", "1")
    elif cpu_ext.compiler() is None:
        pytest.skip("no C++ compiler: the C++ path cannot be built here")
    else:
        monkeypatch.delenv("KVPOLICY_NO_CPP", raising=False)
        monkeypatch.setattr(cpu_ext, "load", cpu_ext.build)
    _check(torch_backend.BACKEND, case)


@pytest.mark.triton
@pytest.mark.parametrize("case", ("both-rope", "both-masked"))
def test_triton_decode_attention(case: str) -> None:
    _check(triton_backend.load(), case, triton_device())


def test_decode_attention_needs_a_segment() -> None:
    args, _ = _case("both-rope", "cpu")
    args.update(pk=None, pv=None, fk=None, fv=None)
    for rec in (ref.BACKEND, torch_backend.BACKEND):
        with pytest.raises(CacheError, match="segment"):
            _decode(rec, args)
