"""kvpolicy's packing kernel as a ``torch.library`` custom op, ``kvpolicy::quantize``.

``quantize(x, bits, group_size, axis, dtype, backend)`` packs ``x [B, H, T, D]`` with the
quantize function of the backend :func:`kvpolicy.kernels.backend.select` picks for ``x``'s
device, and returns the fields of :class:`~kvpolicy.kernels.layout.Packed`
``(codes, scale, zero)``. As an op it has a schema and a fake implementation that
computes the shapes and dtypes of the packed layout (:mod:`kvpolicy.kernels.layout`)
without running a kernel, so that ``torch.compile``, ``torch.export`` and
``FakeTensorMode`` see through a packing call without tracing the backend's Python.

A :class:`~kvpolicy.kernels.layout.QuantSpec` is a Python object, which an op cannot
take: its fields are the op's ``bits``, ``group_size``, ``axis``, ``levels`` and
``meta_bits`` arguments and
the real implementation rebuilds it (``QuantSpec`` validates them, so a bad spec is the
same :class:`~kvpolicy.errors.CacheError` as without the op).

The compiled model's cache does not call this op: its decode step is the one opaque op
``kvpolicy::attend`` (``runtime.ops``), inside which packing runs eagerly, so routing it
through ``kvpolicy::quantize`` would change no graph. The op is for a step that is
decomposed into ops (a CUDA-graph capture, a packing call in user code).
"""

from __future__ import annotations

import torch

from ..errors import CacheError
from .backend import select
from .layout import Packed, QuantSpec

__all__ = ["packed_shapes", "quantize", "quantize_packed"]


def packed_shapes(
    shape: tuple, spec: QuantSpec
) -> tuple[tuple, tuple]:
    """``(codes shape, scale/zero shape)`` of ``x`` of ``shape [B, H, T, D]`` packed by
    ``spec``, as the module docstring of :mod:`kvpolicy.kernels.layout` lays them out;
    :class:`CacheError` for a shape the spec cannot pack (the message of the kernels)."""
    if len(shape) != 4:
        raise CacheError(f"quantize input must be [B, H, T, D], got shape {tuple(shape)}")
    b, h, t, d = shape
    if spec.full_precision:
        return (b, h, t, d), (0,)
    g, bits = spec.group_size, spec.bits
    if spec.axis == "channel":
        if t % g != 0:
            raise CacheError(
                f"per-channel quantization needs whole token groups: T={t} is not a "
                f"multiple of group_size={g}; keep the remainder in the residual window"
            )
        return (b, h, t // g, g * bits // 8, d), (b, h, t // g, d)
    if d % g != 0:
        raise CacheError(
            f"per-token quantization needs whole channel groups: head_dim={d} is not a "
            f"multiple of group_size={g}; use a group_size that divides {d}"
        )
    return (b, h, t, d * bits // 8), (b, h, t, d // g)


@torch.library.custom_op("kvpolicy::quantize", mutates_args=())
def quantize(
    x: torch.Tensor, bits: int, group_size: int, axis: str, dtype: torch.dtype | None = None,
    backend: str = "auto", levels: str = "uniform", meta_bits: int = 16, fit: str = "minmax",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(codes, scale, zero)`` of ``x [B, H, T, D]`` packed with ``bits``/``group_size``
    along ``axis`` (``"channel"`` or ``"token"``) with ``levels`` (``"uniform"`` or
    ``"normal"``, :mod:`kvpolicy.kernels.layout`) by ``backend`` (one of
    :data:`kvpolicy.kernels.backend.BACKENDS`); scale and zero (and, at 16 bits, the plain
    tensor in ``codes``) in ``dtype``, default ``x``'s, or with ``meta_bits=8`` a uint8
    scale index and an int8 zero point (``fit``: how the 8-bit grid is fitted). At 16 bits
    scale and zero are empty.
    """
    spec = QuantSpec(bits, group_size, axis, levels, meta_bits, fit)  # type: ignore[arg-type]
    codes, scale, zero = select(backend, x.device).quantize(x, spec, dtype)
    if spec.full_precision:
        # The kernels return x itself (x.to(dtype) of the same dtype) and one empty tensor
        # for both scale and zero; an op's outputs may alias neither its inputs nor each
        # other.
        store = x.dtype if dtype is None else dtype
        codes = codes.clone() if codes is x else codes
        scale, zero = x.new_empty(0, dtype=store), x.new_empty(0, dtype=store)
    return codes, scale, zero


@quantize.register_fake
def _quantize_fake(
    x: torch.Tensor, bits: int, group_size: int, axis: str, dtype: torch.dtype | None = None,
    backend: str = "auto", levels: str = "uniform", meta_bits: int = 16, fit: str = "minmax",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    spec = QuantSpec(bits, group_size, axis, levels, meta_bits, fit)  # type: ignore[arg-type]
    store = x.dtype if dtype is None else dtype
    codes_shape, scale_shape = packed_shapes(tuple(x.shape), spec)
    codes_dtype = store if spec.full_precision else torch.uint8
    scale_dtype, zero_dtype = (torch.uint8, torch.int8) if spec.meta8 else (store, store)
    return (x.new_empty(codes_shape, dtype=codes_dtype),
            x.new_empty(scale_shape, dtype=scale_dtype),
            x.new_empty(scale_shape, dtype=zero_dtype))


def quantize_packed(
    x: torch.Tensor, spec: QuantSpec, dtype: torch.dtype | None = None, backend: str = "auto"
) -> Packed:
    """:func:`quantize` with a ``QuantSpec``, as a :class:`Packed` (the backends' contract,
    ``kernels.contract.Quantize``, through the op). The op's schema has no per-channel
    widths: a spec with ``widths`` is refused rather than packed at one width."""
    if spec.widths is not None or spec.codebook is not None:
        what = "per-channel widths" if spec.widths is not None else "a codebook"
        raise CacheError(
            f"kvpolicy::quantize takes no tensor-specific tables and this spec has {what}; "
            "pack it with the backend's quantize "
            "(kvpolicy.kernels.backend.select(backend, x.device).quantize(x, spec, dtype))"
        )
    return Packed(*quantize(x, spec.bits, spec.group_size, spec.axis, dtype, backend,
                            spec.levels, spec.meta_bits, spec.fit))
