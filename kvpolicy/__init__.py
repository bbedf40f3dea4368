"""kvpolicy: a compression-policy compiler for the KV cache of transformer language models.

It traces the attention block, finds how each cached tensor is contracted (keys: a dot
product over channels; values: a softmax-weighted sum over tokens), derives the grouping
axis, bit width and RoPE ordering of each tensor from that, and stores a packed low-bit
cache that attention reads directly.

    policy = kvpolicy.derive_policy(model, bits=2)
    print(kvpolicy.inspect(model))
"""

from .api import analyse_model, derive_policy, inspect
from .errors import AnalysisError, CacheError, KVPolicyError, PolicyError, ZooError
from .policy import Axis, ModelPolicy, PolicySpec, TensorKind, TensorPolicy, load_spec

__version__ = "0.1.0"

__all__ = [
    "analyse_model",
    "derive_policy",
    "inspect",
    "AnalysisError",
    "CacheError",
    "KVPolicyError",
    "PolicyError",
    "ZooError",
    "Axis",
    "ModelPolicy",
    "PolicySpec",
    "TensorKind",
    "TensorPolicy",
    "load_spec",
]
