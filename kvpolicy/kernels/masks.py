"""Attention masks in the one form every kernel takes: additive fp32, ``-inf`` hides a key."""

from __future__ import annotations

import torch

__all__ = ["causal_mask", "mask_rows", "none_if_open", "to_additive"]


def causal_mask(
    tq: int, tk: int, device: torch.device | str | None = None, *, rows: range | None = None
) -> torch.Tensor:
    """``[tq, tk]`` additive fp32 mask of ``tq`` queries that are the last ``tq`` of ``tk``
    tokens: query ``i`` sees key ``j`` iff ``j <= tk - tq + i`` (a prefill: ``tq == tk``).

    ``rows``: only those query rows, ``[len(rows), tk]`` (one block of a long query, so that
    no ``[tq, tk]`` mask is built).
    """
    rows = range(tq) if rows is None else rows
    i = torch.arange(rows.start, rows.stop, device=device)[:, None]
    j = torch.arange(tk, device=device)[None, :]
    hidden = j > tk - tq + i
    return torch.zeros(len(rows), tk, device=device).masked_fill_(hidden, float("-inf"))


def to_additive(mask: torch.Tensor, device: torch.device | str | None = None) -> torch.Tensor:
    """A bool mask (True = attend) or an additive float mask, as additive fp32 on ``device``
    (default: the mask's own)."""
    device = mask.device if device is None else device
    if mask.dtype == torch.bool:
        return torch.where(mask.to(device), torch.zeros((), device=device), float("-inf"))
    return mask.to(device, torch.float32)


def mask_rows(
    mask: torch.Tensor | None, causal: bool, rows: range, tq: int, tk: int,
    device: torch.device | str | None = None,
) -> torch.Tensor | None:
    """Additive fp32 mask of query rows ``rows`` (of ``tq``) over ``tk`` keys, or None.

    ``mask``: a bool or additive mask ``[..., tq | 1, tk]`` (only the block is converted);
    else :func:`causal_mask` rows when ``causal`` and ``tq > 1``, else None (a single query
    at the end sees every key).
    """
    if mask is not None:
        return to_additive(mask if mask.shape[-2] == 1 else mask[..., rows.start : rows.stop, :],
                           device)
    if not causal or tq == 1:
        return None
    return causal_mask(tq, tk, device, rows=rows)[None, None]


def none_if_open(mask: torch.Tensor | None) -> torch.Tensor | None:
    """None for an additive mask that hides nothing (lets kernels skip the mask read)."""
    if mask is None or mask.numel() == 0:
        return mask
    return None if bool((mask == 0).all()) else mask
