"""A packed KV cache in fixed-size pages: what a paged serving engine (vLLM) allocates
(docs/design.md §8).

A serving engine hands every attention layer one byte tensor ``[num_blocks, page_bytes]``
and, per step, a table of the blocks each sequence owns. :class:`PagedLayout` says what a
page holds for one layer's policy, and :class:`PagedKV` appends to pages and attends over
them with kvpolicy's kernels (``kernels.backend``), so the engine counts packed bytes, not
fp16 ones. A page of ``block_size`` tokens (per kv head)::

    key codes + scales/zeros   (bs / G groups of G tokens, one scale per channel)
    value codes + scales/zeros (bs tokens, groups of channels)
    stage: C tokens of K and V in full precision (the block's incomplete group)
    sinks: S tokens of K and V in full precision (used in a sequence's first block)

Groups never span two blocks or two sequences: token ``p`` of a sequence lives in block
``p // bs`` and its key group is the C tokens ``[p // C * C, p // C * C + C)`` (C = the
chunk, ``lcm`` of both tensors' token groups; ``bs % C == 0``). A token is written to its
block's stage when it arrives and packed once its chunk is complete, so the tokens in full
precision are the sinks and the incomplete chunk: the paged cache's residual window is
that chunk, not the policy's ``residual`` (the engine cannot hold a window of R tokens
per sequence in pages of fixed size without paying it in every page). Chunks are aligned
to positions, so the first chunk also holds the sinks: they are packed too (their rows
replaced by the chunk's first non-sink token, so that they do not widen its groups) and
read from the sink area instead. A 16-bit layout is plain K and V at their slots.

Keys are stored before RoPE where the layout has a rotary table (the engine hands rotated
keys: they are rotated back at their positions before packing) and rotated again inside
attention; values are stored rotated where the policy rotates them (``kernels.rotation``)
and the output is rotated back. A step attends first, over the cache as it stood and its
own tokens in full precision, then appends, as :class:`~kvpolicy.runtime.layer.PackedKVLayer`
does.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import torch
import torch.nn.functional as F

from ..errors import CacheError
from ..kernels import cpu_step
from ..kernels.backend import select
from ..kernels.contract import gather_page_rows, rope_rotate
from ..kernels.cpu_step import FusedStep
from ..kernels.layout import Packed, QuantSpec, RotarySpec
from ..kernels.rotation import rotation_matrix
from .page_layout import PagedField, PagedLayout
from .paged_dense import DENSE_FROM, attend_chunk, dense_prefix
from .seq_batch import SeqBatch

__all__ = ["PagedField", "PagedLayout", "PagedKV", "SeqBatch", "sdpa_prefill"]

_ROWS = 256  # query rows per attention call of a long chunk (as runtime.layer)


def sdpa_prefill(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lens: list[int], *,
                 scale: float, window: int | None, softcap: float | None) -> torch.Tensor:
    """Causal attention of each of ``len(lens)`` sequences over its own tokens (token-major
    ``q [N, Hq, D]``, ``k/v [N, Hkv, D]``, ``lens[i]`` tokens each, in order) with torch's
    fused SDPA, one sequence at a time (no ``T x T`` scores), as ``PackedKVLayer`` does;
    ``[N, Hq, Dv]`` fp32. :class:`PagedKV`'s ``prefill`` when the engine gives none."""
    if softcap is not None:
        raise CacheError("SDPA has no logit soft-capping: attend soft-capped prefills "
                         "over the cache instead")
    out, a = q.new_empty(q.shape[0], q.shape[1], v.shape[-1], dtype=torch.float32), 0
    for n in lens:
        qi, ki, vi = (x[a : a + n].transpose(0, 1).unsqueeze(0).to(q.dtype) for x in (q, k, v))
        mask = None
        if window is not None:
            t = torch.arange(n, device=q.device)
            mask = (t[None] <= t[:, None]) & (t[None] > t[:, None] - window)
        o = F.scaled_dot_product_attention(
            qi, ki, vi, attn_mask=mask, is_causal=mask is None, scale=scale,
            enable_gqa=qi.shape[1] != ki.shape[1])
        out[a : a + n] = o[0].transpose(0, 1).float()
        a += n
    return out


