"""The where-consumed axis study: the derived key/value axes against their flips, scored
by the errors attention sees (docs/design.md §3), ranked against decode perplexity.

    study = axis_study(model, input_ids, bits=2)   # derived axes and their flips
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn

from ..api import derive_policy
from ..calibrate.capture import capture_activations
from ..calibrate.metrics import AxisChoice, consumed_errors
from ..errors import KVPolicyError

__all__ = ["METRICS", "axis_study", "consumed_study"]


_FLIP = {"channel": "token", "token": "channel"}
# Per-policy means. "recon" averages the key and value reconstruction errors; "output_err"
# is the attention-output error with both tensors quantized (joint_output_err).
METRICS = ("recon", "output_err", "key_recon", "score_err", "prob_tv", "key_output_err",
           "value_recon", "value_output_err")


def _means(rows: list[dict[str, Any]]) -> dict[str, float]:
    def mean(tensor: str, metric: str) -> float:
        vals = [r[metric] for r in rows if r["tensor"] == tensor]
        return sum(vals) / len(vals)

    m = {
        "key_recon": mean("key", "recon"),
        "score_err": mean("key", "score_err"),
        "prob_tv": mean("key", "prob_tv"),
        "key_output_err": mean("key", "output_err"),
        "value_recon": mean("value", "recon"),
        "value_output_err": mean("value", "output_err"),
        "output_err": mean("value", "joint_output_err"),
    }
    m["recon"] = (m["key_recon"] + m["value_recon"]) / 2
    return {k: m[k] for k in METRICS}


def _ranking(scores: Mapping[str, float]) -> list[str]:
    return sorted(scores, key=lambda name: scores[name])


def _kendall_tau(order: Sequence[str], scores: Mapping[str, float]) -> float:
    """Kendall's tau between ``order`` (best first) and ascending ``scores``; ties count 0."""
    n, total = len(order), 0
    for i in range(n):
        for j in range(i + 1, n):
            diff = scores[order[j]] - scores[order[i]]
            total += (diff > 0) - (diff < 0)
    pairs = n * (n - 1) // 2
    return total / pairs if pairs else 1.0


