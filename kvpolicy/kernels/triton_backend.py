"""The Triton backend's record: Triton kernels for quantize and the packed segment.

The Triton kernel modules are imported when :func:`load` is called, never when this module
is: ``triton.jit`` decides between a compiled and an interpreted kernel from
``TRITON_INTERPRET`` when a kernel module is imported, so importing ``kvpolicy`` must not
fix that choice. :func:`load` raises ``ImportError`` when they cannot be imported
(:func:`kvpolicy.kernels.backend.select` turns that into a fallback or a clear error).

Pieces without a Triton kernel of their own use the torch backend's functions (on the
tensors' device), as the runtime always has: ``dequantize``, ``apply_rope``,
``merge_partials`` (``merge_partials_lse``), and ``attention_partial`` for the
full-precision segment (sinks and residual window). ``triton_attention.attention_partial``
(the packed kernel over 16-bit specs) exists, but the decode step keeps that short segment
in torch.
"""

from __future__ import annotations

from . import torch_backend
from .contract import Backend, compose_decode

__all__ = ["load"]


def load() -> Backend:
    """The Triton backend's record (imports the Triton kernels; raises ``ImportError``)."""
    # Imported here, not at module level: see the module docstring.
    from . import triton_attention, triton_quant

    packed = triton_attention.packed_attention_partial
    return Backend(
        name="triton",
        quantize=triton_quant.quantize,
        dequantize=torch_backend.dequantize,
        attention_partial=torch_backend.attention_partial,
        packed_attention_partial=packed,
        apply_rope=torch_backend.apply_rope,
        merge_partials=torch_backend.merge_partials_lse,
        decode_attention=compose_decode(
            packed_attention_partial=packed,
            attention_partial=torch_backend.attention_partial,
            apply_rope=torch_backend.apply_rope,
            merge_partials=torch_backend.merge_partials_lse,
        ),
    )
