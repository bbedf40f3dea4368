"""The peer in the same run: transformers' own caches, scored by the same decode loop.

The peer kvpolicy is compared with is ``QuantizedCache(backend="quanto")`` of transformers
(package ``optimum-quanto``), whose axes its users pick by hand. This module builds that
peer (and the full-precision ``DynamicCache``), scores it with the teacher-forced decode
loop of :func:`kvpolicy.evaluation.decode.decode_perplexity` (prefill ``context`` tokens,
then ``steps`` single-token decode steps through the cache), counts the bytes it holds, and
searches its four axis pairs.

quanto's axes, read from ``optimum.quanto.tensor.grouped.group`` on a cache tensor of shape
``[batch, kv_heads, tokens, head_dim]``:

* ``axis=0``: groups of ``group_size`` consecutive elements of the flattened tensor, i.e.
  channels of one token (per-token quantization, groups along ``head_dim``);
* ``axis=-1``: per channel, groups of ``group_size`` consecutive rows of the flattened
  ``batch * kv_heads * tokens`` rows (per-channel quantization, groups along tokens).

So ``(axis_key, axis_value) = (-1, 0)`` is KIVI's choice: keys per channel, values per token.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..errors import KVPolicyError, PolicyError
from .decode import decode_perplexity

__all__ = [
    "PEER_KINDS",
    "QUANTO_BITS",
    "CacheBytes",
    "PeerResult",
    "peer_cache",
    "peer_decode_perplexity",
    "cache_bytes",
    "best_quanto_axes",
    "check_token_groups",
]

PEER_KINDS = ("fp", "quanto")
QUANTO_BITS = (2, 4)  # transformers' QuantoQuantizedLayer accepts only qint2 / qint4
_QUANTO_AXES = (0, -1)
_INSTALL = "pip install optimum-quanto  (or: pip install -e '.[dev]')"


@dataclass(frozen=True)
class CacheBytes:
    """Bytes a cache holds, by kind of storage, and the fp16 cache of the same tokens.

    Counted: the storage of the tensors the cache keeps between steps, as
    ``numel * element_size`` of each plain tensor. Not counted: Python objects, and the
    dequantized copy of the whole cache that ``QuantizedLayer.update`` builds on every step
    (working memory, freed after the step).
    """

    packed: int  # bit-packed integer codes (quanto's PackedTensor uint8 storage)
    scales: int  # per-group scales and shifts, in the model's dtype
    residual: int  # full-precision keys/values not (yet) quantized; all of a DynamicCache
    fp16: int  # the same key/value elements stored as fp16 (2 bytes each)
    tokens: int  # cached sequence length of the first layer

    @property
    def total(self) -> int:
        """All bytes the cache holds: packed + scales + residual."""
        return self.packed + self.scales + self.residual

    @property
    def compression(self) -> float:
        """``fp16 / total``: how many times smaller than an fp16 cache (0.0 when empty)."""
        return self.fp16 / self.total if self.total else 0.0


@dataclass
class PeerResult:
    """Decode-time perplexity of one peer cache, with its speed and size."""

    perplexity: float
    tokens: int  # scored tokens, segments x steps
    seconds_per_step: float  # median wall time of one decode step
    bytes: CacheBytes  # the cache of the last segment, after its last step
    nll: float  # summed negative log-likelihood (nats)
    cache: object | None  # the cache of the last segment


def _quanto_available() -> None:
    try:
        import optimum.quanto  # noqa: F401
    except ImportError as exc:
        raise KVPolicyError(
            "the quanto peer (transformers' QuantizedCache(backend='quanto')) needs the "
            f"optimum-quanto package, which cannot be imported ({exc}); install it: {_INSTALL}"
        ) from exc


def peer_cache(
    model: torch.nn.Module,
    kind: str,
    *,
    bits: int = 2,
    group_size: int = 32,
    residual: int = 32,
    axis_key: int = 0,
    axis_value: int = 0,
):
    """A fresh, empty transformers cache of the peer ``kind`` for ``model``.

    Args:
        model: a transformers causal LM (its ``config`` sizes the cache layers).
        kind: ``"fp"`` -> ``DynamicCache(config=model.config)`` (the model's own default);
            ``"quanto"`` -> ``QuantizedCache(backend="quanto", ...)`` with the settings below.
        bits: 2 or 4 (quanto's qint2 / qint4); ignored for ``"fp"``.
        group_size: elements per quantization group (``q_group_size``). With ``axis=0`` it
            should divide ``head_dim``; with ``axis=-1`` groups run along tokens and
            ``kv_heads * tokens`` must be a multiple of it whenever the cache quantizes
            (after the prefill and every ``residual`` decode steps).
        residual: tokens kept in full precision before they are quantized
            (``residual_length``); quanto quantizes the whole cache again when it fills.
        axis_key, axis_value: quanto's axis, 0 (per token) or -1 (per channel), see the
            module docstring.

    Raises:
        PolicyError: unknown ``kind`` or a setting quanto does not accept.
        KVPolicyError: optimum-quanto is not installed.
    """
    from transformers import DynamicCache, QuantizedCache

    if kind == "fp":
        return DynamicCache(config=model.config)
    if kind != "quanto":
        raise PolicyError(f"unknown peer kind {kind!r}; use one of {', '.join(PEER_KINDS)}")
    if bits not in QUANTO_BITS:
        raise PolicyError(
            f"bits={bits}: the quanto peer quantizes to qint2 or qint4 only; use 2 or 4"
        )
    bad_axes = {n: a for n, a in (("axis_key", axis_key), ("axis_value", axis_value))
                if a not in _QUANTO_AXES}
    if bad_axes:
        raise PolicyError(f"{bad_axes}: quanto's axis is 0 (per token) or -1 (per channel)")
    if group_size < 1 or residual < 1:
        raise PolicyError(
            f"group_size={group_size}, residual={residual}: both must be positive"
        )
    _quanto_available()
    return QuantizedCache(
        backend="quanto",
        config=model.config,
        nbits=bits,
        axis_key=axis_key,
        axis_value=axis_value,
        q_group_size=group_size,
        residual_length=residual,
    )


def _plain_bytes(t: torch.Tensor) -> int:
    """Storage bytes of ``t``; a tensor subclass is the sum of its inner tensors."""
    if type(t) is torch.Tensor or torch.nn.Parameter in type(t).__mro__:
        return t.numel() * t.element_size()
    if not hasattr(t, "__tensor_flatten__"):
        raise KVPolicyError(
            f"cannot count the bytes of a {type(t).__name__}: it is neither a plain tensor "
            "nor a tensor subclass with __tensor_flatten__"
        )
    names, _ = t.__tensor_flatten__()
    return sum(_plain_bytes(getattr(t, name)) for name in names)


def _quantized_bytes(q) -> tuple[int, int]:
    """``(packed, scales)`` bytes of a quanto ``WeightQBitsTensor``.

    Its inner tensors (``__tensor_flatten__``) are ``_data`` (a ``PackedTensor`` whose own
    ``_data`` is the uint8 storage of the codes, ``8 // bits`` per byte, rows padded up),
    ``_scale`` and ``_shift`` (one of each per group, float, the dtype of the cached states).
    """
    if not hasattr(q, "__tensor_flatten__"):
        raise KVPolicyError(
            f"cannot count the bytes of quantized states of type {type(q).__name__}; "
            "cache_bytes reads quanto's WeightQBitsTensor (backend='quanto') only"
        )
    names, _ = q.__tensor_flatten__()
    packed = sum(_plain_bytes(getattr(q, n)) for n in names if n == "_data")
    scales = sum(_plain_bytes(getattr(q, n)) for n in names if n != "_data")
    return packed, scales


def cache_bytes(cache) -> CacheBytes:
    """Exact bytes held by a transformers ``DynamicCache`` or quanto ``QuantizedCache``.

    Per layer, counted once each (quanto empties its residual when it quantizes it, so no
    token is in both): the quantized keys and values (packed codes + scales + shifts), and
    the full-precision ``keys``/``values`` tensors (the residual window of the quanto peer,
    the whole cache of a ``DynamicCache``). ``fp16`` counts every key/value element of both
    at 2 bytes.
    """
    packed = scales = residual = elements = 0
    tokens = 0
    for i, layer in enumerate(cache.layers):
        if not getattr(layer, "is_initialized", False):
            continue
        for q in (getattr(layer, "_quantized_keys", None),
                  getattr(layer, "_quantized_values", None)):
            if q is not None:
                p, s = _quantized_bytes(q)
                packed, scales, elements = packed + p, scales + s, elements + q.numel()
        for t in (layer.keys, layer.values):
            if t is not None:
                residual += _plain_bytes(t)
                elements += t.numel()
        if i == 0:
            tokens = layer.get_seq_length()
    return CacheBytes(packed, scales, residual, 2 * elements, tokens)


def peer_decode_perplexity(
    model: torch.nn.Module,
    segments: torch.Tensor,
    context: int,
    steps: int,
    cache_factory: Callable[[], object],
    *,
    desc: str = "peer",
    progress: bool = True,
) -> PeerResult:
    """Perplexity of ``segments [N, >= context + steps]`` scored through a peer cache.

    The loop of :func:`~kvpolicy.evaluation.decode.decode_perplexity`, except that each segment
    starts from a fresh ``cache_factory()`` that is passed to the prefill and to every
    decode step (as ``cache=`` or ``past_key_values=``, whichever the model's forward
    takes). The prefill attends over its own full-precision states (transformers'
    ``QuantizedLayer`` returns them unquantized), so the cache is read only by decode steps.
    """
    res = decode_perplexity(model, segments, context, steps, desc=desc, progress=progress,
                            make_cache=cache_factory)
    return PeerResult(res.perplexity, res.tokens, res.seconds_per_step,
                      cache_bytes(res.cache), res.nll, res.cache)


def check_token_groups(model: torch.nn.Module, context: int, residual: int,
                        group_size: int) -> None:
    """Refuse settings with which quanto's ``axis=-1`` grouping would fail mid-run.

    With ``axis=-1`` quanto groups the ``kv_heads * tokens`` rows of a batch-1 cache, and it
    quantizes after the prefill (``context`` tokens) and then every ``residual`` steps.
    Skipped when the config does not name its head counts.
    """
    config = model.config.get_text_config(decoder=True)
    heads = getattr(config, "num_key_value_heads", None) or getattr(
        config, "num_attention_heads", None
    )
    if not isinstance(heads, int):
        return
    bad = [f"{name}={n}" for name, n in (("context", context), ("residual", residual))
           if (heads * n) % group_size]
    if bad:
        raise PolicyError(
            f"{', '.join(bad)}: quanto's axis=-1 groups kv_heads * tokens = {heads} * tokens "
            f"rows, which group_size={group_size} must divide; use a context and residual "
            f"that are multiples of {group_size // math.gcd(heads, group_size)}"
        )


def best_quanto_axes(
    model: torch.nn.Module,
    segments: torch.Tensor,
    context: int,
    steps: int,
    bits: int = 2,
    group_size: int = 32,
    residual: int = 32,
    *,
    progress: bool = False,
) -> tuple[tuple[int, int], dict[tuple[int, int], PeerResult]]:
    """Score the quanto peer at all four ``(axis_key, axis_value)`` in ``{0, -1}²``.

    This is the hand search its users face. Returns the pair with the
    lowest perplexity and every pair's :class:`PeerResult`, in the order
    ``(0, 0), (0, -1), (-1, 0), (-1, -1)``.

    Raises:
        PolicyError: ``group_size`` does not divide ``kv_heads * context`` or
            ``kv_heads * residual`` (quanto would fail at its first ``axis=-1`` grouping).
    """
    check_token_groups(model, context, residual, group_size)
    results: dict[tuple[int, int], PeerResult] = {}
    for ak, av in itertools.product(_QUANTO_AXES, repeat=2):
        def factory(ak: int = ak, av: int = av):
            return peer_cache(model, "quanto", bits=bits, group_size=group_size,
                              residual=residual, axis_key=ak, axis_value=av)

        results[(ak, av)] = peer_decode_perplexity(
            model, segments, context, steps, factory,
            desc=f"quanto {bits}b axes ({ak},{av})", progress=progress,
        )
    best = min(results, key=lambda axes: results[axes].perplexity)
    return best, results
