"""Pure-PyTorch references, one per kernel, shared by tests and benchmarks.

Every function here is written to be obviously correct, not fast: bits are expanded one
per element, groups are formed by reshapes, attention materialises the full score
matrix in fp32. The torch and Triton backends implement the same signatures over the
same layout (:mod:`kvpolicy.kernels.layout`) and are tested against these.
:data:`BACKEND` bundles them as a :class:`~kvpolicy.kernels.contract.Backend` record, the
oracle of tests, benchmarks and calibration; the runtime never runs it (it is not one of
the names :func:`kvpolicy.kernels.backend.select` accepts).

Conventions
-----------
* Cached tensors are ``[B, H, T, D]``; queries ``[B, Hq, Tq, D]`` with ``Hq % Hkv == 0``
  (query head ``h`` reads kv head ``h // (Hq // Hkv)``: GQA, MQA when ``Hkv == 1``).
* Attention over one *segment* returns ``(out, lse)``: the softmax-normalised output of
  that segment alone and the log-sum-exp of its scaled, masked scores. Segments (sinks,
  packed groups, residual window) are combined by :func:`merge_partials`, which gives
  exactly the softmax over their union.
* Masks are additive floats broadcastable to ``[B, Hq, Tq, Tk]``; ``-inf`` hides a key.
  A row that sees no key yields ``out = 0`` and ``lse = -inf`` (never NaN).
* ``softcap`` (None or > 0) caps every scaled score before the mask is added:
  ``softcap * tanh(scale * q·k / softcap)`` (Gemma2's attention logit soft-capping).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..errors import CacheError
from . import vq_codes
from .contract import Backend, compose_decode, rope_rotate
from .layout import (
    FIT_STEPS,
    ZERO_STEPS,
    Packed,
    QuantSpec,
    RotarySpec,
    byte_aligned,
    channel_offsets,
    scale_table,
    thresholds,
)

__all__ = [
    "pack_bits",
    "unpack_bits",
    "pack_widths",
    "unpack_widths",
    "width_table",
    "check_widths_shape",
    "encode_groups",
    "code_values",
    "meta_values",
    "quantize",
    "dequantize",
    "apply_rope",
    "attention_partial",
    "merge_partials",
    "merge_partials_lse",
    "packed_attention_partial",
    "decode_attention",
    "BACKEND",
]


# --------------------------------------------------------------------------- bit packing


def pack_bits(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack ``bits``-wide codes along the last dim into a little-endian bit stream.

    Args:
        codes: uint8 ``[..., N]`` with values in ``[0, 2**bits)``; ``N * bits % 8 == 0``.
        bits: code width, 1..8.
    Returns:
        uint8 ``[..., N * bits // 8]``; element ``i`` occupies stream bits
        ``[i*bits, (i+1)*bits)`` counted from the least significant bit of byte 0.
    """
    if codes.dtype != torch.uint8:
        raise CacheError(f"pack_bits expects uint8 codes, got {codes.dtype}; cast with .to(uint8)")
    if not 1 <= bits <= 8:
        raise CacheError(f"pack_bits: bits={bits} must be in 1..8")
    n = codes.shape[-1]
    if not byte_aligned(n, bits):
        raise CacheError(f"pack_bits: {n} codes of {bits} bits do not fill whole bytes")
    shifts = torch.arange(bits, device=codes.device, dtype=torch.uint8)
    # [..., N, bits]: bit j of code i is stream bit i*bits + j.
    stream = (codes.unsqueeze(-1) >> shifts) & 1
    stream = stream.reshape(*codes.shape[:-1], n * bits // 8, 8)
    weights = torch.arange(8, device=codes.device, dtype=torch.uint8)
    return (stream << weights).sum(dim=-1, dtype=torch.int32).to(torch.uint8)


def unpack_bits(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """Inverse of :func:`pack_bits`: uint8 ``[..., M]`` -> uint8 codes ``[..., M * 8 // bits]``."""
    if packed.dtype != torch.uint8:
        raise CacheError(f"unpack_bits expects uint8, got {packed.dtype}")
    if not 1 <= bits <= 8:
        raise CacheError(f"unpack_bits: bits={bits} must be in 1..8")
    m = packed.shape[-1]
    if (m * 8) % bits != 0:
        raise CacheError(f"unpack_bits: {m} bytes do not hold a whole number of {bits}-bit codes")
    weights = torch.arange(8, device=packed.device, dtype=torch.uint8)
    stream = (packed.unsqueeze(-1) >> weights) & 1  # [..., M, 8]
    stream = stream.reshape(*packed.shape[:-1], m * 8 // bits, bits)
    shifts = torch.arange(bits, device=packed.device, dtype=torch.uint8)
    return (stream << shifts).sum(dim=-1, dtype=torch.int32).to(torch.uint8)


# --------------------------------------------------------------------------- quantization


def _check_4d(x: torch.Tensor, what: str) -> None:
    if x.dim() != 4:
        raise CacheError(f"{what} must be [B, H, T, D], got shape {tuple(x.shape)}")


def _grouped(x: torch.Tensor, spec: QuantSpec) -> torch.Tensor:
    """View ``x [B,H,T,D]`` with each group along the last dim.

    channel: ``[B, H, T//G, D, G]`` (G consecutive tokens of one channel)
    token:   ``[B, H, T, D//G, G]`` (G consecutive channels of one token)
    """
    b, h, t, d = x.shape
    g = spec.group_size
    if spec.axis == "channel":
        if t % g != 0:
            raise CacheError(
                f"per-channel quantization needs whole token groups: T={t} is not a "
                f"multiple of group_size={g}; keep the remainder in the residual window"
            )
        return x.reshape(b, h, t // g, g, d).transpose(3, 4)
    if d % g != 0:
        raise CacheError(
            f"per-token quantization needs whole channel groups: head_dim={d} is not a "
            f"multiple of group_size={g}; use a group_size that divides {d}"
        )
    return x.reshape(b, h, t, d // g, g)


def encode_groups(
    groups: torch.Tensor, spec: QuantSpec, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Codes, scale and zero of fp32 ``groups [..., G]`` (each group along the last dim),
    by the rule of ``spec.levels`` (:mod:`kvpolicy.kernels.layout`).

    Returns ``(codes uint8 [..., G], scale [...], zero [...])``, scale and zero in
    ``dtype``; the codes are computed against the stored (rounded) scale and zero. Shared
    by the torch backend, so that its codes are bit-identical to these.
    """
    if spec.meta8:
        return _encode_meta8(groups, spec)
    if spec.uniform:
        top = _top(spec, groups)
        lo = groups.amin(dim=-1)
        hi = groups.amax(dim=-1)
        zero = lo.to(dtype)
        scale = ((hi - lo) / top).to(dtype)
    else:
        mean = groups.mean(dim=-1)
        zero = mean.to(dtype)
        scale = (groups - mean.unsqueeze(-1)).square().mean(dim=-1).sqrt().to(dtype)
    z32 = zero.float().unsqueeze(-1)
    s32 = scale.float().unsqueeze(-1)
    safe = torch.where(s32 > 0, s32, torch.ones_like(s32))
    if spec.uniform:
        codes = _clamp_top(torch.round((groups - z32) / safe), top)
    else:
        # The code counts the thresholds strictly below the normalised input.
        edges = torch.tensor(thresholds(spec.bits), dtype=torch.float32, device=groups.device)
        codes = torch.bucketize(((groups - z32) / safe).contiguous(), edges)
    codes = torch.where(s32 > 0, codes, torch.zeros_like(codes)).to(torch.uint8)
    return codes, scale, zero


def _encode_meta8(
    groups: torch.Tensor, spec: QuantSpec
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`encode_groups` with 8-bit metadata (uniform levels): a uint8 scale index into
    :func:`~kvpolicy.kernels.layout.scale_table` and an int8 zero point."""
    top = _top(spec, groups)
    lo = groups.amin(dim=-1)
    hi = groups.amax(dim=-1)
    # The step the group needs, widened so that its zero point fits an int8.
    need = torch.maximum((hi - lo) / top, lo.abs() / (127 / ZERO_STEPS))
    table = _scale_table(groups.device)
    index = torch.searchsorted(table, need.contiguous()).clamp_(max=255)
    s32 = table[index]
    codes, point, z32 = _grid(groups, s32, lo, top)
    if spec.fit == "mse":  # coarser steps' loss against clipping: keep the least error
        err = _squared_error(groups, codes, s32, z32)
        mid, base = (lo + hi) / 2, index
        for k in range(1, FIT_STEPS + 1):
            idx = (base - k).clamp_(min=0)
            s32 = table[idx]
            c, p, z = _grid(groups, s32, mid - top * s32 / 2, top)
            e = _squared_error(groups, c, s32, z)
            better = e < err
            err = torch.where(better, e, err)
            codes = torch.where(better.unsqueeze(-1), c, codes)
            index, point = torch.where(better, idx, index), torch.where(better, p, point)
    return codes.to(torch.uint8), index.to(torch.uint8), point.to(torch.int8)


def _grid(groups: torch.Tensor, s32: torch.Tensor, low: torch.Tensor,
          top: int | torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(codes, zero point, zero)`` of ``groups [..., G]`` on the 8-bit grid of step
    ``s32 [...]`` whose zero point is nearest ``low``."""
    point = torch.round(-low / s32 * ZERO_STEPS).clamp_(-128, 127)
    z32 = -point * s32 / ZERO_STEPS
    codes = _clamp_top(torch.round((groups - z32.unsqueeze(-1)) / s32.unsqueeze(-1)), top)
    return codes, point, z32


def _top(spec: QuantSpec, groups: torch.Tensor) -> int | torch.Tensor:
    """The largest code: ``2**bits - 1``, or with per-channel widths (checked against
    channel groups ``[B, H, T//G, D, G]``) a ``[H, 1, D]`` fp32 tensor that broadcasts over
    their ``[B, H, T//G, D]``."""
    if spec.widths is None:
        return (1 << spec.bits) - 1
    check_widths_shape(spec, groups.shape[1], groups.shape[3])
    w = torch.tensor(spec.widths, dtype=torch.float32, device=groups.device)
    return (2.0 ** w - 1).unsqueeze(1)


def check_widths_shape(spec: QuantSpec, h: int, d: int) -> None:
    """Raise :class:`CacheError` unless ``spec.widths`` has ``h`` rows of ``d`` widths."""
    rows = spec.widths or ()
    if (len(rows), len(rows[0]) if rows else 0) != (h, d):
        raise CacheError(f"per-channel widths are [{len(rows)} heads, {len(rows[0])} "
                         f"channels], the tensor has {h} kv heads of {d} channels")


def _clamp_top(codes: torch.Tensor, top: int | torch.Tensor) -> torch.Tensor:
    """``codes [..., G]`` clamped to ``[0, top]`` (:func:`_top`)."""
    if isinstance(top, int):
        return codes.clamp_(0, top)
    return torch.minimum(codes.clamp_(min=0), top.unsqueeze(-1))


def _stream_bits(spec: QuantSpec, h: int, d: int, g: int,
                 device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-channel widths: ``(first bit, width)``, each ``[1, H, 1, D*G]`` int64, of every
    code in its group's stream (:mod:`kvpolicy.kernels.layout`), channel-major."""
    check_widths_shape(spec, h, d)
    w = torch.tensor(spec.widths, dtype=torch.int64, device=device)
    off = torch.cumsum(w, 1) - w
    bit = g * off.unsqueeze(-1) + torch.arange(g, device=device) * w.unsqueeze(-1)
    return (bit.reshape(1, h, 1, d * g),
            w.unsqueeze(-1).expand(h, d, g).reshape(1, h, 1, d * g))


_WIDTH_TABLES: dict[tuple, torch.Tensor] = {}


def width_table(spec: QuantSpec, device: torch.device | str) -> torch.Tensor:
    """Per-channel widths as the kernels read them: int32 ``[Hkv, D, 2]``, each channel's
    width and the stream bit its first code of a group starts at
    (``G * layout.channel_offsets``); cached per spec and device, so a pointer into it
    stays valid."""
    key = (spec.widths, spec.group_size, str(device))
    if key not in _WIDTH_TABLES:
        rows = [[(w, spec.group_size * o) for w, o in zip(row, channel_offsets(row), strict=True)]
                for row in spec.widths or ()]
        _WIDTH_TABLES[key] = torch.tensor(rows, dtype=torch.int32, device=device)
    return _WIDTH_TABLES[key]


def pack_widths(codes: torch.Tensor, spec: QuantSpec) -> torch.Tensor:
    """Per-channel widths: codes ``[B, H, n, D, G]`` -> uint8 ``[B, H, n, G*bits//8, D]``,
    each group's bytes one stream (:mod:`kvpolicy.kernels.layout`). A code shifted to its
    first bit spans at most two bytes; the bits of different codes never overlap, so
    adding them into the bytes is OR-ing them."""
    b, h, n, d, g = codes.shape
    nbytes = g * spec.bits * d // 8
    bit, _ = _stream_bits(spec, h, d, g, codes.device)
    word = codes.reshape(b, h, n, d * g).to(torch.int32) << (bit % 8).to(torch.int32)
    byte = (bit // 8).expand(b, h, n, d * g)
    out = torch.zeros(b, h, n, nbytes + 1, dtype=torch.int32, device=codes.device)
    out.scatter_add_(-1, byte, word & 0xFF)
    out.scatter_add_(-1, byte + 1, word >> 8)
    return out[..., :nbytes].to(torch.uint8).reshape(b, h, n, nbytes // d, d)


def unpack_widths(packed: torch.Tensor, spec: QuantSpec) -> torch.Tensor:
    """Inverse of :func:`pack_widths`: uint8 ``[B, H, n, G*bits//8, D]`` -> codes
    ``[B, H, n, D, G]``."""
    b, h, n, r, d = packed.shape
    g = r * 8 // spec.bits
    stream = torch.nn.functional.pad(packed.reshape(b, h, n, r * d).to(torch.int32), (0, 1))
    bit, w = _stream_bits(spec, h, d, g, packed.device)
    byte = (bit // 8).expand(b, h, n, d * g)
    word = stream.gather(-1, byte) | (stream.gather(-1, byte + 1) << 8)
    codes = (word >> (bit % 8).to(torch.int32)) & ((1 << w) - 1).to(torch.int32)
    return codes.to(torch.uint8).reshape(b, h, n, d, g)


def _squared_error(groups: torch.Tensor, codes: torch.Tensor, s32: torch.Tensor,
                   z32: torch.Tensor) -> torch.Tensor:
    """``Σ (code * scale + zero - x)²`` over each group (fit ``mse``)."""
    back = codes * s32.unsqueeze(-1) + z32.unsqueeze(-1)
    return (back - groups).square().sum(dim=-1)


def _scale_table(device: torch.device) -> torch.Tensor:
    return torch.tensor(scale_table(), dtype=torch.float32, device=device)


def meta_values(
    scale: torch.Tensor, zero: torch.Tensor, spec: QuantSpec
) -> tuple[torch.Tensor, torch.Tensor]:
    """The fp32 scale and zero of stored metadata: as stored, or for 8-bit metadata
    ``scale_table()[index]`` and ``-point * scale / ZERO_STEPS``."""
    if not spec.meta8:
        return scale.float(), zero.float()
    s32 = _scale_table(scale.device)[scale.long()]
    return s32, -zero.float() * s32 / ZERO_STEPS


def code_values(codes: torch.Tensor, spec: QuantSpec) -> torch.Tensor:
    """The fp32 value of each code in units of its scale (``spec.table[code]``)."""
    if spec.uniform:
        return codes.float()
    table = torch.tensor(spec.table, dtype=torch.float32, device=codes.device)
    return table[codes.long()]


def quantize(x: torch.Tensor, spec: QuantSpec, dtype: torch.dtype | None = None) -> Packed:
    """Quantize ``x`` into the packed layout of :mod:`kvpolicy.kernels.layout`.

    Args:
        x: ``[B, H, T, D]`` float. For ``spec.axis == "channel"`` T must be a multiple of
            ``spec.group_size``; for ``"token"`` D must be.
        spec: bits, group size, axis, levels.
        dtype: dtype of the stored scale/zero (and of the plain tensor when
            ``spec.bits == 16``); defaults to ``x.dtype``.
    Returns:
        :class:`Packed`; for 16 bits ``Packed(x, empty, empty)``.
    """
    _check_4d(x, "quantize input")
    dtype = x.dtype if dtype is None else dtype
    if spec.full_precision:
        empty = x.new_empty(0, dtype=dtype)
        return Packed(x.to(dtype), empty, empty)
    if spec.vq:
        return Packed(*vq_codes.vq_encode(x, spec, dtype))
    groups = _grouped(x, spec).float()  # [..., n_groups_a, n_groups_b, G]
    codes, scale, zero = encode_groups(groups, spec, dtype)
    b, h, t, d = x.shape
    if spec.widths is not None:
        packed = pack_widths(codes, spec)
    elif spec.axis == "channel":
        # codes [B,H,T//G,D,G]: pack along G, then put D innermost.
        packed = pack_bits(codes, spec.bits).transpose(3, 4).contiguous()
    else:
        packed = pack_bits(codes.reshape(b, h, t, d), spec.bits)
    return Packed(packed, scale.contiguous(), zero.contiguous())


def _unpack_channel(codes: torch.Tensor, spec: QuantSpec) -> torch.Tensor:
    """Codes ``[B, H, n, D, G]`` of channel-packed ``[B, H, n, G*bits//8, D]``."""
    if spec.widths is not None:
        return unpack_widths(codes, spec)
    return unpack_bits(codes.transpose(3, 4), spec.bits)


def dequantize(p: Packed, spec: QuantSpec, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Reconstruct ``[B, H, T, D]`` from a :class:`Packed` segment
    (``table[code] * scale + zero``).

    The product is formed in fp32 and cast to ``dtype`` at the end.
    """
    if spec.full_precision:
        return p.codes.to(dtype)
    if spec.vq:
        return vq_codes.vq_decode(p, spec, dtype)
    codes, scale, zero = p
    if spec.axis == "channel":
        if codes.dim() != 5:
            raise CacheError(f"channel-packed codes must be 5-D, got {tuple(codes.shape)}")
        b, h, n, _, d = codes.shape
        g = spec.group_size
        c = code_values(_unpack_channel(codes, spec), spec)  # [B,H,n,D,G]
        s32, z32 = meta_values(scale, zero, spec)
        x = c * s32.unsqueeze(-1) + z32.unsqueeze(-1)
        return x.transpose(3, 4).reshape(b, h, n * g, d).to(dtype)
    if codes.dim() != 4:
        raise CacheError(f"token-packed codes must be 4-D, got {tuple(codes.shape)}")
    b, h, t, _ = codes.shape
    c = code_values(unpack_bits(codes, spec.bits), spec)  # [B,H,T,D]
    d = c.shape[-1]
    c = c.reshape(b, h, t, d // spec.group_size, spec.group_size)
    s32, z32 = meta_values(scale, zero, spec)
    x = c * s32.unsqueeze(-1) + z32.unsqueeze(-1)
    return x.reshape(b, h, t, d).to(dtype)


# --------------------------------------------------------------------------- rotary


def rope_tables(
    rope: RotarySpec, positions: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Gather ``cos``/``sin`` rows for ``positions [B, T]`` -> two ``[B, 1, T, rotary_dim]``."""
    if positions.dtype not in (torch.int64, torch.int32):
        raise CacheError(f"positions must be int64, got {positions.dtype}")
    if positions.numel() and (
        int(positions.min()) < 0 or int(positions.max()) >= rope.max_positions
    ):
        raise CacheError(
            f"positions span [{int(positions.min())}, {int(positions.max())}] but the rotary "
            f"table has {rope.max_positions} rows; build the RotarySpec with more positions"
        )
    pos = positions.to(rope.cos.device).long()
    return rope.cos[pos].unsqueeze(1), rope.sin[pos].unsqueeze(1)


def apply_rope(x: torch.Tensor, positions: torch.Tensor, rope: RotarySpec) -> torch.Tensor:
    """Rotate ``x [B, H, T, D]`` with each token at its own position ``positions [B, T]``.

    Channels ``>= rope.rotary_dim`` pass through unchanged. Computed in fp32, returned in
    ``x.dtype``.
    """
    _check_4d(x, "apply_rope input")
    r = rope.rotary_dim
    if r % 2 != 0 or r > x.shape[-1]:
        raise CacheError(f"rotary_dim={r} must be even and <= head_dim={x.shape[-1]}")
    if positions.shape != (x.shape[0], x.shape[2]):
        raise CacheError(
            f"positions must be [B, T] = {(x.shape[0], x.shape[2])}, got {tuple(positions.shape)}"
        )
    cos, sin = rope_tables(rope, positions)
    cos, sin = cos.to(x.device, torch.float32), sin.to(x.device, torch.float32)
    return rope_rotate(x.float(), cos, sin, rope).to(x.dtype)


# --------------------------------------------------------------------------- attention


def _expand_kv(k: torch.Tensor, hq: int) -> torch.Tensor:
    hkv = k.shape[1]
    if hkv == 0 or hq % hkv != 0:
        raise CacheError(f"{hq} query heads are not a multiple of {hkv} kv heads")
    return k.repeat_interleave(hq // hkv, dim=1)


def attention_partial(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    scale: float,
    mask: torch.Tensor | None = None,
    softcap: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention over one segment, returning its output and log-sum-exp.

    Args:
        q: ``[B, Hq, Tq, D]``; k, v: ``[B, Hkv, Tk, D]`` with ``Hq % Hkv == 0``.
        scale: multiplies ``q·k``.
        mask: additive float, broadcastable to ``[B, Hq, Tq, Tk]`` (``-inf`` hides), or None.
        softcap: if given, scores become ``softcap * tanh(s / softcap)`` before the mask.
    Returns:
        ``out`` fp32 ``[B, Hq, Tq, D]`` and ``lse`` fp32 ``[B, Hq, Tq]``; rows that see no
        key give ``out = 0``, ``lse = -inf``.
    """
    b, hq, tq, _ = q.shape
    dv = v.shape[-1]
    tk = k.shape[2]
    if tk == 0:
        return (
            q.new_zeros(b, hq, tq, dv, dtype=torch.float32),
            q.new_full((b, hq, tq), float("-inf"), dtype=torch.float32),
        )
    kf = _expand_kv(k.float(), hq)
    vf = _expand_kv(v.float(), hq)
    s = torch.matmul(q.float(), kf.transpose(-1, -2)) * scale
    if softcap is not None:
        s = softcap * torch.tanh(s / softcap)
    if mask is not None:
        s = s + mask.float()
    m = s.amax(dim=-1, keepdim=True)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    p = torch.exp(s - m)
    denom = p.sum(dim=-1, keepdim=True)
    out = torch.matmul(p, vf) / torch.where(denom > 0, denom, torch.ones_like(denom))
    lse = (m + torch.log(denom)).squeeze(-1)  # log(0) = -inf for fully hidden rows
    return out, lse


def merge_partials_lse(
    parts: Sequence[tuple[torch.Tensor, torch.Tensor]],
) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-sum-exp merge of per-segment ``(out, lse)`` pairs; returns ``(out, lse)``.

    The result equals softmax attention over the union of the segments' keys.
    """
    if not parts:
        raise CacheError("merge_partials needs at least one (out, lse) pair")
    outs = torch.stack([o.float() for o, _ in parts])  # [n, B, Hq, Tq, D]
    lses = torch.stack([s.float() for _, s in parts])  # [n, B, Hq, Tq]
    m = lses.amax(dim=0)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    w = torch.exp(lses - m)  # exp(-inf) = 0 for empty segments
    total = w.sum(dim=0)
    safe = torch.where(total > 0, total, torch.ones_like(total))
    out = (w.unsqueeze(-1) * outs).sum(dim=0) / safe.unsqueeze(-1)
    return out, m + torch.log(total)


def merge_partials(parts: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
    """Combine per-segment ``(out, lse)`` pairs into one attention output (fp32)."""
    return merge_partials_lse(parts)[0]


def packed_attention_partial(
    q: torch.Tensor,
    k: Packed,
    v: Packed,
    k_spec: QuantSpec,
    v_spec: QuantSpec,
    *,
    scale: float,
    mask: torch.Tensor | None = None,
    rope: RotarySpec | None = None,
    k_positions: torch.Tensor | None = None,
    softcap: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention over a packed segment: dequantize, rotate keys, :func:`attention_partial`.

    Args:
        q: ``[B, Hq, Tq, D]`` (already rotated by the model).
        k, v: packed ``[B, Hkv, Tk, D]`` segments in the layouts of ``k_spec``/``v_spec``.
        scale, mask, softcap: as in :func:`attention_partial` (mask over this segment's
            Tk keys).
        rope: if given, keys are stored pre-RoPE and rotated at ``k_positions [B, Tk]``.
    Returns:
        ``(out [B, Hq, Tq, D] fp32, lse [B, Hq, Tq] fp32)``.
    """
    kd = dequantize(k, k_spec, torch.float32)
    vd = dequantize(v, v_spec, torch.float32)
    if rope is not None:
        if k_positions is None:
            raise CacheError("pre-RoPE keys need k_positions [B, Tk]")
        kd = apply_rope(kd, k_positions, rope)
    return attention_partial(q, kd, vd, scale=scale, mask=mask, softcap=softcap)


decode_attention = compose_decode(
    packed_attention_partial=packed_attention_partial,
    attention_partial=attention_partial,
    apply_rope=apply_rope,
    merge_partials=merge_partials_lse,
)

BACKEND = Backend(
    name="reference",
    quantize=quantize,
    dequantize=dequantize,
    attention_partial=attention_partial,
    packed_attention_partial=packed_attention_partial,
    apply_rope=apply_rope,
    merge_partials=merge_partials_lse,
    decode_attention=decode_attention,
)
