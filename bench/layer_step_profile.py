"""Where a decode step's attention time goes under transformers: fused step against unfused.

SmolLM2-135M compiled at ``bits=2`` reads ``--tokens`` tokens (a prefill, then ``--steps``
single-token steps), twice in one run: with each layer's decode step fused into one C++
call (``runtime.layer_step``, the default) and with ``append`` then ``attend`` (the
general path). Wall time is summed per step over the attention op (``KVAttend.step``, all
of it: Python, small torch ops, kernels) and the pieces inside it, by wrapping them with
timers (which add a few microseconds per call):

- ``C kvp_layer_step``: the fused step's C++ call; ``C kvp_packed_attention``: the general
  path's attention kernel; ``C kvp_pack_chunks``: chunks packed in C++;
- ``RoPE rows``: the step's rotary table and the positions of its new tokens
  (``KVPolicyCache.rope_rows``, shared by both paths);
- the rest of the op is Python and small torch ops around the kernels; the last column is
  the share of the op spent outside the C++ kernels (RoPE rows included).

    .venv/bin/python bench/layer_step_profile.py --tokens 8192
"""

from __future__ import annotations

import argparse
import collections
import functools
import statistics
import time

import torch

import kvpolicy
from kvpolicy import zoo
from kvpolicy.kernels import cpu_ext
from kvpolicy.runtime import attend, cache, layer_step

_KERNELS = ("kvp_layer_step", "kvp_packed_attention", "kvp_pack_chunks")
_spent: collections.Counter = collections.Counter()


def _timed(key: str, f):
    @functools.wraps(f)
    def g(*a, **k):
        t0 = time.perf_counter()
        try:
            return f(*a, **k)
        finally:
            _spent[key] += time.perf_counter() - t0
    return g


class _TimedLib:
    """A kernel library whose entry points are timed."""

    def __init__(self, lib) -> None:
        self._lib = lib

    def __getattr__(self, name: str):
        f = getattr(self._lib, name)
        return _timed(f"C {name}", f) if name in _KERNELS else f


def _instrument() -> None:
    attend.KVAttend.step = _timed("attention op", attend.KVAttend.step)
    cache.KVPolicyCache.rope_rows = _timed("RoPE rows", cache.KVPolicyCache.rope_rows)
    build = cpu_ext.build

    @functools.wraps(build)
    def timed_build(*a, **k):
        return _TimedLib(build(*a, **k))
    cpu_ext.build = timed_build  # load() caches what build returns


def _run(model, ids: torch.Tensor, steps: int) -> tuple[float, dict[str, float]]:
    prefill = ids.shape[1] - steps
    with torch.no_grad():
        past = model(ids[:, :prefill], use_cache=True, logits_to_keep=1).past_key_values
        _spent.clear()
        times = []
        for i in range(prefill, ids.shape[1]):
            t0 = time.perf_counter()
            past = model(ids[:, i:i + 1], past_key_values=past, use_cache=True,
                         logits_to_keep=1).past_key_values
            times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times), {k: 1e3 * v / steps for k, v in _spent.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--steps", type=int, default=32)
    args = parser.parse_args()
    _instrument()
    model = zoo.load("smollm2-135m")[0]
    kvpolicy.compile_model(model, bits=2, progress=False)
    ids = torch.randint(100, 20000, (1, args.tokens),
                        generator=torch.Generator().manual_seed(0))
    rows = {}
    for label, fused in (("fused step", True), ("unfused (append + attend)", False)):
        layer_step.ENABLED = fused
        try:
            rows[label] = _run(model, ids, args.steps)
        finally:
            layer_step.ENABLED = True
    print(f"SmolLM2-135M bits=2, {args.tokens} tokens, {args.steps} decode steps, "
          f"{torch.get_num_threads()} threads; ms per step (sums over its 30 layers)")
    keys = ["attention op", *(f"C {k}" for k in _KERNELS), "RoPE rows"]
    print("| path | step (median) | " + " | ".join(keys)
          + " | rest of the op | share of the op outside the C++ kernels |")
    print("|---" * (len(keys) + 4) + "|")
    for label, (step, spent) in rows.items():
        op = spent.get("attention op", 0.0)
        kernels = sum(spent.get(f"C {k}", 0.0) for k in _KERNELS)
        rest = op - kernels - spent.get("RoPE rows", 0.0)
        cells = " | ".join(f"{spent.get(k, 0.0):.2f}" for k in keys)
        print(f"| {label} | {step:.2f} | {cells} | {rest:.2f} | {1 - kernels / op:.0%} |")


if __name__ == "__main__":
    main()
