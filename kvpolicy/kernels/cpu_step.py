"""The fused decode step of one paged layer on CPU: one C++ call per layer per step.

:class:`~kvpolicy.runtime.paged.PagedKV` serves a decode step (every sequence adds one
token) with :class:`FusedStep` where it covers the layer. One call of ``kvp_paged_step``
(:mod:`kvpolicy.kernels.cpu_ext`) does what the step's torch path does in some thirty small
ops: it rotates each new key back to pre-RoPE at its position, rotates each new value by
the layer's value rotation, writes both to the block's stage (and the sinks), attends the
query over sinks, the packed pages (read in place through the block table, each sequence
only over its own visible tokens: its length and the sliding window bound the work) and
the stage, and writes the output, rotated back, into the engine's rows in their dtype. A
chunk the step completes (once per C tokens of a sequence) is packed into its block in the
same call, with the torch quantizer's arithmetic (bit-identical codes, scales and zeros,
but where fit "mse" finds two candidates equal to fp32 rounding; see the kernel source),
for uniform levels; other levels (normal, vector codes) leave packing to the caller's
torch quantizer (:attr:`FusedStep.packs` says which).

Everything fixed for a layer (the pages' field pointers and strides, the specs' tables,
the rotary table, the checks of the specs against the pages) is resolved once, at
:meth:`FusedStep.build`; a call sets a dozen fields of a kept ``Step`` struct. The kernel
checks every sequence length, block id and position it reads against the pages and the
rotary table (a non-zero return, raised as :class:`~kvpolicy.errors.CacheError`).
"""

from __future__ import annotations

import ctypes
import logging
from typing import Any

import torch

