"""The attention step of a compiled block as a ``torch.library`` custom op, ``kvpolicy::attend``.

A rewritten block calls ``KVAttend`` (``runtime.attend``), whose ``forward`` is one call of
this op. To ``torch.compile`` (dynamo, AOTAutograd, Inductor) the op is one opaque node with
a fake implementation that gives its output's shape, dtype, strides and device; the Python
cache behind it (``runtime.layer.PackedKVLayer``, growing buffers, RoPE groups) is never
traced. That is what lets a compiled model run under ``torch.compile``: the cache's Python
objects would otherwise break the graph at every data-dependent branch, ``ctypes`` call and
host read of the packed kernels.

Why the arguments are what they are. A custom op takes tensors and scalars only, so what is
not a tensor reaches it in one of two ways:

* ``attend_id``: the ``KVAttend`` whose configuration the step uses (layouts, scale, mask
  kind, RoPE style, soft-cap, ``tokens_major``, ``rotary_sources``...), by the int it was
  given in :func:`register`. The table holds the module itself (weakly), not a copy of its
  fields, because the compiler sets some of them after the rewrite built it
  (``rotary_sources``). One int is a constant of the traced graph: dynamo guards on it once
  per block kind instead of on a dozen config fields.
* ``layer``: the attention layer index, a constant per layer (each layer's block has its
  own graph). The *cache* is not an argument: it is a per-call Python object, and a
  constant naming it (an id) would be guarded on and recompile for every new cache. The
  real implementation reads it from ``attend.CURRENT`` at run time, where the model's
  forward bound it for the whole call (and, eagerly, the installed block forward for its
  layer; ``runtime.install``); reading a contextvar there is invisible to dynamo, which
  never runs the real implementation.

NOTE: measured with torch 2.13 and transformers 5.24 on every tiny transformers
architecture of ``zoo.tiny`` (backend "eager", 40-token prefill, 5 decode steps), and on
nanoGPT, gpt-fast and a left-padded batch: no graph break, one graph per decode step,
three compiles (prefill, first step, then dynamic shapes), logits equal to eager.

``mutates_args=()`` is honest: no *tensor* argument is written. What the op changes is the
cache's Python state, which no graph sees; every call's output is used by the block, so no
compiler drops a call, and successive layers' calls are ordered by their data dependence.
The cache never keeps an argument itself (it stores copies: quantized codes, cloned
residual tokens, appended RoPE rows), so a compiler may reuse an argument's memory after
the call. The op has no autograd formula (the packed cache is not differentiable):
backward through it raises.

Not here: ``kvpolicy::decode_attention``. Routing the decode kernel through an op of its
own changes no graph while the step around it is one opaque op; it is worth its schema
once the step is decomposed into ops (the packing is already one: ``kernels.ops``).
"""

from __future__ import annotations

import itertools
import weakref
from typing import Protocol

import torch

from ..errors import KVPolicyError
from ..kernels import ops as kernel_ops  # noqa: F401  (registers kvpolicy::quantize)

__all__ = ["AttendStep", "attend", "register", "registered"]


class AttendStep(Protocol):
    """What :func:`register` takes: the eager step and its output's fake (``KVAttend``)."""

    def step(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
        cos: torch.Tensor | None, sin: torch.Tensor | None,
        write_positions: torch.Tensor | None, layer: int,
    ) -> torch.Tensor: ...

    def output_like(self, q: torch.Tensor, v: torch.Tensor) -> torch.Tensor: ...


# Weak: a KVAttend lives as long as the compiled model that holds it (its KindGraph).
_TABLE: weakref.WeakValueDictionary[int, AttendStep] = weakref.WeakValueDictionary()
_IDS = itertools.count()


def register(step: AttendStep) -> int:
    """Enter ``step`` in the table ``kvpolicy::attend`` dispatches on; returns its id."""
    op_id = next(_IDS)
    _TABLE[op_id] = step
    return op_id


def registered(attend_id: int) -> AttendStep:
    """The step registered as ``attend_id``; :class:`KVPolicyError` if it is gone."""
    step = _TABLE.get(attend_id)
    if step is None:
        raise KVPolicyError(
            f"kvpolicy::attend was called with attend_id={attend_id}, which names no live "
            "KVAttend (its compiled model was freed, or the id comes from another process); "
            "call the op through the KVAttend module of a model compiled by kvpolicy"
        )
    return step


# cudagraph_unsafe: a CUDA graph would record the kernels one step launched and replay
# them, not the step (the cache's buffers grow and its Python state moves on); inductor
# keeps the op out of a captured graph (it partitions around it, or does not capture).
@torch.library.custom_op("kvpolicy::attend", mutates_args=(),
                         tags=(torch.Tag.cudagraph_unsafe,))
def attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
    cos: torch.Tensor | None, sin: torch.Tensor | None, write_positions: torch.Tensor | None,
    attend_id: int, layer: int,
) -> torch.Tensor:
    """Append this call's K/V to the packed cache of ``layer`` and attend over it.

    ``q`` ``[B, Hq, Tq, D]``; ``k``/``v`` in the layout the block produced them (the
    registered ``KVAttend`` brings them to ``[B, Hkv, T, D]``); ``mask``, ``cos``/``sin``
    and ``write_positions`` as ``KVAttend.forward`` takes them. Returns ``[B, Hq, Tq, Dv]``
    in ``q``'s dtype.
    """
    return registered(attend_id).step(q, k, v, mask, cos, sin, write_positions, layer)


@attend.register_fake
def _attend_fake(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
    cos: torch.Tensor | None, sin: torch.Tensor | None, write_positions: torch.Tensor | None,
    attend_id: int, layer: int,
) -> torch.Tensor:
    return registered(attend_id).output_like(q, v)
