"""Progress bars where they can redraw: on a terminal or in a notebook, nowhere else.

A tqdm bar redraws itself with carriage returns. In a CI log, a pipe or a file every
redraw is kept: a 1,000-step decode leaves a thousand fragments on one line. Every bar
kvpolicy draws comes from :func:`progress_bar`, which turns itself off when its stream is
not a terminal; there :func:`stage_done` writes one line when the stage ends instead.
"""

from __future__ import annotations

import sys
from typing import IO

from tqdm.auto import tqdm

__all__ = ["interactive", "progress_bar", "stage_done"]

# tqdm.auto picks the widget bar under a Jupyter kernel, which does not write to the stream
# (a kernel's stderr is not a terminal, yet the bar shows).
_NOTEBOOK = any(c.__module__ == "tqdm.notebook" for c in tqdm.__mro__)


def interactive(stream: IO[str] | None = None) -> bool:
    """Whether a bar on ``stream`` (default ``sys.stderr``, where tqdm writes) redraws in
    place: the stream is a terminal, or the bar is a notebook widget."""
    if _NOTEBOOK:
        return True
    stream = sys.stderr if stream is None else stream
    isatty = getattr(stream, "isatty", None)
    try:
        return bool(isatty is not None and isatty())
    except (ValueError, OSError):  # a closed or detached stream
        return False


def progress_bar(total: int, *, desc: str | None = None, unit: str = "it",
                 enabled: bool = True, file: IO[str] | None = None) -> tqdm:
    """A tqdm bar of ``total`` steps on ``file`` (default ``sys.stderr``), drawn only when
    ``enabled`` and the stream is interactive (:func:`interactive`); otherwise a disabled
    bar, whose ``update`` and ``close`` do nothing."""
    return tqdm(total=total, desc=desc, unit=unit, file=file,
                disable=not (enabled and interactive(file)))


def stage_done(bar: tqdm, line: str, *, enabled: bool = True,
               file: IO[str] | None = None) -> None:
    """Close ``bar``; where it was not drawn (``enabled`` but not interactive), write
    ``line`` instead, one per stage, to ``file`` (default ``sys.stderr``)."""
    bar.close()
    if enabled and bar.disable:
        print(line, file=sys.stderr if file is None else file, flush=True)
