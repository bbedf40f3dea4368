"""The runtime: one layer of packed KV cache (sinks + packed groups + residual window).

A layer holds, per batch row and kv head, three segments of the token axis::

    [ sinks: first S tokens | packed: whole chunks, quantized | residual: recent tokens ]
      full precision          key_spec / value_spec             full precision

K and V share one segmentation. The residual overflows in chunks of
``lcm(key_spec.token_group, value_spec.token_group)`` tokens: a chunk is packed once the
residual holds at least ``residual + chunk`` tokens, oldest first, and a packed token is
never re-quantized. Packing therefore happens at the same token indices whether tokens
arrive one at a time or in bulk, so both give bit-identical caches.

Keys may be stored *before* RoPE (``rope`` given): every key keeps its absolute position
and is rotated after dequantization inside attention (docs/design.md §2). Attention runs
over the packed segment and the full-precision one (sinks and residual) and the partial
results are merged by log-sum-exp, so sinks, packed groups and residual share one softmax.
The kernels are those of one :class:`~kvpolicy.kernels.contract.Backend` record, chosen
once per device (:func:`kvpolicy.kernels.backend.select`).
"""

from __future__ import annotations

import math
from typing import Any

import torch

from ..errors import CacheError
from ..kernels.backend import Backend, check_name, select
from ..kernels.layout import Packed, QuantSpec, RotarySpec
from ..kernels.masks import causal_mask, to_additive
from .growing import Growing

__all__ = ["PackedKVLayer"]


