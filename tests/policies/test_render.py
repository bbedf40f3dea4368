"""The policy table (kvpolicy/policies/render.py)."""

from __future__ import annotations

from policy_factories import build

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
    rows = [line.split() for line in lines[3:-2]]
    assert len(rows) == 2  # layers 0-3 are identical: one key row, one value row
    # Footer: the achieved average and the packed bytes per token against fp16.
    assert lines[-1].startswith("average 2.000 code bits per cached element;")
    # 2 bits + 8-bit scale and zero per 12 tokens (keys) or 32 channels (values): 2.92 bits.
    assert "5.49x smaller" in lines[-1]
    assert rows[0][:13] == ["0-3", "key", "channel", "2", "12", "uniform", "8", "mse", "-",
                            "yes", "128", "4", "-"]
    assert rows[1][:13] == ["0-3", "value", "token", "2", "32", "uniform", "8", "minmax",
                            "hadamard", "-", "128", "4", "-"]
    assert "q·kᵀ sums over channels" in lines[3]


def test_table_splits_where_a_layer_differs():
    policy = build({"overrides": [{"layers": 1, "tensor": "key", "bits": 4}]})
    rows = [line.split()[:13] for line in str(policy).splitlines()[3:-2]]
    assert [r[0] for r in rows] == ["0", "0", "1", "1", "2-3", "2-3"]
    # 4 bits: fp16 metadata in groups of 32, so no fit to show.
    assert rows[2][:8] == ["1", "key", "channel", "4", "32", "uniform", "16", "-"]
    assert rows[2][12] == "yes"
