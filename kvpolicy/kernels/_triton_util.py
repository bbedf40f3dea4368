"""What the Triton kernel modules share about how Triton runs here."""

from __future__ import annotations

import os

import triton


def interpreting() -> bool:
    """True when Triton runs in interpreter mode (decided, like ``triton.jit``, at import)."""
    knobs = getattr(triton, "knobs", None)  # triton >= 3.4
    if knobs is not None:
        return bool(knobs.runtime.interpret)
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")
