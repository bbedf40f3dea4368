"""Real evaluation text with no download: CPython's ``pydoc_data.topics``.

The standard library ships English technical prose (the help topics of ``pydoc``), long
enough for many disjoint evaluation segments of a thousand tokens. ``read_text`` reads a
text the user brings instead (``kvpolicy eval --text FILE``).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch

from ..errors import KVPolicyError

__all__ = ["pydoc_text", "pydoc_tokens", "read_text", "segments", "topic_passage"]


def pydoc_text() -> str:
    """All pydoc help topics joined in sorted-key order (deterministic)."""
    from pydoc_data.topics import topics

    return "\n\n".join(topics[key] for key in sorted(topics))


def topic_passage(tokenizer, topic: str, max_tokens: int) -> str:
    """The opening of one pydoc help topic (``"string-methods"``): as many whole paragraphs
    as fit in ``max_tokens`` tokens, and at least the first.

    Raises:
        KVPolicyError: there is no such topic.
    """
    from pydoc_data.topics import topics

    if topic not in topics:
        raise KVPolicyError(
            f"no pydoc help topic {topic!r}; the topics are: {', '.join(sorted(topics))}"
        )
    paragraphs = topics[topic].split("\n\n")

    def fits(n: int) -> bool:
        body = "\n\n".join(paragraphs[:n])
        ids = tokenizer(body, add_special_tokens=False, return_attention_mask=False)
        return len(ids["input_ids"]) <= max_tokens

    # Tokens grow with the paragraphs taken: bisect for the most that fit.
    lo, hi = 1, len(paragraphs)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid - 1)
    return "\n\n".join(paragraphs[:lo])


def read_text(path: str | Path) -> str:
    """The UTF-8 text of the file at ``path``, to score instead of the pydoc text.

    Raises:
        KVPolicyError: the file is missing, is not UTF-8 text or is empty.
    """
    p = Path(path)
    try:
        body = p.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise KVPolicyError(f"--text {path}: no such file") from None
    except UnicodeDecodeError as exc:
        raise KVPolicyError(
            f"--text {path}: not UTF-8 text ({exc.reason} at byte {exc.start}); give a text file"
        ) from None
    if not body.strip():
        raise KVPolicyError(f"--text {path}: the file is empty")
    return body


def pydoc_tokens(tokenizer, source: str | None = None) -> torch.Tensor:
    """The whole pydoc text (or ``source``) as one 1-D ``int64`` tensor of token ids (no
    special tokens)."""
    body = pydoc_text() if source is None else source
    ids = tokenizer(body, add_special_tokens=False, return_attention_mask=False)
    return torch.tensor(ids["input_ids"], dtype=torch.long)


def segments(
    tokenizer,
    length: int,
    n: int = 4,
    *,
    starts: Sequence[int] | None = None,
    stride: int = 1024,
    source: str | None = None,
) -> torch.Tensor:
    """Cut ``n`` segments of ``length`` tokens out of the pydoc text (or ``source``).

    Args:
        tokenizer: a Hugging Face tokenizer.
        length: tokens per segment.
        n: number of segments (ignored when ``starts`` is given).
        starts: token offsets of the segments; default ``0, stride, 2*stride, ...``
            (the reference figures of docs/results.md: 4 segments of 1024 tokens, starting at 0,
            1024, 2048, 3072).
        stride: distance between default starts.
        source: a text to cut them from instead of the pydoc text (``read_text``).

    Returns:
        ``[n, length]`` int64 token ids.
    """
    if length < 1:
        raise ValueError(f"length={length} must be positive")
    tokens = pydoc_tokens(tokenizer, source)
    starts = list(starts) if starts is not None else [i * stride for i in range(n)]
    too_far = [s for s in starts if s < 0 or s + length > tokens.numel()]
    if too_far:
        what = "pydoc text" if source is None else "given text"
        raise ValueError(
            f"segments starting at {too_far} with length {length} do not fit in the "
            f"{tokens.numel()} tokens of the {what}; use smaller starts or length"
        )
    return torch.stack([tokens[s : s + length] for s in starts])
