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
tensors' device): ``dequantize``, ``apply_rope``, ``merge_partials``
(``merge_partials_lse``), and ``attention_partial`` for a full-precision segment attended
alone (``triton_attention.attention_partial``, the packed kernel over 16-bit specs,
exists; the runtime's decode step never calls this field).
"""

from __future__ import annotations

from . import torch_backend
from .contract import Backend

__all__ = ["load"]


def load() -> Backend:
    """The Triton backend's record (imports the Triton kernels; raises ``ImportError``)."""
    # Imported here, not at module level: see the module docstring.
    from . import triton_attention, triton_quant

    return Backend(
        name="triton",
        quantize=triton_quant.quantize,
        dequantize=torch_backend.dequantize,
        attention_partial=torch_backend.attention_partial,
        packed_attention_partial=triton_attention.packed_attention_partial,
        apply_rope=torch_backend.apply_rope,
        merge_partials=torch_backend.merge_partials_lse,
        decode_attention=triton_attention.decode_attention,
    )
