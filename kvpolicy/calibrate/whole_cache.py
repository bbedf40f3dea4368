"""Whole-cache budgets: the bits a layer holds, and its recent window chosen per layer.

A stored-bits budget with ``budget_context`` L counts everything a layer holds after L
tokens (``policies.footprint``'s schedule): the packed body, the sinks at 16 bits, and the
recent window (the residual and the incomplete chunk) at ``residual_bits``.
:func:`whole_cache_sizes` gives that size for a layer's key and value options together.

Where the spec writes neither ``residual`` nor ``residual_bits``
(``ModelPolicy.window_choices``), the window of each global layer is an option too: a
``(tokens, bits)`` pair from the choices, allocated with the layer's key and value
(``allocate_joint``). A larger window keeps more of what attention reads most in full
precision, and costs bytes the body then lacks; an 8-bit window costs half the bytes of a
16-bit one and a little error. The calibration prices each choice per layer and tensor
(:func:`measure`), against a reference body (:data:`REFERENCE_BITS`, uniform, min-max, the
tensor's own group and axis, no rotation), on the last :data:`PRICED_ROWS` query rows of
the calibration text joined into one row (the longest context the text gives: what a window
saves shrinks as the context grows, and 512-token rows overrated it):

``body``
    the error with the reference body and the choice's recent tokens exact;
``window``
    the error with those recent tokens alone at the choice's width (0 at 16 bits).

The cost of a layer at body options ``(k, v)`` and choice ``c`` (:func:`joint_cost`) scales
each tensor's measured body error (taken at the policy's own window, ``residual``) by how
much the choice's window changes the reference body's error, and adds the window's own::

    e_k(k) · body_k(c) / body_k(own) + e_v(v) · body_v(c) / body_v(own)
        + window_k(c) + window_v(c)

A local layer keeps the window its share of its sliding window gives it
(``policies.derive.local_residuals``): the calibration scores every layer with a plain
causal mask, so a local layer's reads are not what it measures.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from fractions import Fraction

import torch

from ..errors import KVPolicyError, PolicyError
from ..kernels import reference
from ..kernels.layout import QuantSpec, vq_dim
from ..kernels.masks import causal_mask
from ..policies import Calibration, ModelPolicy, TensorPolicy
from ..policies.footprint import held_tokens
from ..runtime.recent import recent_spec
from .allocate import Option, exact_stored_bits
from .capture import LayerActivations
from .metrics import (
    attention_scores,
    expand_heads,
    fisher_error,
    packed_counts,
    relative_error,
    roundtrip,
)

__all__ = ["PRICED_ROWS", "REFERENCE_BITS", "body_bits", "chunk_of", "is_vq", "joint_cost",
           "layer_pairs", "measure", "window_tables", "window_text", "whole_cache_sizes"]

Choice = tuple[int, int]  # (recent tokens, their bits)
Rows = list[tuple[float, float]]  # per choice: (body error, window error)

# The body a window choice is priced against: the width most whole-cache budgets give.
REFERENCE_BITS = 2
# ... on the last this many query rows of the calibration text joined into one row (2,048
# tokens by default: a window of 128 is 6-8% of what those rows read, where on the 512-token
# rows the body is measured on it was a quarter to most of it).
PRICED_ROWS = 512


# --------------------------------------------------------------------------- sizes


def layer_pairs(policy: ModelPolicy) -> list[tuple[TensorPolicy, TensorPolicy]]:
    """Each layer's (key, value) policies (tensors are in layer order, key first)."""
    t = policy.tensors
    return [(t[i], t[i + 1]) for i in range(0, len(t), 2)]


def is_vq(o: Option) -> bool:
    """An option of vector-quantized values ``(width, head_dim, 8, 1)``: its fourth field
    is the metadata count per group."""
    return len(o) > 3


