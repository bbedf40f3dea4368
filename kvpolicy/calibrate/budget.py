"""Bit budgets: how many bits each cached tensor gets, from where it is consumed.

``compile_model(model, bits=2.5)`` treats a non-integer ``bits`` as a *budget*: the
average code bits per cached element over all layers and both tensors. Three steps:

``calibrate(model, policy)``
    One forward and one backward per row of calibration text (default: the last 2,048 tokens
    of the pydoc text as 4 rows of 512, which the eval's segments never reach; the errors
    add over rows) capture every layer's q, k, v at the consumer (``capture.py``) and the
    gradient of the text's next-token loss for every attention output. For each layer, tensor
    and width in ``BUDGET_WIDTHS`` it quantizes *that tensor alone*, with the policy's axis,
    group, pre-RoPE ordering, sinks and residual, and measures what the change ``Δo`` of the
    output costs: ``Σ_t (∂L/∂o_t · Δo_t)²``, the squared first-order loss change per token
    (:data:`CALIBRATION_METRICS`). Keys act through the scores and the softmax, values through
    the weighted sum; one currency for both tensors and for every layer, so bits can move
    between them.

    Why the loss weighting: on SmolLM2 the plain relative output error ``‖Δo‖/‖o‖`` rates
    2-bit values as worse than 2-bit keys on many early layers, yet moving bits from values
    to keys there lowers perplexity; the value noise lands in directions the rest of the
    model barely reads. Weighted by the loss gradient, the same budget scores a lower
    perplexity (docs/results.md, "An earlier release", has the measurement).
``allocate(errors, sizes, budget)`` (:mod:`kvpolicy.calibrate.allocate`)
    Exact minimum of the summed error subject to the budget: a multiple-choice knapsack
    solved by dynamic programming over the budget in units of the smallest tensor size.
``apply_budget(policy, calibration)`` (:mod:`kvpolicy.calibrate.apply`)
    Writes the widths into the policy; each reason quotes the measured errors.

Tensors whose ``bits`` an override rule sets are pinned: they keep their width, count
against the budget, and the rest of it is spread over the other tensors.

A *stored-bits* budget (``compile_model(model, stored_bits=3.0)``, YAML
``defaults: {stored_bits: 3.0}``) counts what the packed cache stores per element: the code
plus a scale and a zero per group (fp16; ``2 + 32/32 = 3`` bits for 2-bit codes in groups
of 32, ``2.5`` in groups of 64, ``2.25`` in groups of 128). There the group size is a choice
too (``group_size: auto``, the default under ``stored_bits``: ``GROUP_CHOICES`` where they
fit): the calibration measures every (width, group) pair of such a tensor, and the
allocator chooses one pair per tensor (``allocate_stored``). A code-bits budget
(``bits=2.5``) keeps the policy's group size and measures only it, as before.

The sink and residual windows are not counted by these two: the budget is over the packed
body, whose size per token is what grows with the context. A whole-cache budget
(``budget_context``) counts them too, and where the spec writes no window it also prices
each global layer's window choices (``ModelPolicy.window_choices``) on the calibration rows
joined into one, one more forward and backward
(:func:`kvpolicy.calibrate.whole_cache.measure`), for the allocator to choose one per layer
with the layer's body.

Decode-time cache schedule modelled by the calibration
(:class:`kvpolicy.runtime.layer.PackedKVLayer`): the query
at position ``i`` reads the tokens ``[sinks, sinks + p(i))`` quantized, where ``p(i)`` is
the number of tokens packed once ``i + 1`` tokens have arrived (whole chunks leave the
residual window once it holds ``residual + chunk``); everything else it reads exactly.
Where group sizes are candidates, the chunk is the lcm of all the candidates' token groups,
so that every candidate is measured on the same quantized tokens: a comparison of groups,
not of how soon each would pack (the up to ``chunk - 1`` extra tokens that a larger key
group keeps in the residual window are neither counted nor measured).
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Sequence
from typing import Any, NamedTuple

import torch
from torch import nn

from ..errors import KVPolicyError
from ..kernels import reference
from ..kernels.layout import NORMAL_LEVELS, Codebook, QuantSpec
from ..kernels.masks import causal_mask
from ..kernels.rotation import rotation_matrix
from ..policies import (
    BUDGET_WIDTHS,
    Calibration,
    LayerSensitivity,
    ModelPolicy,
    TensorPolicy,
)
from ..progress import progress_bar, stage_done
from . import vq, whole_cache
from .allocate import allocate
from .capture import LayerActivations, capture_activations
from .channels import places_widths, widths_for
from .metrics import attention_scores, expand_heads, relative_error, roundtrip
from .metrics import fisher_error as _fisher
from .metrics import packed_counts as _packed_counts
from .text import (  # re-exported: this module was their home
    CALIBRATION_ROWS,
    CALIBRATION_TOKENS,
    calibration_ids,
    calibration_ids_from_file,
)

__all__ = [
    "CALIBRATION_TOKENS",
    "CALIBRATION_ROWS",
    "CALIBRATION_METRICS",
    "calibrate",
    "calibrate_on",
    "calibration_ids",
    "calibration_ids_from_file",
    "allocate",
    "scale_dtype",
]

log = logging.getLogger(__name__)

# --------------------------------------------------------------------------- measure


CALIBRATION_METRICS = {
    "fisher": "loss-weighted attention-output error",
    "relative": "relative attention-output error",
}
"""Calibration currencies (:func:`calibrate`'s ``metric``) and how reasons name them.

``fisher`` (default)
    ``Σ_t (∂L/∂o_t · Δo_t)²`` where ``L`` is the summed next-token loss of the calibration
    text and ``o_t`` the layer's attention output at token ``t``: the squared first-order
    loss change per token, an empirical-Fisher estimate (exact across channels and heads,
    diagonal across tokens) of how much the output change costs the model. Needs one
    backward pass.
``relative``
    ``‖o' − o‖ / ‖o‖`` over the rows that read quantized tokens: the output change itself,
    every channel and token weighted alike (no backward).
"""


def _token_group(t: TensorPolicy, group_size: int) -> int:
    """``QuantSpec.token_group`` of ``t`` at ``group_size`` in the cache the budget builds:
    one token at a time where a rule pins it at full precision (every allocated width
    quantizes), else the group along tokens of axis 'channel'."""
    quantized = not t.pinned_full_precision
    return group_size if quantized and t.axis.value == "channel" else 1


def _fits(width: int, group_size: int) -> bool:
    return (group_size * width) % 8 == 0


def _candidates(t: TensorPolicy) -> tuple[int, ...]:
    """The group sizes measured for ``t``: its candidates, or its one group size."""
    return t.group_sizes or (t.group_size,)


Rows = dict[int, list["float | None"]]  # {group size: [error per width]}


@torch.no_grad()
def _layer_errors(act: LayerActivations, kp: TensorPolicy, vp: TensorPolicy, widths: Sequence[int],
                  store: torch.dtype, metric: str = "fisher"
                  ) -> tuple[list[float | None], list[float | None], list[float | None] | None]:
    """``(key errors, value errors, value errors rotated)`` per width at each tensor's own
    group size; the last only for ``rotation: auto`` (the value's ``rotation`` otherwise
    applies to ``value errors``)."""
    got = _layer_errors_by_group(act, kp, vp, widths, store, metric)
    turned = None if got.value_rotated is None else got.value_rotated[vp.group_size]
    return got.key[kp.group_size], got.value[vp.group_size], turned


class GroupErrors(NamedTuple):
    """Errors ``{group size: [error per width]}`` of one layer, per variant measured (None:
    not measured for this layer's settings)."""

    key: Rows
    value: Rows
    value_rotated: Rows | None  # rotation: auto
    key_normal: Rows | None  # levels: auto (None entries where a width has no table)
    value_normal: Rows | None
    key_meta8: Rows | None  # meta_bits: auto (uniform levels, 8-bit scale and zero)
    value_meta8: Rows | None
    value_vq: Rows | None = None  # vq values (vq.priced), at group head_dim


@torch.no_grad()
def _layer_errors_by_group(act: LayerActivations, kp: TensorPolicy, vp: TensorPolicy,
                           widths: Sequence[int], store: torch.dtype, metric: str = "fisher",
                           books: dict[int, Codebook] | None = None) -> GroupErrors:
    """The errors of every variant a layer's settings ask for (:class:`GroupErrors`) over
    each tensor's candidate group sizes (:func:`_candidates`), all on one packing schedule.
    Under ``levels: auto`` the plain rows are measured with uniform levels and the normal
    rows with normal ones; under ``meta_bits: auto`` the plain rows with 16-bit metadata and
    the meta8 rows with 8-bit metadata; fixed settings apply to the plain rows."""
    q, k, v = act.query, act.key, act.value
    if metric == "fisher" and act.out_grad is None:
        raise ValueError("the fisher metric needs activations captured with loss_grad=True")
    b, hq, t, _ = q.shape
    sinks, residual = kp.sinks, kp.residual
    key_groups, value_groups = _candidates(kp), _candidates(vp)
    chunk = math.lcm(*(_token_group(kp, g) for g in key_groups),
                     *(_token_group(vp, g) for g in value_groups))
    p = _packed_counts(t, sinks, residual, chunk).to(q.device)
    n_packed = int(p[-1])
    if n_packed == 0:
        what = " (the lcm of the candidate group sizes)" if kp.group_sizes or vp.group_sizes else ""
        raise KVPolicyError(
            f"layer {act.layer}: {t} calibration tokens never leave the full-precision windows "
            f"(sinks {sinks} + residual {residual} + a chunk of {chunk}{what}); calibrate on "
            f"at least {sinks + residual + chunk} tokens"
        )
    # Only rows from r0 on read a packed token (p never falls) and only ``seg`` is packed:
    # errors are computed on those rows (the others' are 0) and changes on those columns.
    r0 = int((p > 0).nonzero()[0])
    seg = slice(sinks, sinks + n_packed)
    j = torch.arange(sinks, sinks + n_packed, device=q.device)  # the packed columns
    quantized = j[None, :] < sinks + p[r0:, None]  # [query row from r0, packed column]
    mask = causal_mask(t, t, q.device)[r0:]
    q_r = q[:, :, r0:]

    scores = attention_scores(q_r, k, act.scale)  # [B, Hq, t - r0, t]
    probs = torch.softmax(scores + mask, dim=-1)
    v_heads = expand_heads(v, hq)  # values per query head, read by every key width
    out = torch.matmul(probs, v_heads)
    probs_quantized = probs[..., seg] * quantized  # what the packed values weigh, every width
    grad = None if act.out_grad is None else act.out_grad[:, :, r0:]

    def error(approx: torch.Tensor) -> float:
        if metric == "fisher":
            return _fisher(approx - out, grad)
        return relative_error(approx, out)  # every row from r0 on reads a packed token

    pre_rope = kp.pre_rope and act.cos is not None
    if pre_rope:
        rope, positions = act.rotary(t)
    key_errs: Rows = {g: [] for g in key_groups}
    value_errs: Rows = {g: [] for g in value_groups}
    rotated_errs: Rows | None = {g: [] for g in value_groups} if vp.rotation == "auto" else None
    rotations = ("none", "hadamard") if vp.rotation == "auto" else (vp.rotation,)

    placed: dict[tuple[int, int], tuple[tuple[int, ...], ...] | None] = {}

    def key_error(w: int, g: int, levels: str, meta: int = kp.stored_meta_bits) -> float:
        stored = act.key_pre if pre_rope else k
        # channel_widths: auto prices each width with the widths the cache will place
        # (once per width and group: both metadata widths read the same ones)
        widths = None
        if places_widths(kp, w, levels):
            if (w, g) not in placed:
                placed[(w, g)] = widths_for(act, kp, w, g)
            widths = placed[(w, g)]
        spec = QuantSpec(w, g, kp.axis.value, levels, meta,  # type: ignore[arg-type]
                         kp.fit if meta == 8 else "minmax", widths)
        k_seg = roundtrip(stored[:, :, seg].contiguous(), spec, store)
        if pre_rope:
            k_seg = reference.apply_rope(k_seg, positions[:, seg], rope)
        s_mix = scores.clone()
        s_mix[..., seg] = torch.where(quantized, attention_scores(q_r, k_seg, act.scale),
                                      scores[..., seg])
        return error(torch.matmul(torch.softmax(s_mix + mask, dim=-1), v_heads))

    def value_error(w: int, g: int, rotation: str, levels: str,
                    meta: int = vp.stored_meta_bits, book: Codebook | None = None) -> float:
        spec = QuantSpec(w, g, vp.axis.value, levels, meta,  # type: ignore[arg-type]
                         vp.fit if meta == 8 and book is None else "minmax", codebook=book)
        rot = rotation_matrix(rotation, v.shape[-1], v.device)
        if rot is None:
            v_seg = roundtrip(v[:, :, seg].contiguous(), spec, store)
        else:  # stored as v R, read back through Rᵀ (kernels.rotation)
            v_seg = roundtrip((v[:, :, seg] @ rot).contiguous(), spec, store) @ rot.T
        dv = expand_heads(v_seg - v[:, :, seg], hq)
        return error(out + torch.matmul(probs_quantized, dv))

    # levels: auto measures uniform levels (levels_at), then normal ones where the width
    # has a table (8-bit metadata has uniform levels only).
    key_normal: Rows | None = ({g: [] for g in key_groups}
                               if kp.levels == "auto" and kp.meta_bits != 8 else None)
    value_normal: Rows | None = ({g: [] for g in value_groups}
                                 if vp.levels == "auto" and vp.meta_bits != 8 else None)
    key_meta8: Rows | None = {g: [] for g in key_groups} if kp.meta_bits == "auto" else None
    value_meta8: Rows | None = ({g: [] for g in value_groups} if vp.meta_bits == "auto"
                                else None)

    for w in widths:
        normal_fits = w in NORMAL_LEVELS
        k_levels = kp.model_copy(update={"bits": w}).code_levels
        v_levels = vp.model_copy(update={"bits": w}).code_levels
        for g in key_groups:
            fits = _fits(w, g) and not kp.pinned_full_precision
            key_errs[g].append(key_error(w, g, k_levels) if fits else None)
            if key_normal is not None:
                key_normal[g].append(key_error(w, g, "normal") if fits and normal_fits
                                     else None)
            if key_meta8 is not None:
                key_meta8[g].append(key_error(w, g, "uniform", 8) if fits else None)
        for g in value_groups:
            fits = _fits(w, g) and not vp.pinned_full_precision
            value_errs[g].append(value_error(w, g, rotations[0], v_levels) if fits else None)
            if rotated_errs is not None:
                rotated_errs[g].append(value_error(w, g, rotations[1], v_levels) if fits
                                       else None)
            if value_normal is not None:
                value_normal[g].append(value_error(w, g, rotations[0], "normal")
                                       if fits and normal_fits else None)
            if value_meta8 is not None:
                value_meta8[g].append(value_error(w, g, rotations[0], "uniform", 8)
                                      if fits else None)
    value_vq = None
    if books:  # vq values (calibrate.vq): one group of head_dim, an 8-bit scale
        rot = vq.candidate(vp, min(books)).rotation
        value_vq = {vp.head_dim: [value_error(w, vp.head_dim, rot, "vq", 8, books[w])
                                  if w in books else None for w in widths]}
    return GroupErrors(key_errs, value_errs, rotated_errs, key_normal, value_normal,
                       key_meta8, value_meta8, value_vq)


def _add(a: GroupErrors | None, b: GroupErrors) -> GroupErrors:
    """``a + b`` entry by entry (None: not measured, the same in both)."""
    if a is None:
        return b

    def rows(x: Rows | None, y: Rows | None) -> Rows | None:
        if x is None or y is None:
            return None
        return {g: [None if u is None or v is None else u + v
                    for u, v in zip(x[g], y[g], strict=True)] for g in x}

    return GroupErrors(*(rows(x, y) for x, y in zip(a, b, strict=True)))


def _group_table(rows: Rows | None, t: TensorPolicy, groups: Sequence[int], n: int
                 ) -> tuple[tuple[float | None, ...], ...] | None:
    """``rows`` laid out over the calibration's ``groups`` (a row of None where a group is
    not a candidate of ``t``); None where ``t``'s group is fixed."""
    if rows is None or not t.group_sizes:
        return None
    return tuple(tuple(rows[g]) if g in rows else (None,) * n for g in groups)


def _own_row(rows: Rows | None, t: TensorPolicy) -> tuple[float | None, ...] | None:
    """The row of ``t``'s own group size where its group is fixed (None otherwise)."""
    return None if rows is None or t.group_sizes else tuple(rows[t.group_size])


def _vq_rows(rows: Rows | None, vp: TensorPolicy, books: dict[int, Codebook],
             widths: Sequence[int]) -> dict[str, Any]:
    """``LayerSensitivity``'s vq fields: the errors and each width's codebook text."""
    if rows is None:
        return {}
    return {"value_vq": tuple(rows[vp.head_dim]), "value_vq_books": tuple(
        vq.codebook_text(books[w]) if w in books else "" for w in widths)}


def scale_dtype(model: nn.Module) -> torch.dtype:
    """The dtype scales and zeros are stored in (``runtime.cache.storage_dtype``): fp16 for
    fp32 models, the model's own otherwise."""
    dtype = next((p.dtype for p in model.parameters()), torch.float32)
    return torch.float16 if dtype == torch.float32 else dtype


def calibrate(
    model: nn.Module,
    policy: ModelPolicy,
    input_ids: torch.Tensor | None = None,
    *,
    tokenizer: Any = None,
    widths: Sequence[int] = BUDGET_WIDTHS,
    metric: str = "fisher",
    progress: bool = True,
    vq_values: bool = True,
) -> Calibration:
    """Measure how much each tensor of each layer costs at each width, where consumed.

    Args:
        model: the uncompiled model (its attention must call SDPA; see
            :mod:`kvpolicy.calibrate.capture`).
        policy: axes, group sizes, pre-RoPE, sinks and residual of every tensor (bits are
            ignored: every width of ``widths`` is measured; where a tensor has candidate
            ``group_sizes``, every width at every candidate).
        input_ids: ``[B, T]`` calibration token ids; default :func:`calibration_ids`
            (:data:`CALIBRATION_ROWS` rows of :data:`CALIBRATION_TOKENS`). Under the
            default metric each row runs its own forward and backward and the errors add
            up, so memory is one row's.
        tokenizer: for the default text when the model has none saved beside it.
        widths: candidate widths, a subset of ``BUDGET_WIDTHS``.
        metric: the currency, a key of :data:`CALIBRATION_METRICS`: ``"fisher"`` (default)
            weighs the output change by the calibration loss's gradient; ``"relative"`` is
            the plain relative output error.
        vq_values: price vector-quantized values where a value's levels and metadata are
            the budget's to choose (``calibrate.vq.priced``); False: scalar options only.

    Returns:
        A :class:`~kvpolicy.policies.Calibration`; deterministic for the same input.
    """
    start = time.perf_counter()
    if input_ids is None:
        input_ids, source = calibration_ids(model, tokenizer=tokenizer, rows=CALIBRATION_ROWS)
    else:
        if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2:
            shape = tuple(input_ids.shape) if isinstance(input_ids, torch.Tensor) else None
            raise KVPolicyError(
                f"calibration token ids must be a [B, T] integer tensor, got "
                f"{type(input_ids).__name__} {shape or ''}".rstrip()
            )
        source = "user token ids"
    if metric not in CALIBRATION_METRICS:
        raise KVPolicyError(
            f"calibration metric {metric!r}: choose from {sorted(CALIBRATION_METRICS)}"
        )
    widths = tuple(widths)
    bad = [w for w in widths if w not in BUDGET_WIDTHS]
    if bad or not widths:
        raise KVPolicyError(f"widths {list(widths)}: choose from {BUDGET_WIDTHS}")
    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    store = scale_dtype(model)
    groups = tuple(sorted({g for t in policy.tensors for g in t.group_sizes}))
    # The loss-weighted errors are sums over rows and tokens: one row at a time gives the
    # same table with one row's activations in memory. The relative error is a ratio over
    # the whole batch.
    # vq codebooks are fitted on held-out text where kvpolicy picks the text (the pydoc
    # tokens before the calibration's), so that their measured cost is not flattered by
    # the fit; on user ids, on those ids.
    fit_ids = input_ids
    priced = vq_values and any(vq.priced(t) for t in policy.tensors)
    if priced and source.startswith("pydoc"):
        fit_ids, _ = calibration_ids(model, tokenizer=tokenizer, rows=CALIBRATION_ROWS,
                                     skip=input_ids.numel())
    books = vq.fit_books(model, fit_ids.to(device), policy, widths) if priced else {}
    parts = input_ids.split(1) if metric == "fisher" else (input_ids,)
    summed: dict[int, GroupErrors] = {}
    # A whole-cache budget's window choices, priced on each global layer (whole_cache).
    recent: dict[int, tuple[whole_cache.Rows, whole_cache.Rows]] = {}
    bar = progress_bar(len(parts) * policy.num_layers, desc="calibrating", unit="layer",
                       enabled=progress)
    for part in parts:
        for act in capture_activations(model, part.to(device), loss_grad=metric == "fisher"):
            kp, vp = policy.get(act.layer, "key"), policy.get(act.layer, "value")
            got = _layer_errors_by_group(act, kp, vp, widths, store, metric,
                                         books.get(act.layer))
            summed[act.layer] = _add(summed.get(act.layer), got)
            act.query = act.key = act.key_pre = act.value = act.out_grad = None  # type: ignore
            bar.update()
    if policy.window_choices:  # priced on the rows joined, the longest context there is
        local = dict(zip(policy.layers, policy.windows or (None,) * policy.num_layers,
                         strict=True))
        limit = getattr(getattr(model, "config", None), "max_position_embeddings", None)
        joined = input_ids.reshape(1, -1)[:, :limit].to(device)
        for act in capture_activations(model, joined, loss_grad=metric == "fisher"):
            if local[act.layer] is None:
                recent[act.layer] = whole_cache.measure(
                    act, policy.get(act.layer, "key"), policy.get(act.layer, "value"), store,
                    policy.window_choices, metric, rows=whole_cache.PRICED_ROWS)
    stage_done(bar, f"calibrated {policy.num_layers} layers on {input_ids.shape[0]} x "
               f"{input_ids.shape[1]} tokens ({metric}) in {time.perf_counter() - start:.1f} s",
               enabled=progress)
    layers = []
    for i, got in sorted(summed.items()):
        kp, vp = policy.get(i, "key"), policy.get(i, "value")
        vr, kn, vn = got.value_rotated, got.key_normal, got.value_normal
        n = len(widths)
        layers.append(LayerSensitivity(
            layer=i, key=tuple(got.key[kp.group_size]),
            value=tuple(got.value[vp.group_size]),
            value_rotated=None if vr is None else tuple(vr[vp.group_size]),
            key_normal=None if kn is None else tuple(kn[kp.group_size]),
            value_normal=None if vn is None else tuple(vn[vp.group_size]),
            key_meta8=_own_row(got.key_meta8, kp), value_meta8=_own_row(got.value_meta8, vp),
            key_groups=_group_table(got.key, kp, groups, n),
            value_groups=_group_table(got.value, vp, groups, n),
            value_rotated_groups=_group_table(vr, vp, groups, n),
            key_normal_groups=_group_table(kn, kp, groups, n),
            value_normal_groups=_group_table(vn, vp, groups, n),
            key_meta8_groups=_group_table(got.key_meta8, kp, groups, n),
            value_meta8_groups=_group_table(got.value_meta8, vp, groups, n),
            **_vq_rows(got.value_vq, vp, books.get(i, {}), widths),
            key_recent=tuple(recent[i][0]) if i in recent else None,
            value_recent=tuple(recent[i][1]) if i in recent else None,
        ))
    cal = Calibration(
        metric=CALIBRATION_METRICS[metric], model=policy.model, source=source,
        tokens=int(input_ids.shape[1]), rows=int(input_ids.shape[0]),
        seconds=round(time.perf_counter() - start, 3),
        settings=policy.calibration_key(), widths=widths, groups=groups, layers=tuple(layers),
        recent=policy.window_choices,
    )
    log.info("calibrated %d layers x %d widths x %d groups in %.1f s", len(layers),
             len(widths), max(len(groups), 1), cal.seconds)
    return cal


def calibrate_on(model: nn.Module, policy: ModelPolicy, source: torch.Tensor | Any = None,
                 **kwargs: Any) -> Calibration:
    """:func:`calibrate` on ``source``: ``[B, T]`` token ids, a tokenizer for the default
    text, or None (the default text, with the tokenizer saved beside the model)."""
    if source is None or isinstance(source, torch.Tensor):
        return calibrate(model, policy, source, **kwargs)
    return calibrate(model, policy, tokenizer=source, **kwargs)
