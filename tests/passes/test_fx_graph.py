"""FX helpers (kvpolicy/passes/fx_graph.py): copying an exported graph."""

from __future__ import annotations

import warnings

import torch
from torch import fx, nn

from kvpolicy.passes.fx_graph import copy_graph


class _TwoOut(nn.Module):
    def forward(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return x * 2 + y, (x - y).relu()


def _exported() -> fx.GraphModule:
    """An unlifted exported module: its graph's codegen carries pytree specs whose leaves
    are ``LeafSpec`` objects."""
    args = (torch.randn(2, 3), torch.randn(2, 3))
    return torch.export.export(_TwoOut(), args).module()


def test_copy_is_a_new_graph_that_computes_the_same():
    gm = _exported()
    new, env = copy_graph(gm.graph)
    assert set(env) == {n for n in gm.graph.nodes if n.op != "output"}
    assert not set(env.values()) & set(gm.graph.nodes)  # new nodes, none shared
    assert [n.name for n in new.nodes] == [n.name for n in gm.graph.nodes]
    out_old = next(n for n in gm.graph.nodes if n.op == "output")
    out_new = next(n for n in new.nodes if n.op == "output")
    assert out_new.meta.keys() == out_old.meta.keys()
    assert new._codegen is not gm.graph._codegen
    assert new._codegen.pytree_info == gm.graph._codegen.pytree_info
    x, y = torch.randn(2, 3), torch.randn(2, 3)
    copied = fx.GraphModule(gm, new)
    for got, want in zip(copied(x, y), gm(x, y), strict=True):
        torch.testing.assert_close(got, want)


def test_copy_warns_nothing_where_deepcopy_warns():
    """torch 2.13 deprecates ``LeafSpec`` and ``copy.deepcopy(graph)`` rebuilds the leaf
    specs of the codegen, with a FutureWarning each time; the copy does not."""
    gm = _exported()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        copy_graph(gm.graph)
    assert not caught, [str(w.message) for w in caught]
