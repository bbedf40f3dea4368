"""Writing an allocated budget into a policy: widths, group sizes, rotations and reasons.

``apply_budget(policy, calibration, budget)`` reads each tensor's measured costs from the
calibration (:mod:`kvpolicy.calibrate.budget`), lets the allocator
(:mod:`kvpolicy.calibrate.allocate`) choose, and writes every choice with the numbers
behind it into the tensor's reason, so that ``kvpolicy inspect`` can explain it:

- a code-bits budget (``bits=2.5``): one width per tensor at the policy's group size;
- a stored-bits budget (``stored_bits=3.0``): one ``(width, group size)`` per tensor, the
  reason quoting the stored bits of the choice and the measured cost of each candidate
  group at the chosen width ("2 bits, group 64: 2.50 stored bits per element; ... at 2
  bits: group 32 9.0e-05 (3.00) · group 64 1.2e-04 (2.50) · group 128 3.1e-04 (2.25)");
- with ``budget_context`` L, the stored-bits budget counts the whole cache at L tokens:
  each layer's key and value options are chosen together
  (:func:`~kvpolicy.calibrate.whole_cache.whole_cache_sizes`), with the layer's recent
  window where the policy has window choices (the key's reason quoting the cost and the
  bytes of each), the value's reason adding what the layer holds;
- ``rotation: auto``: at the chosen option, the rotated and the plain cost;
- ``levels: auto``: at the chosen option, the cost with normal and with uniform levels.

``budget_policy`` is the way in from ``derive_policy``: it finds or measures the
calibration and applies the spec's budget.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from typing import Any, Literal

import torch
from torch import nn

from ..errors import AnalysisError, KVPolicyError, PolicyError
from ..policies import Calibration, ModelPolicy, PolicySpec, TensorPolicy, stored_bits
from . import budget as measure
from . import channels, vq
from .allocate import Option, allocate, allocate_joint, allocate_stored
from .capture import LayerActivations, reduce_activations
from .whole_cache import (
    body_bits,
    chunk_of,
    is_vq,
    joint_cost,
    layer_pairs,
    whole_cache_sizes,
    window_tables,
    window_text,
)

__all__ = ["ROTATION_GAIN", "LEVELS_GAIN", "apply_budget", "budget_policy", "channel_text",
           "channel_policy", "uniform_widths"]

log = logging.getLogger(__name__)

# rotation: auto rotates a value when the rotation cuts its measured cost at the allocated
# width below this share of the plain cost: a rotation costs a [D, D] matmul of the values
# appended and of the attention output per step, so a tie keeps the plain cache.
ROTATION_GAIN = 0.95
# levels: auto takes normal levels where they cut the measured cost below this share of the
# uniform (or rotated) one: the same bytes and one table lookup per element, so a clear
# margin, not a tie, decides.
LEVELS_GAIN = 0.95


def _fmt(e: float) -> str:
    return f"{e:.1e}"


def _bits(w: int) -> str:
    return f"{w} bit{'s' if w > 1 else ''}"


def _pick(plain: float | None, turned: float | None, normal: float | None
          ) -> tuple[float | None, str]:
    """The cheapest measured variant of one option: ``(cost, "plain" | "rotated" |
    "normal")``, rotated and normal only where they beat what they replace by their gain."""
    if plain is None:
        return None, "plain"
    cost, name = plain, "plain"
    if turned is not None and turned < ROTATION_GAIN * plain:
        cost, name = turned, "rotated"
    if normal is not None and normal < LEVELS_GAIN * cost:
        cost, name = normal, "normal"
    return cost, name


def _stale(calibration: Calibration) -> PolicyError:
    return PolicyError(
        f"the calibration (measured on {calibration.source}) was taken with other "
        "settings than this policy's (axis, group size or candidate group sizes, "
        "pre-RoPE, residual or sinks of some tensor, or another model); delete the "
        "'calibration' block of the policy file so that compile_model measures it again"
    )


Measured = tuple[dict[int, float], dict[int, float], dict[int, float]]


def _measured(calibration: Calibration, t: TensorPolicy, group: int | None) -> Measured:
    """``({width: plain error}, {width: rotated error}, {width: error with normal
    levels})`` of ``t`` at ``group`` (None: its own fixed group); the rotated ones only for
    ``rotation: auto``, the normal ones only for ``levels: auto``."""
    plain = calibration.errors(t.layer, t.tensor, group=group)
    turned = normal = {}
    if t.rotation == "auto":
        turned = calibration.errors(t.layer, t.tensor, rotated=True, group=group)
    if t.levels == "auto":
        normal = calibration.errors(t.layer, t.tensor, normal=True, group=group)
    for setting, got in (("rotation", turned), ("levels", normal)):
        if getattr(t, setting) == "auto" and plain and not got:
            what = "rotated errors" if setting == "rotation" else "errors with normal levels"
            raise PolicyError(
                f"layer {t.layer} {t.tensor.value}: {setting}: auto, but the calibration "
                f"has no {what}; delete the 'calibration' block so that compile_model "
                "measures it again"
            )
    return plain, turned, normal


def apply_budget(policy: ModelPolicy, calibration: Calibration, budget: float,
                 unit: Literal["code", "stored"] = "code", scale_bits: int = 16,
                 context: int | None = None, pages: int | None = None) -> ModelPolicy:
    """``policy`` with every tensor not pinned by a rule at the width (and, for a
    stored-bits budget, the group size) the allocator gives it; reasons quote the measured
    errors, the result records budget, unit and calibration.

    Args:
        policy: the policy built from the spec, widths unallocated.
        calibration: measured on ``policy``'s settings (``calibration_key``).
        budget: average bits per element, in ``unit``.
        unit: ``"code"`` (code bits; group sizes stay) or ``"stored"`` (codes plus a scale
            and a zero of ``scale_bits`` each per group; widths and group sizes chosen).
        scale_bits: bits of one stored scale or zero (16: fp16 or bf16).
        context: for a stored-bits budget, count the whole cache each layer holds after
            this many tokens (``defaults.budget_context``); None: the packed body.
        pages: for a stored-bits budget, count each layer's page of this many tokens
            (``defaults.budget_pages``), every layer within the budget on its own.

    Raises:
        PolicyError: the calibration was measured with other settings, a code-bits budget
            meets candidate group sizes, or the budget cannot be met.
    """
    tensors = policy.tensors
    if unit == "code" and any(t.group_sizes for t in tensors):
        raise PolicyError(
            "a code-bits budget does not choose group sizes (their scales and zeros are not "
            "counted, so the smallest would always win); give stored_bits, or one group size"
        )
    if calibration.settings != policy.calibration_key():
        raise _stale(calibration)
    if unit == "stored":
        return _apply_stored(policy, calibration, budget, scale_bits, context, pages)
    variants: list[Measured] = []
    pinned = {}
    for i, t in enumerate(tensors):
        if t.bits_from == "rule":
            pinned[i] = t.bits
            variants.append(({}, {}, {}))
            continue
        variants.append(_measured(calibration, t, None))
    errors = [m[0] for m in variants]
    # rotation: auto and levels: auto take, at each width, the cheapest variant (_pick).
    costs = [{w: _pick(e, turned.get(w), normal.get(w))[0] for w, e in plain.items()}
             for plain, turned, normal in variants]
    sizes = [t.elements_per_token for t in tensors]
    widths = allocate(costs, sizes, budget, pinned)
    out = []
    for i, (t, w) in enumerate(zip(tensors, widths, strict=True)):
        data = t.model_dump()
        if i in pinned:
            reason = f"{t.reason}; pinned by the rule, counted against the budget {budget:g}"
        else:
            measured = " · ".join(f"{x} b {_fmt(e)}" for x, e in sorted(errors[i].items()))
            reason = (
                f"{t.reason}; budget {budget:g}: {w} bit{'s' if w > 1 else ''}, from the "
                f"measured {calibration.metric} of quantizing this tensor alone ({measured})"
            )
        plain, turned, normal = variants[i]
        reason += _variant_reason(t, data, w, plain.get(w), turned.get(w), normal.get(w))
        data.update(bits=w, reason=reason, bits_from="rule" if i in pinned else "budget")
        out.append(TensorPolicy.model_validate(data))
    return policy.model_copy(update={
        "tensors": tuple(out), "budget": budget, "budget_unit": "code",
        "calibration": calibration,
    })


def _choice_text(setting: str, chosen: str, w: int, alt: float | None, alt_name: str,
                 plain: float, plain_name: str, gain: float) -> str:
    return (
        f"; {setting}: auto chose {chosen} (at {w} bits "
        f"{_fmt(alt) if alt is not None else '-'} {alt_name} against {_fmt(plain)} "
        f"{plain_name}; {alt_name} when it costs under {gain:g}x)"
    )


def _variant_reason(t: TensorPolicy, data: dict[str, Any], w: int, plain: float | None,
                    turned: float | None, normal: float | None) -> str:
    """Set ``data``'s ``rotation`` / ``levels`` where they are ``auto`` to the variant
    :func:`_pick` chose at the allocated option, and say why (nothing where neither is)."""
    if t.rotation != "auto" and t.levels != "auto":
        return ""
    if plain is None:  # nothing measured at this option (a pinned width): the defaults
        if t.rotation == "auto":
            data["rotation"] = "none"
        return ""
    _, name = _pick(plain, turned, normal)
    text = ""
    if t.rotation == "auto":
        data["rotation"] = "hadamard" if name == "rotated" else "none"
        text += _choice_text("rotation", data["rotation"], w, turned, "rotated", plain,
                             "plain", ROTATION_GAIN)
    if t.levels == "auto":
        data["levels"] = "normal" if name == "normal" else "uniform"
        text += _choice_text("levels", data["levels"], w, normal, "normal", plain, "uniform",
                             LEVELS_GAIN)
    return text


# (width, group size), (width, group size, 8) for 8-bit scales and zeros, or
# (width, head_dim, 8, 1) for vq values (one 8-bit scale per group, no zero; calibrate.vq).
def _vq_options(calibration: Calibration, t: TensorPolicy, pages: int | None
                ) -> dict[Option, float]:
    """``{(width, head_dim, 8, 1): error}`` of ``t`` vector-quantized where the calibration
    priced it (``calibrate.vq.priced``); none for a budget over pages (``budget_pages``:
    not enabled there yet)."""
    if not vq.priced(t) or pages is not None or t.bits_from == "rule":
        return {}
    return {(w, t.head_dim, 8, 1): e for w, (e, _) in calibration.vq_errors(t.layer).items()}


def _meta8_options(calibration: Calibration, t: TensorPolicy) -> dict[Option, float]:
    """``{(width, group, 8): error}`` of ``t`` with 8-bit metadata (``meta_bits: auto``)."""
    if t.meta_bits != "auto" or t.pinned_full_precision:
        return {}
    out: dict[Option, float] = {}
    for g in t.group_sizes or (t.group_size,):
        got = calibration.errors(t.layer, t.tensor, group=g if t.group_sizes else None,
                                 meta8=True)
        out.update({(w, g, 8): e for w, e in got.items()})
    if not out and calibration.errors(t.layer, t.tensor, group=t.group_sizes[0]
                                      if t.group_sizes else None):
        raise PolicyError(
            f"layer {t.layer} {t.tensor.value}: meta_bits: auto, but the calibration has no "
            "errors with 8-bit metadata; delete the 'calibration' block so that "
            "compile_model measures it again"
        )
    return out


def _meta_text(t: TensorPolicy, o: Option, opts: dict[Option, float]) -> str:
    """Why ``meta_bits: auto`` chose the metadata width of ``o`` (nothing otherwise)."""
    if t.meta_bits != "auto" or o[0] >= 16:
        return ""
    w, g = o[:2]
    e8, e16 = opts.get((w, g, 8)), opts.get((w, g))
    chosen = "8" if len(o) > 2 else "16"
    cost = " · ".join(f"{m}-bit {_fmt(e)}" for m, e in (("8", e8), ("16", e16))
                      if e is not None)
    return (f"; meta_bits: auto chose {chosen} (at {_bits(w)}, group {g}: {cost}; the "
            "allocator prices each by its stored bits)")


def _vq_text(t: TensorPolicy, o: Option, opts: dict[Option, float]) -> str:
    """Why the allocator took vq values: the option's cost against the best scalar option
    of no more stored bits (what it would have paid instead)."""
    w = o[0]
    mine = stored_bits(w, o[1], 8, 1)
    scalar = [(e, x) for x, e in opts.items() if not is_vq(x) and x[0] < 16
              and stored_bits(x[0], x[1], x[2] if len(x) > 2 else 16) <= mine + 0.5]
    e, x = min(scalar) if scalar else (0.0, ())
    alt = (f" against {_fmt(e)} for the best scalar option up to 0.5 bits more ({_bits(x[0])}"
           f", group {x[1]}, {stored_bits(x[0], x[1], x[2] if len(x) > 2 else 16):.2f} stored"
           " bits)") if scalar else ""
    return (f"; levels: auto chose vq (at {_bits(w)}: {_fmt(opts[o])}{alt}; 256 centroids "
            "per kv head fitted by k-means, on held-out pydoc text for the default text; the "
            "allocator prices each option by its stored bits and the centroids' bytes)")


def _page_sizes(policy: ModelPolicy, meta: list[int], pages: int
                ) -> tuple[Callable[[int, tuple[Option, ...]], int | None], list[int]]:
    """For a budget over pages of ``pages`` tokens: ``size(layer, (key option, value
    option))``, the bits of that layer's page as ``runtime.paged.PagedLayout`` lays it out
    (less the alignment of its fields), None where the options' chunk does not divide the
    page; and per layer the elements a page holds."""
    pairs = layer_pairs(policy)

    def size(layer: int, opts: tuple[Option, ...]) -> int | None:
        key, value = pairs[layer]
        e = key.elements_per_token + value.elements_per_token
        if all(o[0] >= 16 for o in opts):
            return pages * e * 16
        chunk = chunk_of(pairs[layer], opts)
        if pages % chunk:
            return None
        stage = chunk if chunk > 1 else 0
        return (math.ceil(pages * body_bits(pairs[layer], opts, meta, layer))
                + (stage + key.sinks) * e * 16)

    return size, [pages * (k.elements_per_token + v.elements_per_token) for k, v in pairs]


def _apply_stored(policy: ModelPolicy, calibration: Calibration, budget: float,
                  scale_bits: int, context: int | None = None,
                  pages: int | None = None) -> ModelPolicy:
    """:func:`apply_budget` for a stored-bits budget: a ``(width, group)`` per tensor, and
    under ``meta_bits: auto`` the metadata width too."""
    tensors = policy.tensors
    # Per tensor: {option: error} plain, rotated and with normal levels (_measured).
    measured: list[tuple[dict[Option, float], ...]] = []
    options: list[dict[Option, float]] = []
    for t in tensors:
        p: dict[Option, float] = {}
        r: dict[Option, float] = {}
        n: dict[Option, float] = {}
        if not t.pinned_full_precision:
            for g in t.group_sizes or (t.group_size,):
                errs, rot, nor = _measured(calibration, t, g if t.group_sizes else None)
                if t.group_sizes and not errs:
                    raise _stale(calibration)  # the candidates were not measured
                for table, got in ((p, errs), (r, rot), (n, nor)):
                    table.update({(w, g): e for w, e in got.items()})
        measured.append((p, r, n))
        if t.pinned_full_precision:
            opts = {(t.bits, t.group_size): 0.0}
        else:
            opts = {o: _pick(e, r.get(o), n.get(o))[0] for o, e in p.items()  # type: ignore[misc]
                    if t.bits_from != "rule" or o[0] == t.bits}
            opts.update({o: e for o, e in _meta8_options(calibration, t).items()
                         if t.bits_from != "rule" or o[0] == t.bits})
            opts.update(_vq_options(calibration, t, pages))
            if t.bits_from == "rule" and not opts:  # a pinned width the table lacks
                opts = {(t.bits, t.group_size): 0.0}
            if not opts:
                raise PolicyError(
                    f"layer {t.layer} {t.tensor.value}: the calibration measured no width "
                    f"and group size that fit it (group sizes "
                    f"{list(t.group_sizes or (t.group_size,))}); give group sizes that "
                    "fill whole bytes at some width, e.g. multiples of 8"
                )
        options.append(opts)
    sizes = [t.elements_per_token for t in tensors]
    # Each tensor's scale and zero: the cache dtype's, or a byte with 8-bit metadata (an
    # option (width, group, 8) says so itself).
    meta = [8 * t.meta_bytes(scale_bits // 8) for t in tensors]
    pairs = [options[i : i + 2] for i in range(0, len(options), 2)]
    size: Callable[[int, tuple[Option, ...]], int | None] | None = None
    held_text = ""
    picked: list[tuple] = []
    recent: list = [None] * len(pairs)  # per layer: the window a whole-cache budget chose
    if pages is not None:  # every layer's page within the budget on its own
        size, per_page = _page_sizes(policy, meta, pages)
        chosen = []
        for layer, pair in enumerate(pairs):
            got = allocate_joint([pair], lambda _, opts, at=layer: size(at, opts),
                                 math.floor(budget * per_page[layer] + 1e-9))
            chosen += got[0]
            picked += got
        budget_text = f"stored-bits budget {budget:g} per page of {pages} tokens"
        held_text = "the layer's page holds {:,.0f} bytes, its stage and sink area included"
    elif context is None:
        chosen = allocate_stored(options, sizes, budget, meta)
        budget_text = f"stored-bits budget {budget:g}"
    else:
        size, elements = whole_cache_sizes(policy, meta, context)
        windows = window_tables(policy, calibration)
        groups = pairs if windows is None else [p + [w] for p, w in zip(pairs, windows,
                                                                          strict=True)]
        cost = joint_cost(policy, calibration)
        picked = allocate_joint(groups, size, math.floor(budget * elements + 1e-9), cost=cost)
        chosen = [o for pair in picked for o in pair[:2]]
        recent = [p[2] if len(p) > 2 else None for p in picked]
        budget_text = f"stored-bits budget {budget:g} over the whole cache at {context:,} tokens"
        held_text = (f"the layer holds {{:,.0f}} bytes per batch row at {context:,} tokens, "
                     "sinks, residual and incomplete chunk included")
    out = []
    for i, (t, o) in enumerate(zip(tensors, chosen, strict=True)):
        w, g = o[:2]
        mb = o[2] if len(o) > 2 else meta[i]
        data = t.model_dump()
        fields = o[3] if is_vq(o) else 2
        sb = stored_bits(w, g, mb, fields)
        what = (f"{_bits(w)}{' vq' if is_vq(o) else ''}, group {g}: {sb:.2f} stored bits "
                f"per element ({w} + {fields} x {mb}/{g})" if w < 16 else
                "16 bits: 16.00 stored bits per element, no scales")
        pinned = t.bits_from == "rule"
        if pinned:
            reason = f"{t.reason}; pinned by the rule at {what}, counted against the " \
                     f"{budget_text}"
        else:
            reason = (f"{t.reason}; {budget_text}: {what}, from the measured "
                      f"{calibration.metric} of quantizing this tensor alone")
        if size is not None and i % 2 == 1:  # what the layer holds, on its value
            reason += "; " + held_text.format(size(i // 2, picked[i // 2]) / 8)
        if (c := recent[i // 2]) is not None:  # both tensors hold it; the key quotes it
            data.update(residual=c[0], residual_bits=c[1] if w < 16 else 16)
            if i % 2 == 0:
                body = picked[i // 2][:2]
                errs = (options[i][o], options[i + 1][body[1]])
                reason += "; " + window_text(calibration, c, i // 2, body, errs, cost, size)
        same_meta = [x for x in options[i] if len(x) == len(o) and not is_vq(x)]
        if t.group_sizes and w < 16 and not is_vq(o):
            at_w = " · ".join(
                f"group {x[1]} {_fmt(options[i][x])} ({stored_bits(w, x[1], mb):.2f})"
                for x in sorted(same_meta) if x[0] == w)
            reason += f"; at {_bits(w)}: {at_w}"
        if not pinned and not is_vq(o):
            at_g = " · ".join(f"{x[0]} b {_fmt(options[i][x])}" for x in sorted(same_meta)
                              if x[1] == g)
            reason += f"; at group {g}: {at_g}"
        if is_vq(o):  # vq values: the option as calibrate.vq priced it, its codebook
            reason += _vq_text(t, o, options[i])
            data.update(vq.candidate(t, w, calibration.vq_errors(t.layer)[w][1]).model_dump(
                include={"group_size", "group_sizes", "levels", "meta_bits", "fit",
                         "rotation", "codebook"}))
        elif len(o) == 3:  # 8-bit metadata: uniform levels, no rotation was measured with it
            reason += _meta_text(t, o, options[i])
            data.update(meta_bits=8, levels="uniform" if t.levels == "auto" else t.levels,
                        rotation="none" if t.rotation == "auto" else t.rotation)
        else:
            reason += _meta_text(t, o, options[i])
            if t.meta_bits == "auto":
                data["meta_bits"] = 16
                data["fit"] = "minmax"  # the fit searches 8-bit scales only
            p, r, n = measured[i]
            reason += _variant_reason(t, data, w, p.get((w, g)), r.get((w, g)),
                                      n.get((w, g)))
        data.update(bits=w, group_size=g, reason=reason,
                    bits_from="rule" if pinned else "budget")
        out.append(TensorPolicy.model_validate(data))
    return policy.model_copy(update={
        "tensors": tuple(out), "budget": budget, "budget_unit": "stored",
        "budget_context": context, "budget_pages": pages, "calibration": calibration,
    })


def budget_policy(
    model: nn.Module,
    base: ModelPolicy,
    spec: PolicySpec,
    calibration: Calibration | torch.Tensor | Any = None,
    progress: bool = True,
    vq_values: bool = True,
) -> tuple[ModelPolicy, Calibration]:
    """Allocate ``spec.budget`` (in ``spec.budget_unit``) over ``base`` (built from
    ``spec``): from ``calibration`` (a :class:`Calibration`, token ids or a tokenizer), else
    ``spec.calibration``, else a fresh :func:`~kvpolicy.calibrate.budget.calibrate` on the
    default text (``vq_values``: as there)."""
    budget, unit = spec.budget, spec.budget_unit
    if budget is None or unit is None:
        raise ValueError("budget_policy needs a spec with a budget (bits float or stored_bits)")
    if isinstance(calibration, Calibration):
        cal = calibration
    elif spec.calibration is not None and calibration is None:
        cal = spec.calibration
    else:
        cal = measure.calibrate_on(model, base, calibration, progress=progress,
                                   vq_values=vq_values)
    # NOTE: scales and zeros are stored in fp16 for fp32/fp16 models and in bf16 for bf16
    # ones (runtime.cache.storage_dtype): 16 bits each.
    scale_bits = torch.finfo(measure.scale_dtype(model)).bits
    return apply_budget(base, cal, budget, unit, scale_bits, spec.defaults.budget_context,
                        spec.defaults.budget_pages), cal


# --------------------------------------------------------------------------- channel widths


def channel_text(model: nn.Module, source: torch.Tensor | None = None, tokenizer: Any = None,
                 written: bool = True, usable: bool = True) -> tuple[torch.Tensor, str] | None:
    """The calibration text ``channel_widths: auto`` measures on: ``(ids [B, T], where)``
    from ``source`` token ids, else the last 512 pydoc tokens in ``tokenizer``'s or the
    model's own tokenizer; None where there is none and the user did not write ``auto``
    (kvpolicy's default then keeps one width: :func:`uniform_widths`). Decided before a
    budget, so that its calibration measures the keys as the cache will store them.

    ``usable``: False where plain forwards of token ids do not take the model's cached
    path (``probe_kwargs``), which the capture relies on.

    Raises:
        KVPolicyError: ``written`` and no calibration text can be had.
    """
    try:
        if not usable:
            raise KVPolicyError(
                "channel_widths: auto measures the keys with plain forwards of token ids, "
                "which a model that needs probe_kwargs does not take its cached path on")
        if source is not None:
            return source, "user token ids"
        try:
            return measure.calibration_ids(model, tokenizer=tokenizer)
        except KVPolicyError:
            raise KVPolicyError(
                f"channel_widths: auto measures where the queries look on calibration text in "
                f"the model's own tokens, and {type(model).__name__} has no tokenizer saved at "
                "config._name_or_path; pass calibration=<[B, T] token ids> (about 512 tokens "
                "of text like yours) or calibration=<a tokenizer>, or set channel_widths: "
                "uniform") from None
    except KVPolicyError as e:
        if written:
            raise
        # No silent downgrade: the default spreads the keys' widths over their channels,
        # and one width for all of them loses retrieval (docs/results.md, per-channel key
        # widths). Said once per derivation, with what was done and how to get the default.
        log.warning(
            "kvpolicy derived one width for every key channel instead of the default "
            "per-channel widths, which costs retrieval at 2-3 bits: %s", e)
        return None


NO_TEXT = ("no calibration text to place them by (pass calibration= token ids or a tokenizer "
           "to compile_model)")


def uniform_widths(policy: ModelPolicy, why: str = NO_TEXT) -> ModelPolicy:
    """``policy`` with every pending ``channel_widths: auto`` key back to one width, its
    reason saying ``why`` where the width could have been spread."""
    tensors = tuple(
        t.model_copy(update={"channel_widths": "uniform", "reason": t.reason + (
            f"; one width for every channel: {why}" if channels.spreads(t.bits) else "")})
        if t.channel_widths == "auto" and not t.widths else t
        for t in policy.tensors
    )
    return policy.model_copy(update={"tensors": tensors})


def channel_policy(model: nn.Module, policy: ModelPolicy, text: tuple[torch.Tensor, str],
                   written: bool = True) -> ModelPolicy:
    """``policy`` with every ``channel_widths: auto`` key's widths allocated from one
    calibration forward of ``model`` on ``text`` (:func:`channel_text`).

    ``written``: the user asked for ``channel_widths: auto``, so that a capture that fails
    is an error; otherwise (kvpolicy's default) such keys keep one width and their reason
    says why.

    Raises:
        KVPolicyError, AnalysisError: ``written`` and the capture failed.
    """
    if not any(t.channel_widths == "auto" and not t.widths for t in policy.tensors):
        return policy
    ids, where = text
    pending: dict[int, list[TensorPolicy]] = {}
    for t in policy.tensors:
        if t.channel_widths == "auto" and not t.widths:
            pending.setdefault(t.layer, []).append(t)

    def place(act: LayerActivations) -> list[TensorPolicy]:
        return [channels.allocated(t, act, where, written) for t in pending.get(act.layer, [])]

    try:  # one layer's activations at a time: only the placed policies are kept
        placed = reduce_activations(model, ids, place)
    except (KVPolicyError, AnalysisError) as e:
        if written:
            raise
        log.info("channel widths stay uniform: %s", e)
        return uniform_widths(policy, f"the calibration forward failed ({e})")
    new = {(t.layer, t.tensor): t for ts in placed.values() for t in ts}
    tensors = tuple(new.get((t.layer, t.tensor), t) for t in policy.tensors)
    return policy.model_copy(update={"tensors": tensors})
