"""The model-level cache: a ``transformers`` ``Cache`` whose layers are packed KV layers.

``KVPolicyCache`` is what a compiled model's attention reads and writes. It holds one
``PackedKVLayer`` per attention layer (sinks + packed groups + residual, per the policy)
and the RoPE groups that pre-RoPE keys are rotated with after dequantization.

RoPE: every key is cached *before* its rotation, so attention must know the rotation of
each cached token. The compiled block hands over the cos/sin rows it was given for the new
tokens; the cache's ``RotaryGroup`` (``runtime.rotary``; one per rotation, shared by every
layer that rotates with the same angles) turns them into positions, which each layer keeps
implicitly (``runtime.positions``), and recomputes rows from the positions when attention
needs them. Rows it cannot reproduce are stored instead. Any RoPE variant whose angles
depend on the token works (linear/NTK/YaRN/Llama-3 scaling, per-row positions under left
padding).
"""

from __future__ import annotations

import logging
import math
from typing import Any

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from ..errors import CacheError, KVPolicyError
from ..kernels.layout import RotarySpec
from ..policies import ModelPolicy
from ..state import compiled_of
from .layer import PackedKVLayer
from .positions import TokenPositions, least_position
from .rotary import RotaryGroup

__all__ = ["KVPolicyCache", "KVPolicyLayer"]

log = logging.getLogger(__name__)



class KVPolicyLayer(CacheLayerMixin):
    """A transformers cache layer backed by a ``PackedKVLayer``.

    Compiled attention appends and attends through ``packed`` directly; ``update()`` is
    what uncompiled attention would call, and is refused. A layer with a window is
    ``is_sliding``: transformers then sizes the window layers' mask from its
    ``get_mask_sizes``, which covers exactly the tokens it holds.
    """

    is_compileable = False
    is_croppable = False

    def __init__(
        self, packed: PackedKVLayer, layer_idx: int, value_rotation: str = "none"
    ) -> None:
        super().__init__()
        self.packed = packed
        self.layer_idx = layer_idx
        self.rotary: RotaryGroup | None = None
        self.is_initialized = True
        # The policy's rotation of the values (kernels.rotation): the layer stores v R,
        # compiled attention rotates its output back (runtime.attend).
        self.value_rotation = value_rotation

    @property
    def is_sliding(self) -> bool:  # noqa: D102
        return self.packed.window is not None

    def lazy_initialization(self, key_states, value_states) -> None:  # noqa: D102
        return None

    def update(self, key_states, value_states, *args, **kwargs):
        raise KVPolicyError(
            f"layer {self.layer_idx}: a kvpolicy cache is filled by compiled attention; this "
            "attention module was not compiled. Call kvpolicy.compile_model(model) first."
        )

    def get_seq_length(self) -> int:
        return self.packed.n_seen

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        # (key columns, index of the first one): the held tokens and the step's own.
        return self.packed.seq_len + query_length, self.packed.n_evicted

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        self.packed.clear()
        self.rotary = None

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self.packed.reorder(beam_idx.to(torch.int64))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self.packed.reorder(indices.to(torch.int64))

    def batch_repeat_interleave(self, repeats: int) -> None:
        b = self.packed.batch_size
        if b is not None:
            self.packed.reorder(torch.arange(b).repeat_interleave(repeats))

    def crop(self, tokens_to_remove: int) -> None:
        raise KVPolicyError(
            "a kvpolicy cache cannot be cropped: packed groups are never re-quantized, so "
            "tokens cannot be taken back out (assisted decoding is not supported)"
        )


