"""A model whose layers are mostly local: the whole cache against fp16, and the decode step.

A Gemma3-style tiny model (random weights: bytes and time do not depend on them): 18
layers, five sliding-window layers (window 512) per global one, one KV head, head_dim
256. It reads ``--tokens`` tokens (a prefill, then ``--decode`` single-token steps) with
kvpolicy's ``bits=2`` default (a local layer's residual is the share of its window that
128 is of 4,096 tokens: 16), the same with ``residual_bits: 8`` (the residual window and
incomplete chunk packed per token, runtime.recent), with ``residual: 128`` on every layer
(the default before), and with transformers' own cache. Printed side by side from one run:
the whole cache's bytes
(``memory_report()``: codes, scales, zeros, sinks, residual, positions, RoPE rows) against
fp16, what ``inspect``'s whole-cache line predicted, and the median decode step. The
default row runs each layer's decode step as one fused C++ call (``runtime.layer_step``);
the "unfused" row times the same policy through ``append`` then ``attend``.

    .venv/bin/python bench/local_layers.py
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time

import torch

import kvpolicy
from kvpolicy.policies.footprint import whole_cache
from kvpolicy.runtime import layer_step
from kvpolicy.zoo.tiny import tiny_model

LAYER_TYPES = (["sliding_attention"] * 5 + ["full_attention"]) * 3


def build() -> torch.nn.Module:
    return tiny_model("gemma3_text", num_hidden_layers=18, head_dim=256,
                      num_attention_heads=2, num_key_value_heads=1, sliding_window=512,
                      layer_types=LAYER_TYPES, max_position_embeddings=8192)


def run(model: torch.nn.Module, tokens: int, decode: int) -> tuple[object, float]:
    """The cache after ``tokens`` tokens and the median decode step in ms."""
    ids = torch.randint(3, 120, (1, tokens), generator=torch.Generator().manual_seed(0))
    prefill = tokens - decode
    steps = []
    with torch.no_grad():
        cache = model(ids[:, :prefill], use_cache=True).past_key_values
        for i in range(prefill, tokens):
            t0 = time.perf_counter()
            cache = model(ids[:, i:i + 1], past_key_values=cache,
                          use_cache=True).past_key_values
            steps.append(time.perf_counter() - t0)
    return cache, 1e3 * statistics.median(steps)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=2559)
    parser.add_argument("--decode", type=int, default=64)
    args = parser.parse_args()
    torch.manual_seed(0)
    base = build()
    _, fp_ms = run(base, args.tokens, args.decode)
    print(f"{args.tokens} tokens ({args.tokens - args.decode} prefill + {args.decode} "
          "decode steps), 18 layers (15 local, window 512), 1 KV head, head_dim 256")
    print("| cache | whole-cache bytes | x smaller than fp16 | inspect's whole-cache "
          "figure | decode step ms | x fp cache |")
    print("|---|---|---|---|---|---|")
    print(f"| transformers (fp32) | - | - | - | {fp_ms:.2f} | 1.00 |")
    rows = [("kvpolicy bits=2", None, True),
            ("bits=2, steps unfused (append + attend)", None, False),
            ("bits=2, residual_bits 8", {"defaults": {"bits": 2, "residual_bits": 8}}, True),
            ("bits=2, residual 128 everywhere", {"defaults": {"bits": 2, "residual": 128}},
             True)]
    for label, spec, fused in rows:
        model = copy.deepcopy(base)
        kvpolicy.compile_model(model, bits=2, policy=spec, progress=False)
        layer_step.ENABLED = fused
        try:
            cache, ms = run(model, args.tokens, args.decode)
        finally:
            layer_step.ENABLED = True
        rep = cache.memory_report()
        predicted = whole_cache(kvpolicy.inspect(model), args.tokens)
        print(f"| {label} | {rep['bytes']:,} | {rep['compression']:.2f} | "
              f"{predicted.compression:.2f} ({predicted.bits:.2f} bits) | {ms:.2f} | "
              f"{ms / fp_ms:.2f} |")


if __name__ == "__main__":
    main()
