"""What per-channel key widths could buy: an emulation study on SmolLM2's retrieval check.

At 2 bits the retrieval check (a pydoc passage, then the same passage, scored on the
second copy) loses a fifth of fp's top-1, and the keys lose it (docs/results.md, "The split
toward the keys"). A key enters attention as ``q · k``: the error of channel ``c`` costs about
``E[q_c²] · step_c²``, and ``step_c`` is the channel's range over its group divided by
``2^b - 1``. Channels differ in both factors by orders of magnitude, so one width for
every channel spends bits where the query never looks. This script measures what giving
each channel its own width (1-4 bits, 2 on average) would do, before any kernel exists:

- keys are fake-quantized where the model computes them (the output of each layer's
  ``k_proj``: SmolLM2 has no key norm, so that is the pre-RoPE key kvpolicy caches), per
  channel over groups of ``--group`` tokens, min-max, fp32 scale and zero, the first
  ``--sinks`` tokens kept; values are left in full precision;
- one forward pass over each passage and its copy (no residual window: every earlier key
  is quantized, as it would be far back in a cache);
- the widths are allocated per layer, KV head and channel pair (RoPE rotates channels ``c``
  and ``c + D/2`` together) by greedy marginal gain of ``E[q²] · range²``, both measured
  on a calibration text the passages never reach (the last ``--calibration`` pydoc tokens).

    python bench/key_channel_bits.py [--passages 2] [--length 2048] [--group 16]

Prints top-1 and perplexity on the second copies for fp, uniform widths and allocated
widths at the same average, and which factor of the cost carries the gain (query energy
alone, range alone). An emulation of a format kvpolicy does not have yet; its figures are
not the cache's.
"""

from __future__ import annotations

import argparse
import math
import time

import torch

from kvpolicy import zoo
from kvpolicy.zoo import text

WIDTHS = (1, 2, 3, 4)


def fake_quantize(x: torch.Tensor, bits: torch.Tensor, group: int) -> torch.Tensor:
    """``x [T, C]`` quantized per column over groups of ``group`` rows (whole groups only; a
    tail shorter than a group stays as it is), min-max, ``bits [C]`` per column."""
    t = x.shape[0] // group * group
    g = x[:t].reshape(-1, group, x.shape[1])
    lo, hi = g.amin(1, keepdim=True), g.amax(1, keepdim=True)
    top = (2.0 ** bits.float() - 1).view(1, 1, -1)
    step = ((hi - lo) / top).clamp(min=1e-12)
    out = x.clone()
    out[:t] = (torch.round((g - lo) / step).clamp(min=0).minimum(top) * step + lo).reshape(t, -1)
    return out


def allocate(cost: torch.Tensor, average: float, widths=WIDTHS) -> torch.Tensor:
    """Widths ``[n]`` for items of ``cost [n]`` (error at width b: ``cost / (2^b - 1)²``),
    ``average`` on the mean, by greedy marginal gain (exact for this convex cost)."""
    bits = torch.full_like(cost, widths[0], dtype=torch.long)
    for _ in range(round((average - widths[0]) * cost.numel())):
        err = cost / (2.0 ** bits - 1) ** 2
        nxt = cost / (2.0 ** (bits + 1) - 1) ** 2
        gain = torch.where(bits < widths[-1], err - nxt, torch.full_like(err, -1.0))
        bits[gain.argmax()] += 1
    return bits