class PagedKV:
    """One layer's attention over a :class:`PagedLayout` cache.

    Args:
        layout: the page layout.
        scale: multiplies ``q·k``.
        rope: the rotary table of pre-RoPE keys (``[P, rotary_dim]`` covering every
            position served), or None to store keys as given.
        value_rotation: ``"none"`` or ``"hadamard"`` (values stored rotated).
        window: sliding window W (query ``i`` sees keys ``i - W < j <= i``), or None.
        softcap: logit soft-capping, or None.
        backend: kernel backend name (``kernels.backend``).
        prefill: the engine's fused causal attention for sequences whose cache is empty,
            ``prefill(q, k, v, lens, scale=, window=, softcap=)`` over token-major rows
            (``lens``: each sequence's tokens, in order) returning ``[N, Hq, Dv]`` fp32;
            None: :func:`sdpa_prefill` (not for soft-capped layers, whose first prefills
            then attend over the cache). A long chunk continuing a cached sequence calls it
            with ``cached=[c]``: ``k/v`` then hold the sequence's ``c`` earlier tokens,
            dequantized, before the chunk's (:mod:`kvpolicy.runtime.paged_dense`).
        fused: serve decode steps (every sequence adds one token) with the fused C++ step
            (:class:`~kvpolicy.kernels.cpu_step.FusedStep`) where it covers the layer; False:
            always the torch path (the fused step's reference in tests); None (default):
            True unless the environment sets ``KVPOLICY_FUSED_STEP=0``.
    """

    def __init__(
        self, layout: PagedLayout, *, scale: float, rope: RotarySpec | None = None,
        value_rotation: str = "none", window: int | None = None,
        softcap: float | None = None, backend: str = "auto",
        prefill: Callable[..., torch.Tensor] | None = None, fused: bool | None = None,
    ) -> None:
        if fused is None:
            fused = os.environ.get("KVPOLICY_FUSED_STEP", "1") not in ("0", "")
        self.layout, self.scale, self.window, self.softcap = layout, scale, window, softcap
        # Full-precision keys gain nothing from being stored before RoPE: keep them as given.
        self.rope = None if layout.key_spec.full_precision else rope
        self.value_rotation = value_rotation
        self.backend, self.prefill, self.fused = backend, prefill, fused
        self._views: tuple[tuple, dict[str, torch.Tensor]] | None = None
        self._step: tuple[tuple, FusedStep | None] | None = None
        # What serves decode steps, once one has run (for the engine's log)
        self.step_path: str | None = None if fused else "the torch path (fused=False)"

    # ------------------------------------------------------------------ step

    def forward(self, pages: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                v: torch.Tensor, batch: SeqBatch, out: torch.Tensor | None = None
                ) -> torch.Tensor:
        """Attend the query tokens ``q [N, Hq, D]`` of ``batch`` over the cache and their
        own ``k [N, Hkv, D]``/``v [N, Hkv, Dv]`` (causally), then append them.

        Returns ``[N, Hq, Dv]`` in ``q.dtype``: ``out`` when given (written in place).
        """
        lay = self.layout
        rounds = batch.rounds(lay.block_size)
        if rounds is not None:  # a block shared in the step it is filled: writers first
            res = q.new_empty(q.shape[0], q.shape[1], lay.v_head_dim) if out is None else out
            for rows, sub in rounds:
                res[rows] = self.forward(pages, q[rows], k[rows], v[rows], sub)
            return res
        kern = select(self.backend, q.device)
        # The same pages come back every step (a new view object each time): their field
        # views are kept, keyed by address (holding them keeps that memory alive).
        key = (pages.data_ptr(), tuple(pages.shape), pages.stride(0))
        if self._views is None or self._views[0] != key:
            self._views = (key, lay.views(pages))
        views = self._views[1]
        # Built at the first call: decode steps run it, any step's packing uses it
        step = self._fused_step(key, views, kern, q, k, v, out) if self.fused else None
        if batch.decoding and step is not None:
            lens, table = batch.step_tensors()
            o = q.new_empty(q.shape[0], q.shape[1], lay.v_head_dim) if out is None else out
            step(q, k, v, o, lens, table)
            if not step.packs:
                self._pack_staged(kern, views, batch)
            return o
        got = self._forward(kern, views, q, k, v, batch)
        if out is None:
            return got
        out.copy_(got)
        return out

    @property
    def fused_step(self) -> FusedStep | None:
        """The fused step built for the current pages (None before the first call, with
        ``fused=False``, or where it does not cover the layer)."""
        return None if self._step is None else self._step[1]

    def _fused_step(self, key: tuple, views: dict, kern, q: torch.Tensor, k: torch.Tensor,
                    v: torch.Tensor, out: torch.Tensor | None) -> FusedStep | None:
        """The layer's fused C++ step for these pages where it covers this call (the torch
        backend on CPU, q/k/v/out of one dtype), built once per pages."""
        if kern.name != "torch" or q.device.type != "cpu":
            return None
        if not (q.dtype == k.dtype == v.dtype and (out is None or out.dtype == q.dtype)):
            return None
        if self._step is None or self._step[0] != key:
            lay = self.layout
            rot = rotation_matrix(self.value_rotation, lay.v_head_dim)
            self._step = (key, FusedStep.build(
                lay, views, num_heads=q.shape[1], scale=self.scale, rope=self.rope,
                rotation=rot, window=self.window, softcap=self.softcap))
            why = cpu_step.why_not(lay, self.rope, self.window) or (
                None if self._step[1] is not None else "the C++ kernel is unavailable")
            self.step_path = ("the fused C++ step" if why is None
                              else f"the torch path ({why})")
        step = self._step[1]
        return step if step is not None and step.num_heads == q.shape[1] else None

    def _pack_staged(self, kern, views, batch: SeqBatch) -> None:
        """Pack the chunks a fused decode step completed: each sequence whose new token
        closed its chunk has the whole chunk in its block's stage."""
        lay = self.layout
        c, bs, s_n = lay.chunk, lay.block_size, lay.sinks

        def make() -> tuple | None:
            done = [i for i, n in enumerate(batch.seq_lens) if n % c == 0]
            if not done:
                return None
            dev = batch.block_table.device
            lens = torch.tensor([batch.seq_lens[i] for i in done], device=dev)
            cstart = lens - c
            cblk = batch.block_table[torch.tensor(done, device=dev), cstart // bs]
            return cblk, cstart % bs, self._sink_gather(cstart, dev)
        plan = batch.cached(("staged", c, bs, s_n), make)
        if plan is not None:
            cblk, off, gather = plan
            self._pack_complete(kern, views, None, None, cblk, off, None, None, gather)

    def _sink_gather(self, cstart: torch.Tensor, dev: torch.device) -> torch.Tensor | None:
        """For chunks starting at ``cstart [n]``: the index that replaces their sink rows
        by the chunk's first non-sink row (``[n, C, 1, 1]``), or None without any."""
        c, s_n = self.layout.chunk, self.layout.sinks
        if not s_n:
            return None
        rows = cstart[:, None] + torch.arange(c, device=dev)
        first_ok = (s_n - cstart).clamp(min=0)  # [n] that row's index in its chunk
        sink_rows = (rows < s_n) & (first_ok < c)[:, None]
        if not bool(sink_rows.any()):
            return None
        return torch.where(sink_rows, first_ok.clamp(max=c - 1)[:, None],
                           torch.arange(c, device=dev)[None])[..., None, None]

    def _forward(self, kern, views: dict, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 batch: SeqBatch) -> torch.Tensor:
        """The torch path of :meth:`forward`: any step, any layout."""
        lay = self.layout
        pos = batch.positions(q.device)
        store = lay.store_dtype
        given = k  # as the engine rotated it: what a first prefill attends with
        if self.rope is not None:  # rotated keys back to pre-RoPE, at their positions
            k = rope_rotate(k.float(), *self._inverse_rows(batch, pos), self.rope)
        rot = rotation_matrix(self.value_rotation, v.shape[-1], v.device)
        if rot is not None:
            v = v.float() @ rot
        k, v = k.to(store), v.to(store)
        out = q.new_empty(q.shape[0], q.shape[1], v.shape[-1], dtype=torch.float32)
        rows, single, many = batch.groups(q.device)
        if single is not None:
            o = self._attend(kern, views, q[rows].unsqueeze(2), k[rows].unsqueeze(2),
                             v[rows].unsqueeze(2), single)
            out[rows] = o[:, :, 0]
        fresh = []  # sequences whose cache is empty: their own tokens only
        for i, a, n, sub in many:
            if batch.seq_lens[i] == n and (self.prefill is not None or self.softcap is None):
                fresh.append((a, n))
                continue
            if n >= DENSE_FROM and (self.prefill is not None or self.softcap is None):
                # a long chunk: the sequence's cache dequantized once
                prefix = dense_prefix(kern, views, lay, batch.block_table[i],
                                      batch.seq_lens[i] - n)
                out[a : a + n] = attend_chunk(
                    q[a : a + n], given[a : a + n], v[a : a + n], prefix, scale=self.scale,
                    rope=self.rope, window=self.window, softcap=self.softcap,
                    prefill=self.prefill)
                continue
            qi, ki, vi = (x[a : a + n].transpose(0, 1).unsqueeze(0) for x in (q, k, v))
            out[a : a + n] = self._attend(kern, views, qi, ki, vi, sub)[0].transpose(0, 1)
        if fresh:
            self._fresh(out, q, given, v, fresh)
        # One append for the whole step (sequences never share a page).
        self._append(kern, views, k, v, batch)
        if rot is not None:
            out = out @ rot.T
        return out.to(q.dtype)

    def _inverse_rows(self, batch: SeqBatch, pos: torch.Tensor) -> tuple:
        """cos and -sin at the step's positions, ``[N, 1, rotary_dim]`` fp32: what rotates
        the engine's keys back (gathered once per step for every layer with this table)."""
        rope = self.rope

        def make() -> tuple:
            if pos.numel() and int(pos.max()) >= rope.max_positions:
                raise CacheError(f"position {int(pos.max())} is past the rotary table's "
                                 f"{rope.max_positions} rows")
            return (rope.cos[pos].to(pos.device, torch.float32)[:, None],
                    -rope.sin[pos].to(pos.device, torch.float32)[:, None])
        return batch.cached(("inverse", rope.cos.data_ptr(), rope.sin.data_ptr()), make)

    # ------------------------------------------------------------------ attention

    def _visible(self, qpos: torch.Tensor, kpos: torch.Tensor,
                 ok: torch.Tensor) -> torch.Tensor:
        """Additive mask ``[B, 1, Tq, Tk]`` from query positions ``[B, Tq]``, key positions
        ``[B, Tk]`` and which keys exist ``[B, Tk]``: causal, inside the window."""
        see = ok[:, None, :] & (kpos[:, None, :] <= qpos[:, :, None])
        if self.window is not None:
            see &= kpos[:, None, :] > qpos[:, :, None] - self.window
        zero = torch.zeros((), dtype=torch.float32, device=qpos.device)
        return torch.where(see, zero, float("-inf")).unsqueeze(1)

    def _fresh(self, out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               spans: list[tuple[int, int]]) -> None:
        """Sequences with an empty cache (token ``spans`` ``(start, n)``) attend causally
        over their own tokens in full precision, keys as the engine rotated them, all in
        one call of ``prefill`` (the engine's fused kernel, else :func:`sdpa_prefill`)."""
        a0, n_all = spans[0][0], sum(n for _, n in spans)
        if all(a == b + m for (a, _), (b, m) in zip(spans[1:], spans, strict=False)):
            ix = slice(a0, a0 + n_all)  # one run of tokens: no copy
        else:
            ix = torch.cat([torch.arange(a, a + n) for a, n in spans]).to(q.device)
        out[ix] = (self.prefill or sdpa_prefill)(
            q[ix], k[ix], v[ix], [n for _, n in spans], scale=self.scale, window=self.window,
            softcap=self.softcap)

    @staticmethod
    def _pages(views: dict, name: str, spec: QuantSpec) -> Packed:
        """Tensor ``name`` of every page, ``[num_blocks, H, rows, ...]`` views (a plain one
        at 16 bits): the kernels read a sequence's pages through the block table."""
        if spec.full_precision:
            x = views[name]
            return Packed(x, x.new_empty(0), x.new_empty(0))
        return Packed(*(views[f"{name}_{x}"] for x in ("codes", "scale", "zero")))

    def _key(self) -> tuple:
        lay = self.layout
        top = None if self.rope is None else self.rope.max_positions - 1
        return (lay.block_size, lay.chunk, lay.sinks, lay.full_precision, self.window, top)

    def _attend_index(self, batch: SeqBatch, tq: int, dev: torch.device,
                      n_pages: int) -> dict:
        """What attention reads for ``batch`` adding ``tq`` tokens per sequence: block
        ids, positions and masks of each segment (the same for every layer of a step).
        Block ids past a sequence's blocks are masked; they are clamped to the ``n_pages``
        pages so that the kernel, which reads them, stays inside the cache."""
        lay = self.layout
        b, bs, s_n, c = batch.n, lay.block_size, lay.sinks, lay.chunk
        prev = torch.tensor(batch.seq_lens, device=dev) - tq  # tokens cached before
        qpos = prev[:, None] + torch.arange(tq, device=dev)
        ix: dict = {"blocks": None, "kpos": None, "pmask": None, "first": None, "tail": None}
        fpos, fok = [], []
        if lay.full_precision:
            nb = -(-int(prev.max()) // bs)
            if nb:
                ix["blocks"] = batch.block_table[:, :nb]
                t = torch.arange(nb * bs, device=dev).expand(b, -1)
                fpos.append(t)
                fok.append(t < prev[:, None])
        else:
            n_packed = prev // c * c  # tokens whose chunk is complete (sink rows included)
            nb = -(-int(n_packed.max()) // bs)
            if nb:
                ix["blocks"] = batch.block_table[:, :nb].clamp(0, n_pages - 1)
                kpos = torch.arange(nb * bs, device=dev).expand(b, -1)
                ix["pmask"] = self._visible(qpos, kpos,
                                            (kpos >= s_n) & (kpos < n_packed[:, None]))
                ix["kpos"] = kpos
            if s_n:
                ix["first"] = batch.block_table[:, 0]
                t = torch.arange(s_n, device=dev).expand(b, -1)
                fpos.append(t)
                fok.append(t < prev[:, None])
            if c > 1:
                at = (n_packed // bs).clamp(max=batch.block_table.shape[1] - 1)
                ix["tail"] = batch.block_table.gather(1, at[:, None])[:, 0]
                t = n_packed[:, None] + torch.arange(c, device=dev)
                fpos.append(t)
                fok.append((t < prev[:, None]) & (t >= s_n))
        fpos.append(qpos)
        fok.append(torch.ones_like(qpos, dtype=torch.bool))
        fp_pos, fp_ok = torch.cat(fpos, dim=1), torch.cat(fok, dim=1)
        ix["fmasks"] = [self._visible(qpos[:, r0 : r0 + _ROWS], fp_pos, fp_ok)
                        for r0 in range(0, tq, _ROWS)]
        if self.rope is not None:
            # Masked slots (past a sequence's end, in the last block) may lie beyond the
            # table: any row serves them.
            top = self.rope.max_positions - 1
            ix["kpos"] = None if ix["kpos"] is None else ix["kpos"].clamp(max=top)
            fp_pos = fp_pos.clamp(max=top)
        ix["fp_pos"] = fp_pos
        return ix

    def _attend(self, kern, views, q, k_new, v_new, batch: SeqBatch) -> torch.Tensor:
        """``q [B, Hq, Tq, D]`` of sequences that each add ``Tq`` tokens ``k_new/v_new
        [B, Hkv, Tq, D]`` attends over the cache as it stood and those tokens (fp32 out)."""
        lay, dev, tq = self.layout, q.device, q.shape[2]
        n_pages = next(iter(views.values())).shape[0]
        ix = batch.cached(("attend", tq, dev, n_pages, *self._key()),
                          lambda: self._attend_index(batch, tq, dev, n_pages))
        pk = pv = None
        fks, fvs = [], []
        blocks = ix["blocks"]
        if blocks is not None and lay.full_precision:
            fks.append(gather_page_rows(views["k"], blocks))
            fvs.append(gather_page_rows(views["v"], blocks))
        elif blocks is not None:
            pk = self._pages(views, "k", lay.key_spec)
            pv = self._pages(views, "v", lay.value_spec)
        if ix["first"] is not None:
            fks.append(views["sink_k"][ix["first"]])
            fvs.append(views["sink_v"][ix["first"]])
        if ix["tail"] is not None:
            fks.append(views["stage_k"][ix["tail"]])
            fvs.append(views["stage_v"][ix["tail"]])
        fks.append(k_new)
        fvs.append(v_new)
        fk, fv = torch.cat(fks, dim=2), torch.cat(fvs, dim=2)
        rope = self.rope
        outs = []
        for j, r0 in enumerate(range(0, tq, _ROWS)):
            r1 = min(tq, r0 + _ROWS)
            out, _ = kern.decode_attention(
                q[:, :, r0:r1], pk, pv, lay.key_spec, lay.value_spec, fk, fv,
                scale=self.scale,
                mask=None if ix["pmask"] is None else ix["pmask"][:, :, r0:r1],
                fp_mask=ix["fmasks"][j], rope=rope,
                k_positions=None if rope is None or pk is None else ix["kpos"],
                fp_positions=None if rope is None else ix["fp_pos"],
                check_positions=False, softcap=self.softcap,
                block_table=None if pk is None else blocks)
            outs.append(out)
        return outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)

    # ------------------------------------------------------------------ append

    def _append_plan(self, batch: SeqBatch, dev: torch.device) -> dict:
        """Where ``batch``'s query tokens go (the same for every layer of a step): each
        token's block and slot, which are sinks, which wait in the stage, and for every
        chunk they complete the rows it is packed from."""
        lay = self.layout
        bs, c, s_n = lay.block_size, lay.chunk, lay.sinks
        pos = batch.positions(dev)
        qlen = torch.tensor([batch.query_len(i) for i in range(batch.n)], device=dev)
        seq = torch.repeat_interleave(torch.arange(batch.n, device=dev), qlen)
        blk = batch.block_table[seq, pos // bs]
        plan: dict = {"blk": blk, "slot": pos % bs, "sink": None, "stage": None, "pack": None}
        if lay.full_precision:
            return plan
        if s_n and bool((pos < s_n).any()):
            sink = pos < s_n
            plan["sink"] = (sink, batch.block_table[seq[sink], 0], pos[sink])
        if c == 1:
            return plan
        # The chunk of each token and whether it is complete after this step. Tokens of
        # complete chunks are packed from the stage (earlier steps' tokens of the chunk)
        # and this step's tokens; tokens of incomplete chunks go to the stage.
        end = torch.tensor(batch.seq_lens, device=dev)[seq]
        start = pos // c * c
        partial = start + c > end
        if bool(partial.any()):  # (every token, the usual decode step: no index)
            every = bool(partial.all())
            plan["stage"] = (blk[partial], pos[partial] % c,
                             slice(None) if every else partial.nonzero()[:, 0])
        # One row per completed chunk: the chunk's last token closes it.
        last = ~partial & ((pos + 1) % c == 0)
        if not bool(last.any()):
            return plan
        cblk, cstart, cseq = blk[last], start[last], seq[last]
        first_new = (end - qlen[seq])[last]
        # [n, C]: rows before this step's first token from the stage, the rest new, by
        # the index of token (seq, position) among this step's tokens.
        rows = cstart[:, None] + torch.arange(c, device=dev)
        tok_index = torch.full((batch.n, int(end.max()) + 1), -1, dtype=torch.long, device=dev)
        tok_index[seq, pos] = torch.arange(pos.shape[0], device=dev)
        fill = rows >= first_new[:, None]
        take = tok_index[cseq[:, None].expand_as(rows), rows][fill]
        # sink rows: a copy of the chunk's first non-sink row (read as sinks)
        gather = self._sink_gather(cstart, dev)
        plan["pack"] = (cblk, cstart % bs, fill, take, gather)
        return plan

    def _append(self, kern, views, k: torch.Tensor, v: torch.Tensor, batch: SeqBatch) -> None:
        """Store the query tokens ``k/v [N, Hkv, D]`` of ``batch`` (token-major, in the
        order of ``batch``) in their pages."""
        lay, dev = self.layout, k.device
        plan = batch.cached(("append", dev, *self._key()), lambda: self._append_plan(batch, dev))
        blk, slot = plan["blk"], plan["slot"]
        if lay.full_precision:
            views["k"].transpose(1, 2)[blk, slot] = k
            views["v"].transpose(1, 2)[blk, slot] = v
            return
        if plan["sink"] is not None:
            sink, first, at = plan["sink"]
            views["sink_k"].transpose(1, 2)[first, at] = k[sink]
            views["sink_v"].transpose(1, 2)[first, at] = v[sink]
        if lay.chunk == 1:  # every token is a whole group: pack it now
            self._pack(kern, views, k.unsqueeze(2), v.unsqueeze(2), blk, slot)
            return
        if plan["pack"] is not None:
            self._pack_complete(kern, views, k, v, *plan["pack"])
        # After packing: a completed chunk may read the stage rows a later chunk of the
        # same block is about to take.
        if plan["stage"] is not None:
            sblk, srow, partial = plan["stage"]
            views["stage_k"].transpose(1, 2)[sblk, srow] = k[partial]
            views["stage_v"].transpose(1, 2)[sblk, srow] = v[partial]

    def _pack_complete(self, kern, views, k, v, cblk, off, fill, take, gather) -> None:
        """Pack the chunks this step completes (blocks ``cblk``, token offsets ``off``):
        their earlier tokens from the stage, this step's (``fill``: the rows that are new,
        ``take``: their index in ``k``/``v``; None: every row is in the stage), sink rows
        replaced by ``gather``."""
        ck = views["stage_k"].transpose(1, 2)[cblk]  # [n, C, H, D], a copy
        cv = views["stage_v"].transpose(1, 2)[cblk]
        if fill is not None:
            ck[fill] = k[take]
            cv[fill] = v[take]
        if gather is not None:
            ck = ck.gather(1, gather.expand_as(ck))
            cv = cv.gather(1, gather.expand_as(cv))
        self._pack(kern, views, ck.transpose(1, 2), cv.transpose(1, 2), cblk, off)

    def _pack(self, kern, views, k: torch.Tensor, v: torch.Tensor, blk: torch.Tensor,
              off: torch.Tensor) -> None:
        """Pack chunks ``k/v [n, H, C, D]`` into blocks ``blk [n]`` at token offset
        ``off [n]``."""
        lay = self.layout
        step = self.fused_step if self.fused else None
        if step is not None and step.packs and k.shape[2] == lay.chunk and k.device.type == "cpu":
            step.pack_chunks(k, v, blk, off)  # the torch quantizer's bytes, in one C++ call
            return
        for name, x, spec in (("k", k, lay.key_spec), ("v", v, lay.value_spec)):
            if spec.full_precision:
                t = torch.arange(x.shape[2], device=x.device)
                views[name].transpose(1, 2)[blk[:, None], off[:, None] + t] = x.transpose(1, 2)
                continue
            p = kern.quantize(x, spec, lay.store_dtype)
            rows = x.shape[2] // spec.token_group
            at = off // spec.token_group
            r = at[:, None] + torch.arange(rows, device=x.device)
            for part_name, part in zip(("codes", "scale", "zero"), p, strict=True):
                # [n, H, rows, ...] -> [n, rows, H, ...] at (block, row)
                views[f"{name}_{part_name}"].transpose(1, 2)[blk[:, None], r] = part.transpose(1, 2)
