"""The stored-bits rows of ``kvpolicy eval``'s frontier (``--stored-bits``).

A stored-bits budget (``defaults: {stored_bits: 3.0}``) counts codes plus a scale and a zero
per group (fp16, or a byte each where ``meta_bits: auto``, the default, chooses 8-bit
metadata), and its allocator chooses each tensor's group size and metadata width with its
width. Each row
is the user's spec with ``bits`` dropped, ``stored_bits`` set and the group size left to
the allocator; the rows differ only in ``stored_bits``, so one calibration (every width at
every candidate group) serves them all, as the code-bits budgets share theirs.

The whole-cache rows (``--whole-cache``) are the same with ``budget_context`` set: the
budget counts everything a layer holds after ``policies.footprint.CONTEXT`` tokens, the
sinks, residual window and incomplete chunk included (the window held at 8 bits per token
unless the policy says otherwise, ``policies.derive.whole_cache_residuals``), and they share
a calibration of their own (the residual they keep differs).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from ..api import derive_policy
from ..policies import load_spec

__all__ = ["STORED_BUDGETS", "WHOLE_BUDGETS", "QUICK_STORED_GROUPS", "stored_name",
           "whole_name", "stored_specs", "stored_calibration"]

# The stored-bits budgets of the frontier by default (average stored bits per element).
STORED_BUDGETS: tuple[float, ...] = (2.5, 3.0)
# The whole-cache stored-bits budgets of the frontier by default (``budget_context`` at
# policies.footprint.CONTEXT tokens): below the body-only budgets, where 8x and 10.7x lie.
WHOLE_BUDGETS: tuple[float, ...] = (2.0, 1.5)
# ``quick``'s 80 tokens (residual 16, sinks 2) pack nothing in key groups of 64 or 128:
# there the allocator chooses among these groups instead of ``GROUP_CHOICES``.
QUICK_STORED_GROUPS: tuple[int, ...] = (16, 32)


def stored_name(budget: float) -> str:
    """The run name of a stored-bits budget row: ``"stored budget 2.5"``."""
    return f"stored budget {budget:g}"


def whole_name(budget: float) -> str:
    """The run name of a whole-cache budget row: ``"whole-cache budget 2"``."""
    return f"whole-cache budget {budget:g}"


def stored_specs(user: dict[str, Any], budgets: Sequence[float],
                 groups: Sequence[int] | None = None, context: int | None = None
                 ) -> list[tuple[str, dict[str, Any]]]:
    """``[(run name, spec)]``: ``user`` with ``bits`` dropped (the widths are allocated;
    override rules that pin one stay), ``stored_bits`` set, and ``group_size`` ``"auto"``
    (or the candidate ``groups``); overrides kept, so a group an override fixes stays
    fixed. ``context``: the budgets count the whole cache at that many tokens
    (``budget_context``), rows named by :func:`whole_name`."""
    out = []
    for b in budgets:
        defaults = {k: v for k, v in user.get("defaults", {}).items() if k != "bits"}
        defaults["stored_bits"] = float(b)
        defaults["group_size"] = "auto" if groups is None else list(groups)
        if context is not None:
            defaults["budget_context"] = context
        spec = {"defaults": defaults, "overrides": list(user.get("overrides", []))}
        loaded = load_spec(spec)
        if loaded.budget_unit != "stored" or loaded.budget != float(b):
            raise ValueError(f"stored budget {b!r} does not load as a stored-bits budget")
        out.append((stored_name(b) if context is None else whole_name(b), spec))
    return out


def stored_calibration(load, specs: list[tuple[str, dict[str, Any]]], cal_input,
                       notes: list[str], progress: bool, what: str = "stored-bits budget"
                       ) -> tuple[dict[str, Any], Any]:
    """``(frontier record, calibration)``: one calibration of the first stored spec's
    settings on a fresh model, for every row of ``specs`` (``what`` they are, for the
    note)."""
    t0 = time.perf_counter()
    base = derive_policy(load(), policy=specs[0][1], calibration=cal_input, progress=progress)
    cal = base.calibration
    wall = time.perf_counter() - t0
    budgets = [load_spec(spec).budget for _, spec in specs]
    notes.append(
        f"{what} runs ({', '.join(f'{b:g}' for b in budgets)}): widths and group "
        f"sizes (of {list(cal.groups) or 'fixed groups'}) allocated from one calibration on "
        f"{cal.source} ({cal.rows}x{cal.tokens} tokens), measured in {cal.seconds:.1f} s "
        f"({wall:.1f} s with the policy derivation)"
    )
    record = {"budgets": budgets, "groups": list(cal.groups),
              "calibration": {"source": cal.source, "rows": cal.rows, "tokens": cal.tokens,
                              "seconds": cal.seconds, "wall_seconds": round(wall, 3)}}
    return record, cal
