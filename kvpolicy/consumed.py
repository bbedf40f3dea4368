"""Quantization error measured where the cached tensor is consumed (DESIGN.md §3).

Reconstruction error of a stored tensor says little about what attention sees. This
module captures the real query, key (before and after RoPE) and value of every attention
layer during one forward of an *uncompiled* model, quantizes the stored tensor with the
reference quantizer, and reports the error at the consumer:

* keys: relative error of the pre-softmax scores ``q·kᵀ·scale`` and the mean total
  variation between the exact and the perturbed causal softmax rows;
* values: relative error of the attention output ``softmax(scores)·V`` with exact
  probabilities.

    acts = capture_activations(model, input_ids)
    rows = consumed_errors(acts, AxisChoice("channel", "token", key_pre_rope=True), bits=2)
    study = axis_study(model, input_ids, bits=2)   # derived axes and their flips

What the capture relies on (no module names are matched):

* the attention modules are the ones :func:`kvpolicy.analyse_model` finds (the innermost
  module active when the consumer runs);
* the consumer is ``torch.nn.functional.scaled_dot_product_attention`` (the transformers
  default; models loaded with ``attn_implementation="eager"`` are refused) and its q, k, v
  arguments are ``[B, H, T, D]``, called once per module per forward; GQA keys/values
  expanded by head repetition (``repeat_kv``) are folded back to the kv heads;
* where the analysis found RoPE on the key path, cos/sin are read from the module's call
  arguments at the path the analysis recorded (``RopeFacts.cos_source``, e.g.
  ``kwargs['position_embeddings'][0]``); pre-RoPE keys are the post-RoPE keys rotated
  back by the inverse rotation, which is exact when the two channels of a rotated pair
  share one angle (true for rotate-half and interleaved RoPE).

Errors are computed for a causal LM over whole groups of the captured tokens: no
full-precision residual window and no sinks, ``T`` trimmed to a multiple of the group size.
The consumer's own mask is not replayed: every layer is scored with a plain causal mask
(``LayerActivations.meta`` records whether SDPA got ``is_causal`` or a mask), so padding
and sliding windows are not modelled. One forward gives prefill activations only; the
cache-built-over-time evaluation of DESIGN §3 is a different measurement.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

from .api import analyse_model, derive_policy
from .errors import AnalysisError, KVPolicyError
from .facts import RopeFacts, RopeStyle
from .kernels import reference
from .kernels.layout import QuantSpec, RotarySpec
from .policy import ModelPolicy

__all__ = [
    "AxisChoice",
    "LayerActivations",
    "capture_activations",
    "consumed_errors",
    "axis_study",
]

_EPS = 1e-30  # keeps a relative error finite for an all-zero reference


@dataclass
class LayerActivations:
    """Tensors of one attention layer as its consumer saw them (fp32, detached).

    ``rope_style``/``cos``/``sin`` are None for a layer without RoPE on the key path, and
    then ``key_pre is key``.
    """

    layer: int
    query: torch.Tensor  # [B, Hq, T, D] after RoPE
    key_pre: torch.Tensor  # [B, Hkv, T, D] before RoPE
    key: torch.Tensor  # [B, Hkv, T, D] after RoPE (what q·kᵀ reads)
    value: torch.Tensor  # [B, Hkv, T, Dv]
    scale: float  # multiplies q·kᵀ
    rope_style: str | None = None  # "rotate_half" | "interleaved"
    rotary_dim: int | None = None
    cos: torch.Tensor | None = None  # [B, T, rotary_dim], the model's layout
    sin: torch.Tensor | None = None  # [B, T, rotary_dim]
    # [B, Hq, T, Dv]: d(summed next-token loss)/d(attention output), when captured with
    # ``loss_grad=True``
    out_grad: torch.Tensor | None = None
    meta: dict[str, Any] = field(default_factory=dict)

    def rotary(self, tokens: int | None = None) -> tuple[RotarySpec, torch.Tensor]:
        """A :class:`RotarySpec` over the first ``tokens`` tokens and its ``[B, T]`` positions.

        Each (batch row, token) gets its own table row, so batch rows may use different
        positions.
        """
        if self.cos is None or self.sin is None or self.rope_style is None:
            raise KVPolicyError(f"layer {self.layer} has no RoPE on its key path")
        t = self.cos.shape[1] if tokens is None else tokens
        b, r = self.cos.shape[0], self.cos.shape[-1]
        cos = self.cos[:, :t].reshape(b * t, r)
        sin = self.sin[:, :t].reshape(b * t, r)
        positions = torch.arange(b * t, device=cos.device).view(b, t)
        return RotarySpec(self.rope_style, r, cos, sin), positions  # type: ignore[arg-type]


# --------------------------------------------------------------------------- capture


_PATH_STEP = re.compile(r"\[(?:'([^']*)'|(\d+))\]")


def _resolve(path: str, args: tuple, kwargs: dict) -> Any:
    """Follow an argument path like ``kwargs['position_embeddings'][0]`` or ``args[1]``."""
    root, _, rest = path.partition("[")
    if root not in ("args", "kwargs"):
        raise AnalysisError(
            f"RoPE cos/sin come from {path!r}, not from the attention module's call "
            "arguments; capture_activations can only read tables passed to the module"
        )
    obj: Any = args if root == "args" else kwargs
    for key, index in _PATH_STEP.findall("[" + rest):
        try:
            obj = obj[key] if key else obj[int(index)]
        except (KeyError, IndexError, TypeError) as exc:
            raise AnalysisError(f"cannot follow {path!r} in the module's call: {exc}") from exc
    if not isinstance(obj, torch.Tensor):
        raise AnalysisError(f"{path!r} is a {type(obj).__name__}, expected a tensor")
    return obj


def _table(x: torch.Tensor, rope: RopeFacts, batch: int, tokens: int) -> torch.Tensor:
    """A cos or sin argument -> ``[B, T, rotary_dim]`` in the layout the rotation uses."""
    x = x.detach().float()
    while x.dim() > 3:  # [B, 1, T, r] or [B, T, 1, r]: drop broadcast head dims
        x = x.squeeze(1) if x.shape[1] == 1 else x.squeeze(2)
    if x.dim() == 2:
        x = x.unsqueeze(0)
    r = rope.rotary_dim
    if x.shape[-1] == r // 2:  # one entry per pair: expand the way the style pairs channels
        if rope.style is RopeStyle.ROTATE_HALF:
            x = torch.cat((x, x), dim=-1)
        else:
            x = x.repeat_interleave(2, dim=-1)
    if x.dim() != 3 or x.shape[-1] != r or x.shape[-2] != tokens:
        raise AnalysisError(
            f"RoPE table of shape {tuple(x.shape)} does not fit {tokens} tokens x "
            f"rotary_dim={r}"
        )
    return x.expand(batch, tokens, r)


def _fold_heads(x: torch.Tensor, kv_heads: int, what: str) -> torch.Tensor:
    """``[B, Hq, T, D]`` repeated per query group (``repeat_kv``) -> ``[B, Hkv, T, D]``."""
    b, h, t, d = x.shape
    if h == kv_heads:
        return x
    if h % kv_heads:
        raise AnalysisError(f"{what} has {h} heads, not a multiple of {kv_heads} kv heads")
    grouped = x.view(b, kv_heads, h // kv_heads, t, d)
    first = grouped[:, :, :1]
    if not torch.equal(grouped, first.expand_as(grouped)):
        raise AnalysisError(
            f"{what} has {h} heads that are not {kv_heads} kv heads each repeated "
            f"{h // kv_heads} times"
        )
    return first.squeeze(2).contiguous()


class _SDPAWatch(TorchFunctionMode):
    """Records the arguments of every ``scaled_dot_product_attention`` run inside a
    watched module (``active`` holds the layer index of the one running)."""

    def __init__(self, active: list[int], seen: dict[int, tuple[tuple, dict]],
                 probes: dict[int, torch.Tensor] | None = None) -> None:
        super().__init__()
        self.active, self.seen, self.probes = active, seen, probes

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention and self.active:
            layer = self.active[-1]
            if layer in self.seen:
                raise AnalysisError(
                    f"attention layer {layer} ran scaled_dot_product_attention twice in one "
                    "forward; capture_activations expects one consumer call per layer"
                )
            self.seen[layer] = (args, dict(kwargs))
            out = func(*args, **kwargs)
            if self.probes is None:
                return out
            # A zero leaf added to the output: its gradient is the loss's gradient with
            # respect to this output, along every path downstream (later layers included).
            probe = torch.zeros_like(out, requires_grad=True)
            self.probes[layer] = probe
            return out + probe
        return func(*args, **kwargs)


def _sdpa_arg(args: tuple, kwargs: dict, index: int, name: str, default: Any) -> Any:
    if len(args) > index:
        return args[index]
    return kwargs.get(name, default)


_RELATIVE_HINT = (
    "or measure the plain relative output error, which needs no backward: "
    "cal = kvpolicy.budget.calibrate(model, kvpolicy.derive_policy(model, bits=2), ids, "
    "metric='relative'), then compile_model(model, bits=<budget>, calibration=cal)"
)


def _loss_grads(out: Any, input_ids: torch.Tensor,
                probes: dict[int, torch.Tensor]) -> dict[int, torch.Tensor]:
    """Per layer, the gradient of the summed next-token cross-entropy of ``input_ids``
    with respect to its probe (the attention output), from the forward's output ``out``
    (an HF output with ``.logits``, a tensor, or a tuple starting with one); fp32."""
    logits = getattr(out, "logits", None)
    if logits is None:
        logits = out if isinstance(out, torch.Tensor) else (
            out[0] if isinstance(out, (tuple, list)) and out else None)
    if not isinstance(logits, torch.Tensor) or logits.dim() != 3:
        raise KVPolicyError(
            f"the model's forward returned {type(out).__name__}, not [B, T, vocab] logits; "
            "the loss-weighted calibration needs a causal LM's logits (an output with "
            f"`.logits`, a tensor, or a tuple starting with one); {_RELATIVE_HINT}"
        )
    largest = int(input_ids.max())
    if logits.shape[:2] != input_ids.shape or logits.shape[-1] <= largest:
        raise KVPolicyError(
            f"the model's output of shape {tuple(logits.shape)} is not next-token logits "
            f"over a vocabulary that holds every calibration id (ids {tuple(input_ids.shape)},"
            f" largest {largest}); the loss-weighted calibration needs a causal LM's "
            f"[B, T, vocab] logits; {_RELATIVE_HINT}"
        )
    logits = logits[:, :-1].float()
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), input_ids[:, 1:].reshape(-1),
                           reduction="sum")
    layers = sorted(probes)
    found = torch.autograd.grad(loss, [probes[i] for i in layers], allow_unused=True)
    return {i: (torch.zeros_like(probes[i]) if g is None else g).detach().float()
            for i, g in zip(layers, found, strict=True)}


def capture_activations(
    model: nn.Module, input_ids: torch.Tensor, *, loss_grad: bool = False
) -> list[LayerActivations]:
    """Run one forward of ``model`` on ``input_ids`` and capture every layer's q, k, v.

    Args:
        model: an uncompiled causal LM whose attention calls
            ``scaled_dot_product_attention`` (see the module docstring for what is relied on).
        input_ids: ``[B, T]`` token ids.
        loss_grad: also run one backward of the summed next-token cross-entropy of
            ``input_ids`` and keep, per layer, its gradient with respect to the attention
            output (``LayerActivations.out_grad``). Parameter gradients are neither
            computed nor touched.

    Returns:
        One :class:`LayerActivations` per attention layer, in layer order; tensors fp32 on
        the model's device.

    Raises:
        KVPolicyError: the model is compiled by kvpolicy, ``input_ids`` is not 2-D, or
            (``loss_grad``) the forward does not return logits or the model was built under
            ``torch.inference_mode()``.
        AnalysisError: a layer's attention did not run SDPA, or RoPE tables could not be
            found or do not invert.
    """
    if getattr(model, "_kvpolicy_compiled", None) is not None:
        raise KVPolicyError(
            f"{type(model).__name__} is compiled by kvpolicy; capture activations on the "
            "original (uncompiled) model: consumed_errors applies the policy itself"
        )
    if input_ids.dim() != 2:
        raise KVPolicyError(f"input_ids must be [B, T], got shape {tuple(input_ids.shape)}")
    if loss_grad and any(t.is_inference() for t in (*model.parameters(), *model.buffers())):
        raise KVPolicyError(
            f"{type(model).__name__} was built under torch.inference_mode(), so no gradient "
            "can flow through it; build or load the model outside inference mode (calling "
            f"compile_model inside inference mode is fine); {_RELATIVE_HINT}"
        )
    analysis = analyse_model(model)
    active: list[int] = []
    calls: dict[int, tuple[tuple, dict]] = {}
    seen: dict[int, tuple[tuple, dict]] = {}
    handles = []
    for i, mod in enumerate(analysis.modules):

        def pre(mod, args, kwargs, i=i):
            active.append(i)
            calls.setdefault(i, (args, kwargs))

        def post(mod, args, kwargs, out):
            active.pop()

        handles.append(mod.register_forward_pre_hook(pre, with_kwargs=True))
        handles.append(mod.register_forward_hook(post, with_kwargs=True))
    probes: dict[int, torch.Tensor] | None = {} if loss_grad else None
    grads: dict[int, torch.Tensor] = {}
    was_training = model.training
    model.eval()
    try:
        with torch.inference_mode(False), torch.set_grad_enabled(loss_grad), \
                _SDPAWatch(active, seen, probes):
            if loss_grad:  # a tensor made in inference mode cannot be saved for backward
                input_ids = input_ids.clone()
            out = model(input_ids)
            if probes:
                grads = _loss_grads(out, input_ids, probes)
            del out
    finally:
        for h in handles:
            h.remove()
        model.train(was_training)

    out: list[LayerActivations] = []
    for facts in analysis.layers:
        i = facts.layer
        if i not in seen:
            raise AnalysisError(
                f"attention layer {i} did not call scaled_dot_product_attention; load the "
                "model with attn_implementation='sdpa' to capture its activations"
            )
        args, kwargs = seen[i]
        q = _sdpa_arg(args, kwargs, 0, "query", None).detach().to(torch.float32, copy=True)
        k = _sdpa_arg(args, kwargs, 1, "key", None).detach().to(torch.float32, copy=True)
        v = _sdpa_arg(args, kwargs, 2, "value", None).detach().to(torch.float32, copy=True)
        if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
            raise AnalysisError(
                f"layer {i}: SDPA arguments of shapes {tuple(q.shape)}, {tuple(k.shape)}, "
                f"{tuple(v.shape)}; expected [B, H, T, D]"
            )
        scale = _sdpa_arg(args, kwargs, 6, "scale", None)
        scale = float(scale) if scale is not None else 1.0 / math.sqrt(q.shape[-1])
        hkv = facts.key.num_kv_heads
        k = _fold_heads(k, hkv, f"layer {i} key")
        v = _fold_heads(v, facts.value.num_kv_heads, f"layer {i} value")
        act = LayerActivations(layer=i, query=q, key_pre=k, key=k, value=v, scale=scale,
                               out_grad=grads.get(i))
        act.meta["is_causal"] = bool(_sdpa_arg(args, kwargs, 5, "is_causal", False))
        act.meta["has_mask"] = _sdpa_arg(args, kwargs, 3, "attn_mask", None) is not None
        rope = facts.key.rope
        if rope is not None:
            if rope.style is RopeStyle.COMPLEX or rope.sin_source is None:
                raise AnalysisError(
                    f"layer {i}: {rope.description} passes one complex table; "
                    "capture_activations reads separate cos/sin tables only"
                )
            margs, mkwargs = calls[i]
            b, _, t, _ = k.shape
            cos = _table(_resolve(rope.cos_source, margs, mkwargs), rope, b, t).to(k.device)
            sin = _table(_resolve(rope.sin_source, margs, mkwargs), rope, b, t).to(k.device)
            act.rope_style, act.rotary_dim, act.cos, act.sin = (
                rope.style.value, rope.rotary_dim, cos, sin,
            )
            act.key_pre = _unrotate(act, k)
        out.append(act)
    return out


def _unrotate(act: LayerActivations, k: torch.Tensor) -> torch.Tensor:
    """Invert the rotation: per pair ``[[c, -s], [s, c]]⁻¹ = [[c, s], [-s, c]] / (c² + s²)``,
    which is the same rotation with ``(c, -s) / (c² + s²)`` (also undoes a cos/sin
    attention scaling)."""
    spec, positions = act.rotary()
    norm = spec.cos.square() + spec.sin.square()
    if bool((norm <= 0).any()):
        raise AnalysisError(f"layer {act.layer}: RoPE rows with cos = sin = 0 do not invert")
    inverse = RotarySpec(spec.style, spec.rotary_dim, spec.cos / norm, -spec.sin / norm)
    return reference.apply_rope(k, positions, inverse)


# --------------------------------------------------------------------------- errors


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


def _rel(approx: torch.Tensor, exact: torch.Tensor) -> float:
    return float((approx - exact).norm() / exact.norm().clamp_min(_EPS))


def _roundtrip(x: torch.Tensor, spec: QuantSpec, store: torch.dtype | None = None) -> torch.Tensor:
    """Quantize and dequantize (fp32); ``store``: the dtype scales and zeros are kept in."""
    return reference.dequantize(reference.quantize(x, spec, store), spec, torch.float32)


def _expand(x: torch.Tensor, hq: int) -> torch.Tensor:
    return x.repeat_interleave(hq // x.shape[1], dim=1)


def _causal_mask(t: int, device: torch.device) -> torch.Tensor:
    keep = torch.ones(t, t, dtype=torch.bool, device=device).tril()
    return torch.zeros(t, t, device=device).masked_fill(~keep, float("-inf"))


def _scores(q: torch.Tensor, k: torch.Tensor, scale: float) -> torch.Tensor:
    return torch.matmul(q, _expand(k, q.shape[1]).transpose(-1, -2)) * scale


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
    mask = _causal_mask(t, q.device)
    causal = torch.isfinite(mask).float()
    scores = _scores(q, k, act.scale)
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
        acts: from :func:`capture_activations`.
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
        k_hat = _roundtrip(k_stored, QuantSpec(bits, group_size, key_axis))  # type: ignore[arg-type]
        recon_k = _rel(k_hat, k_stored)
        if pre_rope:
            spec, positions = act.rotary(t)
            k_hat = reference.apply_rope(k_hat, positions, spec)
        scores_hat = _scores(q, k_hat, act.scale)
        probs_hat = torch.softmax(scores_hat + mask, dim=-1)
        out_k, _ = reference.attention_partial(q, k_hat, v, scale=act.scale, mask=mask)
        rows.append(dict(
            layer=act.layer, tensor="key", axis=key_axis, pre_rope=pre_rope, bits=bits,
            tokens=t, recon=recon_k,
            score_err=_rel(scores_hat * causal, scores * causal),
            prob_tv=float(0.5 * (probs_hat - probs).abs().sum(-1).mean()),
            output_err=_rel(out_k, out),
        ))

        v_hat = _roundtrip(v, QuantSpec(bits, group_size, value_axis))  # type: ignore[arg-type]
        out_v = torch.matmul(probs, _expand(v_hat, q.shape[1]))
        out_kv = torch.matmul(probs_hat, _expand(v_hat, q.shape[1]))
        rows.append(dict(
            layer=act.layer, tensor="value", axis=value_axis, pre_rope=False, bits=bits,
            tokens=t, recon=_rel(v_hat, v), score_err=None, prob_tv=None,
            output_err=_rel(out_v, out), joint_output_err=_rel(out_kv, out),
        ))
    return rows


# --------------------------------------------------------------------------- study

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
        bits, group_size: as in :func:`consumed_errors`.
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
