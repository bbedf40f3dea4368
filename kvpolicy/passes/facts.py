"""Facts the graph analysis establishes about each cached tensor.

These records are the contract between *analyse* (``kvpolicy.passes``) and *derive*
(``kvpolicy.policies``), docs/design.md §4: the analysis returns them (``LayerFacts`` per
layer, in ``ModelAnalysis.layers``), the policy derivation reads them, and derivation never
looks at the graph. They are plain frozen dataclasses, shared by every layer of one kind.
(The graph-bound match records the rewrite reads live in ``node.meta``; see
``analysis.analyse``.)
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

__all__ = ["Contracted", "RopeStyle", "RopeFacts", "TensorFacts", "LayerFacts"]


class Contracted(str, Enum):
    """Which dimension of the cached tensor ``[batch, kv_heads, tokens, head_dim]`` the
    attention consumer sums over."""

    CHANNEL = "channel"  # q · kᵀ: a dot product over head_dim
    TOKEN = "token"  # softmax(s) · V: a weighted sum over the sequence


class RopeStyle(str, Enum):
    ROTATE_HALF = "rotate_half"  # x*cos + cat(-x2, x1)*sin      (Llama, NeoX, ...)
    INTERLEAVED = "interleaved"  # pairs (x[2i], x[2i+1])          (GPT-J, CodeGen)
    # view_as_complex(x) * freqs_cis (Meta Llama, gpt-fast): interleaved pairs
    COMPLEX = "complex"


@dataclass(frozen=True)
class RopeFacts:
    """A rotary embedding found on the key path, and how to re-apply it after dequantization."""

    style: RopeStyle
    rotary_dim: int  # channels rotated, counted from channel 0 (== head_dim unless partial)
    head_dim: int
    # Where cos/sin (or freqs_cis) enter the block: the placeholder or attribute names
    # of the exported graph and the argument path, e.g. "position_embeddings[0]".
    cos_source: str
    sin_source: str | None  # None for the complex style (one freqs_cis tensor)
    pre_rope_node: str  # graph node holding the key right before the rotation
    description: str  # e.g. "rotate-half RoPE on channels 0-31 of 64 (partial)"
    # First rotated channel. 0 for a rotation of the key itself; > 0 for the rotary slice
    # of a key assembled from parts (MLA's decoupled RoPE key: channels 128-191 of 192).
    first_channel: int = 0

    @property
    def partial(self) -> bool:
        return self.rotary_dim < self.head_dim

    @property
    def reapplicable(self) -> bool:
        """Whether the cache can store the key before this rotation and re-apply it: the
        kernels rotate channels ``0 .. rotary_dim - 1`` of a whole key."""
        return self.first_channel == 0


@dataclass(frozen=True)
class TensorFacts:
    """What the analysis found about one cached tensor (key or value) of one block kind."""

    tensor: str  # "key" | "value"
    contracted: Contracted
    head_dim: int  # size of the channel dim of the cached tensor
    num_kv_heads: int
    contraction: str  # human text, e.g. "q·kᵀ over head_dim=64 (scaled_dot_product_attention)"
    source_node: str  # graph node that would be cached (after any key norm, before RoPE)
    consumer_node: str  # the attention consumer
    rope: RopeFacts | None = None  # keys only; None when the key path has no rotation
    norm_before_rope: bool = False  # a per-head key norm precedes the rotation (Qwen3, OLMo2)


@dataclass(frozen=True)
class LayerFacts:
    """Facts for one attention layer: its index, its block kind, and key/value facts."""

    layer: int
    block_kind: str  # module class + shape signature, the unit traced once
    key: TensorFacts
    value: TensorFacts