def axis_study(
    model: nn.Module,
    input_ids: torch.Tensor,
    bits: int = 2,
    group_size: int = 32,
    reference_order: Sequence[str] | None = None,
) -> dict[str, Any]:
    """Compare the derived key/value axes with their flips, at the consumer.

    Policies: keys channel/token × pre/post-RoPE (``pre`` only where the model has RoPE;
    without RoPE the names drop the suffix) × values token/channel, named like
    ``K-channel-pre/V-token``. The derived policy's axes must be the same in every layer.

    Args:
        model, input_ids: as in :func:`capture_activations`.
        bits, group_size: as in :func:`~kvpolicy.calibrate.metrics.consumed_errors`.
        reference_order: policy names best first (e.g. ranked by perplexity); the summary
            then says which metrics rank those policies the same way, and Kendall's tau
            of each metric against it.

    Returns:
        ``{"derived": name, "policies": {name: {metric: mean over layers}}, "rankings":
        {metric: names best first}, "tau": {metric: tau} (with reference_order),
        "summary": one line, ...}`` with the metrics of :data:`METRICS`.
    """
    derived = derive_policy(model, bits=bits)
    key_axes = {t.axis.value for t in derived.tensors if t.tensor.value == "key"}
    value_axes = {t.axis.value for t in derived.tensors if t.tensor.value == "value"}
    if len(key_axes) != 1 or len(value_axes) != 1:
        raise KVPolicyError(
            f"derived axes differ across layers (keys {sorted(key_axes)}, values "
            f"{sorted(value_axes)}); axis_study compares one axis pair for the whole model"
        )
    k_axis, v_axis = key_axes.pop(), value_axes.pop()
    acts = capture_activations(model, input_ids)
    has_rope = any(a.cos is not None for a in acts)

    policies: dict[str, dict[str, float]] = {}
    for ka in (k_axis, _FLIP[k_axis]):
        for pre in (True, False) if has_rope else (False,):
            for va in (v_axis, _FLIP[v_axis]):
                choice = AxisChoice(ka, va, pre)
                name = choice.name if has_rope else f"K-{ka}/V-{va}"
                policies[name] = _means(consumed_errors(acts, choice, bits, group_size))
    rankings = {m: _ranking({n: p[m] for n, p in policies.items()}) for m in METRICS}
    result: dict[str, Any] = {
        "derived": next(iter(policies)),
        "bits": bits,
        "group_size": group_size,
        "tokens": int(acts[0].key.shape[2] // group_size * group_size),
        "policies": policies,
        "rankings": rankings,
    }
    if reference_order is not None:
        order = list(reference_order)
        unknown = [n for n in order if n not in policies]
        if unknown or len(set(order)) != len(order) or len(order) < 2:
            raise KVPolicyError(
                f"reference_order must name at least two distinct studied policies; "
                f"unknown {unknown}; studied: {list(policies)}"
            )
        tau = {m: _kendall_tau(order, {n: policies[n][m] for n in order}) for m in METRICS}
        agree = [m for m in METRICS if tau[m] == 1.0]
        result["tau"] = tau
        result["summary"] = (
            f"metrics ranking {' > '.join(order)} the same way: "
            f"{', '.join(agree) if agree else 'none'}; Kendall tau: "
            + ", ".join(f"{m} {tau[m]:+.2f}" for m in METRICS)
        )
    else:
        result["summary"] = _summary(policies, k_axis, v_axis, has_rope)
    return result


def _summary(
    policies: Mapping[str, Mapping[str, float]], k_axis: str, v_axis: str, has_rope: bool
) -> str:
    """How reconstruction and consumed error choose between the axes of each tensor."""
    pre = "-pre" if has_rope else ""
    k_ref, k_flip = f"K-{k_axis}{pre}", f"K-{_FLIP[k_axis]}{pre}"
    v_ref, v_flip = f"V-{v_axis}", f"V-{_FLIP[v_axis]}"

    def pick(a: str, b: str, name_a: str, name_b: str, metric: str) -> str:
        x, y = policies[a][metric], policies[b][metric]
        return f"{name_a} ({x:.3g} vs {y:.3g})" if x <= y else f"{name_b} ({y:.3g} vs {x:.3g})"

    base = f"{k_ref}/{v_ref}"
    v_other, k_other = f"{k_ref}/{v_flip}", f"{k_flip}/{v_ref}"
    joint = _ranking({n: p["output_err"] for n, p in policies.items()})
    return (
        f"values: reconstruction prefers {pick(base, v_other, v_ref, v_flip, 'value_recon')}, "
        f"output error prefers {pick(base, v_other, v_ref, v_flip, 'value_output_err')}; "
        f"keys: reconstruction prefers {pick(base, k_other, k_ref, k_flip, 'key_recon')}, "
        f"score error prefers {pick(base, k_other, k_ref, k_flip, 'score_err')}; "
        f"joint output error ranks {' < '.join(joint)}"
    )


_STUDY_NAMES = {
    "derived policy": ("K-channel-pre/V-token", "K-channel/V-token"),
    "K token / V token": ("K-token-pre/V-token", "K-token/V-token"),
    "K channel / V channel": ("K-channel-pre/V-channel", "K-channel/V-channel"),
    "K token / V channel": ("K-token-pre/V-channel", "K-token/V-channel"),
    "keys post-RoPE": ("K-channel-post/V-token", None),
}


def consumed_study(load, segs, context: int, bits: int, runs) -> dict[str, Any]:
    """Errors where each tensor is consumed, on the model's own activations of the first
    segment's prefill, for the derived axes and their flips; ranked against perplexity."""
    model = load()
    acts = capture_activations(model, segs[:1, :context])
    has_rope = acts[0].rope_style is not None
    ranked = sorted((r for r in runs if r.name in _STUDY_NAMES), key=lambda r: r.perplexity)
    order = [_STUDY_NAMES[r.name][0 if has_rope else 1] for r in ranked]
    order = [n for n in order if n is not None]
    study = axis_study(model, segs[:1, :context], bits=bits,
                       reference_order=order if len(order) >= 2 else None)
    # Per layer, the largest |pre-RoPE key| of each channel: the outlier channels.
    study["key_channel_absmax"] = [
        a.key_pre.abs().amax(dim=(0, 2)).reshape(-1).tolist() for a in acts
    ]
    study["perplexity_order"] = order
    # Per layer and tensor, for the derived axes and for both flipped (docs/design.md §3).
    study["per_layer"] = {
        choice.name: consumed_errors(acts, choice, bits=bits)
        for choice in (
            AxisChoice("channel", "token", has_rope),
            AxisChoice("token", "channel", has_rope),
        )
    }
    return study
