"""kvpolicy: a compression-policy compiler for the KV cache of transformer language models.

It traces the attention block, finds how each cached tensor is contracted (keys: a dot
product over channels; values: a softmax-weighted sum over tokens), derives the grouping
axis, bit width and RoPE ordering of each tensor from that, and stores a packed low-bit
cache that attention reads directly.

    model = kvpolicy.compile_model(model, bits=2)
    print(kvpolicy.inspect(model))
    model.generate(...)
"""

from .api import analyse_model, compile_model, derive_policy, inspect, save_policy
from .errors import AnalysisError, CacheError, KVPolicyError, PolicyError, ZooError
from .evaluation.run import evaluate
from .policies import (
    Axis,
    Calibration,
    ModelPolicy,
    PolicySpec,
    TensorKind,
    TensorPolicy,
    load_spec,
)
from .runtime.cache import KVPolicyCache

__version__ = "0.1.0"

__all__ = [
    "compile_model",
    "evaluate",
    "KVPolicyCache",
    "analyse_model",
    "derive_policy",
    "inspect",
    "save_policy",
    "AnalysisError",
    "CacheError",
    "KVPolicyError",
    "PolicyError",
    "ZooError",
    "Axis",
    "Calibration",
    "ModelPolicy",
    "PolicySpec",
    "TensorKind",
    "TensorPolicy",
    "load_spec",
]
