"""Per-channel key widths (``channel_widths: auto``): where each key's bits go.

A key enters attention only through ``q · k``, so the error of channel ``c`` costs about
``E[q_c²] · step_c²``, where ``step_c`` is the channel's range over its group divided by
``2^b - 1``. Both factors differ between channels by orders of magnitude (a few channels
carry most of the query's energy, a few others most of the key's range), so one width for
every channel spends bits where the queries never look. This module measures
``E[q_c²]`` and the mean squared group range ``E[r_c²]`` per kv head and channel on a
calibration text (one forward, :func:`~kvpolicy.calibrate.capture.capture_activations`),
and gives each head's channels widths among :data:`~kvpolicy.kernels.layout.CHANNEL_WIDTHS`
that keep the head's total at ``bits * head_dim`` (so the packed shapes do not change) by
greedy marginal gain of the cost ``E[q²] · E[r²] / (2^b - 1)²``: exact for this convex,
separable cost.

A pre-RoPE key's channels are rotated in pairs after dequantization (``c`` with
``c + rotary_dim/2``, or ``2i`` with ``2i + 1`` for interleaved RoPE), which mixes the
pair's errors; a pair takes one width, by the sum of its channels' costs. The query is
captured after RoPE, the key before it: the pair's summed query energy is what the
rotation preserves.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import nn

from ..errors import AnalysisError, KVPolicyError
from ..kernels.layout import CHANNEL_WIDTHS
from ..policy import ModelPolicy, TensorPolicy
from .budget import calibration_ids
from .capture import LayerActivations, capture_activations

__all__ = ["channel_costs", "allocate_widths", "channel_policy"]

log = logging.getLogger(__name__)


def channel_costs(act: LayerActivations, group_size: int, pre_rope: bool = True
                  ) -> torch.Tensor:
    """``E[q_c²] · E[r_c²]`` per kv head and channel, ``[Hkv, D]``: the query energy
    averaged over the query heads that share the kv head, times the squared range of the
    key as the cache stores it (before RoPE with ``pre_rope``) over groups of
    ``group_size`` tokens (whole groups only)."""
    b, hq, t, d = act.query.shape
    key = act.key_pre if pre_rope else act.key
    hkv = key.shape[1]
    energy = act.query.reshape(b, hkv, hq // hkv, t, d).square().mean((0, 2, 3))
    n = t // group_size * group_size
    if n == 0:
        raise ValueError(f"{t} calibration tokens hold no group of {group_size}")
    g = key[:, :, :n].reshape(b, hkv, n // group_size, group_size, d)
    span = (g.amax(3) - g.amin(3)).square().mean((0, 2))
    return energy * span


def _pairs(d: int, rotary_dim: int | None, style: str | None) -> list[list[int]]:
    """The channels that share one width: RoPE pairs, then the unrotated channels alone."""
    if not rotary_dim or style is None:
        return [[c] for c in range(d)]
    if style == "interleaved":
        out = [[2 * i, 2 * i + 1] for i in range(rotary_dim // 2)]
    else:
        half = rotary_dim // 2
        out = [[c, c + half] for c in range(half)]
    return out + [[c] for c in range(rotary_dim, d)]


def allocate_widths(cost: torch.Tensor, bits: int, pairs: list[list[int]]
                    ) -> tuple[int, ...] | None:
    """Widths of one head's channels (``cost [D]``) summing to ``bits * D``: every unit
    (a channel or a RoPE pair, ``pairs``) starts at the narrowest width and the bits go one
    step at a time to the unit whose cost falls most per bit added. None when the total
    cannot be met exactly (an odd remainder and no single channel left to take it)."""
    lo, hi = CHANNEL_WIDTHS[0], CHANNEL_WIDTHS[-1]
    unit_cost = torch.stack([cost[p].sum() for p in pairs]).double()
    size = torch.tensor([len(p) for p in pairs], dtype=torch.float64)
    width = torch.full_like(unit_cost, lo)
    left = bits * cost.numel() - lo * int(size.sum())

    def err(w: torch.Tensor) -> torch.Tensor:
        return unit_cost / (2.0 ** w - 1) ** 2

    while left > 0:
        gain = (err(width) - err(width + 1)) / size
        gain[(width >= hi) | (size > left)] = -1.0
        best = int(gain.argmax())
        if gain[best] < 0:
            return None
        width[best] += 1
        left -= int(size[best])
    out = [0] * cost.numel()
    for p, w in zip(pairs, width.tolist(), strict=True):
        for c in p:
            out[c] = int(w)
    return tuple(out)


def _histogram(widths: tuple[tuple[int, ...], ...]) -> str:
    flat = [w for row in widths for w in row]
    return "/".join(str(flat.count(w)) for w in CHANNEL_WIDTHS)


def _allocated(t: TensorPolicy, act: LayerActivations, source: str,
               written: bool) -> TensorPolicy:
    if t.full_precision or not CHANNEL_WIDTHS[0] < t.bits < CHANNEL_WIDTHS[-1]:
        if not written:  # kvpolicy's own default: nothing to say where nothing is traded
            return t.model_copy(update={"channel_widths": "uniform"})
        return t.model_copy(update={"reason": t.reason + (
            f"; channel_widths auto: {t.bits} bits leave no width to trade between "
            f"channels among {list(CHANNEL_WIDTHS)}, so every channel keeps {t.bits}")})
    if t.code_levels != "uniform":  # a budget chose normal levels for this key
        if not written:
            return t.model_copy(update={"channel_widths": "uniform"})
        return t.model_copy(update={"reason": t.reason + (
            f"; channel_widths auto: {t.code_levels} levels have one table per width, so "
            "every channel keeps its width")})
    cost = channel_costs(act, t.group_size, t.pre_rope)
    pairs = _pairs(t.head_dim, t.rotary_dim if t.pre_rope else None,
                   t.rope_style if t.pre_rope else None)
    rows = [allocate_widths(cost[h], t.bits, pairs) for h in range(cost.shape[0])]
    if any(r is None for r in rows):
        return t.model_copy(update={"reason": t.reason + (
            "; channel_widths auto: the RoPE pairs cannot meet the head's total exactly, so "
            "every channel keeps its width")})
    widths = tuple(rows)  # type: ignore[arg-type]
    share = cost.sum(1, keepdim=True).clamp_min(1e-30)
    top = (cost / share).sort(1, descending=True).values[:, : t.head_dim // 8].sum(1).mean()
    text = (f"; channel widths {'/'.join(map(str, CHANNEL_WIDTHS))} bits on "
            f"{_histogram(widths)} channels ({t.bits} on average per head), by "
            f"E[q²]·range² on {source}: a key reaches attention only through q·k, and the "
            f"top eighth of channels carry {top:.0%} of that cost")
    # Validated (model_copy would not): the widths' shape and totals against the tensor.
    return TensorPolicy(**{**t.model_dump(), "widths": widths, "reason": t.reason + text})


def _uniform(policy: ModelPolicy, why: str) -> ModelPolicy:
    """``policy`` with every pending ``channel_widths: auto`` key back to one width."""
    tensors = tuple(
        t.model_copy(update={"channel_widths": "uniform", "reason": t.reason + (
            f"; one width for every channel: {why}" if CHANNEL_WIDTHS[0] < t.bits
            < CHANNEL_WIDTHS[-1] else "")})
        if t.channel_widths == "auto" and not t.widths else t
        for t in policy.tensors
    )
    return policy.model_copy(update={"tensors": tensors})


def channel_policy(model: nn.Module, policy: ModelPolicy, source: torch.Tensor | None = None,
                   tokenizer: Any = None, written: bool = True,
                   usable: bool = True) -> ModelPolicy:
    """``policy`` with every ``channel_widths: auto`` key's widths allocated from one
    calibration forward of ``model`` on ``source`` (``[B, T]`` token ids; default: the last
    512 pydoc tokens in ``tokenizer``'s or the model's own tokenizer).

    ``written``: the user asked for ``channel_widths: auto``, so that a calibration that
    cannot run is an error; otherwise (kvpolicy's default) such keys keep one width and
    their reason says why. ``usable``: False where plain forwards of token ids do not take
    the model's cached path (``probe_kwargs``), which the capture relies on.

    Raises:
        KVPolicyError: ``written`` and no calibration text, or the capture failed.
    """
    wanted = [t for t in policy.tensors if t.channel_widths == "auto" and not t.widths]
    if not wanted:
        return policy
    if not any(CHANNEL_WIDTHS[0] < t.bits < CHANNEL_WIDTHS[-1] for t in wanted) and not written:
        return _uniform(policy, "")
    try:
        if not usable:
            raise KVPolicyError(
                "channel_widths: auto measures the keys with plain forwards of token ids, "
                "which a model that needs probe_kwargs does not take its cached path on")
        if source is None:
            try:
                source, where = calibration_ids(model, tokenizer=tokenizer)
            except KVPolicyError:
                raise KVPolicyError(
                    f"channel_widths: auto measures where the queries look on calibration "
                    f"text in the model's own tokens, and {type(model).__name__} has no "
                    "tokenizer saved at config._name_or_path; pass calibration=<[B, T] token "
                    "ids> (about 512 tokens of text like yours) or calibration=<a tokenizer>, "
                    "or set channel_widths: uniform") from None
        else:
            where = "user token ids"
        acts = {a.layer: a for a in capture_activations(model, source)}
    except (KVPolicyError, AnalysisError) as e:
        if written:
            raise
        log.info("channel widths stay uniform: %s", e)
        return _uniform(policy, "no calibration text to place them by (pass calibration= "
                        "token ids or a tokenizer to compile_model)")
    tensors = tuple(
        _allocated(t, acts[t.layer], where, written)
        if t.channel_widths == "auto" and not t.widths else t
        for t in policy.tensors
    )
    return policy.model_copy(update={"tensors": tensors})
