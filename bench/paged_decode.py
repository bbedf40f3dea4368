"""CPU time of one decode step of one layer over a paged cache (what the vLLM plugin runs).

SmolLM2 shapes (9 query heads, 3 kv heads, head_dim 64), bf16 pages of 576 tokens,
``bits=2``'s served quantizer (keys per channel in groups of 12, values per token in groups
of 32, both 2 bits with 8-bit scales and zeros, keys pre-RoPE), 4 sinks. ``--seqs``
sequences of ``--tokens`` cached tokens each decode one token per step; the pages of the
sequences are shuffled. Two ways to read the packed pages, timed interleaved in one run:

- ``in place``: ``decode_attention(block_table=...)``, the C++ kernel reads each
  sequence's pages where they lie (what :class:`~kvpolicy.runtime.paged.PagedKV` does);
- ``gathered``: the same pages first copied into one contiguous segment per sequence
  (:func:`~kvpolicy.kernels.contract.gather_pages`), then the same kernel.

A 16-bit layout (plain bf16 K/V pages, gathered and attended in torch) is timed beside
them for scale. Every step also appends its token (and packs a chunk every 12 steps), as
in serving. The table shows medians of the per-step times and their ratios to in place.

    .venv/bin/python bench/paged_decode.py [--seqs 1 8 32] [--tokens 512] [--steps 60]
        [--layers 4] [--threads 1]
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import time

import torch

from kvpolicy.kernels import torch_backend
from kvpolicy.kernels.contract import gather_pages
from kvpolicy.kernels.layout import QuantSpec, RotarySpec
from kvpolicy.runtime import paged as paged_mod
from kvpolicy.runtime.paged import PagedKV, PagedLayout, SeqBatch

HQ, HKV, D, BLOCK, SINKS = 9, 3, 64, 576, 4
KEY = QuantSpec(2, 12, "channel", meta_bits=8, fit="mse")
VALUE = QuantSpec(2, 32, "token", meta_bits=8)
FP = QuantSpec(16, 1, "token")


def _gathering(q, k, v, k_spec, v_spec, fk, fv, *, block_table=None, **kw):
    """The torch backend's decode attention, handed gathered pages instead of a table."""
    if block_table is not None and k is not None:
        k, v = gather_pages(k, block_table), gather_pages(v, block_table)
    return torch_backend.decode_attention(q, k, v, k_spec, v_spec, fk, fv, **kw)


GATHERING = dataclasses.replace(torch_backend.BACKEND, decode_attention=_gathering)


class Case:
    """``layers`` paged layers with ``seqs`` sequences of ``tokens`` cached tokens; a step
    runs every layer on one batch, as an engine step does (the batch's index tensors are
    built once and shared by the layers)."""

    def __init__(self, key: QuantSpec, value: QuantSpec, seqs: int, tokens: int,
                 steps: int, layers: int, rope: RotarySpec, gen: torch.Generator) -> None:
        self.layout = PagedLayout(key, value, num_kv_heads=HKV, head_dim=D,
                                  block_size=BLOCK, sinks=SINKS, store_dtype=torch.bfloat16)
        per = -(-(tokens + steps + 1) // BLOCK)
        self.table = torch.randperm(seqs * per, generator=gen).view(seqs, per)
        self.pages = [torch.zeros(seqs * per, self.layout.page_bytes, dtype=torch.uint8)
                      for _ in range(layers)]
        # One PagedKV per layer, as the plugin has (each keeps its own page views).
        self.kv = [PagedKV(self.layout, scale=D ** -0.5, rope=rope, backend="torch")
                   for _ in range(layers)]
        self.seqs, self.n, self.gen = seqs, tokens, gen
        start = [i * tokens for i in range(seqs + 1)]
        batch = SeqBatch(start, [tokens] * seqs, self.table)
        for kv, pages in zip(self.kv, self.pages, strict=True):
            kv.forward(pages, *self._qkv(seqs * tokens), batch)

    def _qkv(self, n: int) -> tuple[torch.Tensor, ...]:
        g = self.gen
        return (torch.randn(n, HQ, D, generator=g).bfloat16(),
                torch.randn(n, HKV, D, generator=g).bfloat16() * 2,
                torch.randn(n, HKV, D, generator=g).bfloat16())

    def step(self) -> float:
        """One decode step of every sequence through every layer (attend, then append);
        seconds per layer."""
        qkv = [self._qkv(self.seqs) for _ in self.pages]
        self.n += 1
        batch = SeqBatch(list(range(self.seqs + 1)), [self.n] * self.seqs, self.table)
        t0 = time.perf_counter()
        for kv, pages, (q, k, v) in zip(self.kv, self.pages, qkv, strict=True):
            kv.forward(pages, q, k, v, batch)
        return (time.perf_counter() - t0) / len(self.pages)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seqs", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    inv = 1.0 / 1e5 ** (torch.arange(0, D, 2, dtype=torch.float64) / D)
    ang = torch.arange(args.tokens + args.steps + 8, dtype=torch.float64)[:, None] * inv
    ang = torch.cat((ang, ang), dim=-1)
    rope = RotarySpec("rotate_half", D, ang.cos().float(), ang.sin().float())
    print(f"# {args.tokens} cached tokens per sequence, {args.steps} steps of "
          f"{args.layers} layers (times per layer), {args.threads} thread(s), "
          f"load {os.getloadavg()[0]:.1f}")
    print("| sequences | in place (ms) | gathered (ms) | 16-bit pages (ms) | gathered / in place "
          "| 16-bit / in place |")
    print("|---|---|---|---|---|---|")
    original = paged_mod.select
    for seqs in args.seqs:
        gen = torch.Generator().manual_seed(seqs)
        cases = {"in place": Case(KEY, VALUE, seqs, args.tokens, args.steps, args.layers, rope,
                                          gen),
                 "gathered": Case(KEY, VALUE, seqs, args.tokens, args.steps, args.layers, rope,
                                          gen),
                 "16-bit": Case(FP, FP, seqs, args.tokens, args.steps, args.layers, rope, gen)}
        times: dict[str, list[float]] = {name: [] for name in cases}
        try:
            for _ in range(args.steps):
                for name, case in cases.items():
                    paged_mod.select = ((lambda *a: GATHERING) if name == "gathered"
                                        else original)
                    times[name].append(case.step())
        finally:
            paged_mod.select = original
        med = {name: statistics.median(t) * 1e3 for name, t in times.items()}
        print(f"| {seqs} | {med['in place']:.3f} | {med['gathered']:.3f} | {med['16-bit']:.3f} "
              f"| {med['gathered'] / med['in place']:.2f}x "
              f"| {med['16-bit'] / med['in place']:.2f}x |")


if __name__ == "__main__":
    main()
