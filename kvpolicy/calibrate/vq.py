"""Codebooks of vector-quantized values (``levels: vq``), fitted on calibration text.

A value is consumed by a weighted sum over tokens, so each token's channels are free to
be coded together (docs/design.md §1): ``kernels.layout`` splits a token's group of G
channels into sub-vectors of ``d = 8 // bits`` channels and stores each as one byte, an
index into 256 centroids. The centroids are learned per layer and kv head by k-means on
what the cache stores: the values the model writes (Hadamard-rotated where the policy
rotates them), each group brought to unit RMS as the encoder does before its
nearest-centroid search. One forward over the calibration text (the pydoc text in the
model's own tokenizer, or the user's ids) captures every layer's values
(``capture.reduce_activations``), one layer at a time.

Clustered data is where a codebook beats a scalar grid of the same bits: a 2-bit scalar
code of 4 channels has 4**4 = 256 points on a fixed lattice, a 4-channel codebook 256
points where the data lies. ``bench/vq_study.py`` measured it on SmolLM2 (docs/results.md,
"What vector codes could buy").
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from ..errors import KVPolicyError
from ..kernels.layout import VQ_BITS, VQ_ENTRIES, Codebook, vq_dim
from ..kernels.rotation import rotation_matrix
from ..policies import Axis, Calibration, ModelPolicy, TensorKind, TensorPolicy
from .capture import LayerActivations, reduce_activations
from .text import calibration_ids

__all__ = ["KMEANS_ITERS", "kmeans", "unit_subvectors", "fit_codebook", "codebook_policy",
           "pending_vq", "vq_text", "codebook_text", "priced", "candidate", "fit_books"]

log = logging.getLogger(__name__)

# Lloyd iterations per codebook. NOTE: bench/vq_study.py fitted with 25; the relative
# attention-output error of SmolLM2's layers moved by under 1% between 15 and 25.
KMEANS_ITERS = 20


def kmeans(x: torch.Tensor, k: int = VQ_ENTRIES, iters: int = KMEANS_ITERS,
           seed: int = 0) -> torch.Tensor:
    """``k`` centroids ``[k, d]`` of the rows of ``x [N, d]`` by Lloyd's algorithm.

    Seeded by k-means++ (each next seed drawn with probability proportional to its squared
    distance from the seeds so far, by a fixed generator: deterministic for a given ``x``),
    so that no cluster starts with two seeds and another with none; a centroid that still
    loses every row moves to the row farthest from its own centroid. With fewer distinct
    rows than ``k`` the spare centroids repeat rows (the encoder takes the first index on
    a tie, so they are never used).
    """
    x = x.float()
    n = x.shape[0]
    if n == 0:
        raise KVPolicyError("k-means needs at least one sub-vector to fit a codebook on")
    gen = torch.Generator().manual_seed(seed)
    c = torch.empty(k, x.shape[1])
    c[0] = x[torch.randint(n, (1,), generator=gen)]
    near = (x - c[0]).square().sum(1)
    for i in range(1, k):
        total = near.sum()
        j = (torch.multinomial(near / total, 1, generator=gen) if total > 0
             else torch.randint(n, (1,), generator=gen))
        c[i] = x[j]
        near = torch.minimum(near, (x - c[i]).square().sum(1))
    for _ in range(iters):
        dist = (c.square().sum(1)[None, :] - 2 * x @ c.T)  # |x|^2 is the same per row
        a = dist.argmin(1)
        count = torch.bincount(a, minlength=k)
        total = torch.zeros_like(c).index_add_(0, a, x)
        c = torch.where((count > 0)[:, None], total / count.clamp_min(1)[:, None], c)
        empty = (count == 0).nonzero().flatten()
        if empty.numel():
            far = (x - c[a]).square().sum(1).topk(min(empty.numel(), n)).indices
            c[empty[: far.numel()]] = x[far]
    return c


def unit_subvectors(values: torch.Tensor, t: TensorPolicy) -> list[torch.Tensor]:
    """Values ``[B, H, T, D]`` as the vq encoder sees them, one ``[N, d]`` per kv head:
    rotated where ``t`` rotates them, each group of ``t.group_size`` channels brought to
    unit RMS, all-zero groups left out (the encoder codes them as zero whatever the
    codebook)."""
    b, h, n, dim = values.shape
    v = values.float()
    if t.rotation == "hadamard":
        v = v @ rotation_matrix("hadamard", dim)
    g = v.transpose(0, 1).reshape(h, -1, t.group_size)  # [H, groups, G]
    rms = g.square().mean(-1, keepdim=True).sqrt()
    unit = g / torch.where(rms > 0, rms, torch.ones_like(rms))
    keep = rms.squeeze(-1) > 0
    out = [unit[i][keep[i]].reshape(-1, vq_dim(t.bits)) for i in range(h)]
    if any(x.shape[0] == 0 for x in out):
        raise KVPolicyError(f"layer {t.layer}: a kv head's calibration values are all zero; "
                            "a codebook cannot be fitted on them")
    return out


# Sub-vectors a codebook is fitted on, at most (a fixed random subset beyond): 64 per
# centroid. NOTE: SmolLM2, 4 x 512 calibration tokens, 2 bits: 32,768 sub-vectors per head,
# 0.32 s per k-means here, 75 s for the 180 codebooks a budget prices.
KMEANS_ROWS = 64 * VQ_ENTRIES


def fit_codebook(values: torch.Tensor, t: TensorPolicy, iters: int = KMEANS_ITERS
                 ) -> Codebook:
    """The codebook of ``t`` (levels vq) fitted on captured values ``[B, H, T, D]``: one
    k-means per kv head over :func:`unit_subvectors` (at most :data:`KMEANS_ROWS` of them,
    a fixed random subset)."""
    books = []
    for s in unit_subvectors(values, t):
        if s.shape[0] > KMEANS_ROWS:
            gen = torch.Generator().manual_seed(1)
            s = s[torch.randperm(s.shape[0], generator=gen)[:KMEANS_ROWS]]
        books.append(kmeans(s, VQ_ENTRIES, iters))
    return Codebook.from_tensor(torch.stack(books))


def pending_vq(policy: ModelPolicy) -> list[TensorPolicy]:
    """The tensors of ``policy`` at ``levels: vq`` below 16 bits without a codebook yet."""
    return [t for t in policy.tensors if t.vq and not t.codebook]


def codebook_policy(model: torch.nn.Module, policy: ModelPolicy,
                    text: tuple[torch.Tensor, str]) -> ModelPolicy:
    """``policy`` with every pending ``levels: vq`` value's codebook fitted on one
    calibration forward of ``model`` over ``text`` (``(ids [B, T], where)``), each reason
    saying on what."""
    pending: dict[int, list[TensorPolicy]] = {}
    for t in pending_vq(policy):
        pending.setdefault(t.layer, []).append(t)
    if not pending:
        return policy
    ids, where = text

    def fit(act: LayerActivations) -> list[TensorPolicy]:
        return [_with_codebook(t, fit_codebook(act.value, t), where, ids.numel())
                for t in pending.get(act.layer, [])]

    fitted = reduce_activations(model, ids, fit)
    new = {(t.layer, t.tensor): t for ts in fitted.values() for t in ts}
    missing = sorted({t.layer for t in pending_vq(policy)} - {k[0] for k in new})
    if missing:
        raise KVPolicyError(f"the calibration forward did not reach layers {missing}; their "
                            "vq codebooks cannot be fitted")
    return policy.model_copy(update={
        "tensors": tuple(new.get((t.layer, t.tensor), t) for t in policy.tensors)})


def vq_text(model: torch.nn.Module, calibration: Any = None, usable: bool = True
            ) -> tuple[torch.Tensor, str]:
    """The text ``levels: vq`` fits its codebooks on: ``(ids [B, T], where)``, from
    ``calibration`` token ids, else the last 512 pydoc tokens in ``calibration``'s (a
    tokenizer's) or the model's own tokenizer.

    Raises:
        KVPolicyError: no text can be had (no tokenizer beside the model and none given),
            or the model needs ``probe_kwargs`` (``usable`` False), naming the fix.
    """
    if not usable:
        raise KVPolicyError(
            "levels: vq fits its codebooks with plain forwards of token ids, which a model "
            "that needs probe_kwargs does not take its cached path on; use levels: uniform")
    if isinstance(calibration, torch.Tensor):
        return calibration, "user token ids"
    tok = None if calibration is None or isinstance(calibration, Calibration) else calibration
    try:
        return calibration_ids(model, tokenizer=tok)
    except KVPolicyError:
        raise KVPolicyError(
            f"levels: vq fits its codebooks on calibration text in the model's own tokens, "
            f"and {type(model).__name__} has no tokenizer saved at config._name_or_path; "
            "pass calibration=<[B, T] token ids> (about 512 tokens of text like yours) or "
            "calibration=<a tokenizer>, or use levels: uniform") from None


def codebook_text(book: Codebook) -> str:
    """``book``'s bytes as the policy stores them (``TensorPolicy.codebook``)."""
    import base64

    return base64.b64encode(book.data).decode("ascii")