class KeyQuantizer:
    """Forward hooks on every ``k_proj`` (keys) and ``q_proj`` (statistics only)."""

    def __init__(self, model: torch.nn.Module, group: int, sinks: int) -> None:
        self.layers = model.model.layers
        cfg = model.config
        self.hkv, self.hq = cfg.num_key_value_heads, cfg.num_attention_heads
        self.d = cfg.hidden_size // self.hq
        self.group, self.sinks = group, sinks
        self.bits: list[torch.Tensor] | None = None  # per layer, [hkv * d]
        self.stats: dict[int, dict[str, torch.Tensor]] | None = None
        for i, layer in enumerate(self.layers):
            layer.self_attn.k_proj.register_forward_hook(self._key_hook(i))
            layer.self_attn.q_proj.register_forward_hook(self._query_hook(i))

    def _key_hook(self, i: int):
        def hook(module, args, out):
            if self.stats is not None:
                self.stats.setdefault(i, {})["k"] = out.detach()[0]
            if self.bits is None:
                return out
            rows = []
            for x in out:  # batch rows
                y = x.clone()
                y[self.sinks:] = fake_quantize(x[self.sinks:], self.bits[i], self.group)
                rows.append(y)
            return torch.stack(rows)
        return hook

    def _query_hook(self, i: int):
        def hook(module, args, out):
            if self.stats is not None:
                self.stats.setdefault(i, {})["q"] = out.detach()[0]
        return hook

    def costs(self, model: torch.nn.Module, ids: torch.Tensor) -> list[tuple[torch.Tensor, ...]]:
        """Per layer ``(E[q²], E[range²])``, each ``[hkv, d]``, from one forward of ``ids``."""
        self.stats, self.bits = {}, None
        with torch.no_grad():
            model(ids)
        out = []
        for i in range(len(self.layers)):
            q = self.stats[i]["q"].reshape(-1, self.hkv, self.hq // self.hkv, self.d)
            k = self.stats[i]["k"].reshape(-1, self.hkv, self.d)
            t = k.shape[0] // self.group * self.group
            g = k[:t].reshape(-1, self.group, self.hkv, self.d)
            out.append(((q ** 2).mean((0, 2)), ((g.amax(1) - g.amin(1)) ** 2).mean(0)))
        self.stats = None
        return out

    def allocated(self, costs, average: float, what: str = "both") -> list[torch.Tensor]:
        """Widths per layer ``[hkv * d]``: one width per channel pair (c, c + d/2)."""
        bits = []
        for energy, range2 in costs:
            c = {"both": energy * range2, "query": energy, "range": range2}[what]
            pairs = c.reshape(self.hkv, 2, self.d // 2).sum(1).reshape(-1)
            b = allocate(pairs, average).reshape(self.hkv, self.d // 2)
            bits.append(torch.cat([b, b], 1).reshape(-1))
        return bits

    def uniform(self, width: int) -> list[torch.Tensor]:
        return [torch.full((self.hkv * self.d,), width) for _ in self.layers]


def score(model: torch.nn.Module, ids: torch.Tensor, length: int, prefix: int) -> tuple[float, ...]:
    """Top-1 and perplexity over the second copies, after ``prefix`` of their tokens."""
    with torch.no_grad():
        logits = model(ids).logits[:, length + prefix - 1:-1].float()
    target = ids[:, length + prefix:]
    top1 = (logits.argmax(-1) == target).float().mean().item()
    nll = torch.nn.functional.cross_entropy(logits.flatten(0, 1), target.flatten()).item()
    return top1, math.exp(nll)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--passages", type=int, default=2)
    ap.add_argument("--length", type=int, default=2048, help="tokens per passage")
    ap.add_argument("--group", type=int, default=16, help="tokens per key group")
    ap.add_argument("--sinks", type=int, default=4)
    ap.add_argument("--calibration", type=int, default=1024,
                    help="the last N pydoc tokens measure the costs")
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model, tokenizer = zoo.load("smollm2-135m")
    passages = text.segments(tokenizer, args.length, args.passages,
                             stride=max(args.length, 1024))
    ids = torch.cat([passages, passages], 1)
    calibration = text.pydoc_tokens(tokenizer)[-args.calibration:].unsqueeze(0)
    kq = KeyQuantizer(model, args.group, args.sinks)
    costs = kq.costs(model, calibration)
    rows = [("full precision", None), ("uniform 2 bits", kq.uniform(2)),
            ("uniform 3 bits", kq.uniform(3)),
            ("allocated 1-4 bits, 2 on average", kq.allocated(costs, 2.0)),
            ("  by query energy alone", kq.allocated(costs, 2.0, "query")),
            ("  by range alone", kq.allocated(costs, 2.0, "range")),
            ("allocated 1-4 bits, 2.5 on average", kq.allocated(costs, 2.5))]
    print(f"SmolLM2-135M, {args.passages} pydoc passages of {args.length} tokens, each "
          f"repeated; keys per channel in groups of {args.group} tokens, min-max, fp32 "
          f"metadata, {args.sinks} sinks kept; values in full precision; one thread")
    print(f"{'keys':<36} {'top-1':>7} {'x fp':>6} {'ppl':>7}  widths 1/2/3/4   s")
    fp_top1 = None
    for name, bits in rows:
        kq.bits = bits
        start = time.perf_counter()
        top1, ppl = score(model, ids, args.length, 16)
        fp_top1 = top1 if fp_top1 is None else fp_top1
        hist = ("" if bits is None else
                "/".join(str(int((torch.cat(bits) == w).sum())) for w in WIDTHS))
        print(f"{name:<36} {top1:7.3f} {top1 / fp_top1:6.3f} {ppl:7.3f}  {hist:<15} "
              f"{time.perf_counter() - start:4.0f}", flush=True)


if __name__ == "__main__":
    main()
