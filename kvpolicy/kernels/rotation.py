"""Orthogonal rotations of the head dim applied before quantization (a policy's
``rotation``).

A rotation ``R`` (``R Rᵀ = I``) spreads a few large channels over all of them, so a group's
min-max range is set by typical values rather than by an outlier; it costs no metadata. For
values it is exact and cheap: the cache stores ``v R`` for every token (packed or not), the
attention over them gives ``(Σ p v) R``, and the output is rotated back once per step,
``out = out' Rᵀ`` (``runtime.attend``). Keys are not rotated: their RoPE is re-applied
after dequantization, and a rotation of the head dim does not commute with it.

``hadamard``: Sylvester's Walsh-Hadamard matrix scaled by ``1/sqrt(n)``, its rows
multiplied by a fixed pseudo-random sign (seed 0), for a power-of-two ``n``.
"""

from __future__ import annotations

import functools
import math

import torch

from ..errors import CacheError

__all__ = ["ROTATIONS", "check_rotation", "rotation_matrix"]

ROTATIONS: tuple[str, ...] = ("none", "hadamard")


def check_rotation(name: str, n: int) -> None:
    """Raise ``CacheError`` for an unknown rotation or one that cannot rotate ``n`` channels."""
    if name not in ROTATIONS:
        raise CacheError(f"rotation {name!r} is not one of {', '.join(ROTATIONS)}")
    if name == "hadamard" and (n < 2 or n & (n - 1)):
        raise CacheError(
            f"a Hadamard rotation needs a power-of-two head_dim, got {n}; use rotation: none"
        )


@functools.lru_cache(maxsize=16)
def _hadamard(n: int, seed: int) -> torch.Tensor:
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    gen = torch.Generator().manual_seed(seed)
    signs = torch.randint(0, 2, (n,), generator=gen, dtype=torch.int64) * 2 - 1
    return (signs[:, None].double() * h / math.sqrt(n)).float()


def rotation_matrix(name: str, n: int, device=None, dtype=torch.float32) -> torch.Tensor | None:
    """The ``[n, n]`` orthogonal matrix of rotation ``name`` (None for ``"none"``)."""
    check_rotation(name, n)
    if name == "none":
        return None
    return _hadamard(n, 0).to(device=device, dtype=dtype)
