"""Shared fixtures: the real model (converted once per machine, cached on disk), and the
Triton kernels in interpreter mode on machines without a GPU.

Why the interpreter is set here and this way: ``triton.jit`` decides between a compiled
and an interpreted kernel when the kernel module is *imported* (it reads
``TRITON_INTERPRET`` through ``triton.knobs`` at decoration time), so the variable must be
set before the test modules import ``kvpolicy.kernels.triton_*``. pytest imports this
conftest before it collects any test module, and nothing in the package imports the Triton
modules at import time (the backends import them lazily), so setting it here reaches every
Triton test (tests/kernels, tests/runtime). It is an environment variable of the test
process, read only by Triton; no Triton module is imported at this point. On a machine
with CUDA it is left unset (the same tests then run compiled kernels on the GPU, with one
autotune config, see the fixture below); an explicit value is respected.
"""

from __future__ import annotations

import os
import sys

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

for _name in ("kvpolicy.kernels.triton_quant", "kvpolicy.kernels.triton_attention"):
    _mod = sys.modules.get(_name)
    if _mod is not None and not _mod._INTERPRET and not torch.cuda.is_available():
        # Imported earlier in this process without the interpreter: its kernels were
        # decorated as compiled GPU kernels and cannot run on CPU tensors.
        raise RuntimeError(
            f"{_name} was imported before tests/conftest.py set TRITON_INTERPRET=1; "
            "run the Triton tests on their own (pytest -m triton) or set TRITON_INTERPRET=1"
        )


@pytest.fixture(autouse=True, scope="session")
def _one_triton_config_on_gpu():
    """On a GPU, run the tests with the first autotune config of each kernel.

    Tuning would compile and time every config for each of the many small policies the
    tests cover (minutes); the tests check results, not speed. The interpreter already
    keeps a single config. Restored after the session.
    """
    if not torch.cuda.is_available():
        yield
        return
    from kvpolicy.kernels import triton_attention, triton_decode, triton_quant

    tuned = [triton_attention._packed_attention_kernel, triton_decode._decode_kernel,
             triton_quant._quantize_pack_kernel]
    saved = [k.configs for k in tuned]
    for k in tuned:
        k.configs = k.configs[:1]
    yield
    for k, configs in zip(tuned, saved, strict=True):
        k.configs = configs




@pytest.fixture(scope="session")
def smollm2():
    """(model, tokenizer) of SmolLM2-135M-Instruct, loaded once per test session."""
    from kvpolicy import zoo

    return zoo.load("smollm2-135m")
