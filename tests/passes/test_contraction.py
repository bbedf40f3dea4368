"""Unit tests of the dim bookkeeping the contraction walk relies on."""

import sympy
import torch
from torch.fx.experimental.symbolic_shapes import ShapeEnv

from kvpolicy.passes.contraction import _reshape_map
from kvpolicy.passes.fx_graph import is_symbolic


def _sym(env: ShapeEnv, name: str, hint: int) -> torch.SymInt:
    return env.create_symintnode(sympy.Symbol(name, positive=True, integer=True), hint=hint)


def test_reshape_map_follows_copied_dims_and_refuses_split_or_merged_ones():
    env = ShapeEnv()
    b, t = _sym(env, "b", 2), _sym(env, "t", 7)
    # [B, T, H*D] -> [B, T, H, D]: B and T are copies, H and D are a split of one dim.
    src, dst = (b, t, 96), (b, t, 3, 32)
    assert _reshape_map(src, dst, 0) == 0
    assert _reshape_map(src, dst, 1) == 1
    assert _reshape_map(src, dst, 2) is None and _reshape_map(src, dst, 3) is None
    # [B, 1, T, D] -> [B, T, D]: size-1 dims do not block the mapping.
    assert _reshape_map((b, 1, t, 32), (b, t, 32), 1) == 2
    # [B, H, T, D] -> [B, H*T, D]: tokens merged with heads are lost.
    assert _reshape_map((b, 3, t, 32), (b, 3 * t, 32), 1) is None
    assert _reshape_map((b, 3, t, 32), (b, 3 * t, 32), 2) == 3


def test_symbolic_sizes_are_told_from_static_ones():
    env = ShapeEnv()
    assert is_symbolic(_sym(env, "t", 7))
    assert not is_symbolic(64)
