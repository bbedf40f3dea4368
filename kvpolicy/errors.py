"""Exceptions a user of kvpolicy can meet.

Every error names what happened and what to do about it. ``assert`` is reserved for
internal invariants; anything a user can cause raises one of these.
"""

from __future__ import annotations

__all__ = ["KVPolicyError", "PolicyError", "AnalysisError", "CacheError", "ZooError"]


class KVPolicyError(Exception):
    """Base class of every error kvpolicy raises on purpose."""


class PolicyError(KVPolicyError, ValueError):
    """A policy (YAML file, dict or arguments) is invalid or does not fit the model."""


class AnalysisError(KVPolicyError):
    """The graph analysis met something it cannot decide; the message names the node."""


class CacheError(KVPolicyError, ValueError):
    """Bad input to the packed KV cache (shape, dtype, NaN/Inf); the cache is left unchanged."""


class ZooError(KVPolicyError, RuntimeError):
    """A model or data set of the zoo cannot be loaded; the message names the install step."""
