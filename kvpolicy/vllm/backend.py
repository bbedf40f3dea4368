"""kvpolicy's attention backend for vLLM's CPU engine: packed pages, kvpolicy kernels.

vLLM's CPU platform always picks the ``CPU_ATTN`` backend, so the plugin registers
:class:`KVPolicyAttentionBackend` under that name. Without ``additional_config["kvpolicy"]``
it is vLLM's own backend (every class method defers to ``CPUAttentionBackend``). With it:

- ``customize_spec`` declares one page of :class:`~kvpolicy.runtime.paged.PagedLayout`
  bytes per block (one head slot, one state of ``page_bytes``), so vLLM sizes the cache in
  packed bytes and reports that many more blocks;
- the impl attends and appends in ``forward`` (its ``do_kv_cache_update`` does nothing):
  :class:`~kvpolicy.runtime.paged.PagedKV` over the layer's pages, with vLLM's block
  table, query start offsets and sequence lengths (the metadata of vLLM's CPU builder).
"""

from __future__ import annotations

import logging
from dataclasses import replace
from functools import cache
from typing import Any

import torch
from vllm.config import get_current_vllm_config_or_none
from vllm.model_executor.models.utils import extract_layer_index
from vllm.v1.attention.backend import AttentionImpl, AttentionType
from vllm.v1.attention.backends.cpu_attn import (
    CPUAttentionBackend,
    CPUAttentionBackendImpl,
)

from ..errors import KVPolicyError
from ..runtime.paged import PagedKV, SeqBatch
from .policy import ServedPolicy, config_value, served_policy
from .prefill import FusedPrefill

__all__ = ["KVPolicyAttentionBackend", "KVPolicyAttentionImpl", "active_policy"]

log = logging.getLogger("vllm.kvpolicy")  # vLLM's handlers print it


_SERVED: ServedPolicy | None = None  # this process's engine's policy, once resolved


def active_policy() -> ServedPolicy | None:
    """The served policy of the engine being built or run in this process, or None when
    its config asks for no kvpolicy. Resolved where vLLM has set its config (model
    construction) and remembered for ``customize_spec``, which runs without one."""
    global _SERVED
    cfg = get_current_vllm_config_or_none()
    if cfg is None:
        return _SERVED
    value = config_value(cfg)
    if value is None:
        return None
    mc = cfg.model_config
    _SERVED = served_policy(mc.model, value, int(mc.max_model_len))
    return _SERVED


def _tp() -> tuple[int, int]:
    from vllm.distributed import (
        get_tensor_model_parallel_rank,
        get_tensor_model_parallel_world_size,
    )
    try:
        return get_tensor_model_parallel_rank(), get_tensor_model_parallel_world_size()
    except (AssertionError, RuntimeError):  # no distributed group: one rank
        return 0, 1


def local_kv_heads(total: int) -> range:
    """The global kv heads this tensor-parallel rank holds (vLLM replicates heads when
    there are more ranks than heads)."""
    rank, world = _tp()
    if world <= total:
        per = total // world
        return range(rank * per, (rank + 1) * per)
    h = rank * total // world
    return range(h, h + 1)


def _engine_block_size(served: ServedPolicy) -> int:
    """The block size the engine runs with (set by ``configure_engine``), else the one it
    would set."""
    cfg = get_current_vllm_config_or_none()
    size = getattr(getattr(cfg, "cache_config", None), "block_size", None)
    return size if size and size % served.chunk() == 0 else served.default_block_size()


