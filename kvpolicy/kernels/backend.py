"""Which kernels a packed cache runs: the backend names a user may pass, and the choice.

:func:`select` maps a name and a device to one :class:`~kvpolicy.kernels.contract.Backend`
record; a caller chooses once per device and then calls only that record's functions.
"""

from __future__ import annotations

import logging

import torch

from ..errors import CacheError
from . import torch_backend, triton_backend
from .contract import Backend

__all__ = ["BACKENDS", "Backend", "check_name", "select"]

log = logging.getLogger(__name__)

# "auto": Triton for CUDA tensors, the torch backend (vectorised torch + fused C++) else.
BACKENDS: tuple[str, ...] = ("auto", "torch", "triton")


def check_name(backend: str) -> None:
    """Raise :class:`CacheError` naming the choices unless ``backend`` is one of them."""
    if backend not in BACKENDS:
        raise CacheError(f"backend={backend!r} is not one of {BACKENDS}")


def select(backend: str, device: torch.device) -> Backend:
    """The record of ``backend`` (one of :data:`BACKENDS`) for tensors on ``device``.

    ``"auto"`` is Triton on CUDA, the torch backend elsewhere. When the Triton kernels fail
    to import, ``"auto"`` logs a warning and returns the torch backend; ``"triton"``
    raises :class:`CacheError`.
    """
    check_name(backend)
    use_triton = backend == "triton" or (backend == "auto" and device.type == "cuda")
    if not use_triton:
        return torch_backend.BACKEND
    try:
        return triton_backend.load()
    except ImportError as e:  # the Triton half may be missing on this install
        if backend == "triton":
            raise CacheError(
                f"backend='triton' needs kvpolicy.kernels.triton_attention and "
                f"triton_quant, which failed to import ({e}); use backend='torch'"
            ) from e
        log.warning("Triton kernels unavailable (%s); using the torch backend", e)
        return torch_backend.BACKEND
