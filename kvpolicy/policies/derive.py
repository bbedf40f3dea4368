"""Derivation: ``build_policy(facts, spec)`` turns the analysis facts into a ``ModelPolicy``.

Each tensor's policy is derived from the facts of ``kvpolicy.passes`` (docs/design.md
§1–§2), then the overrides apply in order. A value that differs from what was derived is
kept, marked ``overridden`` and explained in the tensor's reason. Nothing falls back
silently: the one fallback, a smaller per-token group where the built-in group size does
not divide head_dim, is written in the tensor's reason. A conflict is blamed on the rule
(or the defaults) that set the offending value.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from pydantic import ValidationError

from ..errors import PolicyError
from ..kernels.layout import FIT_STEPS
from ..passes.facts import Contracted, LayerFacts, TensorFacts
from .messages import show
from .rules import (
    BUDGET_WIDTHS,
    FULL_PRECISION,
    GROUP_CHOICES,
    KVPOLICY_DEFAULTS,
    META8_GROUPS,
    Axis,
    TensorKind,
    byte_aligned,
    fallback_group_size,
    fit_at,
    join_or,
    meta8_rotates_values,
    metadata_at,
    stored_bits,
    token_group_sizes,
)
from .schema import ModelPolicy, TensorPolicy
from .spec import Defaults, PolicySpec

# A contracted axis gets its own scale per index; groups form along the free axis.
_AXIS_OF: dict[Contracted, Axis] = {Contracted.CHANNEL: Axis.CHANNEL, Contracted.TOKEN: Axis.TOKEN}
# How the attention consumes each tensor, for reasons a user reads.
_CONSUMER: dict[TensorKind, str] = {TensorKind.KEY: "q·kᵀ", TensorKind.VALUE: "softmax·V"}

_ANALYSIS, _DEFAULTS = -2, -1  # origins of a value; rules are 0, 1, ... (later wins)


def _sets(origin: int) -> str:
    return "the defaults set" if origin == _DEFAULTS else f"rule {origin + 1} sets"


def _where(origin: int) -> str:
    if origin == _ANALYSIS:
        return "analysis"
    return "defaults" if origin == _DEFAULTS else f"rule {origin + 1}"


def _groups(axis: Axis, group_size: int, candidates: Sequence[int] = ()) -> str:
    size = join_or(candidates) if candidates else str(group_size)
    chosen = ", the size chosen with the width by the stored-bits budget" if candidates else ""
    if axis is Axis.CHANNEL:
        return f"each channel gets its own scale (groups of {size} tokens{chosen})"
    return f"each token gets its own scale (groups of {size} channels{chosen})"


def _group_candidates(
    setting: str | tuple[int, ...], axis: Axis, head_dim: int, bits: int, pinned: bool,
    where: str, what: str, meta_bits: int | str = 16,
) -> tuple[int, tuple[int, ...], int | None]:
    """``(group_size, candidates, fallback_from)`` for ``group_size: auto`` or a list under
    a stored-bits budget: the candidates that fit the tensor (any groups tokens; only
    divisors of head_dim group channels; at a width a rule pins, only byte-aligned ones),
    the smallest as the starting size. None fit: for ``auto`` the fallback of a default
    group (``fallback_from`` says from which), for a list an error. With 8-bit metadata
    ``auto`` halves the candidates, so they cost the same stored bits; with ``meta_bits:
    auto`` it measures both sets."""
    halved = tuple(g // 2 for g in GROUP_CHOICES)
    choices = tuple(setting) if setting != "auto" else {
        8: halved, "auto": tuple(sorted(set(halved) | set(GROUP_CHOICES)))
    }.get(meta_bits, GROUP_CHOICES)
    if bits == FULL_PRECISION:  # kept in full precision: no groups to choose
        return choices[0], (), None
    fit = [g for g in choices
           if (axis is Axis.CHANNEL or head_dim % g == 0)
           and (not pinned or byte_aligned(g, bits))]
    if not fit:
        smaller = fallback_group_size(choices[0], head_dim, bits)
        if setting == "auto" and smaller is not None:
            return smaller, (), choices[0]
        why = []
        if axis is Axis.TOKEN:
            why.append(f"axis 'token' groups the channels of one token, so a group must "
                       f"divide head_dim={head_dim}")
        if pinned:
            why.append(f"at the {bits} bits a rule sets, a group must fill whole bytes")
        options = token_group_sizes(head_dim, bits) if axis is Axis.TOKEN else [8, 16, 32]
        raise PolicyError(
            f"{where}, field 'group_size': none of the group sizes {list(choices)} fits "
            f"{what} ({'; '.join(why)}); add one of {options}"
        )
    return fit[0], tuple(fit) if len(fit) > 1 else (), None


def _rope_text(facts: TensorFacts) -> tuple[str | None, str | None, int | None, str]:
    """(short rope text, style, rotary_dim, phrase for reasons)."""
    rope = facts.rope
    if rope is None:
        return None, None, None, ""
    style = rope.style.value
    phrase = f"{style} RoPE"
    if not rope.reapplicable:
        last = rope.first_channel + rope.rotary_dim - 1
        phrase += f" on channels {rope.first_channel}-{last} of {rope.head_dim}"
        return (f"{style} {rope.first_channel}-{last}/{rope.head_dim}", style,
                rope.rotary_dim, phrase)
    if rope.partial:
        phrase += f" on {rope.rotary_dim} of {rope.head_dim} channels"
    return f"{style} {rope.rotary_dim}/{rope.head_dim}", style, rope.rotary_dim, phrase


def _reason(
    kind: TensorKind,
    facts: TensorFacts,
    values: Mapping[str, Any],
    origins: Mapping[str, int],
    derived_axis: Axis,
    derived_pre_rope: bool,
    defaults: Defaults,
    fallback_from: int | None = None,
    meta_from: int | None = None,
) -> str:
    op = _CONSUMER[kind]
    summed = "channels" if facts.contracted is Contracted.CHANNEL else "tokens"
    axis, group_size = values["axis"], values["group_size"]
    candidates = values.get("group_sizes", ())
    parts: list[str] = []
    if values["bits"] == FULL_PRECISION:
        parts.append(f"kept in full precision, so no scales or groups ({op} sums over {summed})")
    elif axis is derived_axis:
        parts.append(f"{op} sums over {summed}, so {_groups(axis, group_size, candidates)}")
    else:
        parts.append(
            f"{op} sums over {summed}, so per-{derived_axis.value} scales were derived, but "
            f"{_sets(origins['axis'])} axis {axis.value}: "
            f"{_groups(axis, group_size, candidates)}"
        )
    if kind is TensorKind.KEY:
        phrase = _rope_text(facts)[3]
        stored = "cached" if values["bits"] == FULL_PRECISION else "quantized"
        if facts.rope is None:
            parts.append(
                "no RoPE on the key path (learned, absolute or no positions): nothing to move"
            )
        elif not facts.rope.reapplicable:
            parts.append(
                f"{stored} after {phrase}, the rotary slice of a key assembled in place "
                "(decoupled RoPE, as in MLA): RoPE is re-applied after dequantization only "
                "to a key's leading channels, so this key is cached rotated"
            )
        elif values["pre_rope"]:
            parts.append(
                f"{stored} before {phrase}, which smears outlier channels; RoPE is re-applied "
                "inside attention"
            )
        elif derived_pre_rope:
            parts.append(
                f"{stored} after {phrase} because {_sets(origins['pre_rope'])} pre_rope "
                "false; pre-RoPE was derived, since the rotation smears outlier channels"
            )
    if values.get("rotation", "none") == "hadamard":
        n = facts.head_dim
        parts.append(
            f"rotated by a sign-flipped {n}x{n} Walsh-Hadamard matrix before quantization, "
            "which spreads large channels over each group; exact, since the attention output "
            "is rotated back once per step"
        )
    if values["bits"] < FULL_PRECISION and values["levels"] == "normal":
        parts.append(_levels_text())
    if values["bits"] < FULL_PRECISION and values["levels"] == "vq":
        n = 8 // values["bits"] if values["bits"] in (1, 2) else 0
        parts.append(
            f"vector-quantized: each sub-vector of {n} channels one byte, an index into 256 "
            "centroids per kv head fitted on calibration text, times one scale per group "
            "(no zero)"
        )
    if (values["bits"] < FULL_PRECISION and values.get("meta_bits", 16) == 8
            and values["levels"] == "vq"):
        parts.append("scale in 8 bits (an index into a table of powers of 2^(1/8))")
    elif values["bits"] < FULL_PRECISION and values.get("meta_bits", 16) == 8:
        parts.append(
            "scale and zero in 8 bits each (a scale index and a zero point on the grid), "
            "half the metadata of the cache dtype"
        )
    if values.get("residual_bits", 16) < FULL_PRECISION and values["residual"]:
        parts.append(
            f"the {values['residual']} recent tokens held at {values['residual_bits']} bits "
            "per token (a scale and a zero per token and kv head), not 16"
        )
    if values.get("fit") == "mse" and values["bits"] < FULL_PRECISION:
        where = (" where the budget chooses 8-bit metadata"
                 if values.get("meta_bits") == "auto" else "")
        parts.append(
            f"each group's grid fitted by least squared error{where} among the min-max "
            f"scale and the {FIT_STEPS} table steps below it, centred (clips a group's "
            "extremes where that costs less than the coarser step)"
        )
    if meta_from is not None:
        bits = values["bits"]
        key, value = META8_GROUPS[TensorKind.KEY], META8_GROUPS[TensorKind.VALUE]
        parts.append(
            f"meta_bits auto at {bits} bits: 8-bit metadata, and the "
            f"{stored_bits(bits, meta_from):.1f} stored bits per element of groups of "
            f"{meta_from} with fp16 metadata split toward the keys, which recalling distant "
            f"tokens depends on: keys in groups of {key} "
            f"({stored_bits(bits, key, 8):.2f} bits), values in groups of {value} "
            f"({stored_bits(bits, value, 8):.2f}, rotated where head_dim is a power of two); "
            "measured closer to full precision (docs/design.md §2)"
        )
    if fallback_from is not None:
        parts.append(
            f"group {group_size}: the default {fallback_from} does not divide "
            f"head_dim={facts.head_dim}, {group_size} is the largest byte-aligned size under "
            f"{fallback_from} that does"
        )
    changed = [
        f"{_sets(origins[f])} {f} {values[f]} (defaults: {getattr(defaults, f)})"
        for f in ("bits", "group_size", "residual", "sinks")
        if origins[f] >= 0 and values[f] != getattr(defaults, f)
    ]
    if changed:
        parts.append(", ".join(changed))
    return "; ".join(parts)


def _vq_defaults(values: dict[str, Any], origins: dict[str, int], d: Any,
                 default_group: bool, head_dim: int) -> None:
    """Written ``levels: vq`` at a fixed width: what nobody wrote follows the format
    (kernels.layout): one 8-bit scale per token and head (group = head_dim), values
    Hadamard-rotated where head_dim is a power of two (the codebooks are fitted on what
    the cache stores, and a rotation makes a token's sub-vectors alike)."""
    if values["meta_bits"] == "auto":
        values["meta_bits"] = 8
    if default_group:
        values["group_size"] = head_dim
    written = origins["rotation"] != _DEFAULTS or "rotation" in d.model_fields_set
    if not written and not head_dim & (head_dim - 1):
        values["rotation"] = "hadamard"


def _levels_text() -> str:
    return ("normal levels (Lloyd-Max levels for a Gaussian, placed by each group's mean and "
            "deviation)")


def build_policy(
    facts: Sequence[LayerFacts], spec: PolicySpec, model_name: str = ""
) -> ModelPolicy:
    """Derive every tensor's policy from the analysis facts, then apply ``spec``.

    Derivation (docs/design.md §1–§2): the contracted axis gets its own scales
    (``Contracted.CHANNEL`` -> ``Axis.CHANNEL``, ``Contracted.TOKEN`` -> ``Axis.TOKEN``);
    keys are cached before RoPE where the key path has one and ``defaults.pre_rope``;
    values never. Overrides apply in order; a value differing from the derived one (axis,
    pre-RoPE) or from the defaults (bits, group_size, residual, sinks) marks the tensor
    ``overridden`` and its reason says what was derived and who changed it.

    Raises:
        PolicyError: a rule names a layer the model does not have, or the result breaks a
            constraint (message: source, ``defaults``/``rule N``, field, layer and tensor).
    """
    if not facts:
        raise PolicyError(f"{spec.source}: the model has no attention layers to build a policy for")
    ordered = sorted(facts, key=lambda f: f.layer)
    layer_ids = [f.layer for f in ordered]
    if len(set(layer_ids)) != len(layer_ids):
        raise ValueError(f"duplicate layer indices in the analysis facts: {layer_ids}")

    selections: list[set[int]] = []
    for i, rule in enumerate(spec.overrides):
        try:
            selections.append(set(rule.select(layer_ids)))
        except ValueError as exc:
            raise PolicyError(f"{spec.source}, rule {i + 1}, field 'layers': {exc}") from None

    d = spec.defaults
    stored = spec.budget_unit == "stored"
    # A budget's tensors start at the widest width within it; kvpolicy.calibrate.budget
    # reallocates.
    start_bits = (
        max(w for w in BUDGET_WIDTHS if w <= spec.budget) if spec.budget is not None else d.bits
    )
    # Under a stored-bits budget a group size nobody gave is chosen (spec.Defaults).
    start_group = "auto" if stored and "group_size" not in d.model_fields_set else d.group_size
    tensors: list[TensorPolicy] = []
    all_origins: list[dict[str, int]] = []
    for lf in ordered:
        for kind, tf in ((TensorKind.KEY, lf.key), (TensorKind.VALUE, lf.value)):
            derived_axis = _AXIS_OF[Contracted(tf.contracted)]
            # Whether the key can be cached before its rotation (a rotation on a slice of
            # a key assembled in place, MLA's, cannot be re-applied: it is only reported).
            has_rope = kind is TensorKind.KEY and tf.rope is not None and tf.rope.reapplicable
            values: dict[str, Any] = {
                "bits": start_bits,
                "group_size": start_group,
                "residual": KVPOLICY_DEFAULTS["residual"] if d.residual == "auto"
                else d.residual,
                "residual_bits": d.residual_bits,
                "sinks": d.sinks,
                "axis": d.axis if d.axis is not None else derived_axis,
                "pre_rope": d.pre_rope and has_rope,
                # In the defaults a rotation means the values' (see spec.Defaults).
                "rotation": d.rotation if kind is TensorKind.VALUE else "none",
                # levels: vq in the defaults means the values' (keys: auto).
                "levels": "auto" if d.levels == "vq" and kind is TensorKind.KEY else d.levels,
                "meta_bits": d.meta_bits,
                "fit": d.fit,
                # In the defaults per-channel widths mean the keys' (see spec.Defaults).
                "channel_widths": d.channel_widths if kind is TensorKind.KEY else "uniform",
            }
            origins = dict.fromkeys(values, _DEFAULTS)
            if d.axis is None:
                origins["axis"] = _ANALYSIS
            if not has_rope:
                origins["pre_rope"] = _ANALYSIS
            for i, rule in enumerate(spec.overrides):
                if lf.layer in selections[i] and kind in rule.kinds():
                    for name, value in rule.settings().items():
                        values[name] = value
                        origins[name] = i
            default_group = (origins["group_size"] == _DEFAULTS
                             and "group_size" not in d.model_fields_set)
            meta_from = None
            if values["levels"] == "vq" and values["bits"] < FULL_PRECISION and not stored:
                _vq_defaults(values, origins, d, default_group, tf.head_dim)
            if values["meta_bits"] == "auto" and not stored:
                # Only a stored-bits budget prices metadata (rules.metadata_at).
                values["meta_bits"] = metadata_at("auto", values["bits"], values["levels"],
                                                  default_group, spec.budget is not None)
                if values["meta_bits"] == 8:
                    meta_from = values["group_size"]
                    values["group_size"] = META8_GROUPS[kind]
                    written = (origins["rotation"] != _DEFAULTS
                               or "rotation" in d.model_fields_set)
                    if (kind is TensorKind.VALUE and not tf.head_dim & (tf.head_dim - 1)
                            and meta8_rotates_values("auto", 8, written)):
                        values["rotation"] = "hadamard"
            values["fit"] = fit_at(values["fit"], kind is TensorKind.KEY, values["meta_bits"])
            if (values["channel_widths"] == "auto" and origins["channel_widths"] == _DEFAULTS
                    and "channel_widths" not in d.model_fields_set
                    and (values["axis"] is not Axis.CHANNEL or values["levels"] == "normal")):
                values["channel_widths"] = "uniform"  # kvpolicy's own auto: nothing to place
            if values["bits"] == FULL_PRECISION:
                values["residual_bits"] = FULL_PRECISION  # every token is full precision
            if values["rotation"] == "auto" and tf.head_dim & (tf.head_dim - 1):
                values["rotation"] = "none"  # no Hadamard of this size: nothing to choose
            if values["pre_rope"] and not has_rope and tf.rope is not None:
                raise PolicyError(
                    f"{spec.source}, {_where(origins['pre_rope'])}, field 'pre_rope': layer "
                    f"{lf.layer}'s key has {tf.rope.description}; kvpolicy re-applies RoPE "
                    "only to a key's leading channels, so it cannot cache this key before "
                    "the rotation. Set pre_rope: false for these layers"
                )
            fallback_from = None
            if not isinstance(values["group_size"], int):
                where = f"{spec.source}, {_where(origins['group_size'])}"
                if not stored:
                    raise PolicyError(
                        f"{where}, field 'group_size': group_size {values['group_size']!r} "
                        "is chosen per tensor by a stored-bits budget (under code bits a "
                        "scale and a zero cost nothing, so the smallest group would always "
                        "win); add defaults.stored_bits (e.g. 3.0) or give one group size"
                    )
                values["group_size"], values["group_sizes"], fallback_from = _group_candidates(
                    values["group_size"], values["axis"], tf.head_dim, values["bits"],
                    origins["bits"] >= 0, where, f"layer {lf.layer} {kind.value}",
                    values["meta_bits"])
            if (
                values["axis"] is Axis.TOKEN
                and values["bits"] < FULL_PRECISION
                and default_group
                and tf.head_dim % values["group_size"]
            ):
                # Only kvpolicy's own default shrinks; one the user wrote stays an error.
                smaller = fallback_group_size(values["group_size"], tf.head_dim, values["bits"])
                if smaller is not None:
                    fallback_from, values["group_size"] = values["group_size"], smaller
            rope_short, rope_style, rotary_dim, _ = (
                _rope_text(tf) if kind is TensorKind.KEY else (None, None, None, "")
            )
            overridden = (
                values["axis"] is not derived_axis
                or values["pre_rope"] != has_rope
                or any(
                    origins[f] >= 0 and values[f] != getattr(d, f)
                    for f in ("bits", "group_size", "residual", "sinks")
                )
            )
            try:
                tp = TensorPolicy(
                    layer=lf.layer,
                    tensor=kind,
                    **values,
                    head_dim=tf.head_dim,
                    num_kv_heads=tf.num_kv_heads,
                    bits_from="rule" if origins["bits"] >= 0 else "defaults",
                    contraction=tf.contraction,
                    rope=rope_short,
                    rope_style=rope_style,
                    rotary_dim=rotary_dim,
                    derived_axis=derived_axis,
                    derived_pre_rope=has_rope,
                    overridden=overridden,
                    reason=_reason(
                        kind, tf, values, origins, derived_axis, has_rope, d, fallback_from,
                        meta_from,
                    ),
                )
            except ValidationError as exc:
                raise _blame(
                    exc,
                    spec.source,
                    [_blamable(origins, values, derived_axis, has_rope)],
                    f"layer {lf.layer} {kind.value}",
                ) from None
            tensors.append(tp)
            all_origins.append(origins)
    try:
        return ModelPolicy(model=model_name, source=spec.source, tensors=tuple(tensors))
    except ValidationError as exc:
        layer = (exc.errors()[0].get("ctx") or {}).get("layer")
        index = layer_ids.index(layer) if layer in layer_ids else 0
        pair = all_origins[2 * index : 2 * index + 2]
        raise _blame(exc, spec.source, pair) from None


# A local (sliding-window) layer holds about a window of tokens and pays its full-precision
# residual on every window, where a global layer amortises it over the whole context. The
# default gives a local layer the share of its window that a global layer's residual is of
# LOCAL_REFERENCE tokens (the context whole-cache figures are quoted at, footprint.CONTEXT):
# 128 * 512 // 4096 = 16 recent tokens of a 512-token window.
LOCAL_REFERENCE = 4096


# Under a whole-cache budget (defaults.budget_context) every full-precision token is paid
# from the budget, so the default residual window is WHOLE_CACHE_RESIDUAL[residual_bits],
# not 128. NOTE: bench/whole_cache_budget.py at ef2a7a5, SmolLM2, 4 x (768 + 128) pydoc
# tokens, retrieval on 2 x 1,024: at 16 bits, residual 32 against 128 at 3.0 / 2.5 / 2.0
# whole-cache bits, perplexity 1.016 / 1.038 / 1.140x fp against 1.020 / 1.066 / 2.912x, KL
# 0.011 / 0.029 / 0.123 against 0.016 / 0.064 / 0.950, retrieval 0.989 / 0.971 / 0.692x
# against 0.969 / 0.850 / 0.365x (top-1 agreement 0.939 against 0.959 at 3.0, better at the
# others). At 8 bits (the same bench at cb382bb, with vq values priced), residual 32 / 64 /
# 128 at 2.0 whole-cache bits: perplexity 1.050 / 1.041 / 1.070x fp, KL 0.035 / 0.029 /
# 0.038, top-1 0.908 / 0.922 / 0.918, retrieval 0.952 / 0.942 / 0.858x; at 1.5 (32 / 64;
# 128 did not fit): 1.54 / 1.33x, KL 0.34 / 0.24, top-1 0.777 / 0.795, retrieval 0.493 /
# 0.497x. 64 at 8 bits costs the bytes of 32 at 16.
WHOLE_CACHE_RESIDUAL: dict[int, int] = {16: 32, 8: 64, 4: 64}


# ... and holds that window at WHOLE_CACHE_RESIDUAL_BITS per token (runtime.recent), so the
# bytes it saves go to the packed body. NOTE: the same bench at cb382bb, 2.0 whole-cache
# bits, residual 32 at 8 bits against 16: perplexity 1.050 against 1.079x fp, KL 0.035
# against 0.048, top-1 0.908 against 0.895, retrieval 0.952 against 0.913x (body 1.82
# against 1.72 stored bits); a /tmp script, bits=2 (residual 128): 8 bits cost 1.0260
# against 1.0239x fp perplexity, KL 0.0133 against 0.0125.
WHOLE_CACHE_RESIDUAL_BITS = 8

# With ``residual: auto`` the budget chooses each global layer's window among these
# (residual tokens, residual_bits) with its body (calibrate.whole_cache), the defaults
# above being what the calibration measures the body at. 32 at 16 bits and 64 at 8 cost
# about the same bytes (8.5 bits per element at head_dim 64). Not the default: NOTE
# bench/whole_cache_budget.py at 72f509c, 2.0 whole-cache bits, the choice (128 tokens on
# 10 of 30 layers, 64 on 17, body 1.71 stored bits) scored 1.051x fp perplexity, KL 0.029,
# top-1 0.934, retrieval 0.944x against 64 at 8 bits' 1.041x / 0.029 / 0.922 / 0.942x: no
# clear gain for one more forward and backward of calibration.
WINDOW_CHOICES: tuple[tuple[int, int], ...] = ((32, 8), (64, 8), (128, 8), (32, 16))


def whole_cache_residuals(policy: ModelPolicy, spec: PolicySpec) -> ModelPolicy:
    """When ``spec`` budgets the whole cache (``budget_context``), ``policy`` with each
    residual window held at :data:`WHOLE_CACHE_RESIDUAL_BITS` unless ``residual_bits`` is
    written, then cut (never raised) to :data:`WHOLE_CACHE_RESIDUAL` at its layer's widest
    residual width unless ``residual`` is written (the defaults or any rule); each reason
    says so. Under ``residual: auto`` the policy records :data:`WINDOW_CHOICES` for the
    budget to choose among per global layer (``calibrate.whole_cache``)."""
    if spec.defaults.budget_context is None:
        return policy
    tensors = policy.tensors
    if not _writes(spec, "residual_bits"):
        rb = WHOLE_CACHE_RESIDUAL_BITS
        tensors = tuple(t if t.full_precision or t.residual_bits <= rb else t.model_copy(
            update={"residual_bits": rb, "reason": (
                f"{t.reason}; the residual window held at {rb} bits per token, not 16: a "
                "whole-cache budget pays for it, and the bytes saved go to the packed "
                "tokens")}) for t in tensors)
        policy = policy.model_copy(update={"tensors": tensors})
    auto = spec.defaults.residual == "auto"
    if auto and any(r.residual is not None or r.residual_bits is not None
                    for r in spec.overrides):
        raise PolicyError(f"{spec.source}: residual: auto lets the budget choose every "
                          "global layer's window; drop residual and residual_bits from "
                          "the rules, or give the defaults a number of tokens")
    if not _writes(spec, "residual"):
        widest = {t.layer: max(u.residual_bits for u in tensors if u.layer == t.layer)
                  for t in tensors}
        tensors = _cut_residuals(
            policy, lambda i, t: WHOLE_CACHE_RESIDUAL[widest[t.layer]],
            lambda i, t: "a whole-cache budget pays every token kept out of the packed body, "
                         "and fewer of them leave the packed tokens more bits" + (
                             "; the body is measured with this window, and residual: auto "
                             "then chooses each global layer's" if auto else ""))
    return policy.model_copy(update={"tensors": tensors,
                                     "window_choices": WINDOW_CHOICES if auto else ()})


def _writes(spec: PolicySpec, field: str) -> bool:
    """Whether ``spec`` writes ``field`` with a value (``auto`` leaves it to kvpolicy)."""
    return ((field in spec.defaults.model_fields_set
             and getattr(spec.defaults, field) != "auto")
            or any(getattr(r, field) is not None for r in spec.overrides))


def _cut_residuals(policy: ModelPolicy, limit: Callable[[int, TensorPolicy], int],
                   why: Callable[[int, TensorPolicy], str]) -> tuple[TensorPolicy, ...]:
    """``policy``'s tensors, tensor ``i``'s residual cut to ``limit(i, t)`` (never raised),
    the reason of each one cut ending with ``why(i, t)``."""
    tensors = []
    for i, t in enumerate(policy.tensors):
        r = min(t.residual, limit(i, t))
        if r != t.residual:
            t = t.model_copy(update={"residual": r, "reason": (
                f"{t.reason}; residual {r}, not {t.residual}: {why(i, t)}")})
        tensors.append(t)
    return tuple(tensors)


def local_residuals(policy: ModelPolicy, spec: PolicySpec,
                    windows: Mapping[int, int]) -> ModelPolicy:
    """``policy`` with ``windows`` (attention layer -> sliding window) recorded and, unless
    ``spec`` writes a residual (the defaults or any rule), each local layer's residual cut
    to ``residual * window // LOCAL_REFERENCE`` (never raised), its reason saying so."""
    if not windows:
        return policy
    record = tuple(windows.get(i) for i in range(policy.num_layers))

    def share(i: int, t: TensorPolicy) -> int:
        w = record[i // 2]
        return t.residual if w is None else t.residual * w // LOCAL_REFERENCE

    def why(i: int, t: TensorPolicy) -> str:
        return (f"a local layer (window {record[i // 2]}) holds about a window of tokens, so "
                f"it keeps the share of it in full precision that {t.residual} is of "
                f"{LOCAL_REFERENCE:,} tokens in a global layer")

    tensors = policy.tensors if _writes(spec, "residual") else _cut_residuals(policy, share, why)
    return policy.model_copy(update={"tensors": tensors, "windows": record})


def _blamable(
    origins: Mapping[str, int], values: Mapping[str, Any], derived_axis: Axis, has_rope: bool
) -> dict[str, int]:
    """Origins for blame: a rule that merely restates the derived axis or RoPE ordering
    (as the kivi presets do) is not the cause of a conflict; the analysis is."""
    out = dict(origins)
    if values["axis"] is derived_axis:
        out["axis"] = _ANALYSIS
    if values["pre_rope"] == has_rope:
        out["pre_rope"] = _ANALYSIS
    return out


def _blame(
    exc: ValidationError, source: str, origins: Sequence[Mapping[str, int]], what: str = ""
) -> PolicyError:
    """Name the rule (or the defaults) that set the offending value: among the fields a
    check involves, the one set last."""
    err = exc.errors(include_url=False)[0]
    ctx = err.get("ctx") or {}
    field = err["loc"][0] if err["loc"] else ctx.get("field", "?")
    involved = [f for f in str(ctx.get("involved", field)).split(",") if f]
    candidates = [(o.get(f, _ANALYSIS), f) for o in origins for f in involved]
    origin, field = max(candidates, default=(_ANALYSIS, field))
    message = (
        err["msg"] if err["type"] == "kvpolicy" else f"{err['msg']} (got {show(err['input'])})"
    )
    suffix = f" ({what})" if what else ""
    return PolicyError(f"{source}, {_where(origin)}, field '{field}': {message}{suffix}")
