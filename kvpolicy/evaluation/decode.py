"""The decode loop every perplexity of kvpolicy's evaluation goes through.

A single forward pass over a prompt hardly touches the cache (docs/design.md §3). Here every
scored token is produced by a single-token decode step that reads the cache: prefill
``context`` tokens, then score ``steps`` tokens teacher-forced, one step at a time. The
same loop scores kvpolicy's compiled cache, the model's own ``DynamicCache`` and the peers'
caches (``make_cache``).
"""

from __future__ import annotations

import inspect
import math
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from tqdm.auto import tqdm

__all__ = ["DecodeResult", "decode_perplexity", "cache_keyword"]


@dataclass
class DecodeResult:
    """Perplexity of a teacher-forced decode, with its speed and the cache it ended with."""

    perplexity: float
    tokens: int
    seconds_per_step: float  # median wall time of one decode step (of the whole batch)
    cache: object | None  # the cache after the last segment
    nll: float  # summed negative log-likelihood (nats)


def decode_perplexity(
    model: torch.nn.Module,
    segments: torch.Tensor,
    context: int,
    steps: int,
    *,
    desc: str = "decode",
    progress: bool = True,
    batched: bool = False,
    make_cache: Callable[[], object] | None = None,
) -> DecodeResult:
    """Perplexity of ``segments [N, >= context + steps]`` scored by teacher-forced decode.

    Each segment: one forward over the first ``context`` tokens with ``use_cache=True``,
    then ``steps`` forwards of one token each through the returned cache; the logits of
    each step score the next token.

    Args:
        batched: decode all segments as one batch (same perplexity, less time; the step
            time is then per batch).
        make_cache: builds the cache handed to the prefill (a peer's cache); default:
            the model makes its own.
    """
    if segments.shape[1] < context + steps:
        raise ValueError(
            f"segments of {segments.shape[1]} tokens are shorter than context + steps = "
            f"{context + steps}"
        )
    if steps < 1:
        raise ValueError(f"steps={steps} must be positive")
    cache_kw = cache_keyword(model)
    # NOTE: all segments decode as one batch: a decode step on CPU costs about the same for
    # 1 or 4 rows (the weights are read once), so scoring N segments takes ~1/N the time.
    groups = [segments] if batched else [s[None] for s in segments]
    nll, n, times = 0.0, 0, []
    cache = None
    bar = tqdm(total=len(groups) * steps, desc=desc, disable=not progress, unit="step")
    with torch.no_grad():
        for ids in groups:
            first = {} if make_cache is None else {cache_kw: make_cache()}
            out = model(ids[:, :context], use_cache=True, **first)
            cache, logits = out.past_key_values, out.logits[:, -1]
            for i in range(steps):
                target = ids[:, context + i]
                nll += torch.nn.functional.cross_entropy(
                    logits.float(), target, reduction="sum"
                ).item()
                n += target.numel()
                t0 = time.perf_counter()
                out = model(ids[:, context + i : context + i + 1], use_cache=True,
                            **{cache_kw: cache})
                times.append(time.perf_counter() - t0)
                cache, logits = out.past_key_values, out.logits[:, -1]
                bar.update(1)
    bar.close()
    times.sort()
    return DecodeResult(math.exp(nll / n), n, times[len(times) // 2], cache, nll)


def cache_keyword(model: torch.nn.Module) -> str:
    """The keyword a model's forward takes its cache by (transformers 5.x: ``cache``)."""
    params = inspect.signature(model.forward).parameters
    return "cache" if "cache" in params else "past_key_values"
