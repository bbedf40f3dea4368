"""The kernel contract: the functions every backend provides, as one record.

A :class:`Backend` is filled in full by every backend (:data:`kvpolicy.kernels.reference.BACKEND`,
:data:`kvpolicy.kernels.torch_backend.BACKEND`, :func:`kvpolicy.kernels.triton_backend.load`);
where a backend has no kernel of its own for a piece, its record names the shared torch
implementation explicitly. :func:`kvpolicy.kernels.backend.select` picks one record per
device; the runtime calls only that record's functions (docs/design.md §6).

Shapes and conventions are those of :mod:`kvpolicy.kernels.reference`: cached tensors
``[B, Hkv, T, D]``, queries ``[B, Hq, Tq, D]`` with ``Hq % Hkv == 0``, additive fp32 masks
(``-inf`` hides a key), and attention over one segment returns ``(out, lse)`` in fp32.
``softcap`` (Gemma2, Grok: None or a positive float) caps each score before the mask,
``s = softcap * tanh(scale * q·k / softcap)``; it acts per score, so segments attended
apart still merge exactly.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from ..errors import CacheError
from .layout import Packed, QuantSpec, RotarySpec

__all__ = [
    "Backend",
    "Quantize",
    "Dequantize",
    "AttentionPartial",
    "PackedAttentionPartial",
    "ApplyRope",
    "MergePartials",
    "DecodeAttention",
    "compose_decode",
    "gather_page_rows",
    "gather_pages",
    "quantize_in_blocks",
    "rope_rotate",
]

Partial = tuple[torch.Tensor, torch.Tensor]  # (out [B, Hq, Tq, Dv], lse [B, Hq, Tq]), fp32


class Quantize(Protocol):
    def __call__(
        self, x: torch.Tensor, spec: QuantSpec, dtype: torch.dtype | None = None
    ) -> Packed: ...


class Dequantize(Protocol):
    def __call__(self, p: Packed, spec: QuantSpec, dtype: torch.dtype = ...) -> torch.Tensor: ...


class AttentionPartial(Protocol):
    def __call__(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
        scale: float, mask: torch.Tensor | None = None, softcap: float | None = None,
    ) -> Partial: ...


class PackedAttentionPartial(Protocol):
    def __call__(
        self, q: torch.Tensor, k: Packed, v: Packed, k_spec: QuantSpec, v_spec: QuantSpec, *,
        scale: float, mask: torch.Tensor | None = None, rope: RotarySpec | None = None,
        k_positions: torch.Tensor | None = None, softcap: float | None = None,
    ) -> Partial: ...


ApplyRope = Callable[[torch.Tensor, torch.Tensor, RotarySpec], torch.Tensor]
MergePartials = Callable[[Sequence[Partial]], Partial]


class DecodeAttention(Protocol):
    def __call__(
        self, q: torch.Tensor, k: Packed | None, v: Packed | None, k_spec: QuantSpec,
        v_spec: QuantSpec, fk: torch.Tensor | None, fv: torch.Tensor | None, *,
        scale: float, mask: torch.Tensor | None = None, fp_mask: torch.Tensor | None = None,
        rope: RotarySpec | None = None, k_positions: torch.Tensor | None = None,
        fp_positions: torch.Tensor | None = None, check_positions: bool = True,
        softcap: float | None = None, block_table: torch.Tensor | None = None,
    ) -> Partial: ...


def gather_page_rows(x: torch.Tensor, block_table: torch.Tensor) -> torch.Tensor:
    """The pages ``x [num_blocks, Hkv, rows, ...]`` that ``block_table [B, nb]`` names as one
    segment ``[B, Hkv, nb * rows, ...]``: batch row ``b`` its pages ``block_table[b, 0],
    ..., block_table[b, nb - 1]`` in order (a copy)."""
    y = x[block_table].transpose(1, 2)  # [B, Hkv, nb, rows, ...]
    return y.reshape(y.shape[0], y.shape[1], -1, *y.shape[4:])


def gather_pages(p: Packed, block_table: torch.Tensor) -> Packed:
    """:func:`gather_page_rows` of every field of the packed pages ``p`` (a full-precision
    "segment" has no scale or zero: kept empty). What a backend without paged reads does
    with ``decode_attention(block_table=...)``."""
    return Packed(*(x if x.numel() == 0 else gather_page_rows(x, block_table) for x in p))


@dataclass(frozen=True, eq=False)
class Backend:
    """The kernels of one backend. Every field is set; signatures as in the reference.

    Attributes:
        name: ``"reference"``, ``"torch"`` or ``"triton"``.
        quantize: ``(x [B,H,T,D], spec, dtype=None) -> Packed``, bit-identical across
            backends.
        dequantize: ``(Packed, spec, dtype=fp32) -> [B,H,T,D]`` (``code*scale + zero`` in fp32).
        attention_partial: full-precision segment
            ``(q, k, v, *, scale, mask, softcap) -> (out, lse)``.
        packed_attention_partial: one packed segment, keys rotated at ``k_positions`` when
            ``rope`` is given ``-> (out, lse)``.
        apply_rope: ``(x [B,H,T,D], positions [B,T], rope) -> x`` rotated, in ``x.dtype``.
        merge_partials: ``[(out, lse), ...] -> (out, lse)``, the softmax over the union of
            the segments (:func:`kvpolicy.kernels.reference.merge_partials_lse`).
        decode_attention: one softmax over a packed segment ``k, v`` (or None) and a
            full-precision segment ``fk, fv [B,Hkv,Tf,D]`` (or None; keys pre-RoPE at
            ``fp_positions [B,Tf]`` when ``rope`` is set), with ``mask``/``fp_mask`` over
            each segment's own keys ``-> (out, lse)``. ``check_positions=False``: the
            caller has checked every position against the rotary table. ``block_table
            [B, nb]`` (int64): ``k, v`` are pages ``[num_blocks, Hkv, rows, ...]`` and the
            packed segment of row ``b`` is its pages ``block_table[b]`` in order
            (:func:`gather_pages`; the C++ kernel reads them in place).
        warm_up: ``(key_spec, value_spec, *, n_kv_heads, gqa, head_dim, dtype, device,
            query_dtype, rope, softcap) -> None``, compiles (and tunes) the decode kernels
            of one layer's policy ahead of its first step; None for a backend with nothing
            to compile (torch: the C++ kernel is built once when first loaded).

    Every attention function takes ``softcap`` (default None): scores are capped as in
    the module docstring, in fp32, before the mask is added.
    """

    name: str
    quantize: Quantize
    dequantize: Dequantize
    attention_partial: AttentionPartial
    packed_attention_partial: PackedAttentionPartial
    apply_rope: ApplyRope
    merge_partials: MergePartials
    decode_attention: DecodeAttention
    warm_up: Callable[..., None] | None = None


def compose_decode(
    *,
    packed_attention_partial: PackedAttentionPartial,
    attention_partial: AttentionPartial,
    apply_rope: ApplyRope,
    merge_partials: MergePartials,
) -> DecodeAttention:
    """A ``decode_attention`` made of a backend's pieces: attend over each segment, merge.

    The packed segment goes through ``packed_attention_partial`` (keys rotated inside);
    full-precision keys are rotated by ``apply_rope`` in fp32 and attended by
    ``attention_partial``; the two ``(out, lse)`` pairs are merged by ``merge_partials``.
    ``check_positions`` is not forwarded: each piece checks positions itself; ``softcap``
    is handed to both pieces (it caps each score, so the merge stays exact).
    """

    def decode_attention(
        q: torch.Tensor,
        k: Packed | None,
        v: Packed | None,
        k_spec: QuantSpec,
        v_spec: QuantSpec,
        fk: torch.Tensor | None,
        fv: torch.Tensor | None,
        *,
        scale: float,
        mask: torch.Tensor | None = None,
        fp_mask: torch.Tensor | None = None,
        rope: RotarySpec | None = None,
        k_positions: torch.Tensor | None = None,
        fp_positions: torch.Tensor | None = None,
        check_positions: bool = True,
        softcap: float | None = None,
        block_table: torch.Tensor | None = None,
    ) -> Partial:
        """``Backend.decode_attention``, segment by segment (see :func:`compose_decode`)."""
        if block_table is not None and k is not None and v is not None:
            k, v = gather_pages(k, block_table), gather_pages(v, block_table)
        parts: list[Partial] = []
        if k is not None and v is not None:
            kpos = None if rope is None or k_positions is None else k_positions.long()
            parts.append(
                packed_attention_partial(
                    q, k, v, k_spec, v_spec, scale=scale, mask=mask, rope=rope,
                    k_positions=kpos, softcap=softcap,
                )
            )
        if fk is not None and fv is not None:
            if rope is not None:
                if fp_positions is None:
                    raise CacheError("pre-RoPE full-precision keys need fp_positions [B, Tf]")
                fk = apply_rope(fk.float(), fp_positions.long(), rope)
            parts.append(attention_partial(q, fk, fv, scale=scale, mask=fp_mask, softcap=softcap))
        if not parts:
            raise CacheError("decode_attention needs a packed or a full-precision segment")
        return parts[0] if len(parts) == 1 else merge_partials(parts)

    return decode_attention


def quantize_in_blocks(
    quantize: Quantize, x: torch.Tensor, spec: QuantSpec, dtype: torch.dtype, tokens: int
) -> Packed:
    """``quantize(x, spec, dtype)`` of ``x [B, H, T, D]`` in blocks of ``tokens`` tokens
    (whole groups: bit-identical), so that its fp32 temporaries are a block's size."""
    if x.shape[2] <= tokens:
        return quantize(x, spec, dtype)
    parts = [quantize(x[:, :, i : i + tokens], spec, dtype) for i in range(0, x.shape[2], tokens)]
    if spec.full_precision:  # the plain tensor, and one empty scale and zero
        return Packed(torch.cat([p.codes for p in parts], dim=2), parts[0].scale, parts[0].zero)
    # Every field along dim 2, an empty VQ zero [B, H, t, 0] included.
    return Packed(*(torch.cat(f, dim=2) for f in zip(*parts, strict=True)))


def rope_rotate(xf: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                rope: RotarySpec) -> torch.Tensor:
    """fp32 ``xf [..., D]`` rotated by ``cos``/``sin`` rows (``[..., rotary_dim]``,
    broadcast against it) in ``rope``'s style; channels ``>= rotary_dim`` pass through."""
    r = rope.rotary_dim
    xr = xf[..., :r]
    if rope.style == "rotate_half":
        rot = torch.cat((-xr[..., r // 2 :], xr[..., : r // 2]), dim=-1)
    elif rope.style == "interleaved":
        rot = torch.stack((-xr[..., 1::2], xr[..., 0::2]), dim=-1).flatten(-2)
    else:
        raise CacheError(f"unknown rotary style {rope.style!r}; use rotate_half or interleaved")
    out = xr * cos + rot * sin
    return out if r == xf.shape[-1] else torch.cat((out, xf[..., r:]), dim=-1)
