"""Attention masks in the one form every kernel takes: additive fp32, ``-inf`` hides a key."""

from __future__ import annotations

import torch

__all__ = ["causal_mask", "to_additive"]


def causal_mask(tq: int, tk: int, device: torch.device | str | None = None) -> torch.Tensor:
    """``[tq, tk]`` additive fp32 mask of ``tq`` queries that are the last ``tq`` of ``tk``
    tokens: query ``i`` sees key ``j`` iff ``j <= tk - tq + i`` (a prefill: ``tq == tk``)."""
    i = torch.arange(tq, device=device)[:, None]
    j = torch.arange(tk, device=device)[None, :]
    hidden = j > tk - tq + i
    return torch.zeros(tq, tk, device=device).masked_fill_(hidden, float("-inf"))


def to_additive(mask: torch.Tensor, device: torch.device | str | None = None) -> torch.Tensor:
    """A bool mask (True = attend) or an additive float mask, as additive fp32 on ``device``
    (default: the mask's own)."""
    device = mask.device if device is None else device
    if mask.dtype == torch.bool:
        return torch.where(mask.to(device), torch.zeros((), device=device), float("-inf"))
    return mask.to(device, torch.float32)
