"""A fused C++ CPU kernel for decode attention over the packed cache, loaded through ctypes.

One call covers one softmax over a packed segment and (optionally) a full-precision
segment (sinks + residual window). Per group of G tokens it unpacks the key codes of all
channels into a small fp32 tile (L1-resident), rotates them at their positions, and
scores them against every query row of the GQA group; values are then dequantized
TB=8 token rows at a time and accumulated into registers. Tokens are split into chunks
(work items) processed in parallel, each producing ``(max, sum, unnormalised out)`` per
row, merged by log-sum-exp at the end. Each packed byte is read once per call; no
dequantized cache is ever materialised.

Covered (everything else falls back to the eager torch path): key axis "channel" and
value axis "token", bits in {1, 2, 3, 4, 8} each, uniform or normal levels for keys and
values each (a normal spec's code is looked up in its level table, passed as fp32),
16- or 8-bit metadata for keys and values each (``QuantSpec.meta_bits``; 8: a uint8 scale
index read through :func:`~kvpolicy.kernels.layout.scale_table`, passed as fp32, and an
int8 zero point, zero ``= -point * scale / 4``), vector-quantized values (levels ``"vq"``
at 1 or 2 bits: each byte indexes the kv head's centroids, passed as fp32, times the
group's scale), no RoPE or rotate_half / interleaved, with or
without logit soft-capping (a run-time field, not a ``-D``: no extra libraries).
Queries are passed as pre-scaled fp32; 16-bit-metadata scales and zeros and full-precision
tokens in their storage dtype (fp32, bf16 or fp16), widened inside the kernel; 8-bit
metadata as stored (uint8 / int8).

The C++ source is ``cpu_ext.cpp`` next to this module. Each library is specialised by
``-D`` (bits, group sizes, head dims, rotary width, storage dtype, level table or not,
8-bit metadata or not, VQ values or not) so every inner loop has a compile-time trip
count, a uniform spec runs no table lookup and 16-bit metadata reads no scale table, and is
built with the C++ compiler (:func:`compiler`) on first use into
``~/.cache/kvpolicy/cpu_ext/<hash>-<config>/`` (the hash covers the source, the flags and
the CPU's feature flags, because of ``-march=native``).

Each library exports four functions: ``kvp_packed_attention`` (one softmax over the
segments it is handed, :class:`Params`), ``kvp_paged_step`` (one whole decode step of
one layer over a paged cache, :class:`Step`: the new tokens' keys rotated back to pre-RoPE
and their values rotated, both written to their block's stage, then the attention above
over sinks, packed pages and stage, with visibility computed from the sequence lengths and
the output rotated back into the engine's rows, then the chunks the step completed packed
into their blocks; :mod:`kvpolicy.kernels.cpu_step`) and ``kvp_pack_chunks`` (whole chunks
quantized and packed into blocks, what a prefill appends), both packing with the torch
quantizer's arithmetic for uniform levels, and ``kvp_layer_step`` (one decode step of one
transformers layer, :class:`LStep`: the new key and value written into the layer's
full-precision buffer of sinks and residual, the attention over sinks, packed body and
residual under the model's mask and window, the output rotated back;
:mod:`kvpolicy.runtime.layer_step`).

Two entry points: :func:`build` raises :class:`BuildError` with the compiler's output when
a library cannot be built (what the tests call); :func:`load`, what the torch backend
calls, turns any failure into ``None`` (the eager path runs) and logs the reason once at
warning level.
"""

# NOTE: a plain shared library through ctypes rather than torch.utils.cpp_extension (not
# tried): no torch/pybind headers to compile, ctypes releases the GIL during the call. One
# specialised library builds in ~1 s; one library with all 25 bit-width pairs instantiated
# took 27 s, hence one library per spec.

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
import threading
from functools import cache
from pathlib import Path

__all__ = ["STEP_ERRORS", "BuildError", "LStep", "Params", "Step", "compiler", "build", "load"]

log = logging.getLogger(__name__)

_SOURCE_FILE = Path(__file__).with_name("cpu_ext.cpp")


class BuildError(RuntimeError):
    """The C++ kernel library could not be built or loaded (the message says why; for a
    compile error it carries the compiler's output)."""


@cache
def _source() -> str:
    try:
        return _SOURCE_FILE.read_text()
    except OSError as e:
        raise BuildError(f"the kernel source {_SOURCE_FILE} cannot be read ({e})") from e


