"""CPU time of one decode step of one layer over a paged cache (what the vLLM plugin runs).

SmolLM2 shapes (9 query heads, 3 kv heads, head_dim 64), bf16 pages of 576 tokens,
``bits=2``'s served quantizer (keys per channel in groups of 12, values per token in groups
of 32 Hadamard-rotated, both 2 bits with 8-bit scales and zeros, keys pre-RoPE), 4 sinks.
``--seqs`` sequences of ``--tokens`` cached tokens each decode one token per step; the
pages of the sequences are shuffled. Four caches, timed interleaved in one run:

- ``fused``: :class:`~kvpolicy.runtime.paged.PagedKV` as served, one C++ call per layer
  per step (:class:`~kvpolicy.kernels.cpu_step.FusedStep`: un-RoPE, rotate, stage, attend,
  rotate back, and pack the chunk a step completes, once every 12 steps);
- ``fused, torch packs``: the same, but the chunk a step completes is packed by the torch
  quantizer after the call (``FusedStep.packs = False``: how the fused step first served);
- ``torch path``: the same pages with ``fused=False``: the step's torch ops around the C++
  attention kernel (what served before the fused step);
- ``16-bit``: plain bf16 K/V pages, gathered and attended in torch, for scale.

Every step also appends its token (and packs a chunk every 12 steps), as in serving. The
table shows, per cache, the median over cycles of 12 steps (one chunk: 11 steps that stage
a token and one that also packs the chunk) of the mean step time in the cycle, so the
packing is counted, and the ratios to the fused step; ``--profile`` also prints where the
fused step's time goes (cProfile, one sequence count).

    .venv/bin/python bench/paged_decode.py [--seqs 1 8 32] [--tokens 512] [--steps 96]
        [--layers 4] [--threads 1] [--profile]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import statistics
import time

import torch

from kvpolicy.kernels.layout import QuantSpec, RotarySpec
from kvpolicy.runtime.paged import PagedKV, PagedLayout, SeqBatch

HQ, HKV, D, BLOCK, SINKS = 9, 3, 64, 576, 4
KEY = QuantSpec(2, 12, "channel", meta_bits=8, fit="mse")
VALUE = QuantSpec(2, 32, "token", meta_bits=8)
FP = QuantSpec(16, 1, "token")


class Case:
    """``layers`` paged layers with ``seqs`` sequences of ``tokens`` cached tokens; a step
    runs every layer on one batch, as an engine step does (the batch's index tensors are
    built once and shared by the layers)."""

    def __init__(self, key: QuantSpec, value: QuantSpec, seqs: int, tokens: int,
                 steps: int, layers: int, rope: RotarySpec, gen: torch.Generator,
                 fused: bool = True, packs: bool = True) -> None:
        self.layout = PagedLayout(key, value, num_kv_heads=HKV, head_dim=D,
                                  block_size=BLOCK, sinks=SINKS, store_dtype=torch.bfloat16)
        per = -(-(tokens + steps + 1) // BLOCK)
        # int32, as vLLM's block table
        self.table = torch.randperm(seqs * per, generator=gen).view(seqs, per).int()
        self.pages = [torch.zeros(seqs * per, self.layout.page_bytes, dtype=torch.uint8)
                      for _ in range(layers)]
        # One PagedKV per layer, as the plugin has (each keeps its own page views).
        rotation = "none" if key.full_precision else "hadamard"
        self.kv = [PagedKV(self.layout, scale=D ** -0.5, rope=rope, backend="torch",
                           value_rotation=rotation, fused=fused)
                   for _ in range(layers)]
        self.seqs, self.n, self.gen, self.packs = seqs, tokens, gen, packs
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
            step = kv.fused_step
            if step is not None and step.packs != self.packs:  # built at the first step
                step.packs = self.packs
            kv.forward(pages, q, k, v, batch)
        return (time.perf_counter() - t0) / len(self.pages)


def rope_table(positions: int) -> RotarySpec:
    """SmolLM2's rotary table (base 1e5, rotate_half) over ``positions`` positions."""
    inv = 1.0 / 1e5 ** (torch.arange(0, D, 2, dtype=torch.float64) / D)
    ang = torch.arange(positions, dtype=torch.float64)[:, None] * inv
    ang = torch.cat((ang, ang), dim=-1)
    return RotarySpec("rotate_half", D, ang.cos().float(), ang.sin().float())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seqs", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--steps", type=int, default=96, help="decode steps (cycles of 12)")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--profile", action="store_true",
                    help="cProfile the fused step at the first --seqs")
    args = ap.parse_args()
    if args.steps < KEY.group_size:
        ap.error(f"--steps {args.steps}: at least one cycle of {KEY.group_size} steps")
    torch.set_num_threads(args.threads)
    rope = rope_table(args.tokens + args.steps + 8)
    print(f"# {args.tokens} cached tokens per sequence, {args.steps} steps of "
          f"{args.layers} layers (times per layer), {args.threads} thread(s), "
          f"load {os.getloadavg()[0]:.1f}")
    print("| sequences | fused (ms) | fused, torch packs (ms) | torch path (ms) "
          "| 16-bit pages (ms) | fused, torch packs / fused | torch path / fused "
          "| 16-bit / fused |")
    print("|---|---|---|---|---|---|---|---|")
    for seqs in args.seqs:
        gen = torch.Generator().manual_seed(seqs)
        cases = {"fused": Case(KEY, VALUE, seqs, args.tokens, args.steps, args.layers, rope,
                               gen),
                 "torch packs": Case(KEY, VALUE, seqs, args.tokens, args.steps, args.layers,
                                     rope, gen, packs=False),
                 "torch": Case(KEY, VALUE, seqs, args.tokens, args.steps, args.layers, rope,
                               gen, fused=False),
                 "16-bit": Case(FP, FP, seqs, args.tokens, args.steps, args.layers, rope, gen)}
        times: dict[str, list[float]] = {name: [] for name in cases}
        for _ in range(args.steps):
            for name, case in cases.items():
                times[name].append(case.step())
        cyc = KEY.group_size  # the chunk: one packing step per cycle
        med = {name: statistics.median(statistics.fmean(t[i:i + cyc])
                                       for i in range(0, len(t) - cyc + 1, cyc)) * 1e3
               for name, t in times.items()}
        print(f"| {seqs} | {med['fused']:.3f} | {med['torch packs']:.3f} | {med['torch']:.3f} "
              f"| {med['16-bit']:.3f} | {med['torch packs'] / med['fused']:.2f}x "
              f"| {med['torch'] / med['fused']:.2f}x "
              f"| {med['16-bit'] / med['fused']:.2f}x |")
    if args.profile:
        seqs = args.seqs[0]
        case = Case(KEY, VALUE, seqs, args.tokens, args.steps, args.layers, rope,
                    torch.Generator().manual_seed(seqs))
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(args.steps):
            case.step()
        prof.disable()
        buf = io.StringIO()
        pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(12)
        print(f"\n# cProfile of the fused step, {seqs} sequence(s), {args.steps} steps x "
              f"{args.layers} layers (tottime: time in the function itself)")
        print(buf.getvalue())


if __name__ == "__main__":
    main()
