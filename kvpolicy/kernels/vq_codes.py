"""Vector-quantized values (``QuantSpec.levels == "vq"``): the one encoder and decoder.

The format is :mod:`kvpolicy.kernels.layout`'s ("Vector-quantized values"). Every backend
packs with :func:`vq_encode` (a nearest-centroid search is a matmul and an argmin; the
codes must be bit-identical everywhere), and :func:`vq_decode` is the reference the fused
kernels (``cpu_ext.cpp``'s value pass, ``triton_dequant.dequant_vq_rows``) are tested
against.
"""

from __future__ import annotations

import torch

from ..errors import CacheError
from .layout import VQ_ENTRIES, Packed, QuantSpec, scale_table

__all__ = ["vq_encode", "vq_decode"]


def _scale_table(device: torch.device) -> torch.Tensor:
    return torch.tensor(scale_table(), dtype=torch.float32, device=device)


def vq_encode(
    x: torch.Tensor, spec: QuantSpec, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Codes, scale and (empty) zero of ``x [B, H, T, D]`` by the vector-quantized rule of
    :mod:`kvpolicy.kernels.layout` (levels ``"vq"``).

    Returns ``(codes uint8 [B, H, T, D // d], scale [B, H, T, D // G], zero [B, H, T, 0])``;
    the scale in ``dtype``, or as a uint8 index with 8-bit metadata. Shared by every
    backend's quantize, so that their codes are bit-identical.
    """
    b, h, t, dim = x.shape
    if dim % spec.group_size:
        raise CacheError(
            f"per-token quantization needs whole channel groups: head_dim={dim} is not a "
            f"multiple of group_size={spec.group_size}; use a group_size that divides {dim}"
        )
    assert spec.codebook is not None  # QuantSpec checks it
    if spec.codebook.heads != h:
        raise CacheError(f"the codebook has centroids for {spec.codebook.heads} kv heads, "
                         f"the tensor has {h}")
    d, g = spec.vq_dim, spec.group_size
    book = spec.codebook.tensor(x.device)  # [H, 256, d]
    groups = x.float().reshape(b, h, t, dim // g, g)
    rms = groups.square().mean(dim=-1, keepdim=True).sqrt()
    unit = groups / torch.where(rms > 0, rms, torch.ones_like(rms))
    sub = unit.reshape(b, h, t * dim // d, d).transpose(0, 1).reshape(h, -1, d)
    # |u - c|^2 = |u|^2 - 2 u.c + |c|^2; |u|^2 is the same for every centroid.
    dist = (book.square().sum(-1).unsqueeze(1)
            - 2 * torch.bmm(sub, book.transpose(1, 2)))  # [H, N, 256]
    codes = dist.argmin(dim=-1).reshape(h, b, t, dim // d).transpose(0, 1)  # [B, H, T, D/d]
    c = book.unsqueeze(0).expand(b, h, VQ_ENTRIES, d).gather(
        2, codes.reshape(b, h, -1, 1).expand(b, h, t * dim // d, d)
    ).reshape(b, h, t, dim // g, g)
    cc = c.square().sum(dim=-1)
    s32 = ((groups * c).sum(dim=-1) / torch.where(cc > 0, cc, torch.ones_like(cc))).clamp_(min=0)
    s32 = torch.where((rms.squeeze(-1) > 0) & (cc > 0), s32, torch.zeros_like(s32))
    codes = torch.where((rms > 0).expand(b, h, t, dim // g, g // d).reshape(b, h, t, dim // d),
                        codes, torch.zeros_like(codes)).to(torch.uint8)
    if spec.meta8:
        table = _scale_table(x.device)
        log = torch.round(torch.log2(s32.clamp(min=table[0])) * 8) + 128
        scale = log.clamp_(0, 255).to(torch.uint8)
        zero = torch.empty(b, h, t, 0, dtype=torch.int8, device=x.device)
    else:
        scale = s32.to(dtype)
        zero = torch.empty(b, h, t, 0, dtype=dtype, device=x.device)
    return codes.contiguous(), scale.contiguous(), zero


def vq_decode(p: Packed, spec: QuantSpec, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``[B, H, T, D]`` of a vector-quantized segment: ``C[h, code][i] * scale`` in fp32
    (:mod:`kvpolicy.kernels.layout`), cast to ``dtype``."""
    codes, scale = p.codes, p.scale
    if codes.dim() != 4:
        raise CacheError(f"token-packed codes must be 4-D, got {tuple(codes.shape)}")
    assert spec.codebook is not None
    b, h, t, n = codes.shape
    d = spec.vq_dim
    book = spec.codebook.tensor(codes.device)
    c = book.unsqueeze(0).expand(b, h, VQ_ENTRIES, d).gather(
        2, codes.long().reshape(b, h, t * n, 1).expand(b, h, t * n, d))
    g = spec.group_size
    c = c.reshape(b, h, t, n * d // g, g)
    s32 = _scale_table(scale.device)[scale.long()] if spec.meta8 else scale.float()
    return (c * s32.unsqueeze(-1)).reshape(b, h, t, n * d).to(dtype)
