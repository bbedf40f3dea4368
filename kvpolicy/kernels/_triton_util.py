"""What the Triton kernel modules share about how Triton runs here."""

from __future__ import annotations

import os

import triton


def interpreting() -> bool:
    """True when Triton runs in interpreter mode (decided, like ``triton.jit``, at import)."""
    knobs = getattr(triton, "knobs", None)  # triton >= 3.4
    if knobs is not None:
        return bool(knobs.runtime.interpret)
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


def compile_ahead(
    kernel,
    ints: dict,
    ptrs: dict,
    consts: dict,
    *,
    floats: tuple[str, ...] = (),
    target=None,
    num_warps: int = 4,
    num_stages: int = 2,
):
    """Compile ``kernel`` ahead of time (no GPU needed) with the argument specialisation the
    runtime would pick: ints equal to 1 become constants, pointers and ints that are
    multiples of 16 carry divisibility 16. ``target`` defaults to sm_90 (H100/H200).

    Args:
        ints: value of every integer argument; ptrs: Triton pointer type of every pointer
        argument (``"*fp16"``); consts: constexpr values; floats: fp32 scalar arguments.
    """
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.runtime.jit import JITFunction

    fn = kernel
    while not isinstance(fn, JITFunction):  # unwrap autotune / heuristics
        fn = fn.fn
    consts = dict(consts)
    sig, attrs = {}, {}
    for i, name in enumerate(fn.arg_names):
        if name in consts:
            sig[name] = "constexpr"
        elif name in ptrs:
            sig[name] = ptrs[name]
            attrs[(i,)] = [["tt.divisibility", 16]]
        elif name in floats:
            sig[name] = "fp32"
        elif ints[name] == 1:
            sig[name] = "constexpr"
            consts[name] = 1
        else:
            sig[name] = "i32"
            if ints[name] % 16 == 0:
                attrs[(i,)] = [["tt.divisibility", 16]]
    src = ASTSource(fn, sig, consts, attrs)
    target = target if target is not None else GPUTarget("cuda", 90, 32)
    return triton.compile(src, target=target,
                          options=dict(num_warps=num_warps, num_stages=num_stages))
