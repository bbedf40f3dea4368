"""Decode-time perplexity: the quality of a cache that was built over time.

A single forward over a prompt hardly touches the cache (DESIGN.md §3). Here every scored
token is produced by a single-token decode step that reads the cache: prefill ``context``
tokens, then score ``steps`` tokens teacher-forced, one step at a time.
"""

from __future__ import annotations

import inspect
import math
import time
from dataclasses import dataclass

import torch
from tqdm.auto import tqdm

__all__ = ["DecodeResult", "decode_perplexity"]


@dataclass
class DecodeResult:
    perplexity: float
    tokens: int
    seconds_per_step: float  # median wall time of one decode step
    cache: object | None  # the cache after the last segment
    nll: float


def decode_perplexity(
    model: torch.nn.Module,
    segments: torch.Tensor,
    context: int,
    steps: int,
    *,
    desc: str = "decode",
    progress: bool = True,
) -> DecodeResult:
    """Perplexity of ``segments [N, >= context + steps]`` scored by teacher-forced decode.

    Each segment: one forward over the first ``context`` tokens with ``use_cache=True``,
    then ``steps`` forwards of one token each through the returned cache; the logits of
    each step score the next token.
    """
    if segments.shape[1] < context + steps:
        raise ValueError(
            f"segments of {segments.shape[1]} tokens are shorter than context + steps = "
            f"{context + steps}"
        )
    # transformers 5.x renames past_key_values -> cache; use what the model takes.
    params = inspect.signature(model.forward).parameters
    cache_kw = "cache" if "cache" in params else "past_key_values"
    nll, n, times = 0.0, 0, []
    cache = None
    bar = tqdm(total=len(segments) * steps, desc=desc, disable=not progress, unit="tok")
    with torch.no_grad():
        for seg in segments:
            ids = seg[None]
            out = model(ids[:, :context], use_cache=True)
            cache, logits = out.past_key_values, out.logits[:, -1]
            for i in range(steps):
                target = ids[:, context + i]
                nll += torch.nn.functional.cross_entropy(logits.float(), target).item()
                n += 1
                t0 = time.perf_counter()
                out = model(ids[:, context + i : context + i + 1], use_cache=True,
                            **{cache_kw: cache})
                times.append(time.perf_counter() - t0)
                cache, logits = out.past_key_values, out.logits[:, -1]
                bar.update(1)
    bar.close()
    times.sort()
    return DecodeResult(math.exp(nll / n), n, times[len(times) // 2], cache, nll)
