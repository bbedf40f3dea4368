"""Activations captured where each cached tensor is consumed (docs/design.md §3).

One forward of an *uncompiled* model records the real query, key (before and after RoPE)
and value of every attention layer as its consumer saw them, and optionally the gradient of
the next-token loss with respect to every attention output; :mod:`kvpolicy.calibrate.metrics`
measures quantization errors on them and :mod:`kvpolicy.calibrate.budget` allocates bits.
Without the gradient the forward stops after the last attention layer: the model's head
and its ``[B, T, vocab]`` logits (100 MB for 512 tokens of SmolLM2 in fp32) are never built.

    acts = capture_activations(model, input_ids)

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
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

from ..errors import AnalysisError, KVPolicyError
from ..kernels import reference
from ..kernels.layout import RotarySpec
from ..passes.analyse import analyse_model
from ..passes.facts import RopeFacts, RopeStyle
from ..state import compiled_of

__all__ = [
    "LayerActivations",
    "capture_activations",
    "reduce_activations",
]

R = TypeVar("R")


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

    def __init__(self, active: list[int], seen: dict[int, tuple[tuple, dict] | None],
                 probes: dict[int, torch.Tensor] | None = None,
                 each: Callable[[int], None] | None = None) -> None:
        super().__init__()
        self.active, self.seen, self.probes, self.each = active, seen, probes, each

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
            if self.each is not None:  # consumed now (reduce_activations); nothing is kept
                self.each(layer)
                return out
            if self.probes is None:
                return out
            # A zero leaf added to the output: its gradient is the loss's gradient with
            # respect to this output, along every path downstream (later layers included).
            probe = torch.zeros_like(out, requires_grad=True)
            self.probes[layer] = probe
            return out + probe
        return func(*args, **kwargs)


class _AllCaptured(Exception):
    """Raised from the last attention layer's forward hook when no gradient is wanted: the
    rest of the forward (the remaining blocks, the ``[B, T, vocab]`` logits) would only
    cost memory."""


def _sdpa_arg(args: tuple, kwargs: dict, index: int, name: str, default: Any) -> Any:
    if len(args) > index:
        return args[index]
    return kwargs.get(name, default)


_RELATIVE_HINT = (
    "or measure the plain relative output error, which needs no backward: "
    "cal = kvpolicy.calibrate.budget.calibrate(model, kvpolicy.derive_policy(model, bits=2), ids, "
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
        the model's device. Every layer's activations are held at once; where only a
        statistic of each layer is needed, :func:`reduce_activations` keeps one layer's.

    Raises:
        KVPolicyError: the model is compiled by kvpolicy, ``input_ids`` is not 2-D, or
            (``loss_grad``) the forward does not return logits or the model was built under
            ``torch.inference_mode()``.
        AnalysisError: a layer's attention did not run SDPA, or RoPE tables could not be
            found or do not invert.
    """
    analysis, seen, calls, grads = _capture(model, input_ids, loss_grad)
    out: list[LayerActivations] = []
    for facts in analysis.layers:
        i = facts.layer
        _check_seen(seen, i)
        args, kwargs = seen.pop(i)  # the model's own tensors go as their fp32 copies come
        out.append(_layer_activations(facts, args, kwargs, calls[i], grads.get(i)))
    return out


def reduce_activations(model: nn.Module, input_ids: torch.Tensor,
                       fn: Callable[[LayerActivations], R]) -> dict[int, R]:
    """``{layer: fn(activations of that layer)}`` from one forward of ``model`` (no gradient).

    Each layer's :class:`LayerActivations` (as :func:`capture_activations` builds them) is
    made as its attention runs, handed to ``fn`` and dropped, so the forward holds one
    layer's fp32 copies and ``fn``'s results instead of every layer's q, k and v (on
    SmolLM2 at 512 tokens, about 80 MB less). Raises what :func:`capture_activations` does,
    and what ``fn`` raises.
    """
    results: dict[int, R] = {}

    def consume(act: LayerActivations) -> None:
        results[act.layer] = fn(act)

    analysis, seen, _, _ = _capture(model, input_ids, False, consume)
    for facts in analysis.layers:
        _check_seen(seen, facts.layer)
    return results


