"""The table a ``ModelPolicy`` prints as (``str(policy)``, ``kvpolicy inspect``).

One aligned row per tensor, consecutive identical layers sharing a row pair, a title and a
footer with the achieved average bits, bytes per packed token and the whole cache's
stored bits (footprint.py). The functions read the fields of ``TensorPolicy`` /
``ModelPolicy`` (schema.py) without importing them: schema.py imports this module, so
this module imports only footprint.py, which imports nothing of the package.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from .footprint import CONTEXT, whole_cache


def ranges(layers: Sequence[int]) -> str:
    """ "0-3, 5, 7-9" for [0, 1, 2, 3, 5, 7, 8, 9]."""
    parts: list[str] = []
    start = prev = None
    for layer in layers:
        if prev is not None and layer == prev + 1:
            prev = layer
            continue
        if start is not None:
            parts.append(str(start) if start == prev else f"{start}-{prev}")
        start = prev = layer
    if start is not None:
        parts.append(str(start) if start == prev else f"{start}-{prev}")
    return ", ".join(parts)


_COLUMNS = (
    "layers", "tensor", "axis", "bits", "G", "levels", "meta", "fit", "rotation", "pre-RoPE",
    "R", "sinks", "override",
)


def _row(label: str, t: Any) -> list[str]:
    """The cells of one ``TensorPolicy``."""
    if t.rope is None:
        pre_rope = "-"  # nothing rotates this tensor
    else:
        pre_rope = "yes" if t.pre_rope else "no"
    return [
        label,
        t.tensor.value,
        t.axis.value,
        str(t.bits),
        str(t.group_size),
        "-" if t.full_precision else t.code_levels,
        "-" if t.full_precision else str(t.meta_bits),
        "-" if t.full_precision or t.stored_meta_bits != 8 else t.fit,
        "-" if t.rotation == "none" else t.rotation,
        pre_rope,
        str(t.residual) if t.residual_bits == 16 else f"{t.residual} at {t.residual_bits}b",
        str(t.sinks),
        "yes" if t.overridden else "-",
        t.contraction,
        t.reason,
    ]


def _residual_width(policy: Any) -> str:
    """How the residual windows are held, in words: "in full precision", "at 8 bits per
    token" or, where layers differ, "at 16 or 8 bits"."""
    widths = sorted({t.residual_bits for t in policy.tensors}, reverse=True)
    if widths == [16]:
        return "in full precision"
    if len(widths) == 1:
        return f"at {widths[0]} bits per token"
    return "at " + " or ".join(map(str, widths)) + " bits"


def render_table(policy: Any, *, reasons: bool = True) -> str:
    """An aligned table of a ``ModelPolicy``, one row per tensor. Consecutive layers whose
    key and value policies are identical in every field but ``layer`` share one row pair
    ("0-29").

    With ``reasons=False``, the short table: no contraction and reason columns, and
    consecutive layers share a row pair wherever the cells shown agree (what only the
    reasons tell apart, such as each layer's key channel widths, is not shown).
    """
    header = [*_COLUMNS, "contraction", "reason"] if reasons else list(_COLUMNS)

    def signature(key: Any, value: Any) -> tuple:
        if reasons:
            return key.model_copy(update={"layer": 0}), value.model_copy(update={"layer": 0})
        return tuple(_row("", key)[1:len(header)]), tuple(_row("", value)[1:len(header)])

    groups: list[tuple[list[int], Any, Any]] = []
    for i in range(0, len(policy.tensors), 2):
        key, value = policy.tensors[i], policy.tensors[i + 1]
        if groups:
            layers, k0, v0 = groups[-1]
            if layers[-1] + 1 == key.layer and signature(key, value) == signature(k0, v0):
                layers.append(key.layer)
                continue
        groups.append(([key.layer], key, value))

    rows = [header]
    for layers, key, value in groups:
        label = ranges(layers)
        rows.append(_row(label, key)[:len(header)])
        rows.append(_row(label, value)[:len(header)])
    widths = [max(len(r[c]) for r in rows) for c in range(len(header) - 1)]

    def line(cells: list[str]) -> str:
        padded = [c.ljust(w) for c, w in zip(cells[:-1], widths, strict=True)]
        return "  ".join([*padded, cells[-1]]).rstrip()

    name = policy.model or "<model>"
    source = f", policy {policy.source}" if policy.source else ""
    title = (
        f"kvpolicy: {name}{source}: {policy.num_layers} attention layers, "
        f"{policy.avg_bits:.2f} code bits per element on average"
    )
    rule = "  ".join("-" * w for w in widths) + "  " + "-" * len(header[-1])
    return "\n".join([title, line(header), rule, *(line(r) for r in rows[1:]), rule,
                      _footer(policy)])


def _footer(policy: Any) -> str:
    """Achieved average bits (against the budget, if any) and bytes per token vs fp16."""
    packed, fp16 = policy.bytes_per_token(), policy.fp16_bytes_per_token
    text = f"average {policy.avg_bits:.3f} code bits per cached element"
    stored = policy.budget is not None and policy.budget_unit == "stored"
    if stored:
        text += f", {policy.avg_stored_bits():.3f} stored bits with scales and zeros"
    if policy.budget is not None:
        text += f" ({'stored-bits budget' if stored else 'budget'} {policy.budget:g}"
        if stored and policy.budget_context is not None:
            text += f" over the whole cache at {policy.budget_context:,} tokens"
        if stored and policy.budget_pages is not None:
            text += f" per page of {policy.budget_pages} tokens"
        if policy.calibration is not None:
            cal = policy.calibration
            what = "widths and group sizes" if stored and cal.groups else "widths"
            text += (
                f"; {what} allocated from the {cal.metric} measured on {cal.source}, "
                f"{cal.rows}x{cal.tokens} tokens"
            )
        text += ")"
    whole = whole_cache(policy, policy.budget_context or CONTEXT)
    local = " (local layers at their window)" if any(w is not None for w in policy.windows) else ""
    return (
        f"{text}; {packed:,.0f} bytes per packed token vs {fp16:,} in fp16 "
        f"({fp16 / packed:.2f}x smaller; scales and zeros counted, the sink and residual "
        "windows not)\n"
        f"whole cache at {whole.tokens:,} tokens{local}: {whole.bits:.2f} stored bits per "
        f"element, {whole.compression:.2f}x smaller than fp16 (sinks in full precision, "
        f"residual and incomplete chunks {_residual_width(policy)}, included)"
    )
