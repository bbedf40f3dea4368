"""What one packed layer holds, counted in bytes by segment (``PackedKVLayer.memory_report``)."""

from __future__ import annotations

from typing import Any

import torch

from .recent import Recent

__all__ = ["layer_memory"]


def _nbytes(t: torch.Tensor | Recent | None) -> int:
    if t is None:
        return 0
    return t.nbytes if isinstance(t, Recent) else t.numel() * t.element_size()


def layer_memory(layer: Any) -> dict[str, Any]:
    """Bytes ``layer`` (a ``runtime.layer.PackedKVLayer``) actually holds, by segment, and
    what a plain fp16 cache would take.

    ``bytes`` counts everything the layer holds: codes, scales, zeros, vq centroids,
    sinks, residual (its codes, scales and zeros where ``residual_bits`` packs it) and
    positions (a few bytes per contiguous run, 4 per lone token). ``spare_bytes`` is the
    allocated but unused capacity of growing buffers; ``allocated_bytes`` is ``bytes +
    spare_bytes``. ``fp16_bytes`` is ``2 * B * Hkv * seq_len * (Dk + Dv)`` (the tokens
    held; a sliding-window layer's evicted tokens are counted in ``evicted_tokens``).
    """
    tokens = layer.seq_len
    sink = _nbytes(layer._sink_k) + _nbytes(layer._sink_v)
    resid = _nbytes(layer._res_k) + _nbytes(layer._res_v)
    pk, pv = layer._pk, layer._pv
    codes = pk[0].nbytes + pv[0].nbytes
    scales = pk[1].nbytes + pv[1].nbytes
    zeros = pk[2].nbytes + pv[2].nbytes
    pos = layer._pos.nbytes
    book = sum(s.codebook.nbytes for s in (layer.key_spec, layer.value_spec) if s.codebook)
    total = sink + resid + codes + scales + zeros + pos + book
    alloc = sink + resid + book + sum(b.allocated_bytes for b in (*pk, *pv))
    alloc += pos + layer._pos.spare_bytes + layer._step.spare_bytes
    fp16 = 0
    if layer._shape is not None:
        b, h, dk, dv = layer._shape
        fp16 = 2 * b * h * tokens * (dk + dv)
    return {
        "tokens": tokens,
        "sink_tokens": layer.n_sinks,
        "packed_tokens": layer.n_packed,
        "residual_tokens": layer.n_residual,
        "residual_bits": layer.residual_bits,
        "evicted_tokens": layer.n_evicted,
        "window": layer.window,
        "bytes": total,
        "sink_bytes": sink,
        "residual_bytes": resid,
        "code_bytes": codes,
        "scale_bytes": scales,
        "zero_bytes": zeros,
        "position_bytes": pos,
        "spare_bytes": alloc - total,
        "allocated_bytes": alloc,
        "fp16_bytes": fp16,
        "compression": fp16 / total if total else float("nan"),
    }
