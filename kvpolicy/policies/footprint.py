"""What a policy's cache holds at a context length: the whole cache, not the packed body.

``TensorPolicy.stored_bits`` prices one *packed* element (its code and its share of a scale
and a zero). A layer also holds full-precision tokens: the sinks, the residual window and
the chunk of it that is not complete yet. A global layer amortises them over the whole
context; a sliding-window layer holds about a window of tokens and pays them on every
window. :func:`whole_cache` counts every byte a layer holds after ``tokens`` tokens, with
the runtime's schedule (kvpolicy/runtime/layer.py): a chunk of ``lcm`` of the key's and
value's token groups is packed once the residual holds ``residual + chunk`` tokens, and a
local layer drops the sinks and whole packed chunks that lie before its window.

Full-precision tokens are counted at 2 bytes per element (fp16 or bf16, what a quantized
layer stores them in), residual tokens at their ``residual_bits`` (``runtime.recent``:
codes, and a scale and a zero per token and kv head below 16); the comparison is with an
fp16 cache of the tokens each layer holds. The positions the cache keeps (a few bytes
per run of tokens) are not counted.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

# ``policy`` is a ModelPolicy and its tensors TensorPolicy (schema.py), read by their
# fields without importing them: schema.py imports render.py, which imports this module.

__all__ = ["CONTEXT", "Footprint", "held_tokens", "whole_cache"]

# The context length a whole-cache figure is quoted at unless another is given.
CONTEXT = 4096

_FP_BYTES = 2  # fp16 / bf16


@dataclass(frozen=True)
class HeldTokens:
    """One layer's tokens after a step: full precision (sinks + residual) and packed."""

    sinks: int
    packed: int
    residual: int

    @property
    def total(self) -> int:
        return self.sinks + self.packed + self.residual


def held_tokens(tokens: int, sinks: int, residual: int, chunk: int,
                window: int | None = None) -> HeldTokens:
    """The segments of a layer after ``tokens`` tokens (the runtime's packing schedule).

    With a ``window`` W, what the next query cannot reach (the first ``tokens - W + 1``)
    is gone: the sinks, then whole packed chunks, then the residual's oldest tokens. The
    packing schedule is taken as if nothing had been evicted, which is exact when the
    window is longer than ``residual + chunk`` (a shorter one evicts residual tokens, and
    the layer then packs later than counted here).
    """
    if chunk <= 0:
        raise ValueError(f"chunk must be positive, got {chunk}")
    s = min(sinks, tokens)
    rest = tokens - s
    packed = (rest - residual) // chunk * chunk if rest >= residual + chunk else 0
    res = rest - packed
    drop = tokens - window + 1 if window is not None else 0
    if drop > 0:
        d_s = min(s, drop)
        d_p = min(packed, (drop - s) // chunk * chunk) if d_s == s else 0
        d_r = max(0, min(res, drop - s - d_p)) if d_s == s and d_p == packed else 0
        s, packed, res = s - d_s, packed - d_p, res - d_r
    return HeldTokens(s, packed, res)


@dataclass(frozen=True)
class Footprint:
    """Bytes a policy's whole cache holds at ``tokens`` tokens, per batch row.

    ``bytes`` counts codes, scales, zeros, vq centroids, the full-precision sinks and
    the residual with the incomplete chunk (at its ``residual_bits``); ``body_bytes``
    the packed part alone;
    ``fp16_bytes`` an fp16 cache of the same held tokens. ``bits`` is stored bits per
    cached element over the whole cache, ``body_bits`` over the packed tokens alone (what
    ``avg_stored_bits`` prices).
    """

    tokens: int
    bytes: float
    body_bytes: float
    fp16_bytes: int
    elements: int
    body_elements: int

    @property
    def bits(self) -> float:
        return 8 * self.bytes / self.elements if self.elements else float("nan")

    @property
    def body_bits(self) -> float:
        return 8 * self.body_bytes / self.body_elements if self.body_elements else float("nan")

    @property
    def compression(self) -> float:
        """How many times smaller than fp16 the whole cache is."""
        return self.fp16_bytes / self.bytes if self.bytes else float("nan")


def _chunk(key: Any, value: Any) -> int:
    return math.lcm(key.quant_spec().token_group, value.quant_spec().token_group)


def whole_cache(policy: Any, tokens: int = CONTEXT,
                windows: Sequence[int | None] | None = None, scale_bytes: int = 2) -> Footprint:
    """The bytes every layer of ``policy`` holds after ``tokens`` tokens.

    Args:
        policy: the model's policy.
        tokens: the context length (tokens seen by every layer).
        windows: per layer, the sliding window of a local layer or None (a global layer);
            by default ``policy.windows`` (empty: every layer global).
        scale_bytes: bytes of a 16-bit scale or zero (2); 8-bit metadata counts 1.
    """
    if windows is None and policy.windows:
        windows = policy.windows
    by_layer: dict[int, list[Any]] = {}
    for t in policy.tensors:
        by_layer.setdefault(t.layer, []).append(t)
    if windows is not None and len(windows) != len(by_layer):
        raise ValueError(f"windows names {len(windows)} layers; the policy has {len(by_layer)}")
    total = body = 0.0
    fp16 = elements = body_elements = 0
    for i, (_, pair) in enumerate(sorted(by_layer.items())):
        key, value = pair
        window = windows[i] if windows is not None else None
        if key.full_precision and value.full_precision:
            held = held_tokens(tokens, 0, tokens, 1, window)  # nothing is packed
        else:
            held = held_tokens(tokens, key.sinks, key.residual, _chunk(key, value), window)
        for t in pair:
            e = t.elements_per_token
            packed = held.packed * t.bytes_per_token(scale_bytes)
            recent = held.residual * t.residual_bytes_per_token(scale_bytes)
            # A vq tensor's centroids: per layer, whatever the context.
            total += packed + held.sinks * e * _FP_BYTES + recent + t.codebook_bytes()
            body += packed
            fp16 += held.total * e * _FP_BYTES
            elements += held.total * e
            body_elements += held.packed * e
    return Footprint(tokens, total, body, fp16, elements, body_elements)
