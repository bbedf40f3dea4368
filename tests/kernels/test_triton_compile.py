"""The compiled path of the Triton kernels, checked without a GPU.

The interpreter runs kernels as Python and accepts programs that Triton's compiler
rejects, so ``_sm90_compile.py`` compiles every kernel family ahead of time for sm_90
(ptxas ships with the triton wheel) in a subprocess that does not set
``TRITON_INTERPRET``. On a machine with a GPU the other tests compile the kernels anyway.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import triton

pytestmark = pytest.mark.triton

_PTXAS = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
_ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(not _PTXAS.exists(), reason="this triton wheel ships no ptxas")
def test_kernels_compile_for_sm90():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(_ROOT), env.get("PYTHONPATH")]))
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # silences a triton 3.9 notice
    proc = subprocess.run(
        [sys.executable, str(Path(__file__).with_name("_sm90_compile.py"))],
        env=env, capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, f"sm_90 compile failed:\n{proc.stdout}\n{proc.stderr[-4000:]}"
    assert proc.stdout.count("compiled for sm_90") == 26, proc.stdout