def chunk_of(pair: tuple[TensorPolicy, TensorPolicy], opts: Sequence[Option]) -> int:
    """The packing chunk of a layer at these options: the lcm of their token groups (a
    tensor grouped per channel and quantized groups ``group`` tokens, else 1)."""
    return math.lcm(*(o[1] if t.axis.value == "channel" and o[0] < 16 else 1
                      for t, o in zip(pair, opts[:2], strict=True)))


def body_bits(pair: tuple[TensorPolicy, TensorPolicy], opts: Sequence[Option],
              meta: list[int], layer: int) -> Fraction:
    """Stored bits of one packed token of the layer at these options (an option's own
    metadata width where it names one, else the tensor's ``meta``)."""
    return sum((t.elements_per_token * exact_stored_bits(
        o[0], o[1], o[2] if len(o) > 2 else meta[2 * layer + j], o[3] if is_vq(o) else 2)
        for j, (t, o) in enumerate(zip(pair, opts[:2], strict=True))), Fraction(0))


def _book_bits(pair: tuple[TensorPolicy, TensorPolicy], opts: Sequence[Option]) -> int:
    """Bits of the vq centroids a layer holds at these options (fp16, whatever the
    context)."""
    return sum(16 * t.num_kv_heads * 256 * vq_dim(o[0])
               for t, o in zip(pair, opts[:2], strict=True) if is_vq(o))


def whole_cache_sizes(policy: ModelPolicy, meta: list[int], context: int
                      ) -> tuple[Callable[[int, tuple], int], int]:
    """For a whole-cache budget at ``context`` tokens: ``size(layer, (key option, value
    option[, window choice]))``, the bits that layer holds (policies.footprint's schedule;
    sinks at 16 bits, residual and incomplete chunk at ``residual_bits``, or at the
    choice's ``(tokens, bits)`` where one is given, None meaning the policy's own), and
    the elements every layer keeps whatever the options (what an fp16 cache holds)."""
    pairs = layer_pairs(policy)
    windows = policy.windows or (None,) * len(pairs)
    per_token: dict[tuple[int, int], float] = {}  # (tensor, bits): bytes per recent token

    def recent_bytes(i: int, t: TensorPolicy, bits: int) -> float:
        if (i, bits) not in per_token:
            per_token[(i, bits)] = t.model_copy(
                update={"residual_bits": bits}).residual_bytes_per_token()
        return per_token[(i, bits)]

    def size(layer: int, opts: tuple) -> int:
        (key, value), window = pairs[layer], windows[layer]
        full = all(o[0] >= 16 for o in opts[:2])
        choice = opts[2] if len(opts) > 2 else None
        residual = key.residual if choice is None else choice[0]
        held = held_tokens(context, 0, context, 1, window) if full else held_tokens(
            context, key.sinks, residual, chunk_of(pairs[layer], opts), window)
        fp = held.sinks * (key.elements_per_token + value.elements_per_token)
        recent = held.residual * 8 * sum(
            2 * t.elements_per_token if full
            else recent_bytes(2 * layer + j, t, t.residual_bits if choice is None
                              else choice[1])
            for j, t in enumerate(pairs[layer]))
        return math.ceil(held.packed * body_bits(pairs[layer], opts, meta, layer) + 16 * fp
                         + recent + _book_bits(pairs[layer], opts))

    elements = sum(held_tokens(context, 0, context, 1, w).total
                   * (k.elements_per_token + v.elements_per_token)
                   for (k, v), w in zip(pairs, windows, strict=True))
    return size, elements


# --------------------------------------------------------------------------- measure


def _reference(t: TensorPolicy) -> QuantSpec:
    return QuantSpec(REFERENCE_BITS, t.group_size, t.axis.value)  # type: ignore[arg-type]