from ..errors import CacheError
from . import cpu_ext
from .cpu_call import (
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
from .layout import FIT_STEPS, Packed, QuantSpec, RotarySpec

__all__ = ["FusedStep", "why_not"]

log = logging.getLogger(__name__)



def why_not(layout: Any, rope: RotarySpec | None, window: int | None) -> str | None:
    """Why the fused step does not cover a layer (None: it does)."""
    ks, vs = layout.key_spec, layout.value_spec
    if layout.full_precision:
        return "a 16-bit layout"
    why = specs_why_not(ks, vs)
    if why is not None:
        return why
    if layout.chunk < 2:
        return "a chunk of one token (no stage)"
    if layout.store_dtype not in DTYPE_CODES:
        return f"storage dtype {layout.store_dtype}"
    if rope is not None and (rope.style not in ("rotate_half", "interleaved")
                             or rope.rotary_dim % 2 or rope.offset):
        return f"a {rope.style} rotary table at offset {rope.offset}"
    if window is not None and window < 1:
        return f"window {window}"
    return None


class FusedStep:
    """One layer's decode step over its pages in one C++ call (see the module doc).

    Built with :meth:`build`, which returns None where the layer is not covered; then
    called once per step with the step's tensors.
    """

    def __init__(self, lib: Any, params: cpu_ext.Params, step: cpu_ext.Step,
                 key_spec: QuantSpec, value_spec: QuantSpec, keep: list, hq: int,
                 store: torch.dtype) -> None:
        self._lib, self._p, self._s = lib, params, step
        self._kbits, self._vbits = key_spec.bits, value_spec.bits
        self._keep = keep  # every tensor whose pointer the struct holds
        self.num_heads = hq
        self._can_pack = bool(step.pack)
        self._store = store

    @property
    def packs(self) -> bool:
        """Whether a call packs the chunks it completes (else the caller must). True where
        the layer's levels are uniform; settable to False (the caller's torch quantizer then
        packs, as ``bench/paged_decode.py`` compares)."""
        return bool(self._s.pack)

    @packs.setter
    def packs(self, on: bool) -> None:
        if on and not self._can_pack:
            raise CacheError("this layer's levels are not uniform: the fused step cannot "
                             "pack its chunks (the torch quantizer does)")
        self._s.pack = int(bool(on))

    @classmethod
    def build(
        cls, layout: Any, views: dict[str, torch.Tensor], *, num_heads: int, scale: float,
        rope: RotarySpec | None, rotation: torch.Tensor | None, window: int | None,
        softcap: float | None,
    ) -> FusedStep | None:
        """The fused step of a :class:`~kvpolicy.runtime.paged.PagedLayout` layer over
        ``views`` (its :meth:`~kvpolicy.runtime.paged.PagedLayout.views` of the pages), or
        None when the kernel does not cover the layer or cannot be built (the caller keeps
        its torch path; the reason is logged at debug level, a build failure once at
        warning level by :func:`~kvpolicy.kernels.cpu_ext.load`)."""
        why = why_not(layout, rope, window)
        ks, vs = layout.key_spec, layout.value_spec
        hkv, dk, dv = layout.num_kv_heads, layout.head_dim, layout.v_head_dim
        if why is None and num_heads % hkv:
            why = f"{num_heads} query heads on {hkv} kv heads"
        if why is not None:
            log.debug("kvpolicy: no fused decode step for this layer: %s", why)
            return None
        k = Packed(*(views[f"k_{x}"] for x in ("codes", "scale", "zero")))
        v = Packed(*(views[f"v_{x}"] for x in ("codes", "scale", "zero")))
        if (ks.meta8, vs.meta8) != (is_meta8(k), is_meta8(v)):
            raise CacheError(f"page scale/zero dtypes {k.scale.dtype}/{v.scale.dtype} do not "
                             f"match the metadata widths of {ks} / {vs}")
        half = 0 if rope is None else rope.rotary_dim // 2
        store = layout.store_dtype
        lib = load_library(ks, vs, dk, dv, half, store)
        if lib is None:
            return None
        keep: list[torch.Tensor] = []
        slabs = {}
        for name in ("k_codes", "k_scale", "k_zero", "v_codes", "v_scale", "v_zero"):
            t, sb, sh = bh_slabs(views[name])
            if t.numel() and t.data_ptr() != views[name].data_ptr():
                raise CacheError(f"the page field {name} is not laid out in slabs")
            slabs[name] = (t, sb, sh)
        book = value_codebook(vs, hkv)
        p = cpu_ext.Params(
            Hkv=hkv, rep=num_heads // hkv, Tq=1, Dk=dk, Dv=dv, Gk=ks.group_size,
            Gv=vs.group_size, sdt=DTYPE_CODES[store],
            softcap=0.0 if softcap is None else float(softcap),
            stab=scale_table_f32().data_ptr() if ks.meta8 or vs.meta8 else None,
        )
        for name, field in (("k_codes", "kc"), ("k_scale", "ks"), ("k_zero", "kz"),
                            ("v_codes", "vc"), ("v_scale", "vs"), ("v_zero", "vz")):
            t, sb, sh = slabs[name]
            keep.append(t)
            setattr(p, field, None if (field == "vz" and book is not None) else t.data_ptr())
            setattr(p, f"{field}_sb", sb)
            setattr(p, f"{field}_sh", sh)
        if rope is not None:
            cos, sin = compact_rope(rope)
            keep += [cos, sin]
            p.cosc, p.sinc, p.rope_rs = cos.data_ptr(), sin.data_ptr(), cos.stride(0)
            p.half, p.rope_style = half, 1 if rope.style == "rotate_half" else 2
        set_spec_tables(p, ks, vs, hkv, dk, book, keep)
        raw = views["stage_k"]  # any field: its page 0 starts the pages
        fields = {f.name: f for f in layout.fields}
        base = raw.data_ptr() - fields["stage_k"].offset
        s = cpu_ext.Step(
            pages=base, page_bytes=raw.stride(0) * raw.element_size(),
            num_blocks=raw.shape[0], bs=layout.block_size, C=layout.chunk,
            sinks=layout.sinks, window=0 if window is None else int(window),
            stage_k=fields["stage_k"].offset, stage_v=fields["stage_v"].offset,
            sink_k=fields["sink_k"].offset if layout.sinks else 0,
            sink_v=fields["sink_v"].offset if layout.sinks else 0,
            rope_rows=0 if rope is None else rope.max_positions,
            scale=float(scale), threads_from=THREADS_FROM,
            pack=int(ks.uniform and vs.uniform and not vs.vq),
            kfit=FIT_STEPS if ks.fit == "mse" else 0, vfit=FIT_STEPS if vs.fit == "mse" else 0,
        )
        if rotation is not None:
            rot = rotation.to("cpu", torch.float32).contiguous()
            if rot.shape != (dv, dv):
                raise CacheError(f"a value rotation of {dv} channels must be [{dv}, {dv}], "
                                 f"got {tuple(rot.shape)}")
            keep.append(rot)
            s.rot = rot.data_ptr()
        return cls(lib, p, s, ks, vs, keep, num_heads, store)

    def pack_chunks(self, k: torch.Tensor, v: torch.Tensor, blk: torch.Tensor,
                    off: torch.Tensor) -> None:
        """Quantize and pack whole chunks ``k/v [n, Hkv, C, D]`` (pre-RoPE keys, rotated
        values, as the stage holds them) into blocks ``blk [n]`` at token offsets ``off [n]``
        (multiples of the chunk): what :meth:`PagedKV._pack` does with the torch quantizer,
        bit-identical to it (see the module doc). Only where :attr:`packs` holds."""
        if not self.packs:
            raise CacheError("this fused step does not pack (levels not uniform)")
        s = self._s
        n = k.shape[0]
        if k.shape[2] != s.C or v.shape[2] != s.C or v.shape[0] != n:
            raise CacheError(f"pack_chunks takes whole chunks of {s.C} tokens, got k "
                             f"{tuple(k.shape)} and v {tuple(v.shape)}")
        if k.dtype != self._store:
            k = k.to(self._store)
        if v.dtype != self._store:
            v = v.to(self._store)
        k = k if k.stride(-1) == 1 else k.contiguous()
        v = v if v.stride(-1) == 1 else v.contiguous()
        blk = blk.to(torch.int64).contiguous()
        off = off.to(torch.int64).contiguous()
        rc = self._lib.kvp_pack_chunks(
            ctypes.byref(s), ctypes.byref(self._p), self._kbits, self._vbits,
            k.data_ptr(), k.stride(0), k.stride(1), k.stride(2),
            v.data_ptr(), v.stride(0), v.stride(1), v.stride(2), n, blk.data_ptr(),
            off.data_ptr())
        if rc:
            raise CacheError(f"packing chunks was refused: "
                             f"{cpu_ext.STEP_ERRORS.get(rc, f'error {rc}')}")

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                 seq_lens: torch.Tensor, block_table: torch.Tensor) -> None:
        """One decode step: sequence ``b`` adds token row ``b`` of ``q [B, Hq, Dk]``,
        ``k [B, Hkv, Dk]`` (rotated as the engine rotates it), ``v [B, Hkv, Dv]``, and its
        attention output goes to row ``b`` of ``out [B, Hq, Dv]`` (all four of one dtype:
        float32, bfloat16 or float16, the last dim contiguous). ``seq_lens [B]`` (tokens after
        this step) and ``block_table [B, blocks]`` are contiguous int64 (a step's, shared
        by its layers). Raises :class:`CacheError` for what the kernel refuses."""
        s = self._s
        dt = DTYPE_CODES.get(q.dtype)
        if dt is None or not (k.dtype == v.dtype == out.dtype == q.dtype):
            raise CacheError(f"the fused step takes q/k/v/out of one dtype among float32, "
                             f"bfloat16, float16; got {q.dtype}/{k.dtype}/{v.dtype}/{out.dtype}")
        for t in (q, k, v, out):
            if t.stride(-1) != 1:
                raise CacheError("the fused step needs q/k/v/out contiguous in the head dim")
        s.edt, s.B = dt, seq_lens.shape[0]
        s.seq_len = seq_lens.data_ptr()
        s.btab, s.btab_sb, s.btab_n = (block_table.data_ptr(), block_table.stride(0),
                                       block_table.shape[1])
        s.q, s.q_rs, s.q_hs = q.data_ptr(), q.stride(0), q.stride(1)
        s.k, s.k_rs, s.k_hs = k.data_ptr(), k.stride(0), k.stride(1)
        s.v, s.v_rs, s.v_hs = v.data_ptr(), v.stride(0), v.stride(1)
        s.out, s.o_rs, s.o_hs = out.data_ptr(), out.stride(0), out.stride(1)
        s.nthreads = torch.get_num_threads()
        rc = self._lib.kvp_paged_step(ctypes.byref(s), ctypes.byref(self._p), self._kbits,
                                      self._vbits)
        if rc:
            raise CacheError(f"the fused decode step refused the step: "
                             f"{cpu_ext.STEP_ERRORS.get(rc, f'error {rc}')}")