def _with_codebook(t: TensorPolicy, book: Codebook, where: str, tokens: int) -> TensorPolicy:
    reason = (f"{t.reason}; codebook: {VQ_ENTRIES} centroids per kv head fitted by k-means "
              f"({KMEANS_ITERS} iterations) on {tokens} tokens of {where}, "
              f"{book.nbytes:,} bytes per layer")
    return t.model_copy(update={"codebook": codebook_text(book), "reason": reason})


# --------------------------------------------------------------------------- budgets


def priced(t: TensorPolicy) -> bool:
    """Whether a stored-bits budget's calibration prices ``t`` vector-quantized: a value
    grouped per token whose levels and metadata it chooses (``levels: auto`` and
    ``meta_bits: auto``, which only a stored-bits budget leaves unallocated)."""
    return (t.tensor is TensorKind.VALUE and t.axis is Axis.TOKEN and t.levels == "auto"
            and t.meta_bits == "auto" and not t.pinned_full_precision
            and t.head_dim % vq_dim(VQ_BITS[0]) == 0)


def candidate(t: TensorPolicy, bits: int, book: str = "") -> TensorPolicy:
    """``t`` as the vq option a budget prices at ``bits``: one 8-bit scale per token and
    head (group = head_dim), Hadamard-rotated where head_dim is a power of two whatever
    the scalar options' ``rotation`` (the rotation is part of the option, as uniform levels
    are part of an 8-bit-metadata option: it makes a token's sub-vectors alike, so one
    codebook serves them all)."""
    pow2 = not t.head_dim & (t.head_dim - 1)
    rotation = "hadamard" if pow2 else "none"
    return t.model_copy(update={
        "bits": bits, "group_size": t.head_dim, "group_sizes": (), "levels": "vq",
        "meta_bits": 8, "fit": "minmax", "rotation": rotation, "codebook": book})


def fit_books(model: torch.nn.Module, ids: torch.Tensor, policy: ModelPolicy,
              widths: tuple[int, ...]) -> dict[int, dict[int, Codebook]]:
    """``{layer: {width: codebook}}`` for every value :func:`priced` vq, at the widths of
    ``widths`` that have vq codes, fitted on one forward over ``ids`` (no gradient); empty
    when nothing is priced."""
    want = {t.layer: t for t in policy.tensors if priced(t)}
    bits = [w for w in widths if w in VQ_BITS]
    if not want or not bits:
        return {}

    def fit(act: LayerActivations) -> dict[int, Codebook]:
        t = want.get(act.layer)
        return {} if t is None else {w: fit_codebook(act.value, candidate(t, w)) for w in bits}

    return {layer: books for layer, books in reduce_activations(model, ids, fit).items()
            if books}