@torch.no_grad()
def measure(act: LayerActivations, kp: TensorPolicy, vp: TensorPolicy, store: torch.dtype,
            choices: Sequence[Choice], metric: str = "fisher", rows: int | None = None
            ) -> tuple[Rows, Rows]:
    """Per window choice, ``(body, window)`` errors of the layer's key and of its value
    (module docstring), each tensor alone, summed over the rows that read packed tokens
    under every choice (``rows``: only the last that many of them)."""
    q, k, v = act.query, act.key, act.value
    b, hq, t, _ = q.shape
    sinks = kp.sinks
    chunk = math.lcm(*(x.group_size if x.axis.value == "channel" and not
                       x.pinned_full_precision else 1 for x in (kp, vp)))
    sizes = sorted({c[0] for c in choices} | {kp.residual})
    packed = {r: packed_counts(t, sinks, r, chunk).to(q.device) for r in sizes}
    steady = packed[sizes[-1]] > 0
    if not bool(steady.any()):
        raise KVPolicyError(
            f"layer {act.layer}: {t} calibration tokens never leave a recent window of "
            f"{sizes[-1]} (sinks {sinks}, chunk {chunk}); calibrate on at least "
            f"{sinks + sizes[-1] + chunk} tokens"
        )
    r0 = int(steady.nonzero()[0])
    if rows is not None:
        r0 = max(r0, t - rows)
    n = int(packed[sizes[0]][-1])  # the most tokens any choice packs
    body = slice(sinks, sinks + n)
    cols = torch.arange(t, device=q.device)[None, :]
    mask = causal_mask(t, t, q.device)[r0:]
    seen = mask == 0  # [rows, t]
    q_r = q[:, :, r0:]
    scores = attention_scores(q_r, k, act.scale)
    probs = torch.softmax(scores + mask, dim=-1)
    v_heads = expand_heads(v, hq)
    out = torch.matmul(probs, v_heads)
    grad = None if act.out_grad is None else act.out_grad[:, :, r0:]

    def error(approx: torch.Tensor) -> float:
        if metric == "fisher":
            return fisher_error(approx - out, grad)
        return relative_error(approx, out)

    pre_rope = kp.pre_rope and act.cos is not None
    rope, positions = act.rotary(t) if pre_rope else (None, None)
    stored = act.key_pre if pre_rope else k

    def keys_at(spec: QuantSpec, span: slice) -> torch.Tensor:
        x = roundtrip(stored[:, :, span].contiguous(), spec, store)
        return reference.apply_rope(x, positions[:, span], rope) if pre_rope else x

    def value_change(spec: QuantSpec, span: slice) -> torch.Tensor:
        return expand_heads(roundtrip(v[:, :, span].contiguous(), spec, store)
                            - v[:, :, span], hq)

    # Per recent-window size: which (row, column) a query reads packed, and which recent.
    reads_packed = {r: (cols >= sinks) & (cols < sinks + packed[r][r0:, None]) for r in sizes}

    def key_error(scored: torch.Tensor, where: torch.Tensor, span: slice) -> float:
        s = scores.clone()
        s[..., span] = torch.where(where[:, span], scored, scores[..., span])
        return error(torch.matmul(torch.softmax(s + mask, dim=-1), v_heads))

    def value_error(dv: torch.Tensor, where: torch.Tensor, span: slice) -> float:
        return error(out + torch.matmul(probs[..., span] * where[:, span], dv))

    bodies: dict[int, tuple[float, float]] = {}
    k_ref = attention_scores(q_r, keys_at(_reference(kp), body), act.scale)
    dv_ref = value_change(_reference(vp), body)
    for r in sizes:
        bodies[r] = (0.0 if kp.pinned_full_precision else key_error(k_ref, reads_packed[r], body),
                     0.0 if vp.pinned_full_precision else
                     value_error(dv_ref, reads_packed[r], body))
    everything = slice(0, t)
    # Every token at each window width, rounded once per width (choices share widths).
    rounded = {b: (attention_scores(q_r, keys_at(recent_spec(b, kp.head_dim), everything),
                                    act.scale),
                   value_change(recent_spec(b, vp.head_dim), everything))
               for b in {c[1] for c in choices} if recent_spec(b, kp.head_dim) is not None}
    windows: dict[Choice, tuple[float, float]] = {}
    for c in choices:
        if c[1] not in rounded:  # full precision: the window costs no error
            windows[c] = (0.0, 0.0)
            continue
        recent = seen & ~reads_packed[c[0]] & (cols >= sinks)
        k_c, dv_c = rounded[c[1]]
        windows[c] = (0.0 if kp.pinned_full_precision else key_error(k_c, recent, everything),
                      0.0 if vp.pinned_full_precision else
                      value_error(dv_c, recent, everything))
    return ([(bodies[c[0]][0], windows[c][0]) for c in choices],
            [(bodies[c[0]][1], windows[c][1]) for c in choices])


