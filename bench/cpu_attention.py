"""CPU time of one decode-attention step: packed 2-bit cache vs SDPA over fp32 / bf16 caches.

SmolLM2 shapes: 9 query heads, 3 kv heads, head_dim 64, one query token. The packed cache
is a :class:`PackedKVLayer` (keys per-channel pre-RoPE, values per-token, 2 bits, G=32,
R=128, 4 sinks) on the torch backend, timed through ``attend`` (the whole step: sinks,
packed groups and residual in one softmax, keys rotated at their positions). SDPA runs
over plain caches with ``enable_gqa=True`` (keys already rotated). All methods are timed
in one run with their repetitions interleaved; the table shows medians. Interleaving also
means every call starts with caches disturbed by the other methods, as a decode step does
inside a model: the packed step measured ~0.5 ms faster at 8K when timed alone.
The machine is shared: the header prints the load average, read the ratios with it.
``--levels uniform normal meta8 default widths`` times one packed cache per entry (keys and
values both), side by side in the same interleaved run: ``meta8`` is uniform levels in
groups of 16 with 8-bit scales and zeros (``meta_bits: 8``), the same stored bits as groups
of 32 with fp16 ones; ``default`` and ``widths`` are ``bits=2``'s groups with one width
per key and with per-channel key widths (the C++ kernel's gather of ``Params.kwid``);
``vq`` is uniform keys with vector-quantized values (``--bits`` 1 or 2, groups of 32, a
random codebook: the kernel's gather of ``Params.vcb`` does not depend on the centroids).

    .venv/bin/python bench/cpu_attention.py [--threads 2] [--tokens 1024 8192]
        [--levels uniform normal meta8 default widths vq]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from kvpolicy.kernels import cpu_ext
from kvpolicy.kernels.layout import Codebook, QuantSpec, RotarySpec
from kvpolicy.runtime.layer import PackedKVLayer

HQ, HKV, D = 9, 3, 64


def rotary(max_positions: int) -> RotarySpec:
    inv = 1.0 / 1e5 ** (torch.arange(0, D, 2, dtype=torch.float64) / D)
    ang = torch.arange(max_positions, dtype=torch.float64)[:, None] * inv[None]
    ang = torch.cat((ang, ang), dim=-1)
    return RotarySpec("rotate_half", D, ang.cos().float(), ang.sin().float())


def packed_name(bits: int, levels: str, all_levels: list[str]) -> str:
    return f"packed {bits}-bit" if all_levels == ["uniform"] else f"{levels} {bits}-bit"


def channel_widths(bits: int) -> tuple[tuple[int, ...], ...]:
    """Per-channel key widths shaped like what ``channel_widths: auto`` gives SmolLM2 at 2
    bits (about a sixth of the channels at 1 bit, an eighth at 3-4): per head, 5 RoPE pairs
    at ``bits - 1``, 3 at ``bits + 1``, 1 at ``bits + 2``, the rest at ``bits``."""
    pairs = [bits - 1] * 5 + [bits + 1] * 3 + [bits + 2] + [bits] * (D // 2 - 9)
    return (tuple(pairs + pairs),) * HKV


def specs(bits: int, variant: str) -> tuple[QuantSpec, QuantSpec]:
    """Key and value spec of one ``--levels`` entry (``meta8``: groups of 16, 8-bit
    metadata; ``default``: ``bits=2``'s groups, keys of 12 tokens and values of 32 channels,
    8-bit metadata, one width per key; ``widths``: the same with per-channel key widths,
    :func:`channel_widths`; ``vq``: vector-quantized values, a random codebook)."""
    if variant == "meta8":
        return (QuantSpec(bits, 16, "channel", "uniform", 8),
                QuantSpec(bits, 16, "token", "uniform", 8))
    if variant in ("default", "widths"):
        widths = channel_widths(bits) if variant == "widths" else None
        return (QuantSpec(bits, 12, "channel", "uniform", 8, "mse", widths),
                QuantSpec(bits, 32, "token", "uniform", 8))
    if variant == "vq":
        book = Codebook.from_tensor(torch.randn(HKV, 256, 8 // bits,
                                                generator=torch.Generator().manual_seed(0)))
        return QuantSpec(bits, 32, "channel"), QuantSpec(bits, 32, "token", "vq",
                                                         codebook=book)
    return QuantSpec(bits, 32, "channel", variant), QuantSpec(bits, 32, "token", variant)


def methods(
    tokens: int, rope: RotarySpec, bits: int, levels: list[str]
) -> dict[str, Callable[[], object]]:
    """The timed calls: one packed layer per entry of ``levels``, then the two SDPAs."""
    g = torch.Generator().manual_seed(tokens)
    k = torch.randn(1, HKV, tokens, D, generator=g)
    v = torch.randn(1, HKV, tokens, D, generator=g)
    q = torch.randn(1, HQ, 1, D, generator=g)
    fns: dict[str, Callable[[], object]] = {}
    for lv in levels:
        layer = PackedKVLayer(*specs(bits, lv), residual=128, sinks=4, rope=rope,
                              backend="torch")
        layer.append(k, v)
        fns[packed_name(bits, lv, levels)] = lambda layer=layer: layer.attend(q)
    kb, vb, qb = k.bfloat16(), v.bfloat16(), q.bfloat16()
    fns["SDPA fp32"] = lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
    fns["SDPA bf16"] = lambda: F.scaled_dot_product_attention(qb, kb, vb, enable_gqa=True)
    return fns


def time_interleaved(fns: dict[str, Callable[[], object]], budget_s: float) -> dict[str, float]:
    """Median seconds per call; repetitions of the methods alternate."""
    for fn in fns.values():  # warm-up (and first-use kernel build)
        fn()
        fn()
    start = time.perf_counter()
    for fn in fns.values():
        fn()
    once = time.perf_counter() - start
    reps = int(min(60, max(9, budget_s / max(once, 1e-6))))
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(reps):
        for name, fn in fns.items():
            t = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t)
    return {name: statistics.median(ts) for name, ts in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, nargs="+",
                        default=[1024, 2048, 4096, 8192, 16384, 32768])
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--bits", type=int, default=2)
    parser.add_argument("--budget", type=float, default=3.0, help="seconds per size")
    parser.add_argument("--levels", nargs="+", default=["uniform"],
                        choices=("uniform", "normal", "meta8", "default", "widths", "vq"),
                        help="one packed cache per entry")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    rope = rotary(max(args.tokens) + 1)
    native = all(
        cpu_ext.load(args.bits, args.bits, k.group_size, v.group_size, D, D, D // 2, 0,
                     int(not k.uniform), int(not v.uniform and not v.vq), int(k.meta8),
                     int(v.meta8), v.vq_dim if v.vq else 0) is not None
        for k, v in (specs(args.bits, lv) for lv in args.levels)
    )
    print(f"torch {torch.__version__}, {args.threads} threads, load average "
          f"{os.getloadavg()[0]:.2f}, C++ kernel: {'yes' if native else 'no (eager path)'}")
    rows = []
    for t in args.tokens:
        med = time_interleaved(methods(t, rope, args.bits, args.levels), args.budget)
        rows.append((t, med))
    names = list(rows[0][1])
    packed = [packed_name(args.bits, lv, args.levels) for lv in args.levels]
    tags = ["packed"] if len(packed) == 1 else args.levels
    head = f"{'tokens':>7} " + " ".join(f"{n + ' ms':>16}" for n in names)
    head += "".join(f" {tag + '/fp32':>11} {tag + '/bf16':>11}" for tag in tags)
    print(head)
    print("-" * len(head))
    for t, med in rows:
        line = f"{t:>7} " + " ".join(f"{1e3 * med[n]:>16.3f}" for n in names)
        for p in packed:
            r32, r16 = med[p] / med["SDPA fp32"], med[p] / med["SDPA bf16"]
            line += f" {r32:>10.2f}x {r16:>10.2f}x"
        print(line)


if __name__ == "__main__":
    main()
