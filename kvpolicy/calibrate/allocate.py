"""The allocator of a bit budget: an exact multiple-choice knapsack.

Every tensor takes exactly one option; an option has a size (bits per token) and a
measured cost; the sum of the sizes must stay within the budget, and the sum of the costs
is minimised. Two front ends share one dynamic program (:func:`solve`):

:func:`allocate`
    A code-bits budget (``bits=2.5``): options are widths, sizes ``width x elements``;
    scales and zeros are not counted (the group size is fixed by the policy).
:func:`allocate_stored`
    A stored-bits budget (``stored_bits=3.0``): options are ``(width, group size)`` pairs,
    sizes ``(width + 2 x scale_bits / group) x elements`` (:func:`stored_bits`), the
    metadata of the packed format counted. A larger group costs fewer bits per element
    and usually more error; the allocator trades the two against the widths.

Exact: the sizes are integers once multiplied by a common denominator, and the dynamic
program runs over the budget in units of their greatest common divisor, so no rounding
decides a choice. On SmolLM2 (60 tensors of 192 elements, 15 options each) it is a table
of about 720 units per tensor.

:func:`allocate_joint`
    A stored-bits budget over the whole cache (``budget_context``): a layer's size is the
    bits it holds at a context length, which depends on its key and value choices together
    (the key group sets the chunk, so how many recent tokens wait in full precision). Its
    options are the pairs on the layer's Pareto front (size against summed error), sizes
    rounded up to 1/16,384 of the budget, solved vectorised (:func:`_solve_vectorised`).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Hashable, Mapping, Sequence
from fractions import Fraction
from typing import TypeVar

import torch

from ..errors import PolicyError
from ..policies import FULL_PRECISION, stored_bits

__all__ = ["allocate", "allocate_joint", "allocate_stored", "exact_stored_bits", "solve",
           "stored_bits"]

K = TypeVar("K", bound=Hashable)

# A budget like 2.3 times the total size must not lose a unit to floating-point rounding:
# the slack is far below one unit (an element's bit) and far above the rounding error.
_SLACK = 1e-9


def solve(options: Sequence[Sequence[tuple[int, float, K]]], capacity: int) -> list[K] | None:
    """Least summed cost, one option per tensor, sizes summing to at most ``capacity``.

    Args:
        options: per tensor, ``(size in units, cost, key)`` sorted by size then key.
        capacity: units available.

    Returns:
        The key chosen for every tensor, or None when even the smallest sizes do not fit.
        Ties go to the smaller option of the earlier tensor, then to the smaller total,
        so the result is deterministic.
    """
    inf = float("inf")
    # best[c]: least cost of the tensors so far using exactly c units; pick: the option.
    best = [inf] * (capacity + 1)
    best[0] = 0.0
    picks: list[list[int]] = []
    for opts in options:
        nxt = [inf] * (capacity + 1)
        pick = [-1] * (capacity + 1)
        for c in range(capacity + 1):
            if best[c] == inf:
                continue
            for j, (size, cost, _) in enumerate(opts):
                c2 = c + size
                if c2 > capacity:
                    break
                if best[c] + cost < nxt[c2]:
                    nxt[c2], pick[c2] = best[c] + cost, j
        best = nxt
        picks.append(pick)
    c = min(range(capacity + 1), key=lambda c: (best[c], c))
    if best[c] == inf:
        return None
    out: list[K] = []
    for k in range(len(options) - 1, -1, -1):
        j = picks[k][c]
        out.append(options[k][j][2])
        c -= options[k][j][0]
    return out[::-1]


def allocate(
    errors: Sequence[Mapping[int, float]],
    sizes: Sequence[int],
    budget: float,
    pinned: Mapping[int, int] | None = None,
) -> list[int]:
    """Choose one width per tensor: smallest summed error with a code-bits budget held.

    Args:
        errors: per tensor, ``{width: error}`` over its feasible widths.
        sizes: per tensor, elements per token (the weight of its width in the average).
        budget: the average code bits per element, over all tensors (pinned included).
        pinned: ``{tensor index: width}`` fixed beforehand; their errors are not needed.

    Returns:
        The width of every tensor (pinned ones as given). Exact: dynamic programming over
        the budget in units of the gcd of the free tensors' sizes; ties go to the narrower
        width of the earlier tensor, so the result is deterministic.

    Raises:
        PolicyError: the budget cannot hold even the narrowest feasible widths.
    """
    pinned = dict(pinned or {})
    if len(errors) != len(sizes):
        raise ValueError(f"{len(errors)} error tables for {len(sizes)} sizes")
    total = sum(sizes)
    capacity_bits = budget * total - sum(w * sizes[i] for i, w in pinned.items()) + _SLACK
    free = [i for i in range(len(sizes)) if i not in pinned]
    out = [pinned.get(i, 0) for i in range(len(sizes))]
    if not free:
        if capacity_bits < 0:
            raise PolicyError(_over_budget(budget, pinned, sizes, total))
        return out
    for i in free:
        if not errors[i]:
            raise PolicyError(f"tensor {i} has no feasible width to allocate")
    unit = math.gcd(*(sizes[i] for i in free))
    capacity = math.floor(capacity_bits / unit)
    need = sum(min(errors[i]) * sizes[i] // unit for i in free)
    if capacity < need:
        raise PolicyError(_over_budget(budget, pinned, sizes, total, need * unit))
    options = [[(w * (sizes[i] // unit), e, w) for w, e in sorted(errors[i].items())]
               for i in free]
    chosen = solve(options, capacity)
    assert chosen is not None  # the narrowest widths fit: checked above
    for i, w in zip(free, chosen, strict=True):
        out[i] = w
    return out


def _over_budget(budget: float, pinned: Mapping[int, int], sizes: Sequence[int], total: int,
                 need_free: int = 0) -> str:
    pinned_bits = sum(w * sizes[i] for i, w in pinned.items())
    least = (pinned_bits + need_free) / total
    what = f" ({len(pinned)} pinned tensors take {pinned_bits / total:.2f} of it)" if pinned else ""
    return (
        f"a budget of {budget:g} bits per element cannot be met{what}: the narrowest widths "
        f"need {least:.3f}; raise the budget to at least {least:.3f} or pin fewer tensors "
        "to wide widths"
    )


# (width, group size), or (width, group size, scale bits) for an option that carries its
# own metadata width (8-bit scales and zeros).
Option = tuple[int, ...]


def allocate_stored(
    errors: Sequence[Mapping[Option, float]],
    sizes: Sequence[int],
    budget: float,
    scale_bits: int | Sequence[int] = 16,
) -> list[Option]:
    """Choose one ``(width, group size)`` per tensor: smallest summed error with a
    stored-bits budget held, scales and zeros counted (:func:`stored_bits`).

    Args:
        errors: per tensor, ``{(width, group): error}`` over its feasible options (an
            option ``(width, group, scale bits)`` counts its own metadata width). A
            tensor with one option is fixed (a rule set its width and group, or keeps it
            at 16 bits): it counts against the budget, its error does not matter.
        sizes: per tensor, elements per token.
        budget: the average stored bits per element over all tensors.
        scale_bits: bits of one scale (and of one zero): 16 for the fp16/bf16 storage of
            ``runtime.cache.storage_dtype``, 8 for 8-bit metadata; one for every tensor or
            one per tensor.

    Returns:
        The option of every tensor. Exact, deterministic; ties go to the smaller stored
        size of the earlier tensor.

    Raises:
        PolicyError: a tensor has no option, or the budget cannot hold the smallest ones.
    """
    if len(errors) != len(sizes):
        raise ValueError(f"{len(errors)} error tables for {len(sizes)} sizes")
    for i, errs in enumerate(errors):
        if not errs:
            raise PolicyError(f"tensor {i} has no feasible (width, group size) to allocate")
    # Exact sizes: elements x (width + 2 x scale_bits / group) over a common denominator.
    per_tensor = [scale_bits] * len(errors) if isinstance(scale_bits, int) else list(scale_bits)
    if len(per_tensor) != len(errors):
        raise ValueError(f"{len(per_tensor)} scale widths for {len(errors)} tensors")
    exact = [{o: sizes[i] * exact_stored_bits(o[0], o[1],
                                              o[2] if len(o) > 2 else per_tensor[i],
                                              o[3] if len(o) > 3 else 2)
              for o in errs} for i, errs in enumerate(errors)]
    denom = math.lcm(*(f.denominator for row in exact for f in row.values()))
    units = [{o: int(f * denom) for o, f in row.items()} for row in exact]
    fixed = [i for i, errs in enumerate(errors) if len(errs) == 1]
    free = [i for i in range(len(errors)) if i not in fixed]
    total = sum(sizes)
    capacity_units = budget * total * denom - sum(next(iter(units[i].values())) for i in fixed)
    least = sum(min(row.values()) for row in units) / denom / total
    out: list[Option] = [next(iter(errors[i])) if i in fixed else (0, 0)
                         for i in range(len(errors))]
    unit = math.gcd(*(u for i in free for u in units[i].values())) if free else 1
    capacity = math.floor((capacity_units + _SLACK * denom) / unit)
    chosen = solve([sorted(((units[i][o] // unit, e, o) for o, e in errors[i].items()),
                           key=lambda x: (x[0], x[2])) for i in free], capacity) \
        if capacity >= 0 else None
    if chosen is None:
        pinned = sum(next(iter(units[i].values())) for i in fixed) / denom / total
        what = (f" ({len(fixed)} tensors fixed by rules take {pinned:.2f} of it)"
                if fixed else "")
        raise PolicyError(
            f"a budget of {budget:g} stored bits per element cannot be met{what}: the "
            f"smallest widths and largest groups need {least:.3f}; raise stored_bits to at "
            "least that, allow larger groups, or fix fewer tensors at wide widths"
        )
    for i, o in zip(free, chosen, strict=True):
        out[i] = o
    return out


def exact_stored_bits(bits: int, group_size: int, scale_bits: int, fields: int = 2
                      ) -> Fraction:
    """:func:`stored_bits` as an exact fraction (a float of 32/24 would make the common
    denominator of the sizes astronomically large); ``fields``: metadata numbers per
    group (2, a scale and a zero; 1, a vq scale)."""
    if bits >= FULL_PRECISION:
        return Fraction(bits)
    return bits + Fraction(fields * scale_bits, group_size)


def allocate_joint(
    errors: Sequence[Sequence[Mapping[Option, float]]],
    size: Callable[[int, tuple[Option, ...]], int | None],
    capacity: int,
    resolution: int = 1 << 14,
    cost: Callable[[int, tuple[Option, ...], tuple[float, ...]], float] | None = None,
) -> list[tuple[Option, ...]]:
    """One option per tensor where tensors come in groups whose size depends on their
    options together (a layer's key and value: the key group sets how many recent tokens
    wait in full precision for both): least summed error, sizes within ``capacity``.

    Args:
        errors: per group, per tensor ``{option: error}``.
        size: ``size(group, options)``, the group's size in bits for one option per tensor,
            or None where those options cannot go together (left out).
        capacity: bits available to all groups.
        resolution: the budget is cut into this many units; each group's size is rounded
            up to a unit, so the result never exceeds ``capacity`` and wastes at most one
            unit per group.
        cost: ``cost(group, options, their errors)``, the group's error where it is not
            the sum of its tensors' (a window choice that scales them,
            ``calibrate.whole_cache.joint_cost``); default the sum.

    Returns:
        Per group, its tensors' options. Deterministic.

    Raises:
        PolicyError: a group has no options that go together, or the smallest choices of
            every group exceed ``capacity``.
    """
    fronts = []
    for g, tables in enumerate(errors):
        joint = []
        for combo in itertools.product(*(sorted(t.items()) for t in tables)):
            opts = tuple(o for o, _ in combo)
            s = size(g, opts)
            if s is not None:
                errs = tuple(e for _, e in combo)
                joint.append((s, sum(errs) if cost is None else cost(g, opts, errs), opts))
        if not joint:
            raise PolicyError(f"layer {g}: no choice of its tensors' options fits together "
                              "(e.g. no key group whose chunk divides the page); allow other "
                              "group sizes")
        joint.sort(key=lambda x: (x[0], x[1]))
        front, least = [], math.inf  # only choices that cost less error than every smaller
        for s, e, o in joint:
            if e < least:
                front.append((s, e, o))
                least = e
        fronts.append(front)
    need = sum(f[0][0] for f in fronts)
    unit = max(1, capacity // resolution)
    units = [[(-(-s // unit), e, o) for s, e, o in f] for f in fronts]
    chosen = _solve_vectorised(units, capacity // unit) if need <= capacity else None
    if chosen is None:
        raise PolicyError(
            f"the budget holds {capacity:,} bits and the smallest choice of every layer needs "
            f"{need:,}; raise the budget, allow larger groups or narrower widths, or keep "
            "fewer tokens in full precision (residual, sinks)"
        )
    return chosen


def _solve_vectorised(options: Sequence[Sequence[tuple[int, float, K]]],
                      capacity: int) -> list[K] | None:
    """:func:`solve` with each option's update done over every capacity at once (torch):
    the same least cost, for the tens of thousands of units a whole-cache budget needs."""
    inf = float("inf")
    best = torch.full((capacity + 1,), inf, dtype=torch.float64)
    best[0] = 0.0
    picks = []
    for opts in options:
        nxt = torch.full_like(best, inf)
        pick = torch.full((capacity + 1,), -1, dtype=torch.long)
        for j, (sz, cost, _) in enumerate(opts):
            if sz > capacity:
                break
            cand = best[: capacity + 1 - sz] + cost
            better = cand < nxt[sz:]
            nxt[sz:] = torch.where(better, cand, nxt[sz:])
            pick[sz:] = torch.where(better, j, pick[sz:])
        best = nxt
        picks.append(pick)
    if not bool(torch.isfinite(best).any()):
        return None
    c = int(torch.argmin(best))  # the first least cost: the smallest total on a tie
    out: list[K] = []
    for k in range(len(options) - 1, -1, -1):
        j = int(picks[k][c])
        out.append(options[k][j][2])
        c -= options[k][j][0]
    return out[::-1]
