"""The Triton backend's record: Triton kernels for quantize, the packed segment and the
decode step.

The Triton kernel modules are imported when :func:`load` is called, never when this module
is: ``triton.jit`` decides between a compiled and an interpreted kernel from
``TRITON_INTERPRET`` when a kernel module is imported, so importing ``kvpolicy`` must not
fix that choice. :func:`load` raises ``ImportError`` when they cannot be imported
(:func:`kvpolicy.kernels.backend.select` turns that into a fallback or a clear error).
The decode kernel (:mod:`kvpolicy.kernels.triton_decode`) is reached through
``triton_attention``, which imports it: the lazily imported kernel modules are a fixed
list (tests/test_structure.py).

``decode_attention`` is :func:`kvpolicy.kernels.triton_decode.decode_attention`: the
packed body, the full-precision segment (sinks and residual window, rotated at its own
positions) and their merge in one kernel launch plus at most one small merge launch.
Pieces without a Triton kernel of their own use the torch backend's functions (on the
tensors' device): ``quantize`` of a spec with per-channel widths or a codebook and
``packed_attention_partial`` of keys with per-channel widths (:func:`_unless_read`),
``dequantize``, ``apply_rope``, ``merge_partials``
(``merge_partials_lse``), and ``attention_partial`` for a full-precision segment attended
alone (``triton_attention.attention_partial``, the packed kernel over 16-bit specs,
exists; the runtime's decode step never calls this field).
"""

from __future__ import annotations

import inspect
from typing import Any

import torch

from . import torch_backend
from .contract import Backend
from .layout import QuantSpec, RotarySpec

__all__ = ["load"]

# Variants already warmed in this process: a warm-up per layer would relaunch the same
# tiny kernels 30 times per prefill for a model whose layers share one policy.
_WARMED: set[tuple] = set()


def load() -> Backend:
    """The Triton backend's record (imports the Triton kernels; raises ``ImportError``)."""
    # Imported here, not at module level: see the module docstring.
    from . import triton_attention, triton_quant

    return Backend(
        name="triton",
        quantize=_unless_read(triton_quant.quantize, torch_backend.quantize, ("spec",)),
        dequantize=torch_backend.dequantize,
        attention_partial=torch_backend.attention_partial,
        packed_attention_partial=_unless_read(
            triton_attention.packed_attention_partial,
            torch_backend.packed_attention_partial, ("k_spec", "v_spec"), reads=("codebook",)),
        apply_rope=torch_backend.apply_rope,
        merge_partials=torch_backend.merge_partials_lse,
        decode_attention=triton_attention.decode_attention,
        warm_up=_warm_up,
    )


# The tables a QuantSpec may carry beyond its constexpr fields (layout.QuantSpec).
_TABLES = ("widths", "codebook")


def _unless_read(kernel: Any, fallback: Any, specs: tuple[str, ...],
                 reads: tuple[str, ...] = ()) -> Any:
    """``kernel``, except when one of its spec arguments (named ``specs``, passed by
    position or keyword) carries a table that ``kernel`` does not read (``reads``, among
    :data:`_TABLES`): then ``fallback``, the torch backend's function, on the same device.

    Per-channel key widths are read by the decode kernel only (``K_WID``): packing them
    and the packed-segment attention of such keys take the torch path (a gather and a
    scatter; dequantize, rotate, matmul). A codebook (vector-quantized values) is read by
    both attention kernels (``V_VQ``) but not by the Triton quantize: packing is the shared
    reference encoder (a matmul and an argmin), whose codes every backend must reproduce
    bit for bit."""
    names = list(inspect.signature(kernel).parameters)
    at = {name: names.index(name) for name in specs}
    unread = tuple(t for t in _TABLES if t not in reads)

    def call(*args: Any, **kwargs: Any) -> Any:
        for name, i in at.items():
            spec = args[i] if len(args) > i else kwargs.get(name)
            if spec is not None and any(getattr(spec, t) is not None for t in unread):
                return fallback(*args, **kwargs)
        return kernel(*args, **kwargs)

    call.__doc__, call.__name__ = kernel.__doc__, kernel.__name__
    return call


def _warm_up(
    key_spec: QuantSpec, value_spec: QuantSpec, *, n_kv_heads: int, gqa: int, head_dim: int,
    dtype: torch.dtype, device: torch.device, query_dtype: torch.dtype,
    rope: RotarySpec | None = None, softcap: float | None = None, **kwargs: Any,
) -> None:
    """``Backend.warm_up``: :func:`triton_decode.warm_up_decode` once per variant."""
    from . import triton_attention

    variant = (key_spec, value_spec, n_kv_heads, gqa, head_dim, dtype, str(device),
               query_dtype, None if rope is None else (rope.style, rope.rotary_dim,
                                                       rope.cos.dtype), softcap)
    if variant in _WARMED:
        return
    triton_attention.warm_up_decode(
        key_spec, value_spec, n_kv_heads=n_kv_heads, gqa=gqa, head_dim=head_dim, dtype=dtype,
        device=device, query_dtype=query_dtype, rope=rope, softcap=softcap, **kwargs)
    _WARMED.add(variant)
