"""Per-channel key widths (``channel_widths: auto``): where each key's bits go.

A key enters attention only through ``q · k``, so the error of channel ``c`` costs about
``E[q_c²] · step_c²``, where ``step_c`` is the channel's range over its group divided by
``2^b - 1``. Both factors differ between channels by orders of magnitude (a few channels
carry most of the query's energy, a few others most of the key's range), so one width for
every channel spends bits where the queries never look. This module measures
``E[q_c²]`` and the mean squared group range ``E[r_c²]`` per kv head and channel on a
calibration text (one forward, :func:`kvpolicy.calibrate.apply.channel_policy`; a budget's
calibration prices each key width with them too, :mod:`kvpolicy.calibrate.budget`),
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

import torch

from ..kernels.layout import CHANNEL_WIDTHS
from ..policies import TensorPolicy
from .capture import LayerActivations

__all__ = ["channel_costs", "allocate_widths", "widths_for", "spreads", "places_widths",
           "allocated"]


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


def _head_widths(cost: torch.Tensor, t: TensorPolicy, bits: int
                 ) -> tuple[tuple[int, ...], ...] | None:
    """Per-head widths of key ``t`` at ``bits`` from its costs ``[Hkv, D]``
    (:func:`channel_costs`), or None where the RoPE pairs cannot meet a head's total."""
    pairs = _pairs(t.head_dim, t.rotary_dim if t.pre_rope else None,
                   t.rope_style if t.pre_rope else None)
    rows = [allocate_widths(cost[h], bits, pairs) for h in range(cost.shape[0])]
    return None if any(r is None for r in rows) else tuple(rows)  # type: ignore[arg-type]


def widths_for(act: LayerActivations, t: TensorPolicy, bits: int, group_size: int
               ) -> tuple[tuple[int, ...], ...] | None:
    """Per-head widths of key ``t`` at ``bits`` in groups of ``group_size`` from ``act``,
    or None where the RoPE pairs cannot meet a head's total (the budget's calibration
    measures a key's candidate widths with them, as the cache will store it)."""
    return _head_widths(channel_costs(act, group_size, t.pre_rope), t, bits)


def spreads(bits: int) -> bool:
    """Whether a key at ``bits`` has narrower and wider widths around it to trade between
    its channels (:data:`~kvpolicy.kernels.layout.CHANNEL_WIDTHS`)."""
    return CHANNEL_WIDTHS[0] < bits < CHANNEL_WIDTHS[-1]


def places_widths(t: TensorPolicy, bits: int, levels: str) -> bool:
    """Whether ``channel_widths: auto`` places widths on key ``t`` at ``bits`` with
    ``levels``: uniform levels and a width that :func:`spreads`."""
    return t.channel_widths == "auto" and levels == "uniform" and spreads(bits)


def _histogram(widths: tuple[tuple[int, ...], ...]) -> str:
    flat = [w for row in widths for w in row]
    return "/".join(str(flat.count(w)) for w in CHANNEL_WIDTHS)


def allocated(t: TensorPolicy, act: LayerActivations, source: str,
               written: bool) -> TensorPolicy:
    if t.full_precision or not spreads(t.bits):
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
    widths = _head_widths(cost, t, t.bits)
    if widths is None:
        return t.model_copy(update={"reason": t.reason + (
            "; channel_widths auto: the RoPE pairs cannot meet the head's total exactly, so "
            "every channel keeps its width")})
    share = cost.sum(1, keepdim=True).clamp_min(1e-30)
    top = (cost / share).sort(1, descending=True).values[:, : t.head_dim // 8].sum(1).mean()
    text = (f"; channel widths {'/'.join(map(str, CHANNEL_WIDTHS))} bits on "
            f"{_histogram(widths)} channels ({t.bits} on average per head), by "
            f"E[q²]·range² on {source}: a key reaches attention only through q·k, and the "
            f"top eighth of channels carry {top:.0%} of that cost")
    # Validated (model_copy would not): the widths' shape and totals against the tensor.
    return TensorPolicy(**{**t.model_dump(), "widths": widths, "reason": t.reason + text})