# NOTE: no -ffast-math: it implies -ffinite-math-only and the kernel relies on -inf for
# hidden keys. Reassociation alone lets gcc vectorise the dot-product reductions.
_FLAGS = [
    "-O3", "-march=native", "-fno-math-errno", "-fno-trapping-math", "-fassociative-math",
    "-fno-signed-zeros", "-std=c++17", "-shared", "-fPIC", "-pthread", "-fopenmp",
]


class Params(ctypes.Structure):
    """Mirror of the C ``Params`` struct (same field order)."""

    _fields_ = [
        (name, ctypes.c_int64)
        for name in ("B", "Hkv", "rep", "Tq", "Dk", "Dv", "Tk", "Gk", "Gv", "chunk", "nthreads")
    ] + [
        ("q", ctypes.c_void_p),
        ("kc", ctypes.c_void_p), ("kc_sb", ctypes.c_int64), ("kc_sh", ctypes.c_int64),
        ("ks", ctypes.c_void_p), ("ks_sb", ctypes.c_int64), ("ks_sh", ctypes.c_int64),
        ("kz", ctypes.c_void_p), ("kz_sb", ctypes.c_int64), ("kz_sh", ctypes.c_int64),
        ("vc", ctypes.c_void_p), ("vc_sb", ctypes.c_int64), ("vc_sh", ctypes.c_int64),
        ("vs", ctypes.c_void_p), ("vs_sb", ctypes.c_int64), ("vs_sh", ctypes.c_int64),
        ("vz", ctypes.c_void_p), ("vz_sb", ctypes.c_int64), ("vz_sh", ctypes.c_int64),
        ("mask", ctypes.c_void_p), ("m0", ctypes.c_int64), ("m1", ctypes.c_int64),
        ("m2", ctypes.c_int64), ("m3", ctypes.c_int64),
        ("kpos", ctypes.c_void_p), ("kpos_sb", ctypes.c_int64),
        ("Tf", ctypes.c_int64),
        ("fk", ctypes.c_void_p), ("fk_sb", ctypes.c_int64), ("fk_sh", ctypes.c_int64),
        ("fv", ctypes.c_void_p), ("fv_sb", ctypes.c_int64), ("fv_sh", ctypes.c_int64),
        ("fmask", ctypes.c_void_p), ("f0", ctypes.c_int64), ("f1", ctypes.c_int64),
        ("f2", ctypes.c_int64), ("f3", ctypes.c_int64),
        ("fpos", ctypes.c_void_p), ("fpos_sb", ctypes.c_int64),
        ("cosc", ctypes.c_void_p), ("sinc", ctypes.c_void_p),
        ("half", ctypes.c_int64), ("rope_style", ctypes.c_int64),
        ("rope_rs", ctypes.c_int64),
        ("sdt", ctypes.c_int64),
        ("out", ctypes.c_void_p), ("lse", ctypes.c_void_p),
        ("softcap", ctypes.c_float),
        ("klut", ctypes.c_void_p), ("vlut", ctypes.c_void_p),
        ("stab", ctypes.c_void_p),
        ("kwid", ctypes.c_void_p),
        ("btab", ctypes.c_void_p), ("btab_sb", ctypes.c_int64), ("bsz", ctypes.c_int64),
        ("vcb", ctypes.c_void_p),
        ("plo", ctypes.c_void_p), ("phi", ctypes.c_void_p),
        ("ppos0", ctypes.c_int64), ("rope_off", ctypes.c_int64),
    ]


class Step(ctypes.Structure):
    """Mirror of the C ``Step`` struct: one fused decode step of one layer over paged
    pages (``kvp_paged_step``; :class:`~kvpolicy.runtime.paged.PagedKV` fills it)."""

    _fields_ = [
        ("pages", ctypes.c_void_p),
        *[(n, ctypes.c_int64) for n in (
            "page_bytes", "num_blocks", "bs", "C", "sinks", "window", "stage_k", "stage_v",
            "sink_k", "sink_v", "rope_rows")],
        ("rot", ctypes.c_void_p),
        ("scale", ctypes.c_float),
        ("edt", ctypes.c_int64),
        ("B", ctypes.c_int64),
        ("seq_len", ctypes.c_void_p),
        ("btab", ctypes.c_void_p), ("btab_sb", ctypes.c_int64), ("btab_n", ctypes.c_int64),
        ("q", ctypes.c_void_p), ("q_rs", ctypes.c_int64), ("q_hs", ctypes.c_int64),
        ("k", ctypes.c_void_p), ("k_rs", ctypes.c_int64), ("k_hs", ctypes.c_int64),
        ("v", ctypes.c_void_p), ("v_rs", ctypes.c_int64), ("v_hs", ctypes.c_int64),
        ("out", ctypes.c_void_p), ("o_rs", ctypes.c_int64), ("o_hs", ctypes.c_int64),
        ("nthreads", ctypes.c_int64), ("threads_from", ctypes.c_int64),
        ("pack", ctypes.c_int64), ("kfit", ctypes.c_int64), ("vfit", ctypes.c_int64),
    ]


