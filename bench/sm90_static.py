"""Static cost of the fused decode kernel on sm_90, measured without a GPU.

Compiles ``_packed_attention_kernel`` ahead of time for an H100/H200 target (ptxas ships
with the triton wheel) with the argument specialisation the runtime would pick for the
decode shapes of ``bench/gpu_attention.py``, for every autotune config the prune filter
keeps, and prints registers, spill stack, shared memory and the SASS instructions of
the key loop per key (all threads of a program together). These figures back the NOTE
comments in ``kvpolicy/kernels/triton_attention.py``; timings need
``bench/gpu_attention.py`` on a GPU.

Run from the repository root without TRITON_INTERPRET:
``PYTHONPATH=. python bench/sm90_static.py`` (about a minute on 2 cores); ``--meta8``
compiles the same policy with 8-bit metadata (uint8 scale indices read through the fp32
scale table, int8 zero points: ``K_M8``/``V_M8``).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile

if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
    print("bench/sm90_static.py compiles real kernels: unset TRITON_INTERPRET and rerun.")
    sys.exit(0)

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402

from kvpolicy.kernels import triton_attention as ta
from kvpolicy.kernels._triton_util import compile_ahead  # noqa: E402

TARGET = GPUTarget("cuda", 90, 32)
CUOBJDUMP = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
G, BITS, T, SPLIT = 32, 2, 32768, 4096
# (name, query heads, kv heads, head_dim)
SHAPES = (("SmolLM2-135M", 9, 3, 64), ("Llama-3-8B", 32, 8, 128))


def _args(hq: int, hkv: int, d: int, meta8: bool = False) -> tuple[dict, dict, dict]:
    """(int args, pointer types, constexprs) of a 2-bit kvpolicy-2 decode call (with
    8-bit metadata on keys and values when ``meta8``)."""
    ng, vb = T // G, d * BITS // 8
    kb = G * BITS // 8
    ints = dict(
        n_kv_heads=hkv, n_rows=hq // hkv, q_len=1, kv_len=T, split_len=SPLIT,
        n_splits=T // SPLIT, rows_bucket=triton.next_power_of_2(hq // hkv), split_bucket=SPLIT,
        sq_b=hq * d, sq_h=d, sq_t=d, sq_d=1,
        skc_b=hkv * ng * kb * d, skc_h=ng * kb * d, skc_0=kb * d, skc_1=d, skc_2=1,
        sks_b=hkv * ng * d, sks_h=ng * d, sks_0=d, sks_1=1,
        svc_b=hkv * T * vb, svc_h=T * vb, svc_0=vb, svc_1=1, svc_2=0,
        svs_b=hkv * T * d // G, svs_h=T * d // G, svs_0=d // G, svs_1=1,
        sp_b=0, sp_t=1, sr_p=d, sr_d=1, sm_b=0, sm_h=0, sm_q=0, sm_k=0,
    )
    ptrs = dict(
        q_ptr="*fp16", kc_ptr="*u8", ks_ptr="*fp16", kz_ptr="*fp16", vc_ptr="*u8",
        vs_ptr="*fp16", vz_ptr="*fp16", pos_ptr="*i64", cos_ptr="*fp16", sin_ptr="*fp16",
        mask_ptr="*fp16", out_ptr="*fp32", lse_ptr="*fp32",
    )
    consts = dict(
        GQA=hq // hkv, DK=d, DV=d, K_BITS=BITS, K_GROUP=G, K_CHANNEL=True, V_BITS=BITS,
        V_GROUP=G, V_CHANNEL=False, K_FAST=True, V_FAST=True, ROPE=1, ROT_DIM=d,
        HAS_MASK=False, SOFTCAP=False, DOT_F32=False, MATH_F16=True, BLOCK_M=16, BLOCK_R=d // 2,
        BLOCK_P=16, BLOCK_DV=d,
    )
    if meta8:
        ptrs.update(ks_ptr="*u8", kz_ptr="*i8", vs_ptr="*u8", vz_ptr="*i8", stab_ptr="*fp32")
        consts.update(K_M8=True, V_M8=True)
    return ints, ptrs, consts


def _compile(ints: dict, ptrs: dict, consts: dict, config) -> object:
    """Compile with the runtime's specialisation for one autotune config."""
    return compile_ahead(ta._packed_attention_kernel, ints, ptrs, {**consts, **config.kwargs},
                         floats=("scale", "softcap"), target=TARGET, num_warps=config.num_warps,
                         num_stages=config.num_stages)


def _sass_report(kernel, block_n: int, num_warps: int) -> tuple[int, int, int | None]:
    """(registers, spill stack bytes, loop thread-instructions per key or None)."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        usage = subprocess.run([CUOBJDUMP, "--dump-resource-usage", f.name],
                               capture_output=True, text=True, check=True).stdout
        sass = subprocess.run([CUOBJDUMP, "-sass", f.name],
                              capture_output=True, text=True, check=True).stdout
    m = re.search(r"REG:(\d+) STACK:(\d+)", usage)
    regs, stack = int(m.group(1)), int(m.group(2))
    addrs = [int(a, 16) for a in re.findall(r"^\s+/\*([0-9a-f]{4,})\*/", sass, re.M)]
    loop = None  # the longest backward branch is the key loop
    for line in sass.splitlines():
        a = re.match(r"\s+/\*([0-9a-f]{4,})\*/.*BRA\s+0x([0-9a-f]+)", line)
        if a and int(a.group(2), 16) < int(a.group(1), 16):
            lo, hi = int(a.group(2), 16), int(a.group(1), 16)
            n = sum(lo <= x <= hi for x in addrs)
            loop = n if loop is None or n > loop else loop
    per_key = None if loop is None else loop * 32 * num_warps // block_n
    return regs, stack, per_key


def main() -> int:
    meta8 = "--meta8" in sys.argv[1:]
    meta = "8-bit (uint8 index, int8 point)" if meta8 else "fp16"
    print(f"sm_90 AOT compile (triton {triton.__version__}), 2-bit K per-channel pre-RoPE + "
          f"2-bit V per-token, G={G}, fp16, {meta} metadata, one decode query")
    head = f"{'shape':<13} {'BLOCK_N':>7} {'warps':>5} {'stages':>6} {'regs':>4} " \
           f"{'spill_B':>7} {'smem_KB':>7} {'thread-instr/key':>16}"
    print(head)
    print("-" * len(head))
    for name, hq, hkv, d in SHAPES:
        ints, ptrs, consts = _args(hq, hkv, d, meta8)
        kept = ta._keep_attention_config(ta._ATTENTION_CONFIGS, ints, **consts)
        for cfg in kept:
            k = _compile(ints, ptrs, consts, cfg)
            regs, stack, per_key = _sass_report(k, cfg.kwargs["BLOCK_N"], cfg.num_warps)
            print(f"{name:<13} {cfg.kwargs['BLOCK_N']:>7} {cfg.num_warps:>5} "
                  f"{cfg.num_stages:>6} {regs:>4} {stack:>7} {k.metadata.shared / 1024:>7.1f} "
                  f"{per_key if per_key is not None else '?':>16}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
