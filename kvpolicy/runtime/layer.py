"""The runtime: one layer of packed KV cache (sinks + packed groups + residual window).

A layer holds, per batch row and kv head, three segments of the token axis::

    [ sinks: first S tokens | packed: whole chunks, quantized | residual: recent tokens ]
      full precision          key_spec / value_spec             residual_bits (16: full
                                                                precision; runtime.recent)

K and V share one segmentation. The residual overflows in chunks of
``lcm(key_spec.token_group, value_spec.token_group)`` tokens: a chunk is packed once the
residual holds at least ``residual + chunk`` tokens, oldest first, and a packed token is
never re-quantized. Packing therefore happens at the same token indices whether tokens
arrive one at a time or in bulk, so both give bit-identical caches.

A sliding-window layer (``window`` W: query ``i`` sees keys ``i - W < j <= i``, as the
model's mask says) drops what no later query can see: :meth:`slide`, called after each
step, frees the sinks, whole packed chunks and residual tokens that lie before the
window, so the layer holds at most ``max(W - 1 + chunk, residual + chunk)`` tokens
between steps. ``seq_len`` counts the tokens held,
``n_seen`` every token appended since the last :meth:`clear` (the running index).

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
from ..kernels.backend import Backend, select
from ..kernels.contract import quantize_in_blocks
from ..kernels.layout import Packed, QuantSpec, RotarySpec
from ..kernels.masks import mask_rows, none_if_open
from .checks import (
    align_window_mask,
    check_batch_index,
    check_finite,
    check_layer_args,
    check_pair,
    check_query,
    check_rope,
    check_softcap,
    check_table,
    data_checks,
)
from .growing import Growing
from .layer_step import LayerStep
from .memory import layer_memory
from .positions import Positions, TokenPositions, least_position
from .recent import Recent, check_residual_bits, recent_spec

__all__ = ["PackedKVLayer"]

# Query rows per attention call of a multi-token query: its scores and mask rows are
# [B, Hq, _ROWS, seq_len] at most, whatever Tq is. NOTE: a 1,024-token chunk onto 8K
# packed tokens (2 kv heads, 4 query heads, D=64, 1 thread): 259 / 233 / 238 / 268 ms at
# 64 / 128 / 256 / 512 rows per call; 1,024 rows (past the C++ kernel's row limit) 712 ms.
_ROWS = 256
# Elements of one quantize call (its fp32 temporaries are a few times this). NOTE: 32K
# tokens x 2 heads x 64 channels at 2 bits, 1 thread: keys / values 29 / 37 ms in one
# call, 30 / 40 ms in blocks of this size, 27 / 38 ms in blocks of a quarter of it.
_QUANT_ELEMENTS = 1 << 20


def _cat(a: torch.Tensor | None, b: torch.Tensor, dim: int) -> torch.Tensor:
    return b.clone() if a is None else torch.cat((a, b), dim=dim)


class PackedKVLayer:
    """One layer's key/value cache: full-precision sinks, packed groups, residual window.

    Args:
        key_spec, value_spec: how keys and values are packed (``bits == 16`` keeps them
            in full precision).
        residual: R, recent tokens kept out of the packed body.
        residual_bits: how the residual's tokens are held, for keys and values (an int:
            both): 16, full precision; 8 or 4, packed per token (``runtime.recent``).
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
        window: the model's sliding window W for this layer, or None (global attention):
            :meth:`slide` then evicts tokens that have left the window.
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
        window: int | None = None,
        residual_bits: int | tuple[int, int] = 16,
    ) -> None:
        check_layer_args(key_spec, value_spec, residual, sinks, backend, window, dtype)
        rb = (residual_bits,) * 2 if isinstance(residual_bits, int) else tuple(residual_bits)
        for b in rb:
            check_residual_bits(b)  # here, not at the first append
        self.residual_bits: tuple[int, int] = rb  # type: ignore[assignment]
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
        self.window = window
        self.chunk = math.lcm(key_spec.token_group, value_spec.token_group)
        self._chosen: tuple[torch.device, Backend] | None = None  # see _kernels
        self._reset()
        self._step = LayerStep(self)  # the fused decode step (runtime.layer_step)

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
        self._res_k: Recent | None = None  # [B, Hkv, r, Dk]
        self._res_v: Recent | None = None
        # Positions of pre-RoPE keys (only those), implicit where contiguous
        # (runtime.positions). NOTE: at 2 bits with SmolLM2 shapes a token costs ~150 bytes
        # per layer; int32 positions per token took the 8K compression of
        # bench/cache_memory.py from 4.92x to 4.79x.
        self._pos = Positions()
        self._evicted = 0  # tokens dropped from the front by slide()

    def clear(self) -> None:
        """Drop every token (keeps the configuration)."""
        self._reset()

    @property
    def seq_len(self) -> int:
        """Tokens held (sinks + packed + residual)."""
        return self.n_sinks + self._n_packed + self.n_residual

    @property
    def n_seen(self) -> int:
        """Tokens appended since the last clear: evicted + held (the running index)."""
        return self._evicted + self.seq_len

    @property
    def n_evicted(self) -> int:
        """Tokens :meth:`slide` has dropped from the front (a sliding-window layer)."""
        return self._evicted

    @property
    def n_sinks(self) -> int:
        return 0 if self._sink_k is None else self._sink_k.shape[2]

    @property
    def n_packed(self) -> int:
        return self._n_packed

    @property
    def n_residual(self) -> int:
        return 0 if self._res_k is None else self._res_k.n

    @property
    def batch_size(self) -> int | None:
        return None if self._shape is None else self._shape[0]

    def positions(self) -> torch.Tensor | None:
        """Stored key positions ``[B, seq_len]`` int64 (None unless keys are pre-RoPE)."""
        if self._device is None or not self._pos.n:
            return None
        return self._pos.tensor(self._device).contiguous()

    def held_positions(self) -> Positions:
        """The stored positions as runs (``runtime.positions``; read-only)."""
        return self._pos

    # ------------------------------------------------------------------ validation

    def _validate_append(
        self, key: Any, value: Any, positions: Any
    ) -> tuple[torch.Tensor, torch.Tensor, TokenPositions | None]:
        check_pair(key, value, self.key_spec, self.value_spec)
        b, h, t, dk = key.shape
        dv = value.shape[3]
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
        check_finite(key, value)
        pos = None
        if positions is not None or self.pre_rope:
            # Default: the running index, known without a sync.
            pos = TokenPositions.checked(positions, b, t, key.device, self.n_seen)
        if self.rope is not None:
            check_table(self.rope, pos, dk)
        if self.dtype is not None:
            key, value = key.to(self.dtype), value.to(self.dtype)
        return key, value, pos

    # ------------------------------------------------------------------ backend

    def kernels(self, device: torch.device) -> Backend:
        """The backend record for ``device``, selected on first use and kept (a cleared
        layer may be refilled on another device, hence the key)."""
        if self._chosen is None or self._chosen[0] != device:
            self._chosen = (device, select(self.backend, device))
        return self._chosen[1]

    # ------------------------------------------------------------------ append

    def append(
        self, key: torch.Tensor, value: torch.Tensor,
        positions: torch.Tensor | TokenPositions | None = None,
    ) -> None:
        """Add ``key``/``value`` ``[B, Hkv, T, D]`` (pre-RoPE keys when ``rope`` is set).

        Args:
            positions: ``[B, T]`` int64 absolute positions of the new tokens (used for
                RoPE; contiguous rows are kept as a base, the rest per token), or
                ``runtime.positions.TokenPositions`` with known bounds (no device sync);
                default: the running index ``n_seen .. n_seen + T - 1``.
        Raises:
            CacheError: on bad input; the cache is left exactly as it was.
        """
        key, value, pos = self._validate_append(key, value, positions)
        b, h, t, dk = key.shape
        if t == 0:
            return
        kernels = self.kernels(key.device)
        quantize = kernels.quantize
        # Build the new state in locals, then commit: nothing below raises on valid input,
        # and an unexpected failure (e.g. out of memory) leaves the old state in place.
        store = key.dtype
        # Sinks are the first tokens ever appended (counted with the evicted ones).
        take = max(0, min(self.sinks - self.n_seen, t))
        sink_k, sink_v = self._sink_k, self._sink_v
        if take > 0:
            sink_k = _cat(sink_k, key[:, :, :take], 2)
            sink_v = _cat(sink_v, value[:, :, :take], 2)
        res_k, res_v = self._res_k, self._res_v
        if take < t:
            new_k, new_v = Recent.pair(
                key[:, :, take:], value[:, :, take:], recent_spec(self.residual_bits[0], dk),
                recent_spec(self.residual_bits[1], value.shape[3]), quantize)
            res_k = new_k if res_k is None else res_k.joined(new_k)
            res_v = new_v if res_v is None else res_v.joined(new_v)
        pk, pv, n_packed = self._pk, self._pv, self._n_packed
        r = 0 if res_k is None else res_k.n
        n_chunks = (r - self.residual) // self.chunk if r >= self.residual + self.chunk else 0
        if n_chunks:
            n = n_chunks * self.chunk
            ck = res_k.tokens(0, n).values(kernels.dequantize)
            cv = res_v.tokens(0, n).values(kernels.dequantize)
            # Packed in C++ where the fused step can (bit-identical; runtime.layer_step).
            got = self._step.pack(ck, cv, pk, pv)
            if got is not None:
                pk, pv = got
            else:
                # Chunks are independent groups, so quantizing them in blocks is
                # bit-identical to quantizing them one by one; blocks bound the fp32
                # temporaries of a long prefill to a few _QUANT_ELEMENTS each.
                per = max(1, _QUANT_ELEMENTS // (b * h * max(dk, value.shape[3]) * self.chunk))
                qk = quantize_in_blocks(quantize, ck, self.key_spec, store, per * self.chunk)
                qv = quantize_in_blocks(quantize, cv, self.value_spec, store, per * self.chunk)
                # Full-precision specs have a 1-D empty scale/zero: those buffers stay empty
                # (a vq zero [B, H, n, 0] grows with the tokens, keeping its dtype and shape).
                pk = tuple(buf if x.dim() == 1 else buf.appended(x)
                           for buf, x in zip(pk, qk, strict=True))
                pv = tuple(buf if x.dim() == 1 else buf.appended(x)
                           for buf, x in zip(pv, qv, strict=True))
            n_packed += n
            res_k, res_v = res_k.tokens(n).contiguous(), res_v.tokens(n).contiguous()
        new_pos = self._pos
        if self.pre_rope:
            assert pos is not None
            new_pos = self._pos.appended(pos, key.device)
        # commit
        self._shape = (b, h, dk, value.shape[3])
        self._device = key.device
        self._sink_k, self._sink_v = sink_k, sink_v
        self._res_k, self._res_v = res_k, res_v
        if n_packed != self._n_packed:
            self._packed_views = None
        self._pk, self._pv, self._n_packed = pk, pv, n_packed
        self._pos = new_pos

    def slide(self) -> int:
        """Evict what no query after the last appended token can see; returns the count.

        With a window W the next query (at index ``n_seen``) sees keys from index
        ``n_seen - W + 1`` on. Sinks before that index go, then whole packed chunks that
        end before it (a chunk the window still reaches stays whole), then, once nothing
        is packed, the residual's oldest tokens (a window shorter than the residual).
        A layer without a window keeps everything (returns 0). Call it after a step has
        attended (``KVAttend`` does): the step's own queries may reach one token further.
        """
        if self.window is None or self._shape is None:
            return 0
        drop = self.n_seen - self.window + 1 - self._evicted  # held tokens out of reach
        if drop <= 0:  # none yet (a short residual packs chunks before the window fills)
            return 0
        ns = self.n_sinks
        d_s = max(0, min(ns, drop))
        d_p = d_r = 0
        if d_s == ns:
            d_p = min(self._n_packed, (drop - ns) // self.chunk * self.chunk)
            if d_p == self._n_packed:
                d_r = max(0, min(self.n_residual, drop - ns - d_p))
        if d_s + d_p + d_r == 0:
            return 0
        sink_k, sink_v = self._sink_k, self._sink_v
        if d_s:  # a copy, so that the dropped sinks are freed
            sink_k = None if d_s == ns else sink_k[:, :, d_s:].clone()
            sink_v = None if d_s == ns else sink_v[:, :, d_s:].clone()
        pk, pv = self._pk, self._pv
        if d_p:
            # Every buffer holds a whole number of entries per chunk along dim 2.
            pk = tuple(buf if buf.data is None else buf.dropped(buf.n * d_p // self._n_packed)
                       for buf in pk)
            pv = tuple(buf if buf.data is None else buf.dropped(buf.n * d_p // self._n_packed)
                       for buf in pv)
        res_k, res_v = self._res_k, self._res_v
        if d_r:  # a view: the next append's concatenation frees the dropped tokens
            res_k, res_v = res_k.tokens(d_r), res_v.tokens(d_r)
        n = d_s + d_p + d_r
        new_pos = self._pos.dropped(n) if self._pos.n else self._pos
        # commit
        self._sink_k, self._sink_v = sink_k, sink_v
        self._res_k, self._res_v = res_k, res_v
        self._pk, self._pv, self._n_packed = pk, pv, self._n_packed - d_p
        self._packed_views = None
        self._pos = new_pos
        self._evicted += n
        return n

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
        dequantize = self.kernels(self._device).dequantize
        ks, vs = [], []
        if self._sink_k is not None:
            ks.append(self._sink_k.to(store))
            vs.append(self._sink_v.to(store))
        if self._n_packed:
            pk, pv = self._packed()
            ks.append(dequantize(pk, self.key_spec, store))
            vs.append(dequantize(pv, self.value_spec, store))
        if self._res_k is not None:
            ks.append(self._res_k.values(dequantize, store))
            vs.append(self._res_v.values(dequantize, store))
        return torch.cat(ks, dim=2), torch.cat(vs, dim=2)

    def _validate_query(
        self, query: Any, attn_mask: Any, pending: torch.Tensor | None = None
    ) -> None:
        if self._shape is None and pending is None:
            raise CacheError("attend() on an empty cache; append() the keys and values first")
        # [B, Hkv, *, Dk] on the cache's device (an empty cache: the pending keys)
        ref = next(t for t in (self._sink_k, self._res_k, pending) if t is not None)
        (b, h, _, dk), device = ref.shape, ref.device
        check_query(query, attn_mask, (b, h, dk), device,
                    self.seq_len + (0 if pending is None else pending.shape[2]))

    def attend(
        self,
        query: torch.Tensor,
        *,
        scale: float | None = None,
        attn_mask: torch.Tensor | None = None,
        causal: bool = True,
        rope: RotarySpec | None = None,
        pending: tuple[torch.Tensor, torch.Tensor, torch.Tensor | None] | None = None,
        softcap: float | None = None,
    ) -> torch.Tensor:
        """Softmax attention of ``query [B, Hq, Tq, D]`` over every cached token.

        Args:
            query: post-RoPE queries (the model rotates them); ``Hq % Hkv == 0``.
            scale: multiplies ``q·k``; default ``1/sqrt(D)``.
            attn_mask: bool (True = attend) or additive float, broadcastable to
                ``[B, 1|Hq, Tq, seq_len (+ pending)]``. Takes precedence over ``causal``.
            causal: without a mask, query ``i`` sees key ``<= total - Tq + i``, where
                ``total`` counts the cached and the pending tokens.
            rope: the rotary table for this call (overrides the layer's ``rope``); the
                stored positions index it.
            pending: ``(key, value, positions)`` of tokens that follow the cached ones and
                are not stored, attended in full precision (the residual's dtype); the
                arguments of :meth:`append`, which the caller calls next. A chunk of a
                prompt attends over its own tokens this way, as a prefill does.
            softcap: cap every score at ``softcap * tanh(s / softcap)`` before the mask
                (Gemma2's logit soft-capping), in every segment; None: no cap.
        Returns:
            ``[B, Hq, Tq, Dv]`` in ``query.dtype``.

        A query of many rows is attended in blocks of rows, each with only its own rows of
        the mask: no ``[Tq, seq_len]`` mask or score matrix is built.
        """
        new_k = new_v = new_pos = None
        if pending is not None:
            new_k, new_v, new_pos = self._validate_append(*pending)
        if self.window is not None:
            attn_mask = align_window_mask(
                attn_mask, self.seq_len + (0 if new_k is None else new_k.shape[2]))
        self._validate_query(query, attn_mask, new_k)
        check_softcap(softcap)
        if rope is None:
            rope = self.rope
        elif not self.pre_rope:
            raise CacheError("attend(rope=...) on a layer built without pre_rope=True: its "
                             "keys are post-RoPE and no positions were stored")
        max_pos = self._pos.hi
        if rope is not None and new_pos is not None and new_pos.count:
            max_pos = max(max_pos, new_pos.hi)
        check_rope(rope, max_pos, query.shape[-1], least_position(self._pos, new_pos))
        tq, d = query.shape[2:]
        scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
        ns, npk = self.n_sinks, self._n_packed
        pk = pv = kpos = fpos = None
        if npk:
            pk, pv = self._packed()
        fk, fv = self._fp_segment()
        if rope is not None and self._pos.n:  # as rows of the table
            dev, n = query.device, self._pos.n
            kpos = rope.rows_of(self._pos.tensor(dev, ns, ns + npk))
            fpos = rope.rows_of(self._pos.tensor(dev, 0, ns) if ns + npk == n else torch.cat(
                (self._pos.tensor(dev, 0, ns), self._pos.tensor(dev, ns + npk, n)), dim=1))
        total = self.seq_len
        if new_k is not None and new_k.shape[2]:
            total += new_k.shape[2]
            fk = new_k if fk is None else torch.cat((fk, new_k), dim=2)
            fv = new_v if fv is None else torch.cat((fv, new_v), dim=2)
            if rope is not None:
                new = rope.rows_of(new_pos.tensor(query.device))
                fpos = new if fpos is None else torch.cat((fpos, new), dim=1)
        decode = self.kernels(query.device).decode_attention
        look = data_checks(query.device, tq)
        outs = []
        for r0 in range(0, tq, _ROWS):
            rows = range(r0, min(tq, r0 + _ROWS))
            mask = mask_rows(attn_mask, causal, rows, tq, total, query.device)
            pmask = fmask = None
            if mask is not None:
                # An open mask is dropped (the kernels then skip reading it) where looking
                # costs no stall (runtime.checks.data_checks); elsewhere it is read as is.
                open_ = none_if_open if look else (lambda m: m)
                if npk:
                    pmask = open_(mask[..., ns : ns + npk])
                if fk is not None:
                    pieces = (mask[..., :ns], mask[..., ns + npk :])
                    fmask = open_(torch.cat(pieces, dim=-1))
            outs.append(decode(
                query[:, :, r0 : rows.stop], pk, pv, self.key_spec, self.value_spec,
                fk, fv, scale=scale, mask=pmask, fp_mask=fmask, rope=rope, softcap=softcap,
                k_positions=kpos, fp_positions=fpos, check_positions=False,  # checked above
            )[0])
        return (outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)).to(query.dtype)

    def decode_step(
        self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
        positions: TokenPositions | None, attn_mask: torch.Tensor | None = None, *,
        mask_inverted: bool = False, scale: float | None = None,
        rope: RotarySpec | None = None, softcap: float | None = None,
        rotation: torch.Tensor | None = None,
    ) -> torch.Tensor | None:
        """``append(key, value @ rotation, positions)`` then ``attend(query, ...) @
        rotation.T`` in one fused C++ call (:mod:`kvpolicy.runtime.layer_step`; ``[B, H, 1,
        D]`` each, ``attn_mask`` boolean ``[B|1, 1, 1, seq_len + 1]``, True hiding with
        ``mask_inverted``), or None, nothing changed, where it does not cover the step."""
        scale = 1.0 / math.sqrt(query.shape[-1]) if scale is None else float(scale)
        return self._step(query, key, value, positions, attn_mask,
                          mask_inverted=mask_inverted, scale=scale,
                          rope=self.rope if rope is None else rope, softcap=softcap,
                          rotation=rotation)

    def warm_up(self, query: torch.Tensor, *, rope: RotarySpec | None = None,
                softcap: float | None = None) -> bool:
        """Compile the decode kernels of this layer's steps for queries like ``query``
        (``KVAttend`` calls it after a GPU prefill, so that the first step does not stall);
        returns False for a backend with nothing to compile or an empty layer."""
        backend = self.kernels(query.device)
        if backend.warm_up is None or self._shape is None:
            return False
        _, h, dk, _ = self._shape
        backend.warm_up(
            self.key_spec, self.value_spec, n_kv_heads=h, gqa=query.shape[1] // h,
            head_dim=dk, dtype=self._store_dtype(), device=query.device,
            query_dtype=query.dtype, rope=(rope or self.rope) if self.pre_rope else None,
            softcap=softcap)
        return True

    def _fp_segment(self) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Sinks and residual window as one full-precision segment ``(k, v)`` (a packed
        residual dequantized)."""
        res = (self._res_k, self._res_v)
        if self._res_k is not None and self._res_k.n:
            dequantize = self.kernels(self._device).dequantize
            res = tuple(r.values(dequantize) for r in res)
        fk = [t for t in (self._sink_k, res[0]) if t is not None and t.shape[2]]
        fv = [t for t in (self._sink_v, res[1]) if t is not None and t.shape[2]]
        if not fk:
            return None, None
        if len(fk) == 1:
            return fk[0], fv[0]
        return torch.cat(fk, dim=2), torch.cat(fv, dim=2)

    # ------------------------------------------------------------------ misc

    def reorder(self, batch_index: torch.Tensor) -> None:
        """Select/reorder batch rows (beam search): row ``i`` becomes old row ``batch_index[i]``."""
        if self._shape is None:
            return
        check_batch_index(batch_index, self._shape[0], data_checks(self._device, 1))
        idx = batch_index.to(self._device, torch.int64)

        def sel(t: torch.Tensor | Recent | None) -> torch.Tensor | Recent | None:
            return None if t is None else t.select(idx) if isinstance(t, Recent) else (
                t.index_select(0, idx))

        self._sink_k, self._sink_v = sel(self._sink_k), sel(self._sink_v)
        self._res_k, self._res_v = sel(self._res_k), sel(self._res_v)
        self._packed_views = None
        self._pk = tuple(buf.index_select(idx) for buf in self._pk)
        self._pv = tuple(buf.index_select(idx) for buf in self._pv)
        self._pos = self._pos.select(idx)
        self._shape = (idx.numel(), *self._shape[1:])

    def memory_report(self) -> dict[str, Any]:
        """Bytes actually held, by segment, and what a plain fp16 cache would take
        (:func:`kvpolicy.runtime.memory.layer_memory` says what each entry counts)."""
        return layer_memory(self)
