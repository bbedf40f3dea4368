"""The quanto peer's rows of ``kvpolicy eval``: transformers' ``QuantizedCache`` at the policy's
bits, group and residual, on every axis pair, scored like kvpolicy's runs (perplexity, KL,
top-1, retrieval) and priced like them (steady-state bytes per token, whole-cache bits)."""

from __future__ import annotations

from typing import Any

import torch

from ..errors import KVPolicyError
from ..policies import load_spec, packed_bytes_per_element
from ..policies.footprint import CONTEXT
from .decode import NextTokenReference, decode_perplexity
from .peers import cache_bytes, check_token_groups, peer_cache
from .report import RetrievalResult, RunResult
from .retrieval import RetrievalTask, score_retrieval

__all__ = ["check_peer_context", "peer_runs", "quanto_bytes_per_token",
           "quanto_measured_bytes_per_token", "quanto_whole_bits"]


def check_peer_context(model: torch.nn.Module, context: int, user: dict[str, Any]) -> None:
    """Refuse a context with which the quanto peer's per-channel axes would fail mid-run."""
    d = load_spec(user).defaults
    if d.bits not in (2, 4):  # no peer runs (said in the notes)
        return
    try:
        check_token_groups(model, context, d.residual, d.group_size)
    except KVPolicyError as exc:
        raise type(exc)(f"{exc}; or skip the quanto peer (--no-peers)") from exc


def peer_runs(load, segs, context, steps, fp_ppl, user, per_token, progress, notes,
              reference: NextTokenReference, task: RetrievalTask | None,
              retrieval_ref: NextTokenReference
              ) -> tuple[list[RunResult], dict[str, RetrievalResult]]:
    """transformers' quanto cache at the policy's bits, group and residual: all four axis
    pairs (its users pick them by hand), reported with the default and the best; the best
    also on the retrieval ``task``."""
    d = load_spec(user).defaults
    if d.bits not in (2, 4):
        notes.append(f"peer runs skipped: quanto supports 2 or 4 bits, the policy has {d.bits}")
        return [], {}
    model = load()
    steady = quanto_bytes_per_token(per_token, d.bits, d.group_size, model)
    results = {}
    for axes in ((0, 0), (-1, 0), (0, -1), (-1, -1)):
        def factory(axes=axes):
            return peer_cache(model, "quanto", bits=d.bits, group_size=d.group_size,
                                    residual=d.residual, axis_key=axes[0], axis_value=axes[1])

        results[axes] = decode_perplexity(model, segs, context, steps, desc=f"quanto {axes}",
                                          progress=progress, batched=True, make_cache=factory,
                                          reference=reference)
    best = min(results, key=lambda a: results[a].perplexity)
    out = []
    for label, axes in (("quanto default axes (0, 0)", (0, 0)), (f"quanto best axes {best}", best)):
        res = results[axes]
        held = cache_bytes(res.cache)
        elems = per_token * segs.shape[0] * held.tokens if per_token else None
        out.append(RunResult(
            label, "peer", res.perplexity, res.perplexity / fp_ppl, held.total, held.fp16,
            held.total * 8 / elems if elems else None, res.seconds_per_step * 1e3,
            {"bits": d.bits, "group_size": d.group_size, "residual": d.residual,
             "axes": list(axes),
             "all_axes": {str(a): r.perplexity for a, r in results.items()}},
            avg_bits=float(d.bits), bytes_per_token=steady,
            avg_stored_bits=steady * 8 / per_token if steady and per_token else None,
            fp16_bytes_per_token=2 * per_token if per_token else None,
            measured_bytes_per_token=quanto_measured_bytes_per_token(held, per_token, model),
            kl=res.kl, top1_agreement=res.agreement,
            whole_bits=quanto_whole_bits(steady, per_token, d.residual, model),
        ))
    retrieved = {}
    if task is not None:
        for res in results.values():
            res.cache = None
        label = out[-1].name
        retrieved[label] = score_retrieval(
            model, task, label, reference=retrieval_ref, settings=out[-1].settings,
            make_cache=lambda: peer_cache(model, "quanto", bits=d.bits, group_size=d.group_size,
                                          residual=d.residual, axis_key=best[0],
                                          axis_value=best[1]),
            progress=progress)
    return out, retrieved


def quanto_bytes_per_token(per_token: int | None, bits: int, group_size: int,
                           model: torch.nn.Module) -> float | None:
    """Steady-state bytes per token of transformers' quanto ``QuantizedCache``, counted as
    ``ModelPolicy.bytes_per_token`` counts ours: codes plus per-group scale and zero, no
    full-precision window.

    What quanto stores (transformers ``QuantoQuantizedLayer._quantize``, optimum-quanto
    ``MaxOptimizer`` and ``WeightQBitsTensor``): the whole cache re-quantized with
    ``quantize_weight(states, qint<bits>, axis, scale, shift, group_size)``; the states are
    grouped (``tensor.grouped.group``) into ``numel / group_size`` groups of ``group_size``
    elements on either axis (axis 0: along head_dim; axis -1: along the flattened
    batch*heads*tokens rows), so per element there are ``bits`` code bits (a
    ``PackedTensor``, ``8 // bits`` codes per uint8 along its first dim, padded up to a
    multiple of ``8 // bits`` rows: a few bytes per cache, nothing per token) and
    ``1 / group_size`` of one scale and one shift, both in the dtype of the cached states
    (``MaxOptimizer`` asserts it; it is the model's dtype: fp32 for the fp32 models of this
    eval, where kvpolicy stores fp16). So ``per_token * (bits / 8 + 2 * itemsize /
    group_size)``; ``quanto_measured_bytes_per_token`` checks it against the cache held at
    the end of the eval.
    """
    if per_token is None:
        return None
    itemsize = next(model.parameters()).dtype.itemsize
    return per_token * packed_bytes_per_element(bits, group_size, itemsize)


def quanto_measured_bytes_per_token(held, per_token: int | None,
                                    model: torch.nn.Module) -> float | None:
    """Bytes per quantized token of a quanto cache as held: (codes + scales + shifts) over
    the quantized elements (all elements less the full-precision residual window's), times
    the elements per token. None when nothing is quantized."""
    itemsize = next(model.parameters()).dtype.itemsize
    quantized = held.fp16 // 2 - held.residual // itemsize
    if not per_token or quantized <= 0:
        return None
    return (held.packed + held.scales) / quantized * per_token


def quanto_whole_bits(steady: float | None, per_token: int | None, residual: int,
                      model: torch.nn.Module, tokens: int = CONTEXT) -> float | None:
    """Stored bits per element of a quanto cache holding ``tokens`` tokens, counted as
    ``policies.footprint.whole_cache`` counts kvpolicy's: its body at ``steady`` bytes per
    token, and its residual window full (``residual`` tokens in the model's dtype, which
    quanto holds between re-quantizations; at most that many)."""
    if steady is None or not per_token:
        return None
    held = min(residual, tokens)
    itemsize = next(model.parameters()).dtype.itemsize
    total = steady * (tokens - held) + per_token * itemsize * held
    return total * 8 / (per_token * tokens)