class LStep(ctypes.Structure):
    """Mirror of the C ``LStep`` struct: one decode step of one transformers layer
    (``kvp_layer_step``; :class:`~kvpolicy.runtime.layer_step.LayerStep` fills it)."""

    _fields_ = [
        ("q", ctypes.c_void_p), ("q_bs", ctypes.c_int64), ("q_hs", ctypes.c_int64),
        ("k", ctypes.c_void_p), ("k_bs", ctypes.c_int64), ("k_hs", ctypes.c_int64),
        ("v", ctypes.c_void_p), ("v_bs", ctypes.c_int64), ("v_hs", ctypes.c_int64),
        ("out", ctypes.c_void_p), ("o_bs", ctypes.c_int64), ("o_hs", ctypes.c_int64),
        ("edt", ctypes.c_int64),
        ("scale", ctypes.c_float),
        ("rot", ctypes.c_void_p),
        ("at", ctypes.c_int64),
        ("fpos", ctypes.c_void_p),
        ("newpos", ctypes.c_int64),
        ("ns", ctypes.c_int64),
        ("plo", ctypes.c_int64),
        ("mask", ctypes.c_void_p), ("mask_bs", ctypes.c_int64), ("mask_n", ctypes.c_int64),
        ("mask_inv", ctypes.c_int64),
        ("nthreads", ctypes.c_int64), ("threads_from", ctypes.c_int64),
    ]


# What kvp_paged_step's non-zero returns mean (the caller raises CacheError with it).
STEP_ERRORS = {
    1: "the CPU kernel was built for another spec",
    2: "a sequence of the step holds no token",
    3: "a sequence's block table has no block for its new token",
    4: "a position is past the rotary table",
    5: "a block table names a block outside the pages",
    6: "q/k/v/out are not float32, bfloat16 or float16",
    7: "a chunk's token offset is not a whole chunk inside its block",
    8: "a new key or value holds NaN or Inf",
}


_lock = threading.Lock()
_libs: dict[tuple[int, ...], ctypes.CDLL | None] = {}
_warned: set[str] = set()


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return ""


_DEFINES = ("KVP_KB", "KVP_VB", "KVP_GK", "KVP_GV", "KVP_DK", "KVP_DV", "KVP_HALF", "KVP_SDT",
            "KVP_KLUT", "KVP_VLUT", "KVP_KM8", "KVP_VM8", "KVP_VVQ")
# Defines from KVP_VVQ on are left out of a library's directory name while 0, so that a
# configuration named without them (12 numbers) is the same library as with them at 0.
_NAMED = 12


def _build_dir(config: tuple[int, ...]) -> Path:
    key = hashlib.sha256((_source() + " ".join(_FLAGS) + _cpu_flags()).encode()).hexdigest()[:16]
    root = Path(os.environ.get("KVPOLICY_CACHE_DIR", Path.home() / ".cache" / "kvpolicy"))
    named = list(config)
    while len(named) > _NAMED and named[-1] == 0:
        named.pop()
    return root / "cpu_ext" / f"{key}-{'-'.join(map(str, named))}"


def compiler() -> str | None:
    """The C++ compiler the kernel is built with: ``$CXX`` if set, else ``g++``, else
    ``c++``, resolved on ``PATH``; None when it is not installed."""
    cxx = os.environ.get("CXX")
    if cxx:
        return shutil.which(cxx)
    return shutil.which("g++") or shutil.which("c++")


