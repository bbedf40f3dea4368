"""Real evaluation text with no download: CPython's ``pydoc_data.topics``.

The standard library ships English technical prose (the help topics of ``pydoc``), long
enough for many disjoint evaluation segments of a thousand tokens.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["pydoc_text", "pydoc_tokens", "segments"]


def pydoc_text() -> str:
    """All pydoc help topics joined in sorted-key order (deterministic)."""
    from pydoc_data.topics import topics

    return "\n\n".join(topics[key] for key in sorted(topics))


def pydoc_tokens(tokenizer) -> torch.Tensor:
    """The whole pydoc text as one 1-D ``int64`` tensor of token ids (no special tokens)."""
    ids = tokenizer(pydoc_text(), add_special_tokens=False, return_attention_mask=False)
    return torch.tensor(ids["input_ids"], dtype=torch.long)


def segments(
    tokenizer,
    length: int,
    n: int = 4,
    *,
    starts: Sequence[int] | None = None,
    stride: int = 1024,
) -> torch.Tensor:
    """Cut ``n`` segments of ``length`` tokens out of the pydoc text.

    Args:
        tokenizer: a Hugging Face tokenizer.
        length: tokens per segment.
        n: number of segments (ignored when ``starts`` is given).
        starts: token offsets of the segments; default ``0, stride, 2*stride, ...``
            (the README's reference figures: 4 segments of 1024 tokens, starting at 0,
            1024, 2048, 3072).
        stride: distance between default starts.

    Returns:
        ``[n, length]`` int64 token ids.
    """
    if length < 1:
        raise ValueError(f"length={length} must be positive")
    tokens = pydoc_tokens(tokenizer)
    starts = list(starts) if starts is not None else [i * stride for i in range(n)]
    too_far = [s for s in starts if s < 0 or s + length > tokens.numel()]
    if too_far:
        raise ValueError(
            f"segments starting at {too_far} with length {length} do not fit in the "
            f"{tokens.numel()} tokens of the pydoc text; use smaller starts or length"
        )
    return torch.stack([tokens[s : s + length] for s in starts])
