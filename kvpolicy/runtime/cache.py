"""The model-level cache: a ``transformers`` ``Cache`` whose layers are packed KV layers.

``KVPolicyCache`` is what a compiled model's attention reads and writes. It holds one
``PackedKVLayer`` per attention layer (sinks + packed groups + residual, per the policy)
and the RoPE tables that pre-RoPE keys are rotated with after dequantization.

RoPE tables: every key is cached *before* its rotation, so attention must know the
rotation of each cached token. The compiled block hands over the cos/sin rows it was
given for the new tokens; the cache appends them to a table and stores, per token, an
index into it. Layers fed from the same position tensors (all layers of a Llama share one
``position_embeddings``) share one table, so the table costs ``2 * rotary_dim`` values per
token for the whole model, not per layer. Any RoPE variant whose angles depend on the
token works (linear/NTK/YaRN/Llama-3 scaling, per-row positions under left padding).
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from ..errors import CacheError, KVPolicyError
from ..kernels.layout import QuantSpec, RotarySpec
from ..policy import ModelPolicy
from ..state import compiled_of
from .layer import PackedKVLayer

__all__ = ["KVPolicyCache", "KVPolicyLayer", "RopeTable"]

log = logging.getLogger(__name__)



class RopeTable:
    """cos/sin rows of every cached token, ``[tokens * rows_per_token, rotary_dim]``.

    Row ``t * b_rows + b`` is token ``t`` of batch row ``b``; ``b_rows`` is 1 when all
    batch rows share positions (the usual ``[1, T, r]`` cos of transformers) and B under
    left padding. Rows are never reordered: beam search reorders the layers' stored
    indices instead.
    """

    def __init__(self, style: str, rotary_dim: int) -> None:
        self.style, self.rotary_dim = style, rotary_dim
        self.cos: torch.Tensor | None = None
        self.sin: torch.Tensor | None = None
        self.tokens = 0
        self.b_rows = 0
        self.source_ptr: int | None = None  # storage of the position tensor last appended

    def append(self, cos: torch.Tensor, sin: torch.Tensor, ptr: int) -> None:
        """Append ``[b_rows, T, r]`` rows (token-major in storage)."""
        b, t, r = cos.shape
        if self.cos is not None and b != self.b_rows:
            raise CacheError(
                f"RoPE rows for {b} batch rows after {self.b_rows}; a compiled model's "
                "cache holds one batch layout per sequence"
            )
        c = cos.transpose(0, 1).reshape(t * b, r)
        s = sin.transpose(0, 1).reshape(t * b, r)
        self.cos = c.clone() if self.cos is None else torch.cat((self.cos, c))
        self.sin = s.clone() if self.sin is None else torch.cat((self.sin, s))
        self.tokens += t
        self.b_rows = b
        self.source_ptr = ptr

    def spec(self) -> RotarySpec:
        assert self.cos is not None and self.sin is not None
        return RotarySpec(self.style, self.rotary_dim, self.cos, self.sin)  # type: ignore[arg-type]

    def indices(self, start: int, t: int, batch: int, device) -> torch.Tensor:
        """``[batch, t]`` table rows of tokens ``start .. start+t-1``."""
        tok = torch.arange(start, start + t, device=device)
        if self.b_rows == 1:
            return tok[None, :].expand(batch, t).contiguous()
        return tok[None, :] * self.b_rows + torch.arange(batch, device=device)[:, None]

    def nbytes(self) -> int:
        return 0 if self.cos is None else 2 * self.cos.numel() * self.cos.element_size()


class KVPolicyLayer(CacheLayerMixin):
    """A transformers cache layer backed by a ``PackedKVLayer``.

    Compiled attention appends and attends through ``packed`` directly; ``update()`` is
    what uncompiled attention would call, and is refused.
    """

    is_sliding = False
    is_compileable = False
    is_croppable = False

    def __init__(self, packed: PackedKVLayer, layer_idx: int) -> None:
        super().__init__()
        self.packed = packed
        self.layer_idx = layer_idx
        self.rope_table: RopeTable | None = None
        self.is_initialized = True

    def lazy_initialization(self, key_states, value_states) -> None:  # noqa: D102
        return None

    def update(self, key_states, value_states, *args, **kwargs):
        raise KVPolicyError(
            f"layer {self.layer_idx}: a kvpolicy cache is filled by compiled attention; this "
            "attention module was not compiled. Call kvpolicy.compile_model(model) first."
        )

    def get_seq_length(self) -> int:
        return self.packed.seq_len

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.get_seq_length() + query_length, 0

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        self.packed.clear()
        self.rope_table = None

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
    """

    def __init__(
        self, policy: ModelPolicy, *, backend: str = "auto", model_dtype: torch.dtype | None = None
    ) -> None:
        layers = [
            KVPolicyLayer(_packed_layer(policy, i, backend, model_dtype), i)
            for i in sorted({t.layer for t in policy.tensors})
        ]
        super().__init__(layers=layers)
        self.policy = policy
        self.backend = backend
        self.tables: list[RopeTable] = []

    @classmethod
    def for_model(cls, model: torch.nn.Module) -> KVPolicyCache:
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
        self, layer: KVPolicyLayer, cos: torch.Tensor, sin: torch.Tensor, start: int,
        style: str, ptr: int,
    ) -> RopeTable:
        """Make sure the table of ``layer`` holds rows for tokens ``start .. start+T-1``.

        A layer is bound to a table at its first append: the table whose rows came from
        the same position tensor (same storage) in this forward, else a new one.
        """
        t = cos.shape[1]
        table = layer.rope_table
        if table is None:
            table = next((x for x in self.tables if x.source_ptr == ptr and x.tokens == start + t
                          and x.style == style), None)
            if table is None:
                table = RopeTable(style, cos.shape[-1])
                self.tables.append(table)
            layer.rope_table = table
        if table.tokens == start:
            # NOTE: fp32 rows: the C++ decode kernel reads fp32 rotate-half tables in place
            # and would copy a half-precision table on every call (2 bytes/value saved,
            # ~1 ms per SmolLM2 step lost at 1K tokens).
            table.append(cos.float(), sin.float(), ptr)
        elif table.tokens < start + t:
            raise CacheError(
                f"layer {layer.layer_idx}: RoPE table holds {table.tokens} tokens, expected "
                f"{start} or {start + t}; layers were called out of order"
            )
        return table

    def reset(self) -> None:
        super().reset()
        self.tables = []

    def memory_report(self) -> dict[str, Any]:
        """Bytes held by all layers (codes, scales, zeros, sinks, residual, positions) and
        the shared RoPE tables, against an fp16 cache of the same tokens."""
        per_layer = [layer.packed.memory_report() for layer in self.layers]
        rope = sum(t.nbytes() for t in self.tables)
        total = sum(r["bytes"] for r in per_layer) + rope
        fp16 = sum(r["fp16_bytes"] for r in per_layer)
        return {
            "tokens": per_layer[0]["tokens"] if per_layer else 0,
            "bytes": total,
            "fp16_bytes": fp16,
            "rope_table_bytes": rope,
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
    policy: ModelPolicy, layer: int, backend: str, model_dtype: torch.dtype | None = None
) -> PackedKVLayer:
    k, v = policy.get(layer, "key"), policy.get(layer, "value")
    return PackedKVLayer(
        QuantSpec(k.bits, k.group_size, k.axis.value),
        QuantSpec(v.bits, v.group_size, v.axis.value),
        residual=k.residual, sinks=k.sinks, backend=backend, pre_rope=k.pre_rope,
        dtype=storage_dtype((k.bits, v.bits), model_dtype),
    )
