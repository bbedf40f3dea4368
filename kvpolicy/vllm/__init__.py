"""Serve a kvpolicy policy with vLLM: a general plugin (entry point ``vllm.general_plugins``).

Install ``kvpolicy[vllm]`` and name a policy in vLLM's ``additional_config``::

    vllm serve DIR --additional-config '{"kvpolicy": "policy.yaml"}'
    vllm.LLM(model=DIR, additional_config={"kvpolicy": "kvpolicy-2"})

The value is what ``compile_model(policy=...)`` takes (a preset, a policy file, a dict)
or an int width. The policy is derived from the checkpoint (:mod:`kvpolicy.vllm.policy`),
checked against the model vLLM loads, and served by :mod:`kvpolicy.vllm.backend`: vLLM
allocates packed pages and attention reads them with kvpolicy's kernels. An engine without
the key runs vLLM's own attention, unchanged.

What the engine's config is changed to, said once in the log: a block size that the
policy's key groups tile (when none was given). Prefix caching stays as vLLM sets it (on by
default): full packed blocks are shared as vLLM's own are. Refused at engine
start: speculative decoding. Sliding-window layers hold packed pages as global ones do
(vLLM frees the blocks their window has left).
"""

from __future__ import annotations

import logging

from .config import configure_engine

__all__ = ["register"]

log = logging.getLogger("vllm.kvpolicy")  # vLLM's handlers print it

_REGISTERED = False


def register() -> None:
    """The plugin's entry point, run by vLLM in every process of an engine."""
    global _REGISTERED
    if _REGISTERED:
        return
    _REGISTERED = True
    from vllm.platforms import current_platform
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    register_backend(AttentionBackendEnum.CPU_ATTN,
                     "kvpolicy.vllm.backend.KVPolicyAttentionBackend")
    platform = type(current_platform)
    original = platform.check_and_update_config.__func__

    def check_and_update_config(cls, vllm_config) -> None:
        original(cls, vllm_config)
        configure_engine(vllm_config)

    platform.check_and_update_config = classmethod(check_and_update_config)
