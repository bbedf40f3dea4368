"""The policy table (kvpolicy/policies/render.py)."""

from __future__ import annotations

from policy_factories import build

from kvpolicy.policies.render import render_table

# --------------------------------------------------------------------------- table


def test_table_groups_identical_layers_and_shows_values():
    table = str(build())
    lines = table.splitlines()
    assert "kvpolicy: tiny, policy kvpolicy-2: 4 attention layers" in lines[0]
    assert "2.00 code bits per element" in lines[0]
    header = lines[1].split()
    for column in ("layers", "tensor", "axis", "bits", "G", "levels", "meta", "fit", "rotation",
                   "pre-RoPE", "R", "sinks"):
        assert column in header
    rows = [line.split() for line in lines[3:-3]]
    assert len(rows) == 2  # layers 0-3 are identical: one key row, one value row
    # Footer: the achieved average and the packed bytes per token against fp16.
    assert lines[-2].startswith("average 2.000 code bits per cached element;")
    # 2 bits + 8-bit scale and zero per 12 tokens (keys) or 32 channels (values): 2.92 bits.
    assert "5.49x smaller" in lines[-2]
    # Then the whole cache at 4,096 tokens: 4 sinks and 132 residual tokens (128 and 4 of
    # a 12-token chunk not yet packed) at 16 bits, 3,960 packed at 2.92 -> 3.35 stored bits.
    assert lines[-1].startswith("whole cache at 4,096 tokens: 3.35 stored bits per element, "
                                "4.77x smaller than fp16")
    assert rows[0][:13] == ["0-3", "key", "channel", "2", "12", "uniform", "8", "mse", "-",
                            "yes", "128", "4", "-"]
    assert rows[1][:13] == ["0-3", "value", "token", "2", "32", "uniform", "8", "minmax",
                            "hadamard", "-", "128", "4", "-"]
    assert "q·kᵀ sums over channels" in lines[3]


def test_table_splits_where_a_layer_differs():
    policy = build({"overrides": [{"layers": 1, "tensor": "key", "bits": 4}]})
    rows = [line.split()[:13] for line in str(policy).splitlines()[3:-3]]
    assert [r[0] for r in rows] == ["0", "0", "1", "1", "2-3", "2-3"]
    # 4 bits: fp16 metadata in groups of 32, so no fit to show.
    assert rows[2][:8] == ["1", "key", "channel", "4", "32", "uniform", "16", "-"]
    assert rows[2][12] == "yes"


def _body(table: str) -> list[list[str]]:
    """The cells of the rows between the table's two rules (the footer may run to several
    lines)."""
    lines = table.splitlines()
    end = next(i for i in range(3, len(lines)) if lines[i].startswith("---"))
    return [line.split() for line in lines[3:end]]


def test_short_table_leaves_out_the_reasons_and_groups_on_what_it_shows():
    policy = build()
    # Layer 1's key differs only in its reason (as per-layer channel widths do): the full
    # table splits there, the short table does not.
    tensors = list(policy.tensors)
    tensors[2] = tensors[2].model_copy(update={"reason": "a reason of its own"})
    policy = policy.model_copy(update={"tensors": tuple(tensors)})
    assert [r[0] for r in _body(str(policy))] == ["0", "0", "1", "1", "2-3", "2-3"]
    short = render_table(policy, reasons=False)
    lines = short.splitlines()
    assert lines[1].split()[-1] == "override"  # no contraction or reason column
    rows = _body(short)
    assert [r[:2] for r in rows] == [["0-3", "key"], ["0-3", "value"]]
    assert all(len(r) == 13 for r in rows)
    full = str(policy).splitlines()
    assert lines[0] == full[0] and lines[-1] == full[-1]  # the same title and footer


def test_short_table_still_splits_where_a_shown_cell_differs():
    policy = build({"overrides": [{"layers": 1, "tensor": "key", "bits": 4}]})
    rows = _body(render_table(policy, reasons=False))
    assert [r[0] for r in rows] == ["0", "0", "1", "1", "2-3", "2-3"]
    assert rows[2][3] == "4"
