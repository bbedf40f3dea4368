"""Bit budgets: how many bits each cached tensor gets, from where it is consumed.

``compile_model(model, bits=2.5)`` treats a non-integer ``bits`` as a *budget*: the
average code bits per cached element over all layers and both tensors. Three steps:

``calibrate(model, policy)``
    One forward and one backward over calibration text (default: the last 512 tokens of the
    pydoc text, which the eval's segments never reach) capture every layer's q, k, v at the
    consumer (:mod:`kvpolicy.calibrate.capture`) and the gradient of the text's next-token loss with
    respect to every attention output. For each layer, tensor and width in
    ``BUDGET_WIDTHS`` it quantizes *that tensor alone*, with the policy's axis, group size,
    pre-RoPE ordering, sinks and residual window, and measures what the change ``Δo`` of
    the attention output costs: ``Σ_t (∂L/∂o_t · Δo_t)²``, the squared first-order loss
    change per token (see :data:`CALIBRATION_METRICS`). Keys act through the scores and the
    softmax, values through the weighted sum; one currency for both tensors and for every
    layer, so bits can move between them.

    Why the loss weighting: on SmolLM2 the plain relative output error ``‖Δo‖/‖o‖`` rates
    2-bit values as worse than 2-bit keys on many early layers, yet moving bits from values
    to keys there lowers perplexity; the value noise lands in directions the rest of the
    model barely reads. Weighted by the loss gradient, the same budget scores a lower
    perplexity (README, "Bit budgets", has the measurement).
``allocate(errors, sizes, budget)``
    Exact minimum of the summed error subject to the budget: a multiple-choice knapsack
    solved by dynamic programming over the budget in units of the smallest tensor size.
``apply_budget(policy, calibration)``
    Writes the widths into the policy; each reason quotes the measured errors.

Tensors whose ``bits`` an override rule sets are pinned: they keep their width, count
against the budget, and the rest of it is spread over the other tensors.

Decode-time cache schedule modelled by the calibration
(:class:`kvpolicy.runtime.layer.PackedKVLayer`): the query
at position ``i`` reads the tokens ``[sinks, sinks + p(i))`` quantized, where ``p(i)`` is
the number of tokens packed once ``i + 1`` tokens have arrived (whole chunks leave the
residual window once it holds ``residual + chunk``); everything else it reads exactly.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn
from tqdm.auto import tqdm

from ..errors import KVPolicyError, PolicyError
from ..kernels import reference
from ..kernels.layout import QuantSpec
from ..kernels.masks import causal_mask
from ..kernels.rotation import rotation_matrix
from ..policy import (
    BUDGET_WIDTHS,
    Calibration,
    LayerSensitivity,
    ModelPolicy,
    PolicySpec,
    TensorPolicy,
)
from ..zoo.text import pydoc_tokens
from .capture import LayerActivations, capture_activations
from .metrics import attention_scores, expand_heads, relative_error, roundtrip

__all__ = [
    "ROTATION_GAIN",
    "CALIBRATION_TOKENS",
    "CALIBRATION_METRICS",
    "calibrate",
    "calibrate_on",
    "calibration_ids",
    "calibration_ids_from_file",
    "allocate",
    "apply_budget",
    "budget_policy",
]

log = logging.getLogger(__name__)

CALIBRATION_TOKENS = 512


# --------------------------------------------------------------------------- input


def _find_tokenizer(model: nn.Module):
    """The tokenizer saved beside the model's weights (``config._name_or_path``), or None."""
    path = getattr(getattr(model, "config", None), "_name_or_path", "") or ""
    if not path or not Path(path).is_dir():
        return None
    if not any((Path(path) / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json")):
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


def calibration_ids(
    model: nn.Module, tokens: int = CALIBRATION_TOKENS, tokenizer: Any = None
) -> tuple[torch.Tensor, str]:
    """The default calibration input: the last ``tokens`` tokens of the pydoc text.

    The eval's segments start at the beginning of the text, so this never overlaps them.

    Raises:
        KVPolicyError: no tokenizer given and none saved beside the model.
    """
    tok = tokenizer if tokenizer is not None else _find_tokenizer(model)
    if tok is None:
        raise KVPolicyError(
            f"a bit budget needs calibration text in the model's own tokens, and "
            f"{type(model).__name__} has no tokenizer saved at config._name_or_path; pass "
            "calibration=<[B, T] token ids> (about 512 tokens of text like yours) or "
            "calibration=<a tokenizer>"
        )
    ids = pydoc_tokens(tok)
    if ids.numel() < tokens:
        raise KVPolicyError(f"the pydoc text has only {ids.numel()} tokens, {tokens} requested")
    return ids[-tokens:][None], f"pydoc text, last {tokens} tokens"


_TOKEN_ID_SUFFIXES = (".pt", ".pth")


def calibration_ids_from_file(
    model: nn.Module, path: str | Path, tokens: int = CALIBRATION_TOKENS
) -> torch.Tensor:
    """Calibration token ids read from a file, for ``calibrate(model, policy, ids)``.

    Args:
        model: the model to calibrate; its tokenizer (saved beside its weights, at
            ``config._name_or_path``) tokenizes a text file.
        path: a ``.pt``/``.pth`` file holding token ids saved with ``torch.save`` (an integer
            tensor ``[T]`` or ``[B, T]``, used whole), or any other file: UTF-8 text, of
            which the first ``tokens`` tokens (no special tokens) are used.
        tokens: how many tokens of a text file to keep; a shorter text gives fewer (and
            :func:`calibrate` says when they are too few to pack anything).

    Returns:
        ``[B, T]`` int64 token ids (``B = 1`` for text and for a ``[T]`` tensor).

    Raises:
        KVPolicyError: the file is missing or cannot be read; a ``.pt`` file does not hold
            an integer tensor of 1 or 2 dimensions; a text file is empty; text is given
            but the model has no tokenizer saved beside it.
    """
    path = Path(path)
    if not path.is_file():
        raise KVPolicyError(
            f"calibration file {path} not found; give a .pt file of token ids saved with "
            "torch.save, or a UTF-8 text file"
        )
    if path.suffix.lower() in _TOKEN_ID_SUFFIXES:
        try:
            ids = torch.load(path, weights_only=True, map_location="cpu")
        except Exception as exc:  # unpickling errors come in many types
            raise KVPolicyError(
                f"calibration file {path}: cannot load it with torch.load(weights_only=True) "
                f"({type(exc).__name__}: {exc}); save the token ids with "
                "torch.save(ids, path), ids an integer tensor [T] or [B, T]"
            ) from None
        if isinstance(ids, torch.Tensor):
            what = f"a {ids.dtype} tensor of shape {list(ids.shape)}"
        else:
            what = f"a {type(ids).__name__}"
        if (
            not isinstance(ids, torch.Tensor)
            or ids.dtype.is_floating_point
            or ids.dtype.is_complex
            or ids.dtype == torch.bool
            or ids.dim() not in (1, 2)
            or ids.numel() == 0
        ):
            raise KVPolicyError(
                f"calibration file {path} holds {what}; it must hold the token ids as a "
                "non-empty integer tensor of shape [T] or [B, T] (e.g. "
                "torch.save(tokenizer(text, return_tensors='pt').input_ids, path))"
            )
        ids = ids.to(torch.int64)
        return ids[None] if ids.dim() == 1 else ids
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise KVPolicyError(
            f"calibration file {path} is not UTF-8 text ({exc.reason} at byte {exc.start}); "
            "give UTF-8 text, or token ids saved with torch.save as a .pt file"
        ) from None
    if not text.strip():
        raise KVPolicyError(
            f"calibration file {path} is empty; give about {tokens} tokens of text like the "
            "text the model will see"
        )
    tok = _find_tokenizer(model)
    if tok is None:
        raise KVPolicyError(
            f"calibration file {path} is text, and {type(model).__name__} has no tokenizer "
            "saved at config._name_or_path to turn it into token ids; pass token ids "
            "saved with torch.save as a .pt file instead (an integer tensor [T] or [B, T])"
        )
    ids = tok(text, add_special_tokens=False, return_attention_mask=False)["input_ids"]
    return torch.tensor(ids[:tokens], dtype=torch.long)[None]


# --------------------------------------------------------------------------- measure


def _packed_counts(t: int, sinks: int, residual: int, chunk: int) -> torch.Tensor:
    """``p(i)``: tokens packed once ``i + 1`` tokens arrived (see the module docstring)."""
    n = torch.arange(1, t + 1)
    r = (n - sinks).clamp_min(0)
    return ((r - residual).clamp_min(0) // chunk) * chunk


def _relative_error_on_rows(approx: torch.Tensor, exact: torch.Tensor,
                            rows: torch.Tensor) -> float:
    """``‖approx − exact‖ / ‖exact‖`` over the query rows ``rows`` (a bool mask over T)."""
    return relative_error(approx[..., rows, :], exact[..., rows, :])


def _fisher(delta: torch.Tensor, grad: torch.Tensor) -> float:
    """``Σ_{b,t} (Σ_{h,d} g·Δo)²``: per token, the squared first-order change of the
    calibration loss that the output change ``delta`` causes (``grad``: the loss's gradient
    with respect to the output, both ``[B, Hq, T, Dv]``)."""
    return float((grad * delta).sum(dim=(1, 3)).square().sum())


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


def _token_group(t: TensorPolicy) -> int:
    """``QuantSpec.token_group`` of ``t`` in the cache the budget builds: one token at a time
    where a rule pins it at full precision; every allocated width quantizes."""
    bits = 16 if t.pinned_full_precision else min(BUDGET_WIDTHS)
    return QuantSpec(bits, t.group_size, t.axis.value).token_group


def _fits(t: TensorPolicy, width: int) -> bool:
    return (t.group_size * width) % 8 == 0


@torch.no_grad()
def _layer_errors(act: LayerActivations, kp: TensorPolicy, vp: TensorPolicy, widths: Sequence[int],
                  store: torch.dtype, metric: str = "fisher"
                  ) -> tuple[list[float | None], list[float | None], list[float | None] | None]:
    """``(key errors, value errors, value errors rotated)`` per width; the last only for
    ``rotation: auto`` (the value's ``rotation`` otherwise applies to ``value errors``)."""
    q, k, v = act.query, act.key, act.value
    if metric == "fisher" and act.out_grad is None:
        raise ValueError("the fisher metric needs activations captured with loss_grad=True")
    b, hq, t, _ = q.shape
    sinks, residual = kp.sinks, kp.residual
    chunk = math.lcm(_token_group(kp), _token_group(vp))
    p = _packed_counts(t, sinks, residual, chunk).to(q.device)
    n_packed = int(p[-1])
    if n_packed == 0:
        raise KVPolicyError(
            f"layer {act.layer}: {t} calibration tokens never leave the full-precision windows "
            f"(sinks {sinks} + residual {residual} + a chunk of {chunk}); calibrate on at "
            f"least {sinks + residual + chunk} tokens"
        )
    rows = p > 0
    j = torch.arange(t, device=q.device)
    quantized = (j[None, :] >= sinks) & (j[None, :] < sinks + p[:, None])  # [query, key]
    mask = causal_mask(t, t, q.device)
    seg = slice(sinks, sinks + n_packed)

    scores = attention_scores(q, k, act.scale)
    probs = torch.softmax(scores + mask, dim=-1)
    v_heads = expand_heads(v, hq)  # values per query head, read by every key width
    out = torch.matmul(probs, v_heads)

    def error(approx: torch.Tensor) -> float:
        if metric == "fisher":
            return _fisher(approx - out, act.out_grad)
        return _relative_error_on_rows(approx, out, rows)

    pre_rope = kp.pre_rope and act.cos is not None
    if pre_rope:
        rope, positions = act.rotary(t)
    key_errs: list[float | None] = []
    value_errs: list[float | None] = []
    rotated_errs: list[float | None] | None = [] if vp.rotation == "auto" else None
    rotations = ("none", "hadamard") if vp.rotation == "auto" else (vp.rotation,)

    def value_error(w: int, rotation: str) -> float:
        spec = QuantSpec(w, vp.group_size, vp.axis.value)
        rot = rotation_matrix(rotation, v.shape[-1], v.device)
        if rot is None:
            v_seg = roundtrip(v[:, :, seg].contiguous(), spec, store)
        else:  # stored as v R, read back through Rᵀ (kernels.rotation)
            v_seg = roundtrip((v[:, :, seg] @ rot).contiguous(), spec, store) @ rot.T
        dv = torch.zeros_like(v)
        dv[:, :, seg] = v_seg - v[:, :, seg]
        return error(out + torch.matmul(probs * quantized, expand_heads(dv, hq)))

    for w in widths:
        if not _fits(kp, w) or kp.pinned_full_precision:
            key_errs.append(None)
        else:
            stored = act.key_pre if pre_rope else k
            k_seg = roundtrip(stored[:, :, seg].contiguous(),
                              QuantSpec(w, kp.group_size, kp.axis.value), store)
            if pre_rope:
                k_seg = reference.apply_rope(k_seg, positions[:, seg], rope)
            k_hat = k.clone()
            k_hat[:, :, seg] = k_seg
            s_hat = attention_scores(q, k_hat, act.scale)
            s_mix = torch.where(quantized, s_hat, scores) + mask
            out_k = torch.matmul(torch.softmax(s_mix, dim=-1), v_heads)
            key_errs.append(error(out_k))
        fits = _fits(vp, w) and not vp.pinned_full_precision
        value_errs.append(value_error(w, rotations[0]) if fits else None)
        if rotated_errs is not None:
            rotated_errs.append(value_error(w, rotations[1]) if fits else None)
    return key_errs, value_errs, rotated_errs


def calibrate(
    model: nn.Module,
    policy: ModelPolicy,
    input_ids: torch.Tensor | None = None,
    *,
    tokenizer: Any = None,
    widths: Sequence[int] = BUDGET_WIDTHS,
    metric: str = "fisher",
    progress: bool = True,
) -> Calibration:
    """Measure how much each tensor of each layer costs at each width, where consumed.

    Args:
        model: the uncompiled model (its attention must call SDPA; see
            :mod:`kvpolicy.calibrate.capture`).
        policy: axes, group sizes, pre-RoPE, sinks and residual of every tensor (bits are
            ignored: every width of ``widths`` is measured).
        input_ids: ``[B, T]`` calibration token ids; default :func:`calibration_ids`.
        tokenizer: for the default text when the model has none saved beside it.
        widths: candidate widths, a subset of ``BUDGET_WIDTHS``.
        metric: the currency, a key of :data:`CALIBRATION_METRICS`: ``"fisher"`` (default)
            weighs the output change by the calibration loss's gradient; ``"relative"`` is
            the plain relative output error.

    Returns:
        A :class:`~kvpolicy.policy.Calibration`; deterministic for the same input.
    """
    start = time.perf_counter()
    if input_ids is None:
        input_ids, source = calibration_ids(model, tokenizer=tokenizer)
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
    dtype = next((p.dtype for p in model.parameters()), torch.float32)
    # The dtype scales and zeros are stored in (runtime.cache.storage_dtype): fp16 for fp32
    # models, the model's own otherwise.
    store = torch.float16 if dtype == torch.float32 else dtype
    acts = capture_activations(model, input_ids.to(device), loss_grad=metric == "fisher")
    layers = []
    for act in tqdm(acts, desc="calibrating", unit="layer", disable=not progress):
        ke, ve, vr = _layer_errors(act, policy.get(act.layer, "key"),
                                   policy.get(act.layer, "value"), widths, store, metric)
        layers.append(LayerSensitivity(layer=act.layer, key=tuple(ke), value=tuple(ve),
                                       value_rotated=None if vr is None else tuple(vr)))
        act.query = act.key = act.key_pre = act.value = act.out_grad = None  # type: ignore
    cal = Calibration(
        metric=CALIBRATION_METRICS[metric], model=policy.model, source=source,
        tokens=int(input_ids.shape[1]), rows=int(input_ids.shape[0]),
        seconds=round(time.perf_counter() - start, 3),
        settings=policy.calibration_key(), widths=widths, layers=tuple(layers),
    )
    log.info("calibrated %d layers x %d widths in %.1f s", len(layers), len(widths),
             cal.seconds)
    return cal


# --------------------------------------------------------------------------- allocate


def allocate(
    errors: Sequence[Mapping[int, float]],
    sizes: Sequence[int],
    budget: float,
    pinned: Mapping[int, int] | None = None,
) -> list[int]:
    """Choose one width per tensor: smallest summed error with the budget held.

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
    # 1e-9: a budget like 2.3 times the total size must not lose a unit to rounding.
    capacity_bits = budget * total - sum(w * sizes[i] for i, w in pinned.items()) + 1e-9
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
    inf = float("inf")
    # best[c]: least error of the tensors so far using exactly c units; choice per tensor.
    best = [inf] * (capacity + 1)
    best[0] = 0.0
    choices: list[list[int]] = []
    for i in free:
        u = sizes[i] // unit
        nxt = [inf] * (capacity + 1)
        pick = [0] * (capacity + 1)
        options = sorted(errors[i].items())
        for c in range(capacity + 1):
            if best[c] == inf:
                continue
            for w, e in options:
                c2 = c + w * u
                if c2 > capacity:
                    break
                if best[c] + e < nxt[c2]:
                    nxt[c2], pick[c2] = best[c] + e, w
        best = nxt
        choices.append(pick)
    c = min(range(capacity + 1), key=lambda c: (best[c], c))
    for k in range(len(free) - 1, -1, -1):
        i = free[k]
        w = choices[k][c]
        out[i] = w
        c -= w * (sizes[i] // unit)
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


def _fmt(e: float) -> str:
    return f"{e:.1e}"


# rotation: auto rotates a value when the rotation cuts its measured cost at the allocated
# width below this share of the plain cost: a rotation costs a [D, D] matmul of the values
# appended and of the attention output per step, so a tie keeps the plain cache.
ROTATION_GAIN = 0.95


def _rotate(plain: float | None, turned: float | None) -> bool:
    return plain is not None and turned is not None and turned < ROTATION_GAIN * plain


def apply_budget(policy: ModelPolicy, calibration: Calibration, budget: float) -> ModelPolicy:
    """``policy`` with every tensor not pinned by a rule at the width :func:`allocate`
    gives it; reasons quote the measured errors, the result records budget and calibration.

    Raises:
        PolicyError: the calibration was measured with other settings, or the budget
            cannot be met.
    """
    if calibration.settings != policy.calibration_key():
        raise PolicyError(
            f"the calibration (measured on {calibration.source}) was taken with other "
            "settings than this policy's (axis, group size, pre-RoPE, residual or sinks of "
            "some tensor, or another model); delete the 'calibration' block of the policy "
            "file so that compile_model measures it again"
        )
    tensors = policy.tensors
    errors, rotated, pinned = [], [], {}
    for i, t in enumerate(tensors):
        rotated.append({})
        if t.bits_from == "rule":
            pinned[i] = t.bits
            errors.append({})
            continue
        errors.append(calibration.errors(t.layer, t.tensor))
        if t.rotation == "auto":
            rotated[i] = calibration.errors(t.layer, t.tensor, rotated=True)
            if not rotated[i]:
                raise PolicyError(
                    f"layer {t.layer} {t.tensor.value}: rotation: auto, but the calibration "
                    "has no rotated errors; delete the 'calibration' block so that "
                    "compile_model measures it again"
                )
    # rotation: auto takes, at each width, the cheaper of the two (by ROTATION_GAIN).
    costs = [{w: rotated[i][w] if _rotate(e, rotated[i].get(w)) else e
              for w, e in errs.items()} for i, errs in enumerate(errors)]
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
        if t.rotation == "auto":
            plain, turned = errors[i].get(w), rotated[i].get(w)
            data["rotation"] = "hadamard" if _rotate(plain, turned) else "none"
            reason += (
                f"; rotation: auto chose {data['rotation']} (at {w} bits "
                f"{_fmt(turned) if turned is not None else '-'} rotated against "
                f"{_fmt(plain) if plain is not None else '-'} plain; rotated when it costs "
                f"under {ROTATION_GAIN:g}x)"
            )
        data.update(bits=w, reason=reason, bits_from="rule" if i in pinned else "budget")
        out.append(TensorPolicy.model_validate(data))
    return policy.model_copy(update={
        "tensors": tuple(out), "budget": budget, "calibration": calibration,
    })


def budget_policy(
    model: nn.Module,
    base: ModelPolicy,
    spec: PolicySpec,
    calibration: Calibration | torch.Tensor | Any = None,
    progress: bool = True,
) -> tuple[ModelPolicy, Calibration]:
    """Allocate ``spec.budget`` over ``base`` (built from ``spec``): from ``calibration``
    (a :class:`Calibration`, token ids or a tokenizer), else ``spec.calibration``, else a
    fresh :func:`calibrate` on the default text."""
    budget = spec.budget
    if budget is None:
        raise ValueError("budget_policy needs a spec whose defaults.bits is a budget")
    if isinstance(calibration, Calibration):
        cal = calibration
    elif spec.calibration is not None and calibration is None:
        cal = spec.calibration
    else:
        cal = calibrate_on(model, base, calibration, progress=progress)
    return apply_budget(base, cal, budget), cal


def calibrate_on(model: nn.Module, policy: ModelPolicy, source: torch.Tensor | Any = None,
                 **kwargs: Any) -> Calibration:
    """:func:`calibrate` on ``source``: ``[B, T]`` token ids, a tokenizer for the default
    text, or None (the default text, with the tokenizer saved beside the model)."""
    if source is None or isinstance(source, torch.Tensor):
        return calibrate(model, policy, source, **kwargs)
    return calibrate(model, policy, tokenizer=source, **kwargs)