def _nbytes(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.numel() * t.element_size()


def _cat(a: torch.Tensor | None, b: torch.Tensor, dim: int) -> torch.Tensor:
    return b.clone() if a is None else torch.cat((a, b), dim=dim)


class PackedKVLayer:
    """One layer's key/value cache: full-precision sinks, packed groups, residual window.

    Args:
        key_spec, value_spec: how keys and values are packed (``bits == 16`` keeps them
            in full precision).
        residual: R, recent tokens kept in full precision.
        sinks: S, first tokens kept in full precision.
        rope: if given, appended keys are *pre-RoPE* and are rotated at their stored
            positions inside :meth:`attend` (which can also be handed a newer table).
        pre_rope: store each token's position for a rotation applied at attend time even
            though no table is known yet (the table then comes with each ``attend(rope=)``
            call, e.g. one that grows with the sequence). Default: ``rope is not None``.
        backend: ``"torch"``, ``"triton"``, or ``"auto"`` (triton for CUDA tensors).
        dtype: storage dtype of full-precision tokens and of scales/zeros; appended
            tensors are cast to it. ``None``: the dtype of the first append, and later
            appends must match it.
    """

    def __init__(
        self,
        key_spec: QuantSpec,
        value_spec: QuantSpec,
        *,
        residual: int,
        sinks: int,
        rope: RotarySpec | None = None,
        backend: str = "auto",
        dtype: torch.dtype | None = None,
        pre_rope: bool | None = None,
    ) -> None:
        if not isinstance(key_spec, QuantSpec) or not isinstance(value_spec, QuantSpec):
            raise CacheError("key_spec and value_spec must be kvpolicy QuantSpec instances")
        if residual < 0 or sinks < 0:
            raise CacheError(f"residual={residual} and sinks={sinks} must be >= 0")
        check_name(backend)
        if dtype is not None and not dtype.is_floating_point:
            raise CacheError(f"dtype={dtype} is not a floating dtype; use bfloat16/float16/32")
        self.key_spec = key_spec
        self.value_spec = value_spec
        self.residual = residual
        self.sinks = sinks
        self.rope = rope
        self.pre_rope = rope is not None if pre_rope is None else bool(pre_rope)
        if rope is not None and not self.pre_rope:
            raise CacheError("rope given with pre_rope=False; drop one of them")
        self.backend = backend
        self.dtype = dtype
        self.chunk = math.lcm(key_spec.token_group, value_spec.token_group)
        self._chosen: tuple[torch.device, Backend] | None = None  # see _kernels
        self._reset()

    # ------------------------------------------------------------------ state

    def _reset(self) -> None:
        self._shape: tuple[int, int, int, int] | None = None  # (B, Hkv, Dk, Dv)
        self._device: torch.device | None = None
        self._sink_k: torch.Tensor | None = None  # [B, Hkv, s, Dk]
        self._sink_v: torch.Tensor | None = None
        self._pk = (Growing(2), Growing(2), Growing(2))  # codes, scale, zero
        self._pv = (Growing(2), Growing(2), Growing(2))
        self._n_packed = 0
        self._packed_views: tuple[Packed, Packed] | None = None
        self._res_k: torch.Tensor | None = None  # [B, Hkv, r, Dk]
        self._res_v: torch.Tensor | None = None
        # NOTE: positions are stored as int32: at 2 bits with SmolLM2 shapes a token costs
        # ~150 bytes per layer, and int64 positions alone would take the 32K compression
        # below 5x (bench/cache_memory.py). Only stored for pre-RoPE keys.
        self._pos = Growing(1)  # [B, total] int32
        self._max_pos = -1  # largest stored position: checked against a table per attend

    def clear(self) -> None:
        """Drop every token (keeps the configuration)."""
        self._reset()

    @property
    def seq_len(self) -> int:
        """Tokens held (sinks + packed + residual)."""
        return self.n_sinks + self._n_packed + self.n_residual

    @property
    def n_sinks(self) -> int:
        return 0 if self._sink_k is None else self._sink_k.shape[2]

    @property
    def n_packed(self) -> int:
        return self._n_packed

    @property
    def n_residual(self) -> int:
        return 0 if self._res_k is None else self._res_k.shape[2]

    @property
    def batch_size(self) -> int | None:
        return None if self._shape is None else self._shape[0]

    def positions(self) -> torch.Tensor | None:
        """Stored key positions ``[B, seq_len]`` int64 (None unless keys are pre-RoPE)."""
        p = self._pos.view()
        return None if p is None else p.long()

    # ------------------------------------------------------------------ validation

    def _validate_append(
        self, key: Any, value: Any, positions: Any
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        for name, t in (("key", key), ("value", value)):
            if not isinstance(t, torch.Tensor):
                raise CacheError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
            if t.dim() != 4:
                raise CacheError(
                    f"{name} must be [batch, kv_heads, tokens, head_dim], got shape "
                    f"{tuple(t.shape)}; transpose to the Hugging Face layout first"
                )
            if not t.dtype.is_floating_point:
                raise CacheError(f"{name} has dtype {t.dtype}; pass a floating tensor")
        if key.shape[:3] != value.shape[:3]:
            raise CacheError(
                f"key {tuple(key.shape)} and value {tuple(value.shape)} disagree on "
                f"[batch, kv_heads, tokens]; append matching key/value pairs"
            )
        if key.dtype != value.dtype:
            raise CacheError(
                f"key dtype {key.dtype} != value dtype {value.dtype}; cast both to one dtype"
            )
        if key.device != value.device:
            raise CacheError(f"key on {key.device}, value on {value.device}; use one device")
        b, h, t, dk = key.shape
        dv = value.shape[3]
        for name, spec, d in (("key", self.key_spec, dk), ("value", self.value_spec, dv)):
            if spec.axis == "token" and not spec.full_precision and d % spec.group_size:
                raise CacheError(
                    f"{name} head_dim={d} is not a multiple of group_size="
                    f"{spec.group_size} (per-token groups span channels); use a group size "
                    f"that divides {d}"
                )
        if self._shape is not None:
            want = self._shape
            if (b, h, dk, dv) != want:
                what = ["batch", "kv_heads", "key head_dim", "value head_dim"]
                bad = [f"{w} {g} (cache has {c})" for w, g, c in zip(what, (b, h, dk, dv), want,
                                                                    strict=True) if g != c]
                raise CacheError(
                    f"append does not match the cache: {', '.join(bad)}; use one cache per "
                    f"layer and batch (reorder() to change the batch)"
                )
            if key.device != self._device:
                raise CacheError(f"key on {key.device} but the cache lives on {self._device}")
        store = self.dtype
        if store is None and self._sink_k is not None:
            store = self._sink_k.dtype
        if store is None and self._res_k is not None:
            store = self._res_k.dtype
        if self.dtype is None and store is not None and key.dtype != store:
            raise CacheError(
                f"key/value dtype {key.dtype} differs from the cache dtype {store}; cast with "
                f".to({store}) or build the layer with dtype=..."
            )
        if t and not (torch.isfinite(key).all() and torch.isfinite(value).all()):
            which = "key" if not torch.isfinite(key).all() else "value"
            raise CacheError(
                f"{which} holds NaN or Inf; the cache was left unchanged (check the model "
                f"in full precision, or clamp activations before caching)"
            )
        pos = None
        if positions is not None:
            if not isinstance(positions, torch.Tensor) or positions.dtype not in (
                torch.int64, torch.int32
            ):
                raise CacheError("positions must be an int64 tensor [batch, tokens]")
            if positions.shape != (b, t):
                raise CacheError(
                    f"positions must be [batch, tokens] = {(b, t)}, got {tuple(positions.shape)}"
                )
            pos = positions.to(key.device, torch.int64)
        if self.pre_rope and pos is None:
            start = self.seq_len
            pos = torch.arange(start, start + t, device=key.device).expand(b, t)
        if self.pre_rope and t and (int(pos.min()) < 0 or int(pos.max()) >= 2**31):
            raise CacheError(f"positions must lie in [0, 2**31), got [{int(pos.min())}, "
                             f"{int(pos.max())}]")
        if self.rope is not None:
            if t and int(pos.max()) >= self.rope.max_positions:
                raise CacheError(
                    f"positions span [{int(pos.min())}, {int(pos.max())}] but the rotary table "
                    f"has {self.rope.max_positions} rows; build the RotarySpec longer"
                )
            if self.rope.rotary_dim > dk or self.rope.rotary_dim % 2:
                raise CacheError(
                    f"rotary_dim={self.rope.rotary_dim} must be even and <= head_dim={dk}"
                )
        if self.dtype is not None:
            key, value = key.to(self.dtype), value.to(self.dtype)
        return key, value, pos

    # ------------------------------------------------------------------ backend

    def _kernels(self, device: torch.device) -> Backend:
        """The backend record for ``device``, selected on first use and kept (a cleared
        layer may be refilled on another device, hence the key)."""
        if self._chosen is None or self._chosen[0] != device:
            self._chosen = (device, select(self.backend, device))
        return self._chosen[1]

    # ------------------------------------------------------------------ append

    def append(
        self, key: torch.Tensor, value: torch.Tensor, positions: torch.Tensor | None = None
    ) -> None:
        """Add ``key``/``value`` ``[B, Hkv, T, D]`` (pre-RoPE keys when ``rope`` is set).

        Args:
            positions: ``[B, T]`` int64 absolute positions of the new tokens (used for
                RoPE); default: the running index ``seq_len .. seq_len + T - 1``.
        Raises:
            CacheError: on bad input; the cache is left exactly as it was.
        """
        key, value, pos = self._validate_append(key, value, positions)
        b, h, t, dk = key.shape
        if t == 0:
            return
        quantize = self._kernels(key.device).quantize
        # Build the new state in locals, then commit: nothing below raises on valid input,
        # and an unexpected failure (e.g. out of memory) leaves the old state in place.
        store = key.dtype
        n_sink = self.n_sinks
        take = min(self.sinks - n_sink, t)
        sink_k, sink_v = self._sink_k, self._sink_v
        if take > 0:
            sink_k = _cat(sink_k, key[:, :, :take], 2)
            sink_v = _cat(sink_v, value[:, :, :take], 2)
        res_k, res_v = self._res_k, self._res_v
        if take < t:
            res_k = _cat(res_k, key[:, :, take:], 2)
            res_v = _cat(res_v, value[:, :, take:], 2)
        pk, pv, n_packed = self._pk, self._pv, self._n_packed
        r = 0 if res_k is None else res_k.shape[2]
        n_chunks = (r - self.residual) // self.chunk if r >= self.residual + self.chunk else 0
        if n_chunks:
            n = n_chunks * self.chunk
            # Chunks are independent groups, so quantizing n_chunks at once is bit-identical
            # to quantizing them one by one.
            qk = quantize(res_k[:, :, :n], self.key_spec, store)
            qv = quantize(res_v[:, :, :n], self.value_spec, store)
            # Full-precision specs have empty scale/zero: those buffers stay empty.
            pk = tuple(
                buf if x.numel() == 0 else buf.appended(x) for buf, x in zip(pk, qk, strict=True)
            )
            pv = tuple(
                buf if x.numel() == 0 else buf.appended(x) for buf, x in zip(pv, qv, strict=True)
            )
            n_packed += n
            res_k, res_v = res_k[:, :, n:].contiguous(), res_v[:, :, n:].contiguous()
        new_pos, max_pos = self._pos, self._max_pos
        if self.pre_rope:
            assert pos is not None
            new_pos = self._pos.appended(pos.to(torch.int32))
            max_pos = max(self._max_pos, int(pos.max()))
        # commit
        self._shape = (b, h, dk, value.shape[3])
        self._device = key.device
        self._sink_k, self._sink_v = sink_k, sink_v
        self._res_k, self._res_v = res_k, res_v
        if n_packed != self._n_packed:
            self._packed_views = None
        self._pk, self._pv, self._n_packed = pk, pv, n_packed
        self._pos, self._max_pos = new_pos, max_pos

    # ------------------------------------------------------------------ read

    def _packed(self) -> tuple[Packed, Packed]:
        # The views change only when a chunk is packed or rows are reordered: both reset
        # this cache (saves ~18 us of view building per decode step).
        if self._packed_views is not None:
            return self._packed_views

        def seg(bufs: tuple[Growing, ...]) -> Packed:
            codes = bufs[0].view()
            assert codes is not None
            empty = codes.new_empty(0, dtype=self._store_dtype())
            return Packed(*(empty if b.data is None else b.view() for b in bufs))

        views = (seg(self._pk), seg(self._pv))
        self._packed_views = views
        return views

    def _store_dtype(self) -> torch.dtype:
        t = self._sink_k if self._sink_k is not None else self._res_k
        assert t is not None
        return t.dtype

    def dequantized(self, dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The cache as the attention sees it, ``(k, v)`` ``[B, Hkv, seq_len, D]``.

        Packed groups are dequantized in fp32 (as attention does) and returned in ``dtype``
        (default: the storage dtype). Keys are as stored (pre-RoPE when ``rope`` is set).
        """
        if self._shape is None:
            raise CacheError("the cache is empty; append() first")
        store = self._store_dtype() if dtype is None else dtype
        ks, vs = [], []
        if self._sink_k is not None:
            ks.append(self._sink_k.to(store))
            vs.append(self._sink_v.to(store))
        if self._n_packed:
            pk, pv = self._packed()
            dequantize = self._kernels(self._device).dequantize
            ks.append(dequantize(pk, self.key_spec, store))
            vs.append(dequantize(pv, self.value_spec, store))
        if self._res_k is not None:
            ks.append(self._res_k.to(store))
            vs.append(self._res_v.to(store))
        return torch.cat(ks, dim=2), torch.cat(vs, dim=2)

    def _validate_query(self, query: Any, attn_mask: Any) -> None:
        if self._shape is None:
            raise CacheError("attend() on an empty cache; append() the keys and values first")
        b, h, dk, _ = self._shape
        if not isinstance(query, torch.Tensor) or query.dim() != 4:
            shape = tuple(query.shape) if isinstance(query, torch.Tensor) else type(query)
            raise CacheError(f"query must be [batch, q_heads, q_len, head_dim], got {shape}")
        if not query.dtype.is_floating_point:
            raise CacheError(f"query has dtype {query.dtype}; pass a floating tensor")
        qb, qh, tq, qd = query.shape
        if qb != b:
            raise CacheError(f"query batch {qb} != cache batch {b}; reorder() the cache first")
        if qd != dk:
            raise CacheError(f"query head_dim {qd} != key head_dim {dk}")
        if qh % h:
            raise CacheError(
                f"{qh} query heads are not a multiple of the cache's {h} kv heads (GQA needs "
                f"q_heads % kv_heads == 0)"
            )
        if query.device != self._device:
            raise CacheError(f"query on {query.device} but the cache lives on {self._device}")
        if not torch.isfinite(query).all():
            raise CacheError("query holds NaN or Inf")
        if attn_mask is not None:
            if not isinstance(attn_mask, torch.Tensor):
                raise CacheError("attn_mask must be a bool or float tensor")
            want = (b, qh, tq, self.seq_len)
            ok = attn_mask.dim() == 4 and all(
                m in (1, w) for m, w in zip(attn_mask.shape, want, strict=True)
            )
            if not ok or attn_mask.shape[1] not in (1, qh):
                raise CacheError(
                    f"attn_mask {tuple(attn_mask.shape)} does not broadcast to [batch, 1|heads, "
                    f"q_len, cached tokens] = {want}"
                )
            if not (attn_mask.dtype == torch.bool or attn_mask.dtype.is_floating_point):
                raise CacheError(f"attn_mask dtype {attn_mask.dtype}: use bool or float")

    def attend(
        self,
        query: torch.Tensor,
        *,
        scale: float | None = None,
        attn_mask: torch.Tensor | None = None,
        causal: bool = True,
        rope: RotarySpec | None = None,
    ) -> torch.Tensor:
        """Softmax attention of ``query [B, Hq, Tq, D]`` over every cached token.

        Args:
            query: post-RoPE queries (the model rotates them); ``Hq % Hkv == 0``.
            scale: multiplies ``q·k``; default ``1/sqrt(D)``.
            attn_mask: bool (True = attend) or additive float, broadcastable to
                ``[B, 1|Hq, Tq, seq_len]``. Takes precedence over ``causal``.
            causal: without a mask, query ``i`` sees cache index ``<= seq_len - Tq + i``.
            rope: the rotary table for this call (overrides the layer's ``rope``); the
                stored positions index it.
        Returns:
            ``[B, Hq, Tq, Dv]`` in ``query.dtype``.
        """
        self._validate_query(query, attn_mask)
        if rope is None:
            rope = self.rope
        elif not self.pre_rope:
            raise CacheError("attend(rope=...) on a layer built without pre_rope=True: its "
                             "keys are post-RoPE and no positions were stored")
        if rope is not None and rope.rotary_dim > query.shape[-1]:
            raise CacheError(f"rotary_dim={rope.rotary_dim} > head_dim={query.shape[-1]}")
        if rope is not None and self._max_pos >= rope.max_positions:
            raise CacheError(
                f"a cached key sits at position {self._max_pos} but the rotary table has "
                f"{rope.max_positions} rows; pass a table that covers every stored position"
            )
        b, hq, tq, d = query.shape
        total = self.seq_len
        scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
        mask = self._additive_mask(attn_mask, causal, tq, total, query.device)
        ns, npk = self.n_sinks, self._n_packed
        pk = pv = kpos = fpos = pmask = fmask = None
        if npk:
            pk, pv = self._packed()
        fk, fv = self._fp_segment()
        if rope is not None:
            p = self._pos.view()
            kpos = p[:, ns : ns + npk]
            fpos = torch.cat((p[:, :ns], p[:, ns + npk :]), dim=1)
        if mask is not None:
            if npk:
                pmask = self._drop_if_open(mask[..., ns : ns + npk])
            if fk is not None:
                pieces = (mask[..., :ns], mask[..., ns + npk :])
                fmask = self._drop_if_open(torch.cat(pieces, dim=-1))
        out, _ = self._kernels(query.device).decode_attention(
            query.float(), pk, pv, self.key_spec, self.value_spec, fk, fv,
            scale=scale, mask=pmask, fp_mask=fmask, rope=rope,
            k_positions=kpos, fp_positions=fpos, check_positions=False,  # checked above
        )
        return out.to(query.dtype)

    def _fp_segment(self) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Sinks and residual window as one full-precision segment ``(k, v)``."""
        fk = [t for t in (self._sink_k, self._res_k) if t is not None and t.shape[2]]
        fv = [t for t in (self._sink_v, self._res_v) if t is not None and t.shape[2]]
        if not fk:
            return None, None
        if len(fk) == 1:
            return fk[0], fv[0]
        return torch.cat(fk, dim=2), torch.cat(fv, dim=2)

    @staticmethod
    def _drop_if_open(mask: torch.Tensor | None) -> torch.Tensor | None:
        """None for a mask that hides nothing (lets kernels skip the mask read)."""
        if mask is None or mask.numel() == 0:
            return mask
        return None if bool((mask == 0).all()) else mask

    @staticmethod
    def _additive_mask(
        attn_mask: torch.Tensor | None, causal: bool, tq: int, total: int, device: torch.device
    ) -> torch.Tensor | None:
        if attn_mask is not None:
            return to_additive(attn_mask, device)
        if not causal or tq == 1:
            return None  # a single query at the end sees every cached token
        return causal_mask(tq, total, device)[None, None]

    # ------------------------------------------------------------------ misc

    def reorder(self, batch_index: torch.Tensor) -> None:
        """Select/reorder batch rows (beam search): row ``i`` becomes old row ``batch_index[i]``."""
        if self._shape is None:
            return
        if not isinstance(batch_index, torch.Tensor) or batch_index.dim() != 1 or (
            batch_index.dtype not in (torch.int64, torch.int32)
        ):
            raise CacheError("batch_index must be a 1-D int64 tensor")
        b = self._shape[0]
        if batch_index.numel() and (int(batch_index.min()) < 0 or int(batch_index.max()) >= b):
            raise CacheError(f"batch_index values must lie in [0, {b}); got {batch_index.tolist()}")
        idx = batch_index.to(self._device, torch.int64)

        def sel(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t.index_select(0, idx)

        self._sink_k, self._sink_v = sel(self._sink_k), sel(self._sink_v)
        self._res_k, self._res_v = sel(self._res_k), sel(self._res_v)
        self._packed_views = None
        self._pk = tuple(buf.index_select(idx) for buf in self._pk)
        self._pv = tuple(buf.index_select(idx) for buf in self._pv)
        self._pos = self._pos.index_select(idx)
        self._shape = (idx.numel(), *self._shape[1:])

    def memory_report(self) -> dict[str, Any]:
        """Bytes actually held, by segment, and what a plain fp16 cache would take.

        ``bytes`` counts codes, scales, zeros, sinks, residual and stored positions (the
        logical sizes; ``allocated_bytes`` adds the spare capacity of growing buffers).
        ``fp16_bytes`` is ``2 * B * Hkv * seq_len * (Dk + Dv)``.
        """
        tokens = self.seq_len
        sink = _nbytes(self._sink_k) + _nbytes(self._sink_v)
        resid = _nbytes(self._res_k) + _nbytes(self._res_v)
        codes = self._pk[0].nbytes + self._pv[0].nbytes
        scales = self._pk[1].nbytes + self._pv[1].nbytes
        zeros = self._pk[2].nbytes + self._pv[2].nbytes
        pos = self._pos.nbytes
        total = sink + resid + codes + scales + zeros + pos
        alloc = sink + resid + sum(buf.allocated_bytes for buf in (*self._pk, *self._pv))
        alloc += self._pos.allocated_bytes
        fp16 = 0
        if self._shape is not None:
            b, h, dk, dv = self._shape
            fp16 = 2 * b * h * tokens * (dk + dv)
        return {
            "tokens": tokens,
            "sink_tokens": self.n_sinks,
            "packed_tokens": self._n_packed,
            "residual_tokens": self.n_residual,
            "bytes": total,
            "sink_bytes": sink,
            "residual_bytes": resid,
            "code_bytes": codes,
            "scale_bytes": scales,
            "zero_bytes": zeros,
            "position_bytes": pos,
            "allocated_bytes": alloc,
            "fp16_bytes": fp16,
            "compression": fp16 / total if total else float("nan"),
        }
