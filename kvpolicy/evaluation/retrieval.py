"""The retrieval check: a passage followed by the same passage, scored on the second copy.

Perplexity averages over tokens a model predicts from local context; copying a passage it
has already seen tests whether the cache still holds what was said thousands of tokens ago
(a quantized key that no longer matches its query loses the copy). Each row of
:class:`RetrievalTask` is ``passage + passage``; the prefill holds the first copy and the
first ``prefix`` tokens of the second, and teacher-forced single-token decode steps through
the cache (:func:`~kvpolicy.evaluation.decode.decode_perplexity`) score the rest of the
second copy: top-1 accuracy of the model's argmax against the true next token, and
perplexity.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from .decode import NextTokenReference, decode_perplexity
from .report import RetrievalResult

__all__ = ["RETRIEVAL_PREFIX", "RetrievalTask", "retrieval_task", "score_retrieval"]

# Tokens of the second copy that the prefill holds at least: enough for the model to notice
# the repeat before scoring starts.
RETRIEVAL_PREFIX = 16


@dataclass(frozen=True)
class RetrievalTask:
    """Passages each followed by itself, and where the prefill ends."""

    ids: torch.Tensor  # [n, 2 * length] int64: passage, then the same passage
    length: int  # tokens per passage
    prefix: int  # tokens of the second copy inside the prefill

    @property
    def context(self) -> int:
        """Prefill length: the first copy and ``prefix`` tokens of the second."""
        return self.length + self.prefix

    @property
    def steps(self) -> int:
        """Scored tokens per passage: the second copy after its prefix."""
        return self.length - self.prefix

    def scored(self) -> torch.Tensor:
        """``[n, steps]``: the tokens the decode steps score (targets of each step)."""
        return self.ids[:, self.context : self.context + self.steps]


def retrieval_task(
    passages: torch.Tensor, *, prefix: int = RETRIEVAL_PREFIX, multiple: int = 1
) -> RetrievalTask:
    """The retrieval task of ``passages [n, L]``.

    Args:
        prefix: tokens of the second copy in the prefill, at least.
        multiple: the prefix is rounded up so that the prefill length ``L + prefix`` is a
            multiple of it (quanto's per-channel axis quantizes whole groups of tokens
            after the prefill, ``peers.best_quanto_axes``).

    Raises:
        ValueError: ``passages`` is not 2-D, or too short to score a token after the prefix.
    """
    if passages.dim() != 2:
        raise ValueError(f"passages must be [n, L] token ids, got shape {tuple(passages.shape)}")
    length = passages.shape[1]
    if prefix < 0 or multiple < 1:
        raise ValueError(f"prefix={prefix} must be >= 0 and multiple={multiple} >= 1")
    prefix += -(length + prefix) % multiple
    if prefix >= length:
        raise ValueError(
            f"passages of {length} tokens leave nothing to score after a prefix of {prefix} "
            f"tokens (at least {RETRIEVAL_PREFIX}, the prefill rounded up to a multiple of "
            f"{multiple}); use passages longer than {prefix} tokens"
        )
    return RetrievalTask(torch.cat([passages, passages], dim=1), length, prefix)


def score_retrieval(
    model: torch.nn.Module,
    task: RetrievalTask,
    name: str,
    *,
    reference: NextTokenReference | None = None,
    record: bool = False,
    make_cache: Callable[[], object] | None = None,
    settings: dict[str, Any] | None = None,
    progress: bool = True,
) -> RetrievalResult:
    """Score the second copies of ``task`` through ``model``'s cache (all passages as one
    batch). ``reference``, ``record``, ``make_cache``: as for ``decode_perplexity``; with a
    reference the row carries its top-1 agreement with it."""
    res = decode_perplexity(model, task.ids, task.context, task.steps, desc=f"retrieval {name}",
                            progress=progress, batched=True, make_cache=make_cache,
                            reference=reference, record=record)
    return RetrievalResult(name, res.top1, res.perplexity, res.tokens, res.agreement,
                           dict(settings or {}))