def build(
    kbits: int, vbits: int, gk: int, gv: int, dk: int, dv: int, half: int = 0, sdt: int = 0,
    klut: int = 0, vlut: int = 0, km8: int = 0, vm8: int = 0, vvq: int = 0,
) -> ctypes.CDLL:
    """The kernel library for these bits, group sizes, head dims, rotary half-width (0: no
    RoPE), storage type of 16-bit-metadata scales/zeros and of fp tokens (0 fp32, 1 bf16,
    2 fp16), levels of keys / values (``klut``/``vlut`` 1: a level table,
    ``Params.klut``/``vlut``, is looked up; 0: uniform, the code is its own value) and
    metadata width of keys / values (``km8``/``vm8`` 1: 8-bit, a uint8 scale index into
    ``Params.stab`` and an int8 zero point; 0: 16-bit, in the storage type) and
    vector-quantized values (``vvq`` = d, the channels per code byte, ``8 // vbits``:
    ``Params.vcb`` holds the centroids; 0: none, ``vlut`` then says how codes read),
    compiled on first use and kept on disk.

    Raises:
        BuildError: no compiler is installed, the compiler failed (the message carries its
            output), or the library does not load.
    """
    config = (kbits, vbits, gk, gv, dk, dv, half, sdt, klut, vlut, km8, vm8, vvq)
    out = _build_dir(config)
    so = out / "libkvpolicy_cpu.so"
    if not so.exists():
        cxx = compiler()
        if cxx is None:
            raise BuildError("no C++ compiler (g++) on PATH")
        try:
            out.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryDirectory(dir=out) as tmp:
                src = Path(tmp) / "kernel.cpp"
                src.write_text(_source())
                tmp_so = Path(tmp) / "lib.so"
                defines = [f"-D{n}={v}" for n, v in zip(_DEFINES, config, strict=True)]
                cmd = [cxx, *_FLAGS, *defines, str(src), "-o", str(tmp_so)]
                proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
                if proc.returncode != 0:  # a compiler without OpenMP: the kernel's own threads
                    plain = subprocess.run([c for c in cmd if c != "-fopenmp"],
                                           capture_output=True, text=True, timeout=300)
                    if plain.returncode == 0:
                        log.warning("kvpolicy: %s cannot build the CPU kernel with OpenMP "
                                    "(%s); built it with threads of its own, which do not "
                                    "follow the engine's core binding: install the "
                                    "compiler's OpenMP runtime (libgomp) for torch's threads",
                                    cxx, proc.stderr.strip().splitlines()[-1:])
                    proc = plain
                if proc.returncode != 0:
                    raise BuildError(
                        f"{cxx} failed (exit {proc.returncode}) building the CPU kernel "
                        f"{' '.join(defines)}:\n{proc.stderr}"
                    )
                os.replace(tmp_so, so)  # atomic: concurrent builders never see a partial file
        except (OSError, subprocess.SubprocessError) as e:
            raise BuildError(f"building the CPU kernel with {cxx} failed: {e}") from e
        log.info("built the kvpolicy CPU kernel into %s", so)
    try:
        lib = ctypes.CDLL(str(so))
    except OSError as e:
        raise BuildError(f"the CPU kernel {so} does not load: {e}") from e
    lib.kvp_packed_attention.argtypes = [ctypes.POINTER(Params), ctypes.c_int, ctypes.c_int]
    lib.kvp_packed_attention.restype = ctypes.c_int
    lib.kvp_paged_step.argtypes = [ctypes.POINTER(Step), ctypes.POINTER(Params), ctypes.c_int,
                                   ctypes.c_int]
    lib.kvp_paged_step.restype = ctypes.c_int
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    lib.kvp_pack_chunks.argtypes = [ctypes.POINTER(Step), ctypes.POINTER(Params), ctypes.c_int,
                                    ctypes.c_int, ptr, i64, i64, i64, ptr, i64, i64, i64, i64,
                                    ptr, ptr]
    lib.kvp_pack_chunks.restype = ctypes.c_int
    lib.kvp_layer_step.argtypes = [ctypes.POINTER(LStep), ctypes.POINTER(Params), ctypes.c_int,
                                   ctypes.c_int]
    lib.kvp_layer_step.restype = ctypes.c_int
    return lib


def load(
    kbits: int, vbits: int, gk: int, gv: int, dk: int, dv: int, half: int = 0, sdt: int = 0,
    klut: int = 0, vlut: int = 0, km8: int = 0, vm8: int = 0, vvq: int = 0,
) -> ctypes.CDLL | None:
    """:func:`build`, or None if the library cannot be built: the caller then uses the
    eager path, and the reason is logged once at warning level. Cached per configuration.
    ``KVPOLICY_NO_CPP=1`` disables the kernel (None, nothing logged).
    """
    if os.environ.get("KVPOLICY_NO_CPP", "") not in ("", "0"):
        return None
    key = (kbits, vbits, gk, gv, dk, dv, half, sdt, klut, vlut, km8, vm8, vvq)
    if key in _libs:
        return _libs[key]
    with _lock:
        if key not in _libs:
            try:
                _libs[key] = build(*key)
            except Exception as e:  # noqa: BLE001 - any failure to build means: the eager path
                _libs[key] = None
                # Once per reason, not per configuration: a missing compiler is one message.
                if str(e) not in _warned:
                    _warned.add(str(e))
                    log.warning("kvpolicy CPU kernel unavailable (%s); using the eager torch "
                                "path", e)
    return _libs[key]
