"""Bytes per token of one layer's packed KV cache vs a plain fp16 cache.

SmolLM2 shapes (3 kv heads, head_dim 64), keys per-channel and values per-token with
G=32, residual window R=128, 4 sink tokens, keys stored pre-RoPE so that positions are
stored and counted (one base for the contiguous run: a few bytes, not 4 per token);
scales/zeros and full-precision tokens in fp16.
Everything :meth:`PackedKVLayer.memory_report` counts is in ``bytes``.

    .venv/bin/python bench/cache_memory.py
"""

from __future__ import annotations

import argparse

import torch

from kvpolicy.kernels.layout import QuantSpec, RotarySpec
from kvpolicy.runtime.layer import PackedKVLayer

KV_HEADS, HEAD_DIM, GROUP, RESIDUAL, SINKS = 3, 64, 32, 128, 4


def rotary(max_positions: int) -> RotarySpec:
    inv = 1.0 / 1e5 ** (torch.arange(0, HEAD_DIM, 2, dtype=torch.float64) / HEAD_DIM)
    ang = torch.arange(max_positions, dtype=torch.float64)[:, None] * inv[None]
    ang = torch.cat((ang, ang), dim=-1)
    return RotarySpec("rotate_half", HEAD_DIM, ang.cos().float(), ang.sin().float())


def report(bits: int, tokens: int, rope: RotarySpec) -> dict:
    layer = PackedKVLayer(
        QuantSpec(bits, GROUP, "channel"), QuantSpec(bits, GROUP, "token"),
        residual=RESIDUAL, sinks=SINKS, rope=rope, backend="torch", dtype=torch.float16,
    )
    g = torch.Generator().manual_seed(bits)
    k = torch.randn(1, KV_HEADS, tokens, HEAD_DIM, generator=g, dtype=torch.float16)
    v = torch.randn(1, KV_HEADS, tokens, HEAD_DIM, generator=g, dtype=torch.float16)
    layer.append(k, v)
    return layer.memory_report()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[1024, 8192, 32768])
    parser.add_argument("--bits", type=int, nargs="+", default=[2, 3, 4, 8])
    args = parser.parse_args()
    rope = rotary(max(args.tokens))
    print(f"one layer, {KV_HEADS} kv heads x head_dim {HEAD_DIM}, G={GROUP}, R={RESIDUAL}, "
          f"sinks={SINKS}, fp16 scales, positions counted")
    head = (f"{'bits':>4} {'tokens':>7} {'bytes/token':>11} {'fp16 B/tok':>10} "
            f"{'compression':>11}  {'codes':>6} {'scales+zeros':>12} {'fp tokens':>9} "
            f"{'positions':>9}")
    print(head)
    print("-" * len(head))
    for bits in args.bits:
        for t in args.tokens:
            r = report(bits, t, rope)
            per = r["bytes"] / t
            fp = r["fp16_bytes"] / t
            pct = {
                name: 100 * sum(r[k] for k in keys) / r["bytes"]
                for name, keys in (
                    ("codes", ("code_bytes",)),
                    ("scales", ("scale_bytes", "zero_bytes")),
                    ("fp", ("sink_bytes", "residual_bytes")),
                    ("pos", ("position_bytes",)),
                )
            }
            print(f"{bits:>4} {t:>7} {per:>11.1f} {fp:>10.0f} {fp / per:>10.2f}x  "
                  f"{pct['codes']:>5.1f}% {pct['scales']:>11.1f}% {pct['fp']:>8.1f}% "
                  f"{pct['pos']:>8.1f}%")


if __name__ == "__main__":
    main()
