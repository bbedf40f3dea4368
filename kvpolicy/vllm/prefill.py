"""vLLM's own CPU attention kernel for the tokens of sequences whose cache is empty.

A first prefill attends over its own tokens only, in full precision, before anything is
packed (:class:`~kvpolicy.runtime.paged.PagedKV`). torch's SDPA does that one sequence at
a time; vLLM's ``cpu_attention_with_kv_cache`` does every such sequence of a step in one
call, vectorised for the machine (AVX-512 / AMX). It reads K/V from paged caches, so
the step's fresh tokens are written to a scratch cache first (kept and grown, shared by
every layer of this process: layers run one after the other).

NOTE: ``bench/vllm_prefill.py`` (SmolLM2 shapes, bf16, 448 tokens per sequence, 1 thread):
1.6 / 13.3 / 55 ms per layer for 1 / 8 / 32 sequences this way (scratch write included)
against 5.7 / 46 / 184 ms for SDPA per sequence, 3.3-3.5x.
"""

from __future__ import annotations

import torch
from vllm import _custom_ops as ops
from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

__all__ = ["FusedPrefill"]

_BLOCK = 128  # tokens per scratch block (vLLM's CPU kernels want a multiple of 32)


class FusedPrefill:
    """Causal attention of sequences over their own tokens with vLLM's CPU kernel.

    Called as ``prefill(q, k, v, lens, scale=, window=, softcap=)`` with token-major
    ``q [N, Hq, D]``, ``k/v [N, Hkv, D]`` (keys after RoPE) of ``len(lens)`` sequences of
    ``lens[i]`` tokens each, in order; returns ``[N, Hq, D]`` fp32. ``window``: query ``i``
    sees keys ``i - window < j <= i``. With ``cached=[c_0, ...]``, sequence ``i``'s rows in
    ``k/v`` are its ``c_i`` earlier tokens then its ``lens[i]`` new ones (the queries are the
    new ones, at positions ``c_i ...``): a prefill chunk continuing a cached sequence.
    """

    def __init__(self) -> None:
        self._scratch: tuple[torch.Tensor, torch.Tensor] | None = None
        self._index: tuple[tuple, tuple] | None = None  # (key, tensors) of the last call

    def _caches(self, blocks: int, hkv: int, d: int, dtype: torch.dtype):
        s = self._scratch
        if s is None or s[0].shape[0] < blocks or s[0].shape[1:] != (hkv, _BLOCK, d) \
                or s[0].dtype != dtype:
            shape = (max(blocks, 1 if s is None else s[0].shape[0]), hkv, _BLOCK, d)
            # zeros: the kernel reads a block's unused slots (weighted by zero; not NaN)
            s = self._scratch = (torch.zeros(shape, dtype=dtype),
                                 torch.zeros(shape, dtype=dtype))
        return s

    def _tables(self, lens: tuple[int, ...], cached: tuple[int, ...], hq: int, hkv: int,
                d: int, dtype: torch.dtype, window: int, isa: str) -> tuple:
        """Block table, slot mapping, query starts, lengths and the kernel's scheduler
        metadata of one step (the same for every layer with these shapes: kept)."""
        key = (lens, cached, hq, hkv, d, dtype, window, isa)
        if self._index is not None and self._index[0] == key:
            return self._index[1]
        qn = torch.tensor(lens, dtype=torch.int32)
        n = qn + torch.tensor(cached, dtype=torch.int32)  # each sequence's rows in all
        nb = (n + _BLOCK - 1) // _BLOCK
        first = torch.cumsum(nb, 0) - nb
        width = int(nb.max())
        table = (first[:, None] + torch.arange(width, dtype=torch.int32)).to(torch.int32)
        qsl = torch.zeros(len(lens) + 1, dtype=torch.int32)
        qsl[1:] = torch.cumsum(qn, 0)
        rsl = torch.cumsum(n, 0) - n  # where each sequence's rows start in k / v
        seq = torch.repeat_interleave(torch.arange(len(lens)), n.long())
        pos = torch.arange(int(n.sum())) - rsl.long()[seq]
        slot = first.long()[seq] * _BLOCK + pos
        meta = ops.cpu_attn_get_scheduler_metadata(
            num_reqs=len(lens), num_heads=hq, num_kv_heads=hkv, head_dim=d, seq_lens=n,
            dtype=dtype, query_start_loc=qsl, causal=True, sliding_window_size=window,
            isa=isa, enable_kv_split=False, dynamic_causal=None, kv_cache_dtype="auto")
        got = (table, slot, qsl, n, meta, int(nb.sum()))
        self._index = (key, got)
        return got

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lens: list[int],
                 *, scale: float, window: int | None, softcap: float | None,
                 cached: list[int] | None = None) -> torch.Tensor:
        hq, d = q.shape[1], q.shape[2]
        hkv, dtype = k.shape[1], q.dtype
        isa = _get_attn_isa(dtype, _BLOCK, d)
        win = -1 if window is None else int(window)
        cached = [0] * len(lens) if cached is None else list(cached)
        if k.shape[0] != sum(lens) + sum(cached) or v.shape[0] != k.shape[0]:
            raise ValueError(f"k/v must hold {sum(cached)} cached + {sum(lens)} new rows, "
                             f"got {k.shape[0]} / {v.shape[0]}")
        table, slot, qsl, n, meta, blocks = self._tables(tuple(lens), tuple(cached), hq, hkv,
                                                         d, dtype, win, isa)
        kc, vc = self._caches(blocks, hkv, d, dtype)
        k, v = k.to(dtype).contiguous(), v.to(dtype).contiguous()
        ops.cpu_attn_reshape_and_cache(k, v, kc, vc, slot, isa, k_scale=1.0, v_scale=1.0,
                                       kv_cache_dtype="auto")
        out = torch.empty(q.shape, dtype=dtype)
        ops.cpu_attention_with_kv_cache(
            query=q.contiguous(), key_cache=kc, value_cache=vc, output=out,
            query_start_loc=qsl, seq_lens=n, scale=scale, causal=True, alibi_slopes=None,
            sliding_window=win, block_table=table, softcap=softcap or 0.0,
            scheduler_metadata=meta, s_aux=None, dynamic_causal=None)
        return out.float()