# --------------------------------------------------------------------------- allocate


def window_tables(policy: ModelPolicy, calibration: Calibration
                  ) -> list[dict[Choice | None, float]] | None:
    """Per layer, the window options of the joint allocation: every choice for a global
    layer, ``{None: 0}`` (the policy's own window) for a local one; None when the policy
    has no choices."""
    choices = policy.window_choices
    if not choices:
        return None
    if tuple(calibration.recent) != tuple(choices):
        raise PolicyError(
            f"the policy's window choices {list(choices)} were not measured by its "
            f"calibration (it has {list(calibration.recent)}); delete the 'calibration' "
            "block of the policy file so that compile_model measures it again")
    windows = policy.windows or (None,) * policy.num_layers
    return [{None: 0.0} if w is not None or not calibration.recent_errors(k.layer, "key")
            else dict.fromkeys(choices, 0.0)
            for (k, _), w in zip(layer_pairs(policy), windows, strict=True)]


def _scales(calibration: Calibration, t: TensorPolicy) -> dict[Choice, tuple[float, float]]:
    """Per choice, (factor on the tensor's measured body error, window error added)."""
    got = calibration.recent_errors(t.layer, t.tensor)
    own = next((e[0] for c, e in got.items() if c[0] == t.residual), None)
    if own is None:
        raise PolicyError(f"layer {t.layer}: the calibration measured no window of the "
                          f"policy's own {t.residual} tokens; measure it again")
    return {c: (body / own if own > 0 else 1.0, window) for c, (body, window) in got.items()}


def joint_cost(policy: ModelPolicy, calibration: Calibration
               ) -> Callable[[int, tuple, Sequence[float]], float]:
    """``cost(layer position, (key option, value option, choice), errors)`` for
    ``allocate_joint``: the module docstring's sum (a plain sum without a choice)."""
    scales: dict[int, tuple[dict, dict]] = {}
    pairs = layer_pairs(policy)

    def cost(g: int, opts: tuple, errs: Sequence[float]) -> float:
        choice = opts[2] if len(opts) > 2 else None
        if choice is None:
            return float(sum(errs))
        if g not in scales:
            scales[g] = tuple(_scales(calibration, t) for t in pairs[g])  # type: ignore
        (fk, wk), (fv, wv) = scales[g][0][choice], scales[g][1][choice]
        return errs[0] * fk + errs[1] * fv + wk + wv

    return cost


def window_text(calibration: Calibration, choice: Choice, g: int, body: tuple,
                errs: tuple[float, float], cost: Callable, size: Callable) -> str:
    """The reason's clause for the window chosen at layer position ``g`` with body options
    ``body`` (measured errors ``errs``): both costs of every choice, at those options."""
    rows = " · ".join(f"{c[0]} at {c[1]} b {cost(g, (*body, c), (*errs, 0.0)):.1e}, "
                      f"{size(g, (*body, c)) / 8:,.0f} B" for c in calibration.recent)
    return (f"recent window {choice[0]} tokens at {choice[1]} bits, chosen with this layer's "
            f"body options from the measured cost (the body's errors scaled by what the "
            f"window changes in a {REFERENCE_BITS}-bit body's, plus the window's own) and "
            f"the layer's bytes: {rows}")
