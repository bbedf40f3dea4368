"""CPU time of one layer's first prefill in the vLLM plugin: vLLM's own CPU attention kernel
(:class:`kvpolicy.vllm.prefill.FusedPrefill`, every sequence in one call, scratch cache
write included) against torch's SDPA one sequence at a time (what
:class:`~kvpolicy.runtime.paged.PagedKV` does without an engine), in one run.

SmolLM2 shapes (9 query heads, 3 kv heads, head_dim 64), bf16, ``--seqs`` sequences of
``--tokens`` tokens each; medians over ``--reps`` interleaved calls.

    .venv-vllm/bin/python bench/vllm_prefill.py [--seqs 1 8 32] [--tokens 448] [--threads 1]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from kvpolicy.runtime.paged import sdpa_prefill
from kvpolicy.vllm.prefill import FusedPrefill

HQ, HKV, D = 9, 3, 64
KW = {"scale": D ** -0.5, "window": None, "softcap": None}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seqs", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--tokens", type=int, default=448)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    fused = FusedPrefill()
    print(f"# {args.tokens} tokens per sequence, bf16, {args.threads} thread(s)")
    print("| sequences | vLLM kernel (ms) | SDPA per sequence (ms) | SDPA / vLLM | max diff |")
    print("|---|---|---|---|---|")
    for b in args.seqs:
        g = torch.Generator().manual_seed(b)
        lens = [args.tokens] * b
        q, k, v = (torch.randn(b * args.tokens, h, D, generator=g).bfloat16()
                   for h in (HQ, HKV, HKV))
        f, s = (lambda fn=fn, q=q, k=k, v=v, lens=lens: fn(q, k, v, lens, **KW)
                for fn in (fused, sdpa_prefill))
        diff = (f() - s()).abs().max().item()
        times = {f: [], s: []}
        for _ in range(args.reps):
            for fn, ts in times.items():
                t = time.perf_counter()
                fn()
                ts.append(time.perf_counter() - t)
        mf, ms = (statistics.median(t) * 1e3 for t in times.values())
        print(f"| {b} | {mf:.2f} | {ms:.2f} | {ms / mf:.2f}x | {diff:.3g} |")


if __name__ == "__main__":
    main()
