"""The engine settings a served policy needs, applied where vLLM checks its config."""

from __future__ import annotations

import logging
from typing import Any

from ..errors import PolicyError
from .policy import config_value, served_policy

__all__ = ["configure_engine"]

log = logging.getLogger("vllm.kvpolicy")  # vLLM's handlers print it


def configure_engine(vllm_config: Any) -> None:
    """Derive the policy named in ``additional_config`` (a no-op without one), refuse what
    it cannot serve, and set the block size it needs."""
    value = config_value(vllm_config)
    if value is None:
        return
    mc, cc = vllm_config.model_config, vllm_config.cache_config
    if mc is None:
        return
    kinds = [what for what, yes in (
        ("multi-head latent attention (MLA: vLLM caches the latent, not per-head K/V)",
         getattr(mc, "use_mla", False)),
        ("a hybrid model (attention beside state-space layers share one block pool)",
         getattr(mc, "is_hybrid", False)),
        ("an attention-free model", getattr(mc, "is_attention_free", False)),
        ("an encoder-decoder model", getattr(mc, "is_encoder_decoder", False)),
    ) if yes]
    if kinds:
        raise PolicyError(f"kvpolicy cannot serve {kinds[0]} in vLLM; serve it without "
                          "additional_config['kvpolicy'], or compile it with compile_model")
    served = served_policy(mc.model, value, int(mc.max_model_len))
    served.check_model(num_layers=mc.get_total_num_hidden_layers(),
                       num_kv_heads=mc.get_total_num_kv_heads(), head_dim=mc.get_head_size())
    if getattr(vllm_config, "speculative_config", None) is not None:
        raise PolicyError("kvpolicy does not serve speculative decoding (a rejected draft "
                          "token would have to leave the packed cache); drop "
                          "speculative_config")
    chunk = served.chunk()
    if served.full_precision():
        return
    if not cc.user_specified_block_size:
        cc.block_size = served.default_block_size()
        log.warning("kvpolicy: block_size %d (a multiple of the key group of %d tokens "
                    "and of 32); pass block_size to choose another", cc.block_size, chunk)
    elif cc.block_size % chunk:
        raise PolicyError(
            f"kvpolicy: block_size {cc.block_size} is not a multiple of the policy's key "
            f"group of {chunk} tokens, so a group would span two blocks; pass block_size="
            f"{served.default_block_size()} (or leave it unset)")
    note = served.page_count_note()
    if note is not None:
        log.warning(note)
    res = {t.residual for t in served.policy.tensors if t.bits < 16}
    if res and max(res) > 0:
        log.warning("kvpolicy: the policy's residual window of %d tokens is served as the "
                    "incomplete key group (up to %d tokens) in full precision: vLLM's "
                    "fixed-size pages hold no per-sequence window", max(res), chunk - 1)
    if any(t.residual_bits < 16 for t in served.policy.tensors):
        log.warning("kvpolicy: residual_bits below 16 is not served: a page's incomplete "
                    "key group (its stage) is held in full precision whatever the policy "
                    "says, as the paged layout's bytes count it; residual_bits applies to "
                    "kvpolicy.compile_model's own cache")
