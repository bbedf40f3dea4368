"""The decode loop every perplexity of kvpolicy's evaluation goes through.

A single forward pass over a prompt hardly touches the cache (docs/design.md §3). Here every
scored token is produced by a single-token decode step that reads the cache: prefill
``context`` tokens, then score ``steps`` tokens teacher-forced, one step at a time. The
same loop scores kvpolicy's compiled cache, the model's own ``DynamicCache`` and the peers'
caches (``make_cache``). A :class:`NextTokenReference` recorded on the full-precision run
lets every other run be compared with it step by step: KL divergence of the next-token
distributions and top-1 agreement.
"""

from __future__ import annotations

import inspect
import math
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..progress import progress_bar, stage_done

__all__ = [
    "DecodeResult", "NextTokenReference", "decode_perplexity", "cache_keyword", "output_cache",
]


@dataclass
class DecodeResult:
    """Perplexity of a teacher-forced decode, with its speed and the cache it ended with."""

    perplexity: float
    tokens: int
    seconds_per_step: float  # median wall time of one decode step (of the whole batch)
    cache: object | None  # the cache after the last segment
    nll: float  # summed negative log-likelihood (nats)
    top1: float | None = None  # share of scored steps whose argmax is the true next token
    # Against a NextTokenReference (None without one): mean KL(reference || this run) of the
    # next-token distributions per scored token (nats), and the share of steps whose argmax
    # equals the reference's.
    kl: float | None = None
    agreement: float | None = None


