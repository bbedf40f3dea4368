"""Calibration text: the default (the end of the pydoc text in the model's own tokens)
and the token ids a user's file gives. Every calibration reads its text here: a bit
budget's (``budget``), per-channel key widths' (``apply.channel_text``) and vq codebooks'
(``vq.vq_text``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..errors import KVPolicyError
from ..zoo.text import pydoc_tokens

__all__ = ["CALIBRATION_TOKENS", "CALIBRATION_ROWS", "calibration_ids",
           "calibration_ids_from_file", "find_tokenizer"]

CALIBRATION_TOKENS = 512
# Rows of CALIBRATION_TOKENS in a budget's default text (the last 2,048 pydoc tokens): more
# text, less noise in the costs the allocator trusts (docs/results.md, "Bit budgets:
# calibration"). Measured a row at a time (the loss-weighted errors add over rows): memory
# is one row's.
CALIBRATION_ROWS = 4


def find_tokenizer(model: nn.Module):
    """The tokenizer saved beside the model's weights (``config._name_or_path``: a folder
    with the tokenizer's files or a single GGUF file, or a hub name already in the local
    cache: nothing is downloaded), or None."""
    path = getattr(getattr(model, "config", None), "_name_or_path", "") or ""
    if path and not Path(path).is_dir() and "/" in path and not path.startswith((".", "/")):
        from transformers import AutoTokenizer

        try:
            return AutoTokenizer.from_pretrained(path, local_files_only=True)
        except (OSError, ValueError):  # not in the local cache: the caller says what to pass
            return None
    if not path or not Path(path).is_dir():
        return None
    from transformers import AutoTokenizer

    if any((Path(path) / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json")):
        return AutoTokenizer.from_pretrained(path)
    # A model loaded with from_pretrained(folder, gguf_file=name) keeps only the folder: its
    # tokenizer is in the GGUF file, found when the folder holds exactly one.
    ggufs = sorted(Path(path).glob("*.gguf"))
    if len(ggufs) == 1:
        return AutoTokenizer.from_pretrained(path, gguf_file=ggufs[0].name)
    return None


def calibration_ids(
    model: nn.Module, tokens: int = CALIBRATION_TOKENS, tokenizer: Any = None, rows: int = 1,
    skip: int = 0,
) -> tuple[torch.Tensor, str]:
    """The default calibration input: the last ``rows * tokens`` tokens of the pydoc text,
    ``[rows, tokens]`` (a budget's default is :data:`CALIBRATION_ROWS` rows); ``skip``:
    those before the last ``skip`` tokens instead (held-out text beside a calibration's).

    The eval's segments start at the beginning of the text, so this never overlaps them.

    Raises:
        KVPolicyError: no tokenizer given and none saved beside the model.
    """
    tok = tokenizer if tokenizer is not None else find_tokenizer(model)
    if tok is None:
        raise KVPolicyError(
            f"a bit budget needs calibration text in the model's own tokens, and "
            f"{type(model).__name__} has no tokenizer saved at config._name_or_path; pass "
            "calibration=<[B, T] token ids> (about 512 tokens of text like yours) or "
            "calibration=<a tokenizer>"
        )
    ids = pydoc_tokens(tok)
    n = rows * tokens
    if ids.numel() < n + skip:
        raise KVPolicyError(f"the pydoc text has only {ids.numel()} tokens, {n + skip} "
                            "requested")
    where = (f"pydoc text, last {n} tokens" if not skip else
             f"pydoc text, {n} tokens before the last {skip}")
    where += f" as {rows} rows of {tokens}" if rows > 1 else ""
    return ids[ids.numel() - skip - n : ids.numel() - skip].reshape(rows, tokens), where


_TOKEN_ID_SUFFIXES = (".pt", ".pth")


def calibration_ids_from_file(
    model: nn.Module, path: str | Path, tokens: int = CALIBRATION_TOKENS,
    rows: int = CALIBRATION_ROWS,
) -> torch.Tensor:
    """Calibration token ids read from a file, for ``calibrate(model, policy, ids)``.

    Args:
        model: the model to calibrate; its tokenizer (saved beside its weights, at
            ``config._name_or_path``) tokenizes a text file.
        path: a ``.pt``/``.pth`` file holding token ids saved with ``torch.save`` (an integer
            tensor ``[T]`` or ``[B, T]``, used whole), or any other file: UTF-8 text, cut
            from its start (no special tokens) into up to ``rows`` rows of ``tokens``, as
            the default calibration text is.
        tokens, rows: the rows a text file gives: as many whole rows of ``tokens`` as it
            holds, at most ``rows``; a text shorter than one row gives one shorter row (and
            :func:`calibrate` says when it is too short to pack anything).

    Returns:
        ``[B, T]`` int64 token ids (``B = 1`` for a ``[T]`` tensor).

    Raises:
        KVPolicyError: the file is missing or cannot be read; a ``.pt`` file does not hold
            an integer tensor of 1 or 2 dimensions; a text file is empty; text is given
            but the model has no tokenizer saved beside it.
    """
    path = Path(path)
    if not path.is_file():
        raise KVPolicyError(
            f"calibration file {path} not found; give a .pt file of token ids saved with "
            "torch.save, or a UTF-8 text file"
        )
    if path.suffix.lower() in _TOKEN_ID_SUFFIXES:
        try:
            ids = torch.load(path, weights_only=True, map_location="cpu")
        except Exception as exc:  # unpickling errors come in many types
            raise KVPolicyError(
                f"calibration file {path}: cannot load it with torch.load(weights_only=True) "
                f"({type(exc).__name__}: {exc}); save the token ids with "
                "torch.save(ids, path), ids an integer tensor [T] or [B, T]"
            ) from None
        if isinstance(ids, torch.Tensor):
            what = f"a {ids.dtype} tensor of shape {list(ids.shape)}"
        else:
            what = f"a {type(ids).__name__}"
        if (
            not isinstance(ids, torch.Tensor)
            or ids.dtype.is_floating_point
            or ids.dtype.is_complex
            or ids.dtype == torch.bool
            or ids.dim() not in (1, 2)
            or ids.numel() == 0
        ):
            raise KVPolicyError(
                f"calibration file {path} holds {what}; it must hold the token ids as a "
                "non-empty integer tensor of shape [T] or [B, T] (e.g. "
                "torch.save(tokenizer(text, return_tensors='pt').input_ids, path))"
            )
        ids = ids.to(torch.int64)
        return ids[None] if ids.dim() == 1 else ids
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise KVPolicyError(
            f"calibration file {path} is not UTF-8 text ({exc.reason} at byte {exc.start}); "
            "give UTF-8 text, or token ids saved with torch.save as a .pt file"
        ) from None
    if not text.strip():
        raise KVPolicyError(
            f"calibration file {path} is empty; give about {tokens} tokens of text like the "
            "text the model will see"
        )
    tok = find_tokenizer(model)
    if tok is None:
        raise KVPolicyError(
            f"calibration file {path} is text, and {type(model).__name__} has no tokenizer "
            "saved at config._name_or_path to turn it into token ids; pass token ids "
            "saved with torch.save as a .pt file instead (an integer tensor [T] or [B, T])"
        )
    ids = tok(text, add_special_tokens=False, return_attention_mask=False)["input_ids"]
    whole = min(rows, len(ids) // tokens)
    if whole == 0:
        return torch.tensor(ids, dtype=torch.long)[None]
    return torch.tensor(ids[: whole * tokens], dtype=torch.long).reshape(whole, tokens)