class KVPolicyCache(Cache):
    """The cache of a model compiled by ``kvpolicy.compile_model``.

    Created automatically by ``model(..., use_cache=True)`` and ``model.generate``;
    build one explicitly with ``KVPolicyCache.for_model(model)``.

    Args:
        policy: the compiled model's policy (``kvpolicy.inspect(model)``).
        backend: ``"torch"``, ``"triton"`` or ``"auto"`` (triton for CUDA tensors).
        model_dtype: the model's dtype (``storage_dtype``: a quantized layer of an fp32
            model keeps its full-precision tokens, scales and zeros in fp16).
        windows: attention layer -> sliding window of the layers the model marks as local
            (``analysis.config.sliding_windows``); those layers evict what leaves the window.
    """

    def __init__(
        self, policy: ModelPolicy, *, backend: str = "auto",
        model_dtype: torch.dtype | None = None, windows: dict[int, int] | None = None,
    ) -> None:
        windows = windows or {}
        layers = [
            KVPolicyLayer(_packed_layer(policy, i, backend, model_dtype, windows.get(i)), i,
                          policy.get(i, "value").rotation)
            for i in sorted({t.layer for t in policy.tensors})
        ]
        super().__init__(layers=layers)
        self.policy = policy
        self.backend = backend
        self.rotary: list[RotaryGroup] = []

    @classmethod
    def for_model(cls, model: torch.nn.Module) -> KVPolicyCache:
        """A new, empty cache for ``model``, compiled by ``kvpolicy.compile_model``."""
        compiled = compiled_of(model)
        if compiled is None:
            raise KVPolicyError(
                f"{type(model).__name__} is not compiled; call kvpolicy.compile_model first"
            )
        return compiled.new_cache()

    def packed_layer(self, layer_idx: int) -> KVPolicyLayer:
        if layer_idx >= len(self.layers):
            raise KVPolicyError(
                f"attention layer {layer_idx} but this cache has {len(self.layers)} layers; "
                "was it built for another model?"
            )
        return self.layers[layer_idx]

    def rope_rows(
        self, layer: KVPolicyLayer, cos: torch.Tensor, sin: torch.Tensor, style: str,
        batch: int, sources: tuple = (),
    ) -> tuple[RotarySpec, TokenPositions]:
        """The rotary table and the positions of ``layer``'s new tokens, whose rows are
        ``cos``/``sin`` ``[b_rows, T, r]`` (``b_rows`` 1 or ``batch``).

        A layer is bound to a group at its first append: the group whose rows for this
        step are the same (or which computes the same rows), else a new one fitted from
        ``sources`` (``runtime.rotary.rotary_sources``).
        """
        if cos.shape[0] not in (1, batch) or sin.shape != cos.shape:
            raise CacheError(
                f"RoPE rows {tuple(cos.shape)} / {tuple(sin.shape)} for a batch of {batch}; "
                "a compiled model's cache holds one batch layout per sequence"
            )
        packed = layer.packed
        held, start = packed.held_positions(), packed.n_seen
        group = layer.rotary
        if group is not None:
            pos = group.resolve(held, cos, sin, start, batch)
        else:
            pos = None
            for g in self.rotary:
                if g.style == style and g.rotary_dim == cos.shape[-1] and g.dtype == cos.dtype:
                    pos = g.resolve(held, cos, sin, start, batch, joining=True)
                    if pos is not None:
                        group = g
                        break
            if group is None or pos is None:
                group, pos = RotaryGroup.fit(cos, sin, style, held, start, batch, sources)
                self.rotary.append(group)
                log.debug("layer %d: new RoPE group (%s)", layer.layer_idx,
                          "computed" if group.computed else "stored rows")
            group.layers += 1
            layer.rotary = group
        # The Triton kernels read a half-precision table as it is (half the bytes; the
        # rows are rounded to the model's dtype anyway); the C++ kernel wants fp32.
        half = packed.kernels(cos.device).name == "triton"
        lo = least_position(held, pos)
        return group.spec(cos.dtype if half else torch.float32,
                          0 if lo == math.inf else int(lo)), pos

    def reset(self) -> None:
        super().reset()
        self.rotary = []

    def memory_report(self) -> dict[str, Any]:
        """Bytes held by all layers (codes, scales, zeros, sinks, residual, positions) and,
        once for the model, the RoPE groups, against an fp16 cache of the same tokens.

        ``bytes`` is what is in use; ``spare_bytes`` the allocated but unused capacity of
        growing buffers; ``rope_transient_bytes`` a step's table of RoPE rows while it is
        held (from a step until every layer has read it; not in ``bytes``).
        """
        per_layer = [layer.packed.memory_report() for layer in self.layers]
        evicted = sum(r["evicted_tokens"] for r in per_layer)
        rope = [g.memory() for g in self.rotary]
        rope_bytes = sum(r["bytes"] for r in rope)
        total = sum(r["bytes"] for r in per_layer) + rope_bytes
        fp16 = sum(r["fp16_bytes"] for r in per_layer)
        return {
            "tokens": per_layer[0]["tokens"] if per_layer else 0,
            "bytes": total,
            "fp16_bytes": fp16,
            "position_bytes": sum(r["position_bytes"] for r in per_layer),
            "rope_bytes": rope_bytes,
            "rope_transient_bytes": sum(r["transient"] for r in rope),
            "rope_groups": [
                {"rows": "computed" if g.computed else "stored", **r}
                for g, r in zip(self.rotary, rope, strict=True)
            ],
            "evicted_tokens": evicted,
            "spare_bytes": sum(r["spare_bytes"] for r in per_layer) + sum(r["spare"] for r in rope),
            "compression": fp16 / total if total else float("nan"),
            "layers": per_layer,
        }


def storage_dtype(policy_bits: tuple[int, int], model_dtype: torch.dtype | None):
    """Dtype of a layer's full-precision tokens and scales/zeros.

    A quantized layer of an fp32 model stores them in fp16: the quantization error is
    orders of magnitude above fp16 rounding, and fp16 is what the cache is measured
    against. A full-precision layer (bits 16) keeps the model's dtype, so that
    compiling with ``bits=16`` is exact.
    """
    if model_dtype == torch.float32 and min(policy_bits) < 16:
        return torch.float16
    return None  # the dtype of the first append


def _packed_layer(
    policy: ModelPolicy, layer: int, backend: str, model_dtype: torch.dtype | None = None,
    window: int | None = None,
) -> PackedKVLayer:
    k, v = policy.get(layer, "key"), policy.get(layer, "value")
    return PackedKVLayer(
        k.quant_spec(), v.quant_spec(),
        residual=k.residual, sinks=k.sinks, backend=backend, pre_rope=k.pre_rope,
        residual_bits=(k.residual_bits, v.residual_bits),
        dtype=storage_dtype((k.bits, v.bits), model_dtype), window=window,
    )
