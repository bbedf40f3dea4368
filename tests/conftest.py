"""Shared fixtures. The real model is converted once per machine and cached on disk."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def smollm2():
    """(model, tokenizer) of SmolLM2-135M-Instruct, loaded once per test session."""
    from kvpolicy import zoo

    return zoo.load("smollm2-135m")
