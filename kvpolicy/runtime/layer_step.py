"""The fused decode step of one transformers layer on CPU: one C++ call per layer per step.

:meth:`PackedKVLayer.decode_step <kvpolicy.runtime.layer.PackedKVLayer.decode_step>` runs a
decode step (every batch row adds one token) through :class:`LayerStep` where it covers the
step, instead of ``append`` then ``attend`` (some forty small torch ops and checks). One call
of ``kvp_layer_step`` (:mod:`kvpolicy.kernels.cpu_ext`) checks the new key and value are
finite, writes the key (pre-RoPE, as the block gives it) and the value (rotated by the
layer's value rotation) into the layer's full-precision buffer, attends the query over
sinks, packed body and residual with one softmax (the model's boolean mask read in place: a
hidden head of the body, a sliding window's, becomes a bound, so those groups are not read;
a mask with holes becomes an additive mask), and writes the output, rotated back, in the
query's dtype. RoPE rows come from the step's table, whose row 0 may be a later position
(``Params.rope_off``: a local group's table starts at its least held position).

A chunk a decode step completes is packed by :meth:`LayerStep.pack` in one
``kvp_pack_chunks`` call (uniform levels: the torch quantizer's arithmetic, bit-identical),
written in place into the packed body's growing buffers.

What makes that one call possible is a buffer per layer that holds the sinks and the
residual side by side, ``[B, Hkv, sinks + residual + chunk, D]``, with room for the tokens a
chunk collects before it is packed: the layer's ``_sink_k`` and ``_res_k`` become views of
it (*adopting* the layer state, a copy of at most ``sinks + residual + chunk`` tokens), the
kernel appends in place, and a step only narrows the residual's view by one token. Every
other change to the layer (a chunk packed, a slide, a reorder, a general append) makes new
tensors, as it always did; the next step sees that the state is no longer the one it left
and adopts again (once per chunk of decode steps: the step that completes a chunk takes
the general path, which packs it).

Everything fixed between adoptions (the packed body's pointers and strides, the specs'
tables, the buffer's strides, the positions of the buffered tokens) sits in a kept
``Params`` struct; a step sets a dozen fields of an ``LStep``.

The general path is the oracle: tests compare every step with it (the same kernel
arithmetic; differences come only from the value rotation's summation order and the
merge order of the kernel's work items) and the held state after every step (identical,
packed chunks included).
"""

from __future__ import annotations

import ctypes
import os
from typing import Any

import torch

from ..errors import CacheError
from ..kernels import cpu_ext
from ..kernels.cpu_call import (
    CHUNK_TOKENS,
    DTYPE_CODES,
    THREADS_FROM,
    bh_slabs,
    compact_rope,
    is_meta8,
    load_library,
    scale_table_f32,
    set_spec_tables,
    specs_why_not,
    value_codebook,
)
from ..kernels.layout import FIT_STEPS, RotarySpec
from .positions import Positions, TokenPositions
from .recent import Recent

__all__ = ["ENABLED", "LayerStep", "why_not"]

# Whether layers run their decode steps fused (where covered). ``KVPOLICY_LAYER_STEP=0`` at
# import, or setting this to False, makes every step take ``append`` then ``attend`` (what
# ``bench/local_layers.py``'s unfused row and ``bench/layer_step_profile.py`` set).
ENABLED = os.environ.get("KVPOLICY_LAYER_STEP", "") != "0"


def why_not(layer: Any) -> str | None:
    """Why the fused step never covers ``layer``, a
    :class:`~kvpolicy.runtime.layer.PackedKVLayer` (None: it may, step by step)."""
    why = specs_why_not(layer.key_spec, layer.value_spec)
    if why is not None:
        return why
    if tuple(layer.residual_bits) != (16, 16):
        return f"residual_bits {layer.residual_bits} (a packed residual)"
    return None


def _single_run(pos: Positions | TokenPositions) -> int | None:
    """The int base of positions held as one contiguous run shared by every row, else None."""
    runs = pos.runs
    if len(runs) != 1 or runs[0].values is not None or not isinstance(runs[0].base, int):
        return None
    return runs[0].base


