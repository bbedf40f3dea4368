"""bench/long_context.py: its table and failure rows, and one real child at a tiny size.
No timing is asserted (benchmarks carry their targets, tests do not)."""

import importlib.util
import signal
from pathlib import Path

_PATH = Path(__file__).resolve().parents[2] / "bench" / "long_context.py"
_spec = importlib.util.spec_from_file_location("long_context_bench", _PATH)
bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench)


def _row(cache, peak, prefill, step, held):
    return {"model": "tiny", "length": 4096, "cache": cache, "bits": None if cache == "fp" else 2,
            "peak_rss_bytes": peak, "rss_before_bytes": peak // 2, "prefill_s": prefill,
            "decode_step_s": step, "cache_bytes": held}


def test_table_gives_ratios_against_fp_and_a_row_for_a_child_that_died():
    rows = [_row("fp", 2**30, 2.0, 0.010, 4 * 2**20),
            _row("kvpolicy", 2**29, 3.0, 0.005, 2**20),
            {"model": "tiny", "length": 4096, "cache": "quanto",
             "error": bench._failure(-signal.SIGKILL, "")}]
    lines = bench.table(rows, 2).splitlines()
    assert len(lines) == 5  # header, rule, three rows
    cells = [c.strip() for c in lines[3].split("|")[1:-1]]
    assert cells[:5] == ["tiny", "4096", "kvpolicy-2", "0.50", "0.50"]
    assert cells[6:] == ["3.00", "1.50", "5.0", "0.50", "1.0", "0.25"]
    assert [c.strip() for c in lines[4].split("|")[1:-1]] == [
        "tiny", "4096", "quanto-2", "killed: out of memory"]


def test_failures_are_named():
    assert bench._failure(-signal.SIGKILL, "") == "killed: out of memory"
    assert bench._failure(1, "Traceback\n  ...\nValueError: too long\n") == (
        "failed (exit 1): ValueError: too long")


def test_a_child_past_its_timeout_is_a_row_not_a_crash():
    row = bench.run_child("tiny", 256, "fp", 4, 2, timeout=0.2)
    assert row == {"model": "tiny", "length": 256, "cache": "fp",
                   "error": "timed out after 0.2 s"}


def test_one_child_measures_a_tiny_compiled_run():
    row = bench.run_child("tiny", 256, "kvpolicy", 4, 2, timeout=300)
    assert "error" not in row, row
    assert row["tokens"] == 256  # a prefill of 252 tokens, then 4 decode steps
    assert row["peak_rss_bytes"] >= row["rss_before_bytes"] > 0
    assert row["cache_bytes"] > 0 and row["fp16_cache_bytes"] == 256 * 4 * 2 * 2 * 64 * 2
    assert row["prefill_s"] > 0 and row["decode_step_s"] > 0