class KVPolicyAttentionBackend(CPUAttentionBackend):
    """``CPU_ATTN`` with a packed page per block when the engine serves a kvpolicy."""

    @classmethod
    def customize_spec(cls, spec):
        served = active_policy()
        if served is None or served.full_precision() or spec.state_content_bytes is not None:
            return super().customize_spec(spec)
        block = spec.block_size
        if block % served.chunk():
            # vLLM probes sliding-window layers with a one-token spec and picks their block
            # size as the page budget over its bytes: any per-token figure gives the engine's
            # block size back, and vLLM customizes the final spec (whole blocks) again.
            block = _engine_block_size(served)
        page = served.page_bytes(
            num_kv_heads=spec.num_kv_heads, head_dim=spec.head_size,
            v_head_dim=spec.head_size_v, block_size=block, cache_dtype=spec.dtype)
        # One head slot of ceil(page / block_size) bytes per token: the page, padded by
        # less than a byte per token.
        return replace(spec, dtype=torch.uint8, num_head_slots=1,
                       state_content_bytes=-(-page // block))

    @staticmethod
    def get_impl_cls():
        if active_policy() is None:
            return CPUAttentionBackendImpl
        return KVPolicyAttentionImpl


class KVPolicyAttentionImpl(AttentionImpl):
    """One attention layer of a vLLM model over kvpolicy's packed pages."""

    def __init__(
        self, num_heads: int, head_size: int, scale: float, num_kv_heads: int,
        alibi_slopes: list[float] | None, sliding_window: int | None, kv_cache_dtype: str,
        logits_soft_cap: float | None = None, attn_type: str = AttentionType.DECODER,
        kv_sharing_target_layer_name: str | None = None, sinks: torch.Tensor | None = None,
        **extra: Any,
    ) -> None:
        refused = []
        if attn_type != AttentionType.DECODER:
            refused.append(f"{attn_type} attention (decoder self-attention only)")
        if alibi_slopes is not None:
            refused.append("ALiBi slopes")
        if sinks is not None:
            refused.append("learned attention sinks (s_aux)")
        if kv_sharing_target_layer_name is not None:
            refused.append("KV sharing across layers")
        if kv_cache_dtype not in ("auto", None):
            refused.append(f"kv_cache_dtype={kv_cache_dtype!r} (use 'auto': the policy "
                           "sets the cache's precision)")
        if extra:
            refused.append(f"backend arguments {sorted(extra)}")
        if refused:
            raise KVPolicyError("kvpolicy cannot serve this attention layer: "
                                + "; ".join(refused))
        self.num_heads, self.head_size, self.num_kv_heads = num_heads, head_size, num_kv_heads
        self.scale = float(scale)
        self.sliding_window = sliding_window
        self.softcap = logits_soft_cap or None
        self.kv_cache_dtype = kv_cache_dtype
        self.kv_sharing_target_layer_name = None
        self.served = active_policy()
        cfg = get_current_vllm_config_or_none()
        self.total_kv_heads = (cfg.model_config.get_total_num_kv_heads() if cfg is not None
                               else num_kv_heads)
        if self.served is None:
            raise KVPolicyError("KVPolicyAttentionImpl built for an engine whose "
                                "additional_config names no kvpolicy")
        self._paged: PagedKV | None = None
        self._said, self._index = False, -1  # the decode path logged (layer 0), layer index

    def _build(self, layer: torch.nn.Module, kv_cache: torch.Tensor,
               query: torch.Tensor) -> PagedKV:
        name = getattr(layer, "layer_name", "")
        try:
            index = extract_layer_index(name)
        except (AssertionError, ValueError) as e:
            raise KVPolicyError(f"cannot read a layer index from the attention layer "
                                f"{name!r}") from e
        # vLLM's view of a layer's cache is [num_blocks, head slots, block_size, bytes]
        block_size = kv_cache.shape[2]
        cache_dtype = getattr(layer, "kv_cache_torch_dtype", None) or query.dtype
        total = self.total_kv_heads
        served = self.served
        layout = served.layout(
            index, num_kv_heads=self.num_kv_heads, head_dim=self.head_size,
            v_head_dim=getattr(layer, "head_size_v", self.head_size),
            block_size=block_size, cache_dtype=cache_dtype,
            kv_heads=local_kv_heads(total))
        pol = served.policy.get(index, "value")
        # vLLM's own kernel for first prefills where K and V share a head size (its caches'
        # layout); else torch's SDPA
        same = layout.v_head_dim == layout.head_dim
        paged = PagedKV(layout, scale=self.scale, rope=served.rope_for(index),
                        value_rotation=pol.rotation, window=self.sliding_window,
                        softcap=self.softcap, backend="auto",
                        prefill=_fused_prefill() if same else None)
        self._index = index
        if index == 0:
            log.info("kvpolicy: layer 0 %s; %s", layout.describe(), served.rope_why)
        return paged

    def do_kv_cache_update(self, layer, key, value, kv_cache, slot_mapping) -> None:
        """Nothing: ``forward`` attends first (over the cache as it stood and the new
        tokens in full precision), then appends, as the packed cache of ``compile_model``
        does. (A class attribute, ``forward_includes_kv_cache_update``, would say so, but it
        is read from the backend class, which also serves engines without a policy.)"""

    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output,
                output_scale=None, output_block_scale=None):
        if output_scale is not None or output_block_scale is not None:
            raise KVPolicyError("kvpolicy does not fuse output quantization")
        if attn_metadata is None:  # profiling run
            return output
        if self._paged is None:
            self._paged = self._build(layer, kv_cache, query)
        n = attn_metadata.num_actual_tokens
        batch = _step_batch(attn_metadata)
        pages = _pages(kv_cache)
        # written in place (by the fused decode step, or copied from the torch path)
        self._paged.forward(pages, query[:n], key[:n], value[:n], batch,
                            out=output[:n].view(n, self.num_heads, -1))
        if not self._said and self._paged.step_path is not None and batch.decoding:
            self._said = True
            if self._index == 0:
                log.info("kvpolicy: layer 0 runs decode steps with %s", self._paged.step_path)
        return output


@cache
def _fused_prefill() -> FusedPrefill:
    """One for the process: its scratch cache is shared by the layers, which run in turn."""
    return FusedPrefill()


# The last step's metadata and its SeqBatch: every layer of a step gets the same metadata
# object, so the batch's index tensors are built once per step (a strong reference, so
# that a later step's metadata cannot take a freed one's identity).
_STEP: list = [None, None]


def _step_batch(meta) -> SeqBatch:
    if _STEP[0] is not meta:
        _STEP[:] = [meta, SeqBatch(meta.query_start_loc.tolist(), meta.seq_lens.tolist(),
                                   meta.block_table)]
    return _STEP[1]


def _pages(kv_cache: torch.Tensor) -> torch.Tensor:
    """vLLM's per-layer cache view ``[num_blocks, ...]`` as ``[num_blocks, page_bytes]``
    uint8, a view of the same memory (each block's page is contiguous)."""
    raw = kv_cache.view(torch.uint8) if kv_cache.dtype != torch.uint8 else kv_cache
    return raw.view(raw.shape[0], -1)