class LayerStep:
    """One transformers layer's decode step in one C++ call (see the module doc).

    Held by its :class:`~kvpolicy.runtime.layer.PackedKVLayer`; :meth:`__call__` returns
    None for a step it does not cover, having changed nothing.
    """

    def __init__(self, layer: Any) -> None:  # a PackedKVLayer
        self._layer = layer
        # why_not(layer), asked at the first call: a layer being copied or unpickled has
        # no attributes yet when its step is made
        self._never: str | None | bool = False
        self._state: tuple | None = None  # identities of the layer state last left
        self._lib: Any = None
        self._p: cpu_ext.Params | None = None
        self._s = cpu_ext.LStep(threads_from=THREADS_FROM)
        self._keep: list[torch.Tensor] = []
        self._buf: tuple[torch.Tensor, torch.Tensor] | None = None
        self._fpos: torch.Tensor | None = None
        self._rope_key: tuple | None = None
        self.steps = 0  # decode steps run fused
        self.chunks_packed = 0  # chunks (per batch row) packed in C++

    # A copy of the layer (copy.deepcopy, pickle) gets a step of its own, which adopts the
    # copied state at its first call (ctypes structs holding pointers cannot be copied).
    def __reduce__(self):
        return (_fresh, (self._layer,))

    @property
    def spare_bytes(self) -> int:
        """Bytes of the adopted buffer not held as tokens (its room for the next steps) and
        of the buffered positions; 0 while the layer state is not adopted."""
        if self._buf is None or not self._is_current():
            return 0
        k, v = self._buf
        b, h, cap = k.shape[:3]
        per_token = b * h * (k.shape[3] * k.element_size() + v.shape[3] * v.element_size())
        extra = 0 if self._fpos is None else self._fpos.numel() * self._fpos.element_size()
        held = self._layer.n_sinks + self._layer.n_residual  # the buffer's tokens
        return (cap - held) * per_token + extra

    def _key(self) -> tuple:
        lay = self._layer
        return (lay._pk, lay._pv, lay._sink_k, lay._res_k, lay._pos, lay._evicted)

    def _is_current(self) -> bool:
        s = self._state
        return s is not None and all(a is b for a, b in zip(s, self._key(), strict=True))

    # ------------------------------------------------------------------ adopt

    def _adopt(self, rope: RotarySpec | None) -> bool:
        """Move the layer's sinks and residual into a fresh buffer and build the kept
        ``Params``; False (nothing changed) where the kernel does not cover the layer."""
        lay = self._layer
        b, h, dk, dv = lay._shape
        ks, vs = lay.key_spec, lay.value_spec
        store = lay._store_dtype()
        if store not in DTYPE_CODES:
            return False
        fields: tuple = ()
        if lay._n_packed:
            k, v = lay._packed()
            if (ks.meta8, vs.meta8) != (is_meta8(k), is_meta8(v)):
                raise CacheError(f"stored scale/zero dtypes {k.scale.dtype}/{v.scale.dtype} "
                                 f"do not match the metadata widths of {ks} / {vs}")
            meta16 = [t for seg in (k, v) if not is_meta8(seg) for t in (seg.scale, seg.zero)]
            if any(t.numel() and t.dtype != store for t in meta16):
                return False  # 16-bit metadata in another dtype than the tokens
            fields = (("kc", k.codes), ("ks", k.scale), ("kz", k.zero), ("vc", v.codes),
                      ("vs", v.scale), ("vz", v.zero))
        half = 0 if rope is None else rope.rotary_dim // 2
        lib = load_library(ks, vs, dk, dv, half, store)
        if lib is None:
            return False
        ns, r = lay.n_sinks, lay.n_residual
        cap = ns + lay.residual + lay.chunk
        bk = torch.empty(b, h, cap, dk, dtype=store, device=lay._device)
        bv = torch.empty(b, h, cap, dv, dtype=store, device=lay._device)
        if ns:
            bk[:, :, :ns] = lay._sink_k
            bv[:, :, :ns] = lay._sink_v
        if r:
            bk[:, :, ns : ns + r] = lay._res_k.data
            bv[:, :, ns : ns + r] = lay._res_v.data
        fpos = None
        if lay.pre_rope:
            base = _single_run(lay._pos)
            if base is None:
                return False
            fpos = torch.empty(cap, dtype=torch.int64)
            fpos[:ns] = torch.arange(base, base + ns)
            first = base + ns + lay._n_packed
            fpos[ns : ns + r] = torch.arange(first, first + r)
        keep: list[torch.Tensor] = [bk, bv]
        book = value_codebook(vs, h)
        gk = ks.group_size
        p = cpu_ext.Params(
            B=b, Hkv=h, Dk=dk, Dv=dv, Tk=lay._n_packed, Gk=gk, Gv=vs.group_size,
            chunk=max(gk, CHUNK_TOKENS // gk * gk), sdt=DTYPE_CODES[store],
            stab=scale_table_f32().data_ptr() if ks.meta8 or vs.meta8 else None,
        )
        p.fk, p.fk_sb, p.fk_sh = bk.data_ptr(), bk.stride(0), bk.stride(1)
        p.fv, p.fv_sb, p.fv_sh = bv.data_ptr(), bv.stride(0), bv.stride(1)
        for name, t in fields:
            t, sb, sh = bh_slabs(t)
            keep.append(t)
            setattr(p, name, None if (name == "vz" and book is not None) else t.data_ptr())
            setattr(p, f"{name}_sb", sb)
            setattr(p, f"{name}_sh", sh)
        set_spec_tables(p, ks, vs, h, dk, book, keep)
        # commit: the layer's sinks and residual are now views of the buffer
        lay._sink_k = bk[:, :, :ns] if ns else None
        lay._sink_v = bv[:, :, :ns] if ns else None
        if lay._res_k is not None:
            lay._res_k = Recent(bk[:, :, ns : ns + r])
            lay._res_v = Recent(bv[:, :, ns : ns + r])
        self._lib, self._p, self._keep = lib, p, keep
        self._buf, self._fpos = (bk, bv), fpos
        self._half, self._rope_key, self._rope_tables = half, None, None
        self._state = self._key()
        return True

    # ------------------------------------------------------------------ pack

    def pack(self, k: torch.Tensor, v: torch.Tensor, pk: tuple, pv: tuple
             ) -> tuple[tuple, tuple] | None:
        """Whole chunks ``k/v [B, Hkv, n, D]`` (the residual's oldest tokens, in the storage
        dtype) quantized and packed onto the packed body's buffers ``pk``/``pv`` (tuples of
        :class:`~kvpolicy.runtime.growing.Growing`: codes, scale, zero) in one C++ call
        (``kvp_pack_chunks``, the torch quantizer's arithmetic), returning the grown
        buffers; None (nothing written that the layer holds) where it does not cover them:
        levels other than uniform, a layer this step has not adopted yet (a prefill, whose
        chunks the torch quantizer packs), an empty body."""
        lay = self._layer
        ks, vs = lay.key_spec, lay.value_spec
        if (not ENABLED or self._lib is None or self._never is not None or not ks.uniform
                or not vs.uniform or vs.vq or k.device.type != "cpu"
                or any(buf.data is None for buf in (*pk, *pv))):
            return None
        b, h, n, _ = k.shape
        c, gk = lay.chunk, ks.group_size
        if n % c or k.dtype != lay._store_dtype() or v.dtype != k.dtype:
            return None
        nc = n // c
        grown, p = [], self._p
        for name, buf, add in zip(("kc", "ks", "kz", "vc", "vs", "vz"), (*pk, *pv),
                                  (n // gk,) * 3 + (n,) * 3, strict=True):
            d = buf.data
            # room for the chunks (uninitialised: the kernel writes every byte of it)
            g = buf.appended(d.new_empty((*d.shape[:2], add, *d.shape[3:])))
            grown.append(g)
            region = g.data.narrow(2, g.start + buf.n, add)
            setattr(p, name, region.data_ptr())
            setattr(p, f"{name}_sb", region.stride(0))
            setattr(p, f"{name}_sh", region.stride(1))
        self._state = None  # the body moves: the next step adopts again
        st = cpu_ext.Step(num_blocks=b, bs=n, C=c,
                          kfit=FIT_STEPS if ks.fit == "mse" else 0,
                          vfit=FIT_STEPS if vs.fit == "mse" else 0)
        # chunk i of row r: [B, nc, Hkv, C, D], one contiguous copy of the chunks' tokens
        kc = k.reshape(b, h, nc, c, -1).transpose(1, 2).contiguous()
        vc = v.reshape(b, h, nc, c, -1).transpose(1, 2).contiguous()
        blk = torch.arange(b).repeat_interleave(nc)
        off = (torch.arange(nc) * c).repeat(b)
        rc = self._lib.kvp_pack_chunks(
            ctypes.byref(st), ctypes.byref(p), ks.bits, vs.bits,
            kc.data_ptr(), kc.stride(1), kc.stride(2), kc.stride(3),
            vc.data_ptr(), vc.stride(1), vc.stride(2), vc.stride(3), b * nc,
            blk.data_ptr(), off.data_ptr())
        if rc:
            raise CacheError(f"packing chunks was refused: "
                             f"{cpu_ext.STEP_ERRORS.get(rc, f'error {rc}')}")
        self.chunks_packed += b * nc
        return tuple(grown[:3]), tuple(grown[3:])

    # ------------------------------------------------------------------ step

    def __call__(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pos: TokenPositions | None,
        attn_mask: torch.Tensor | None, *, mask_inverted: bool, scale: float,
        rope: RotarySpec | None, softcap: float | None, rotation: torch.Tensor | None,
    ) -> torch.Tensor | None:
        """The step's output ``[B, Hq, 1, Dv]`` in ``q``'s dtype, the new token appended;
        or None (nothing changed) where the fused step does not cover it. ``k``/``v``
        ``[B, Hkv, 1, D]`` as the block gives them (the value not rotated yet), ``pos`` the
        new token's positions (pre-RoPE layers), ``attn_mask`` the model's boolean mask
        over the held tokens and this one (True: attend, or hides where
        ``mask_inverted``) or None."""
        lay = self._layer
        if self._never is False:
            self._never = why_not(lay)
        if (not ENABLED or self._never is not None or lay._shape is None
                or q.device.type != "cpu" or lay.kernels(q.device).name != "torch"):
            return None  # (a layer built for the Triton kernels keeps them, as on a GPU)
        b, h, dk, dv = lay._shape
        if (k.shape != (b, h, 1, dk) or v.shape != (b, h, 1, dv) or q.shape[0] != b
                or q.shape[1] % h or q.shape[2] != 1 or q.shape[3] != dk):
            return None
        dt = DTYPE_CODES.get(q.dtype)
        if dt is None or k.dtype != q.dtype or v.dtype != q.dtype:
            return None
        if lay.dtype is None and q.dtype != lay._store_dtype():
            return None  # the general path says why
        if k.stride(-1) != 1 or v.stride(-1) != 1 or q.stride(-1) != 1:
            return None
        r = lay.n_residual
        if r + 1 >= lay.residual + lay.chunk:
            return None  # this step completes a chunk: the general path packs it
        if lay.n_seen < lay.sinks:
            return None  # the new token is a sink: the general path
        if (rope is None) == lay.pre_rope or (rope is not None and (
                rope.style not in ("rotate_half", "interleaved") or rope.rotary_dim % 2)):
            return None
        newpos = None
        if lay.pre_rope:
            if pos is None:
                return None
            newpos, held = _single_run(pos), _single_run(lay._pos)
            if newpos is None or held is None or newpos != held + lay._pos.n:
                return None
            if held < rope.offset or newpos - rope.offset >= rope.max_positions:
                return None  # the general path raises with the cause
        # A sliding window is the model's mask (as for attend): the kernel turns the hidden
        # head of the body into a bound, so a window layer reads only what it can see.
        ns = lay.n_sinks
        mask = None
        if attn_mask is not None:
            m = attn_mask
            if (m.dtype != torch.bool or m.dim() != 4 or m.shape[1] != 1 or m.shape[2] != 1
                    or m.shape[0] not in (1, b) or m.stride(-1) != 1 or m.shape[3] < 2):
                return None
            if lay.window is None and m.shape[3] != lay.seq_len + 1:
                return None  # the general path says what is wrong with it
            mask = m
        if not self._is_current() and not self._adopt(rope):
            self._state = None
            return None
        p, s = self._p, self._s
        if rope is not None:
            if rope.rotary_dim // 2 != self._half:
                return None
            if self._rope_key is not rope:  # a new table (one that grew): its pointers
                cos, sin = compact_rope(rope)
                self._rope_tables = (cos, sin)  # kept alive while the struct points at them
                p.cosc, p.sinc, p.rope_rs = cos.data_ptr(), sin.data_ptr(), cos.stride(0)
                p.half, p.rope_style = self._half, 1 if rope.style == "rotate_half" else 2
                self._rope_key = rope
            p.ppos0, p.rope_off = _single_run(lay._pos) + ns, rope.offset
        p.Tk = lay._n_packed
        p.rep = q.shape[1] // h
        p.softcap = 0.0 if softcap is None else float(softcap)
        s.q, s.q_bs, s.q_hs = q.data_ptr(), q.stride(0), q.stride(1)
        s.k, s.k_bs, s.k_hs = k.data_ptr(), k.stride(0), k.stride(1)
        s.v, s.v_bs, s.v_hs = v.data_ptr(), v.stride(0), v.stride(1)
        out = q.new_empty((b, q.shape[1], 1, dv))
        s.out, s.o_bs, s.o_hs = out.data_ptr(), out.stride(0), out.stride(1)
        s.edt, s.scale = dt, float(scale)
        rot = None
        if rotation is not None:
            rot = rotation if (rotation.dtype == torch.float32 and rotation.is_contiguous()
                               and rotation.device.type == "cpu") else (
                rotation.to("cpu", torch.float32).contiguous())
        s.rot = None if rot is None else rot.data_ptr()
        s.at = ns + r
        s.fpos = None if self._fpos is None else self._fpos.data_ptr()
        s.newpos = 0 if newpos is None else newpos
        s.ns, s.plo = ns, 0
        if mask is None:
            s.mask = None
        else:
            s.mask, s.mask_n = mask.data_ptr(), mask.shape[3]
            s.mask_bs = mask.stride(0) if mask.shape[0] > 1 else 0
            s.mask_inv = int(mask_inverted)
        s.nthreads = torch.get_num_threads()
        rc = self._lib.kvp_layer_step(ctypes.byref(s), ctypes.byref(p), lay.key_spec.bits,
                                      lay.value_spec.bits)
        if rc == 8:
            raise CacheError("key or value holds NaN or Inf; the cache was left unchanged "
                             "(check the model in full precision, or clamp activations "
                             "before caching)")
        if rc:
            raise CacheError(f"the fused decode step refused the step: "
                             f"{cpu_ext.STEP_ERRORS.get(rc, f'error {rc}')}")
        # commit: the residual's view grows by the token the kernel wrote
        bk, bv = self._buf
        lay._res_k = Recent(bk[:, :, ns : ns + r + 1])
        lay._res_v = Recent(bv[:, :, ns : ns + r + 1])
        if pos is not None:
            lay._pos = lay._pos.appended(pos, lay._device)
        self._state = self._key()
        self.steps += 1
        return out


def _fresh(layer: Any) -> LayerStep:
    return LayerStep(layer)

