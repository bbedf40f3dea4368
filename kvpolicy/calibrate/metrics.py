"""Quantization error measured where the cached tensor is consumed (docs/design.md §3).

Reconstruction error of a stored tensor says little about what attention sees. Given the
activations :func:`~kvpolicy.calibrate.capture.capture_activations` recorded at every
layer's consumer, this module quantizes the stored tensor with the reference quantizer and
reports the error at the consumer:

* keys: relative error of the pre-softmax scores ``q·kᵀ·scale`` and the mean total
  variation between the exact and the perturbed causal softmax rows;
* values: relative error of the attention output ``softmax(scores)·V`` with exact
  probabilities.

    acts = capture_activations(model, input_ids)
    rows = consumed_errors(acts, AxisChoice("channel", "token", key_pre_rope=True), bits=2)

Errors are computed for a causal LM over whole groups of the captured tokens: no
full-precision residual window and no sinks, ``T`` trimmed to a multiple of the group size.
The consumer's own mask is not replayed: every layer is scored with a plain causal mask
(``LayerActivations.meta`` records whether SDPA got ``is_causal`` or a mask), so padding
and sliding windows are not modelled. One forward gives prefill activations only; the
cache-built-over-time evaluation of docs/design.md §3 is a different measurement.

The helpers (:func:`relative_error`, :func:`roundtrip`, :func:`expand_heads`,
:func:`attention_scores`) are shared with the bit-budget calibration
(:mod:`kvpolicy.calibrate.budget`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..errors import KVPolicyError
from ..kernels import reference
from ..kernels.layout import QuantSpec
from ..kernels.masks import causal_mask
from ..policies import ModelPolicy
from .capture import LayerActivations

__all__ = [
    "AxisChoice",
    "PolicyLike",
    "attention_scores",
    "consumed_errors",
    "expand_heads",
    "fisher_error",
    "packed_counts",
    "relative_error",
    "roundtrip",
]

_EPS = 1e-30  # keeps a relative error finite for an all-zero reference


@dataclass(frozen=True)
class AxisChoice:
    """One axis policy for every layer: the key axis, the value axis, keys pre-RoPE."""

    key_axis: str = "channel"
    value_axis: str = "token"
    key_pre_rope: bool = True

    @property
    def name(self) -> str:
        """``K-channel-pre/V-token`` (pre/post only matters where the model has RoPE)."""
        where = "pre" if self.key_pre_rope else "post"
        return f"K-{self.key_axis}-{where}/V-{self.value_axis}"


PolicyLike = AxisChoice | ModelPolicy | Mapping[str, Any]


def _choice_for(spec: PolicyLike, layer: int) -> tuple[str, str, bool]:
    """(key axis, value axis, keys pre-RoPE) of ``layer`` under ``spec``."""
    if isinstance(spec, ModelPolicy):
        k, v = spec.get(layer, "key"), spec.get(layer, "value")
        return str(k.axis.value), str(v.axis.value), bool(k.pre_rope)
    if isinstance(spec, Mapping):
        spec = AxisChoice(**spec)
    if not isinstance(spec, AxisChoice):
        raise KVPolicyError(
            f"policy_spec is a {type(spec).__name__}; pass an AxisChoice, a ModelPolicy or a "
            "dict with key_axis, value_axis, key_pre_rope"
        )
    return spec.key_axis, spec.value_axis, spec.key_pre_rope


def relative_error(approx: torch.Tensor, exact: torch.Tensor) -> float:
    """``‖approx − exact‖ / ‖exact‖`` (Frobenius, over every element)."""
    return float((approx - exact).norm() / exact.norm().clamp_min(_EPS))


def roundtrip(x: torch.Tensor, spec: QuantSpec, store: torch.dtype | None = None) -> torch.Tensor:
    """Quantize and dequantize (fp32); ``store``: the dtype scales and zeros are kept in."""
    return reference.dequantize(reference.quantize(x, spec, store), spec, torch.float32)


def expand_heads(x: torch.Tensor, hq: int) -> torch.Tensor:
    """``[B, Hkv, T, D]`` -> ``[B, hq, T, D]``: each kv head repeated for its query group."""
    return x.repeat_interleave(hq // x.shape[1], dim=1)


def attention_scores(q: torch.Tensor, k: torch.Tensor, scale: float) -> torch.Tensor:
    """Raw (unmasked) ``q·kᵀ·scale``, ``[B, Hq, Tq, Tk]``, GQA keys expanded per query head."""
    return torch.matmul(q, expand_heads(k, q.shape[1]).transpose(-1, -2)) * scale


def _exact(act: LayerActivations, t: int) -> tuple[torch.Tensor, ...]:
    """Unquantized ``(scores, probs, out, mask, causal)`` over the first ``t`` tokens,
    cached in ``act.meta`` (they do not depend on the policy).

    ``scores`` are raw ``q·kᵀ·scale`` (unmasked), ``mask`` the additive causal mask,
    ``causal`` its 0/1 form, ``out`` the fp32 attention output.
    """
    cached = act.meta.get("_exact")
    if cached is not None and cached[0] == t:
        return cached[1]
    q, k, v = act.query[:, :, :t], act.key[:, :, :t], act.value[:, :, :t]
    mask = causal_mask(t, t, q.device)
    causal = torch.isfinite(mask).float()
    scores = attention_scores(q, k, act.scale)
    probs = torch.softmax(scores + mask, dim=-1)
    out, _ = reference.attention_partial(q, k, v, scale=act.scale, mask=mask)
    exact = (scores, probs, out, mask, causal)
    act.meta["_exact"] = (t, exact)
    return exact


def consumed_errors(
    acts: Sequence[LayerActivations],
    policy_spec: PolicyLike,
    bits: int = 2,
    group_size: int = 32,
) -> list[dict[str, Any]]:
    """Quantize each stored tensor and measure the error where attention consumes it.

    Args:
        acts: from :func:`~kvpolicy.calibrate.capture.capture_activations`.
        policy_spec: the axis of keys and values and whether keys are stored pre-RoPE:
            an :class:`AxisChoice`, a dict of its fields, or a ``ModelPolicy`` (its per-layer
            ``axis`` and ``pre_rope``; its bits, group size, residual and sinks are not used).
        bits: code width for both tensors.
        group_size: G; the captured tokens are trimmed to a multiple of G (all of them
            quantized: no residual window, no sinks).

    Returns:
        Per layer a key row then a value row, each a dict with ``layer, tensor, axis,
        pre_rope, bits, tokens, recon`` (relative Frobenius error of the stored tensor),
        and for keys ``score_err`` (relative error of the causal ``q·kᵀ·scale`` entries),
        ``prob_tv`` (mean total variation per causal softmax row) and ``output_err``
        (relative error of ``softmax(scores)·V`` with exact V); for values ``output_err``
        (relative error of ``softmax(scores)·V`` with exact probabilities) and
        ``score_err = prob_tv = None``, plus ``joint_output_err``: the output error with
        both the key and the value quantized as ``policy_spec`` says.
    """
    rows: list[dict[str, Any]] = []
    for act in acts:
        key_axis, value_axis, pre_rope = _choice_for(policy_spec, act.layer)
        pre_rope = pre_rope and act.cos is not None
        t = (act.key.shape[2] // group_size) * group_size
        if t == 0:
            raise KVPolicyError(
                f"{act.key.shape[2]} captured tokens hold no whole group of {group_size}; "
                "capture at least group_size tokens"
            )
        q, k_post, v = act.query[:, :, :t], act.key[:, :, :t], act.value[:, :, :t]
        scores, probs, out, mask, causal = _exact(act, t)
        k_stored = act.key_pre[:, :, :t] if pre_rope else k_post
        k_hat = roundtrip(k_stored, QuantSpec(bits, group_size, key_axis))  # type: ignore[arg-type]
        recon_k = relative_error(k_hat, k_stored)
        if pre_rope:
            spec, positions = act.rotary(t)
            k_hat = reference.apply_rope(k_hat, positions, spec)
        scores_hat = attention_scores(q, k_hat, act.scale)
        probs_hat = torch.softmax(scores_hat + mask, dim=-1)
        out_k, _ = reference.attention_partial(q, k_hat, v, scale=act.scale, mask=mask)
        rows.append(dict(
            layer=act.layer, tensor="key", axis=key_axis, pre_rope=pre_rope, bits=bits,
            tokens=t, recon=recon_k,
            score_err=relative_error(scores_hat * causal, scores * causal),
            prob_tv=float(0.5 * (probs_hat - probs).abs().sum(-1).mean()),
            output_err=relative_error(out_k, out),
        ))

        v_hat = roundtrip(v, QuantSpec(bits, group_size, value_axis))  # type: ignore[arg-type]
        out_v = torch.matmul(probs, expand_heads(v_hat, q.shape[1]))
        out_kv = torch.matmul(probs_hat, expand_heads(v_hat, q.shape[1]))
        rows.append(dict(
            layer=act.layer, tensor="value", axis=value_axis, pre_rope=False, bits=bits,
            tokens=t, recon=relative_error(v_hat, v), score_err=None, prob_tv=None,
            output_err=relative_error(out_v, out), joint_output_err=relative_error(out_kv, out),
        ))
    return rows


def packed_counts(t: int, sinks: int, residual: int, chunk: int) -> torch.Tensor:
    """``p(i)``: tokens packed once ``i + 1`` tokens arrived (the decode-time schedule
    ``calibrate.budget`` models: whole chunks leave the residual once it holds
    ``residual + chunk``)."""
    n = torch.arange(1, t + 1)
    r = (n - sinks).clamp_min(0)
    return ((r - residual).clamp_min(0) // chunk) * chunk


def fisher_error(delta: torch.Tensor, grad: torch.Tensor) -> float:
    """``Σ_{b,t} (Σ_{h,d} g·Δo)²``: per token, the squared first-order change of the
    calibration loss that the output change ``delta`` causes (``grad``: the loss's gradient
    with respect to the output, both ``[B, Hq, T, Dv]``)."""
    return float((grad * delta).sum(dim=(1, 3)).square().sum())
