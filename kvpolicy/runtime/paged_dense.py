"""A long prefill chunk over a paged cache: the cached tokens dequantized once, then SDPA.

A chunk of ``n`` query tokens continuing a sequence of ``prev`` cached tokens (vLLM's
chunked prefill of a long prompt) reads every cached token once per query row in the
packed attention kernel, a decode kernel: ``n * prev`` dot products done row by row.
Dequantizing the sequence's cache once (sinks, packed blocks, the staged tail: ``prev``
rows) and handing them with the chunk's own tokens to torch's fused SDPA, which runs
matrix kernels (or, served, vLLM's own CPU prefill kernel over a scratch cache of those
rows), costs one dequantization per layer instead.

The keys are dequantized before RoPE, as stored, and rotated at their positions; the
chunk's own keys are the engine's (rotated) and its values are in the cache's value
space (rotated where the layer rotates values: the caller rotates the output back). The
softmax is the prefill kernel's in the query dtype, so the result agrees with the packed
kernel's to that dtype's rounding, not bit for bit. Soft-capped layers keep the packed
kernel unless the engine's kernel is given (SDPA has no soft-cap).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from ..errors import CacheError
from ..kernels.contract import rope_rotate
from ..kernels.layout import Packed, RotarySpec
from .page_layout import PagedLayout

__all__ = ["DENSE_FROM", "dense_prefix", "attend_chunk"]

# Query tokens of one sequence's chunk from which it is attended this way (below it the
# packed kernel reads less than a dequantization writes).
DENSE_FROM = 64


def dense_prefix(kern, views: dict, layout: PagedLayout, row: torch.Tensor,
                 prev: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The first ``prev`` tokens of the sequence whose block ids are ``row``, in fp32:
    keys ``[Hkv, prev, D]`` (before RoPE, as stored), values ``[Hkv, prev, Dv]`` (in the
    cache's value space) and their positions ``[prev]``."""
    c, bs, s_n = layout.chunk, layout.block_size, layout.sinks
    n_packed = prev // c * c  # tokens of complete chunks (their sink rows are stand-ins)
    ks, vs, pos = [], [], []
    dev = row.device

    def add(k: torch.Tensor, v: torch.Tensor, lo: int, hi: int) -> None:
        ks.append(k.float())
        vs.append(v.float())
        pos.append(torch.arange(lo, hi, device=dev))

    m = min(s_n, prev)
    if m:
        first = int(row[0])
        add(views["sink_k"][first][:, :m], views["sink_v"][first][:, :m], 0, m)
    if n_packed > s_n:
        blocks = row[: -(-n_packed // bs)].long()
        parts = []
        for name, spec in (("k", layout.key_spec), ("v", layout.value_spec)):
            fields = ((name,) if spec.full_precision
                      else tuple(f"{name}_{x}" for x in ("codes", "scale", "zero")))
            # [blocks, H, rows, ...] -> [1, H, blocks * rows, ...]: the packed format's
            # [B, H, T, ...] over the sequence's blocks in order
            got = [views[f][blocks].transpose(0, 1).flatten(1, 2).unsqueeze(0) for f in fields]
            if spec.full_precision:
                got += [got[0].new_empty(0), got[0].new_empty(0)]
            parts.append(kern.dequantize(Packed(*got), spec)[0, :, s_n:n_packed])
        add(parts[0], parts[1], s_n, n_packed)
    lo = max(n_packed, s_n)
    if prev > lo:  # the staged tail of the incomplete chunk
        tail = int(row[n_packed // bs])
        a, b = lo - n_packed, prev - n_packed
        add(views["stage_k"][tail][:, a:b], views["stage_v"][tail][:, a:b], lo, prev)
    return torch.cat(ks, dim=1), torch.cat(vs, dim=1), torch.cat(pos)


def attend_chunk(q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor,
                 prefix: tuple[torch.Tensor, torch.Tensor, torch.Tensor], *, scale: float,
                 rope: RotarySpec | None, window: int | None, softcap: float | None = None,
                 prefill: Callable[..., torch.Tensor] | None = None) -> torch.Tensor:
    """Causal attention of a chunk's ``q [n, Hq, D]`` (rotated by the engine) over the
    ``prefix`` of :func:`dense_prefix` and the chunk's own ``k_new [n, Hkv, D]`` (rotated)
    and ``v_new [n, Hkv, Dv]``; ``[n, Hq, Dv]`` fp32. ``prefill``: the engine's kernel
    (``kvpolicy.vllm.prefill.FusedPrefill``, called with ``cached=``), else torch's SDPA
    (no soft-cap)."""
    pk, pv, ppos = prefix
    n, prev = q.shape[0], pk.shape[1]
    if rope is not None:  # the stored keys to where the engine's keys are: rotated
        cos, sin = rope.cos.to(q.device), rope.sin.to(q.device)
        pk = rope_rotate(pk, cos[ppos].unsqueeze(0), sin[ppos].unsqueeze(0), rope)
    dt = q.dtype
    if prefill is not None:
        k = torch.cat((pk.transpose(0, 1).to(dt), k_new.to(dt)))
        v = torch.cat((pv.transpose(0, 1).to(dt), v_new.to(dt)))
        return prefill(q, k, v, [n], scale=scale, window=window, softcap=softcap,
                       cached=[prev])
    if softcap is not None:
        raise CacheError("SDPA has no logit soft-capping: attend soft-capped chunks over "
                         "the packed cache instead")
    k = torch.cat((pk.to(dt), k_new.transpose(0, 1).to(dt)), dim=1).unsqueeze(0)
    v = torch.cat((pv.to(dt), v_new.transpose(0, 1).to(dt)), dim=1).unsqueeze(0)
    qpos = prev + torch.arange(n, device=q.device)
    kpos = torch.cat((ppos, qpos))
    mask = kpos[None] <= qpos[:, None]
    if window is not None:
        mask &= kpos[None] > qpos[:, None] - window
    o = F.scaled_dot_product_attention(q.transpose(0, 1).unsqueeze(0), k, v, attn_mask=mask,
                                       scale=scale, enable_gqa=q.shape[1] != k.shape[1])
    return o[0].transpose(0, 1).float()