def _capture(model: nn.Module, input_ids: torch.Tensor, loss_grad: bool,
             consume: Callable[[LayerActivations], None] | None = None):
    """The forward (and backward) of :func:`capture_activations`: ``(analysis, {layer:
    SDPA (args, kwargs)}, {layer: the module's call (args, kwargs)}, {layer: loss
    gradient})``. With ``consume`` (no gradient), each layer's activations are built and
    handed to it as its SDPA returns; its entry in ``seen`` is then None (one call per layer
    is still checked) and its call is dropped, so nothing of it is kept."""
    if compiled_of(model) is not None:
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
    seen: dict[int, tuple[tuple, dict] | None] = {}
    probes: dict[int, torch.Tensor] | None = {} if loss_grad else None
    handles = []
    for i, mod in enumerate(analysis.modules):

        def pre(mod, args, kwargs, i=i):
            active.append(i)
            calls.setdefault(i, (args, kwargs))

        def post(mod, args, kwargs, out):
            active.pop()
            if probes is None and len(seen) == len(analysis.modules):
                raise _AllCaptured  # nothing after the last attention layer is needed

        handles.append(mod.register_forward_pre_hook(pre, with_kwargs=True))
        handles.append(mod.register_forward_hook(post, with_kwargs=True))
    grads: dict[int, torch.Tensor] = {}
    each = None
    if consume is not None:
        facts_of = {f.layer: f for f in analysis.layers}

        def each(i: int) -> None:
            args, kwargs = seen[i]
            seen[i] = None
            consume(_layer_activations(facts_of[i], args, kwargs, calls.pop(i), None))

    was_training = model.training
    model.eval()
    try:
        with torch.inference_mode(False), torch.set_grad_enabled(loss_grad), \
                _SDPAWatch(active, seen, probes, each):
            if loss_grad:  # a tensor made in inference mode cannot be saved for backward
                input_ids = input_ids.clone()
            out = model(input_ids)
            if probes:
                grads = _loss_grads(out, input_ids, probes)
            del out
    except _AllCaptured:
        pass  # the forward stopped after the last attention layer (no logits are built)
    finally:
        for h in handles:
            h.remove()
        model.train(was_training)
    return analysis, seen, calls, grads


def _check_seen(seen: dict, layer: int) -> None:
    if layer not in seen:
        raise AnalysisError(
            f"attention layer {layer} did not call scaled_dot_product_attention; load the "
            "model with attn_implementation='sdpa' to capture its activations"
        )


def _layer_activations(facts: Any, args: tuple, kwargs: dict, call: tuple[tuple, dict],
                       grad: torch.Tensor | None) -> LayerActivations:
    """One layer's :class:`LayerActivations` from its SDPA arguments and the module's call
    (where the RoPE tables are read)."""
    i = facts.layer
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
    k = _fold_heads(k, facts.key.num_kv_heads, f"layer {i} key")
    v = _fold_heads(v, facts.value.num_kv_heads, f"layer {i} value")
    act = LayerActivations(layer=i, query=q, key_pre=k, key=k, value=v, scale=scale,
                           out_grad=grad)
    act.meta["is_causal"] = bool(_sdpa_arg(args, kwargs, 5, "is_causal", False))
    act.meta["has_mask"] = _sdpa_arg(args, kwargs, 3, "attn_mask", None) is not None
    rope = facts.key.rope
    if rope is not None:
        if rope.style is RopeStyle.COMPLEX or rope.sin_source is None:
            raise AnalysisError(
                f"layer {i}: {rope.description} passes one complex table; "
                "capture_activations reads separate cos/sin tables only"
            )
        margs, mkwargs = call
        b, _, t, _ = k.shape
        cos = _table(_resolve(rope.cos_source, margs, mkwargs), rope, b, t).to(k.device)
        sin = _table(_resolve(rope.sin_source, margs, mkwargs), rope, b, t).to(k.device)
        act.rope_style, act.rotary_dim, act.cos, act.sin = (
            rope.style.value, rope.rotary_dim, cos, sin,
        )
        act.key_pre = _unrotate(act, k)
    return act


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
