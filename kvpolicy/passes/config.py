"""What a model's config says that the graph of one probe forward cannot.

The analysis reads everything it can from the traced graph. Three facts it reads from the
``transformers`` config instead, as transformers itself does to build its own cache:

- which layers are sliding-window layers, and the window (``sliding_windows``): a window
  mask is built by the model outside the attention block, from the cache's sizes;
- whether the model is an encoder-decoder, and whether layers share another layer's keys
  and values (``check_supported``): both are refused before any probe runs, with the
  reason, rather than failing inside a probe forward or ``torch.export``.

A model without a config (a hand-written module) has none of these: its masks are its own.
"""

from __future__ import annotations

import logging
from typing import Any

from torch import nn

from ..errors import AnalysisError

__all__ = ["check_supported", "probe_lengths", "sliding_windows", "text_config"]

log = logging.getLogger(__name__)

# The two plain probe forwards' sequence lengths (analysis.analyse); shorter ones are used
# below a sliding window so that neither probe builds a window mask (see probe_lengths).
PROBE_LENGTHS = (7, 11)
_SHORTEST_PROBES = (2, 3)


def text_config(model: nn.Module) -> Any | None:
    """The decoder's config of ``model`` (the text config of a multimodal one), or None."""
    config = getattr(model, "config", None)
    if config is None:
        return None
    if hasattr(config, "get_text_config"):
        config = config.get_text_config(decoder=True)
    return config


def _window(config: Any) -> int | None:
    window = getattr(config, "sliding_window", None)
    if not isinstance(window, int) or isinstance(window, bool) or window < 1:
        return None
    return window


def sliding_windows(model: nn.Module, n_layers: int) -> dict[int, int]:
    """Attention layer -> sliding window, for the layers the model's config marks local.

    Read as transformers reads it to build its own cache and masks: ``layer_types``
    (``"sliding_attention"``; Gemma2/3, gpt-oss, Qwen2 with ``use_sliding_window``), or,
    without it, a ``sliding_window`` set on the config (Mistral: every layer). Chunked
    attention (Llama 4) is not a window and is left alone.
    """
    config = text_config(model)
    window = _window(config) if config is not None else None
    if window is None:
        return {}
    types = getattr(config, "layer_types", None)
    if types is None:
        return dict.fromkeys(range(n_layers), window)
    if len(types) != n_layers:
        log.warning(
            "config.layer_types names %d layers but %d attention layers were found; "
            "no layer evicts outside its window", len(types), n_layers,
        )
        return {}
    return {i: window for i, t in enumerate(types) if t == "sliding_attention"}


def probe_lengths(model: nn.Module) -> tuple[int, int]:
    """Sequence lengths of the two plain probe forwards.

    Both must be shorter than the model's sliding window: at a length that reaches the
    window transformers builds a window mask and passes it to the block, so one probe
    would pass a mask and the other not, and the call structure could not be traced. (The
    masked call structure is traced separately, from a left-padded probe.)

    Raises:
        AnalysisError: the window is too small for two distinct probe lengths.
    """
    config = text_config(model)
    window = _window(config) if config is not None else None
    if window is None or window > PROBE_LENGTHS[1]:
        return PROBE_LENGTHS
    if window <= _SHORTEST_PROBES[1]:
        raise AnalysisError(
            f"the model's sliding window of {window} tokens is too small to trace: kvpolicy "
            f"traces each attention block from two probe forwards of different lengths "
            f"(at least {_SHORTEST_PROBES[0]} and {_SHORTEST_PROBES[1]} tokens), both shorter "
            "than the window so that neither passes a window mask. Use a window of at least "
            f"{_SHORTEST_PROBES[1] + 1} tokens"
        )
    return window - 2, window - 1


def check_supported(model: nn.Module) -> None:
    """Refuse, before any probe runs, model kinds kvpolicy does not compile.

    Raises:
        AnalysisError: an encoder-decoder (BART, T5, Whisper ...), or a model whose layers
            reuse another layer's keys and values (Gemma3n's ``num_kv_shared_layers``).
    """
    config = getattr(model, "config", None)
    name = type(model).__name__
    if config is not None and getattr(config, "is_encoder_decoder", False):
        raise AnalysisError(
            f"{name} is an encoder-decoder (config.is_encoder_decoder): its decoder attends "
            "to itself and, through cross-attention, to the encoder's output, and its "
            "encoder's self-attention is not cached at all. kvpolicy compiles decoder-only "
            "models, whose every attention layer appends to and reads one growing cache; "
            "it would treat the encoder and cross-attention layers as such caches. Compile "
            "a decoder-only model"
        )
    text = text_config(model)
    shared = getattr(text, "num_kv_shared_layers", 0) if text is not None else 0
    if isinstance(shared, int) and shared > 0:
        raise AnalysisError(
            f"{name} shares keys and values across layers (config.num_kv_shared_layers="
            f"{shared}: the last {shared} layers attend over the cache of an earlier layer "
            "instead of computing their own). kvpolicy gives each attention layer its own "
            "packed cache and rewrites the block that computes it; a layer that reads "
            "another layer's cache has none. Cross-layer KV sharing is not supported; "
            "compile a model without it (num_kv_shared_layers=0)"
        )