class NextTokenReference:
    """One run's next-token distributions on every scored step of a decode, to compare other
    runs of the same segments, context and steps with (:func:`decode_perplexity`).

    Kept per scored step and row: the argmax, and (``log_probs=True``) the whole
    log-softmax in fp16, ``rows * steps * vocab * 2`` bytes. fp16 because the KL of a
    quantized cache is orders of magnitude above fp16 rounding of log-probabilities, and
    half the bytes of fp32 matter at a 49K vocabulary. The compared run's log-probabilities
    are rounded to fp16 too (and both renormalised), so a run compared with its own record
    gives KL exactly 0.
    """

    def __init__(self, *, log_probs: bool = True) -> None:
        self.with_log_probs = log_probs
        self.argmax: torch.Tensor | None = None  # [rows, steps] int64
        self.log_probs: torch.Tensor | None = None  # [rows, steps, vocab] fp16

    @property
    def recorded(self) -> bool:
        return self.argmax is not None

    @property
    def nbytes(self) -> int:
        """Bytes the record holds."""
        return sum(t.numel() * t.element_size() for t in (self.argmax, self.log_probs)
                   if t is not None)

    def _start(self, rows: int, steps: int, vocab: int) -> None:
        if self.recorded:
            raise ValueError("this NextTokenReference is already recorded; make a new one")
        self.argmax = torch.empty(rows, steps, dtype=torch.long)
        if self.with_log_probs:
            self.log_probs = torch.empty(rows, steps, vocab, dtype=torch.float16)

    def _check(self, rows: int, steps: int, vocab: int) -> None:
        if not self.recorded:
            raise ValueError("compare with a NextTokenReference only after recording it: "
                             "pass record=True to the reference run's decode_perplexity")
        have = tuple(self.argmax.shape)
        if have != (rows, steps) or (self.log_probs is not None
                                     and self.log_probs.shape[2] != vocab):
            raise ValueError(
                f"the reference was recorded on {have[0]} rows x {have[1]} steps"
                + (f" x vocabulary {self.log_probs.shape[2]}" if self.log_probs is not None
                   else "")
                + f", this run scores {rows} x {steps} x vocabulary {vocab}; compare runs "
                "of the same segments, context and steps"
            )

    def _store(self, rows: slice, step: int, log_probs: torch.Tensor) -> None:
        self.argmax[rows, step] = log_probs.argmax(-1).cpu()
        if self.log_probs is not None:
            self.log_probs[rows, step] = log_probs.to(torch.float16).cpu()

    def _compare(self, rows: slice, step: int, log_probs: torch.Tensor) -> tuple[float, int]:
        """(summed KL(reference || run) over the rows, 0.0 without log-probs; rows whose
        argmax agrees)."""
        agree = int((log_probs.argmax(-1).cpu() == self.argmax[rows, step]).sum())
        if self.log_probs is None:
            return 0.0, agree
        # Both renormalised after the fp16 rounding: a KL of two distributions, >= 0 up to
        # fp32 arithmetic (clamped), and exactly 0 for identical inputs.
        ref = torch.log_softmax(self.log_probs[rows, step].float(), dim=-1)
        run = torch.log_softmax(log_probs.to(torch.float16).float().cpu(), dim=-1)
        p = ref.exp()
        # 0 * log 0 = 0: a token the reference gives no mass adds nothing, even at -inf.
        terms = torch.where(p > 0, p * (ref - run), torch.zeros_like(p))
        return float(terms.sum(-1).clamp(min=0).sum()), agree


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
    reference: NextTokenReference | None = None,
    record: bool = False,
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
        reference: compare every scored step with this record (``kl`` and ``agreement``
            of the result); with ``record=True`` this run fills it first (and so compares
            with itself: KL 0, agreement 1).
    """
    if segments.shape[1] < context + steps:
        raise ValueError(
            f"segments of {segments.shape[1]} tokens are shorter than context + steps = "
            f"{context + steps}"
        )
    if steps < 1:
        raise ValueError(f"steps={steps} must be positive")
    if record and reference is None:
        raise ValueError("record=True needs a reference to record into")
    cache_kw = cache_keyword(model)
    # NOTE: all segments decode as one batch: a decode step on CPU costs about the same for
    # 1 or 4 rows (the weights are read once), so scoring N segments takes ~1/N the time.
    groups = [segments] if batched else [s[None] for s in segments]
    nll, n, times = 0.0, 0, []
    hits = agree = 0
    kl = 0.0
    row = 0
    cache = None
    bar = progress_bar(len(groups) * steps, desc=desc, unit="step", enabled=progress)
    start = time.perf_counter()
    with torch.no_grad():
        for ids in groups:
            rows = slice(row, row + ids.shape[0])
            row += ids.shape[0]
            first = {} if make_cache is None else {cache_kw: make_cache()}
            out = model(ids[:, :context], use_cache=True, **first)
            cache, logits = output_cache(out), out.logits[:, -1]
            if reference is not None and rows.start == 0:
                shape = (segments.shape[0], steps, logits.shape[-1])
                if record:
                    reference._start(*shape)
                else:
                    reference._check(*shape)
            for i in range(steps):
                target = ids[:, context + i]
                log_probs = torch.log_softmax(logits.float(), dim=-1)
                nll -= log_probs.gather(-1, target[:, None]).sum().item()
                hits += int((log_probs.argmax(-1) == target).sum())
                if reference is not None:
                    if record:
                        reference._store(rows, i, log_probs)
                    step_kl, step_agree = reference._compare(rows, i, log_probs)
                    kl, agree = kl + step_kl, agree + step_agree
                n += target.numel()
                t0 = time.perf_counter()
                out = model(ids[:, context + i : context + i + 1], use_cache=True,
                            **{cache_kw: cache})
                times.append(time.perf_counter() - t0)
                cache, logits = output_cache(out), out.logits[:, -1]
                bar.update(1)
    stage_done(bar, f"{desc}: perplexity {math.exp(nll / n):.3f} over {n:,} scored tokens "
               f"in {time.perf_counter() - start:.1f} s", enabled=progress)
    times.sort()
    compared = reference is not None
    return DecodeResult(
        math.exp(nll / n), n, times[len(times) // 2], cache, nll, hits / n,
        kl / n if compared and reference.log_probs is not None else None,
        agree / n if compared else None,
    )


def cache_keyword(model: torch.nn.Module) -> str:
    """The keyword a model's forward takes its cache by (transformers 5.x: ``cache``)."""
    params = inspect.signature(model.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


_MISSING = object()


def output_cache(output: object) -> object:
    """The cache a forward's or ``generate``'s output carries: ``output.cache`` in
    transformers 5.x, ``output.past_key_values`` before (5.x logs a deprecation warning
    when the old name is read)."""
    cache = getattr(output, "cache", _MISSING)
    return output.past_key_values if cache is _MISSING else cache
