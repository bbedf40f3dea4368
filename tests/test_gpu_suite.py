"""bench/gpu_suite.py without a GPU: the reason it gives, its tiny CPU run end to end (every
row of the plan, each kvpolicy row checked against its reference), the time budget and
out-of-memory rows. No timing is asserted: on CPU the suite's timings mean nothing."""

from __future__ import annotations

import importlib.util
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

_PATH = Path(__file__).resolve().parents[1] / "bench" / "gpu_suite.py"
_spec = importlib.util.spec_from_file_location("gpu_suite_bench", _PATH)
suite = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = suite  # dataclasses look their module up while the class is built
_spec.loader.exec_module(suite)

TINY = ["--device", "cpu", "--tiny"]
T = suite.TINY


def _expected_rows() -> list[tuple[str, int, int, str]]:
    """Every (section, tokens, batch, method) the tiny plan must print, in any order."""
    rows = []
    for t in T.kernel_lengths:
        for b in T.batches:
            rows += [("kernel", t, b, m) for m in suite.KERNEL_METHODS]
    for t in T.model_lengths:
        for b in T.batches:
            rows += [("model", t, b, m) for m in ("DynamicCache fp16", "kvpolicy-2", "quanto-2")]
    rows.append(("model", T.check_length, T.check_batch,
                 "kvpolicy-16 vs DynamicCache (exactness)"))
    rows += [("graph", T.graph_length, T.graph_batch, m) for m in suite.GRAPH_METHODS]
    rows.append(("graph", T.step_graph_length, 1, suite.STEP_GRAPH_METHOD))
    return rows


def _keys(rows) -> list[tuple[str, int, int, str]]:
    return [(r.section, r.tokens, r.batch, r.method) for r in rows]


def test_without_cuda_the_default_run_says_why_and_exits_0(monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert suite.main([]) == 0
    assert suite.NO_CUDA in capsys.readouterr().out


def test_the_script_itself_exits_0_without_cuda():
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    proc = subprocess.run([sys.executable, str(_PATH)], capture_output=True, text=True,
                          env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.startswith(suite.NO_CUDA)


def test_tiny_cpu_run_prints_every_row_and_kvpolicy_matches_its_references():
    rc, rows, text = suite.run([*TINY, "--backend", "torch"])
    assert rc == 0, text
    assert sorted(_keys(rows)) == sorted(_expected_rows())
    lines = [ln for ln in text.splitlines() if ln.startswith("| ")]
    assert len(lines) == 1 + len(rows)  # the header, then one line per row
    assert "TINY MODE" in text and "mean nothing" in text
    by = {k: r for k, r in zip(_keys(rows), rows, strict=True)}
    for (section, _, _, method), r in by.items():
        if section == "graph":
            assert r.status == "n/a (no CUDA)"
            continue
        assert r.status.startswith("ok"), (method, r.status)
        if method.startswith("kvpolicy") and section == "kernel":
            # The packed cache, attended by the torch backend, against the fp32 reference.
            assert math.isfinite(r.values["err"]) and r.values["err"] < 1e-2, r.values
            assert r.values["bytes"] > 0 and r.values["time_s"] > 0
        if method == "kvpolicy decode_attention":
            assert "differs from attend by 0.0e+00" in r.status
        if method == "kvpolicy-2":
            v = r.values
            # The first decoded token comes from the full-precision prefill: fp16 rounding.
            assert math.isfinite(v["first_err"]) and v["first_err"] < 1e-2, v
            assert math.isfinite(v["err"]) and v["err"] < 1.0, v  # 2-bit decode steps
            assert v["kv_bytes"] > 0 and v["tok_s"] > 0
    exact = next(r for r in rows if "exactness" in r.method)
    assert max(exact.values["first_err"], exact.values["err"]) < 1e-2
    assert exact.values["top1"] == 1.0


def test_a_budget_of_zero_prints_every_row_as_skipped():
    rc, rows, text = suite.run([*TINY, "--backend", "torch", "--budget-s", "0"])
    assert rc == 0
    assert sorted(_keys(rows)) == sorted(_expected_rows())
    assert all(r.status.startswith("skipped (time budget)") for r in rows)
    assert text.count("skipped (time budget)") == len(rows)


def _item(name: str, run, guess=None) -> suite.Item:
    return suite.Item("kernel", 1, 1, (f"{name} a", f"{name} b"), run, lambda: guess)


def test_oom_and_errors_are_rows_and_the_suite_goes_on(capsys):
    def oom(emit):
        emit(suite.Row("kernel", 1, 1, "oom a", values={}))
        raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    def broken(emit):
        raise ValueError("a bug")

    def fine(emit):
        emit(suite.Row("kernel", 1, 1, "fine a"))
        emit(suite.Row("kernel", 1, 1, "fine b"))

    rows: list = []
    now = iter([0.0, 0.0, 0.0, 0.0]).__next__
    items = [_item("oom", oom), _item("bad", broken), _item("fine", fine),
             _item("late", fine, guess=100.0)]
    suite.run_items(items, 10.0, torch.device("cpu"), rows, clock=now)
    status = {r.method: r.status for r in rows}
    assert status["oom a"] == "ok"  # emitted before the failure: kept
    assert status["oom b"].startswith("OOM: OutOfMemoryError: CUDA out of memory")
    assert status["bad a"] == "ERROR ValueError: a bug"
    assert status["bad b"] == "not run: ERROR ValueError: a bug"
    assert status["fine a"] == status["fine b"] == "ok"
    assert status["late a"].startswith("skipped (time budget): ~100 s")
    assert [r.failed for r in rows] == [False, False, True, False, False, False, False, False]
    assert "ValueError: a bug" in capsys.readouterr().err  # the traceback, for the reader


def test_a_group_past_the_deadline_is_aborted_and_the_rest_skipped():
    def overrun(emit):
        raise suite.SuiteTimeout()

    rows: list = []
    items = [_item("slow", overrun), _item("next", lambda emit: None)]
    suite.run_items(items, 10.0, torch.device("cpu"), rows, clock=lambda: 0.0)
    assert [r.status for r in rows] == [
        "aborted (time budget): ran past the deadline",
        "not run: aborted (time budget): ran past the deadline",
        "skipped (time budget): the suite stopped at its deadline",
        "skipped (time budget): the suite stopped at its deadline",
    ]


def test_nominal_bandwidth_is_named_only_for_known_devices():
    assert suite.nominal_bandwidth("NVIDIA H200")[0] == 4.8e12
    assert suite.nominal_bandwidth("NVIDIA H100 80GB HBM3")[0] == 3.35e12
    assert suite.nominal_bandwidth("Some GPU") is None


@pytest.mark.triton
@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter run is for CPU machines")
def test_tiny_kernel_rows_run_the_triton_backend_in_the_interpreter():
    if os.environ.get("TRITON_INTERPRET", "0") in ("", "0"):
        pytest.skip("needs TRITON_INTERPRET=1 (tests/conftest.py sets it without CUDA)")
    rc, rows, text = suite.run([*TINY, "--backend", "triton", "--sections", "kernel",
                                "--kernel-lengths", "256", "--batches", "1", "--reps", "1",
                                "--warmup", "0"])
    assert rc == 0, text
    assert [r.method for r in rows] == list(suite.KERNEL_METHODS)
    for r in rows[1:]:
        assert r.status.startswith("ok") and "triton backend" in r.status, r.status
        assert r.values["err"] < suite.ATOL


def test_a_broken_capture_reports_the_error_that_broke_it():
    try:
        try:
            raise RuntimeError("operation not permitted when stream is capturing")
        except RuntimeError:
            raise RuntimeError("CUDA error: operation failed due to a previous error during "
                               "capture") from None
    except RuntimeError as e:
        e.__context__ = RuntimeError("operation not permitted when stream is capturing")
        text = suite._capture_error(e)
    assert text.startswith("RuntimeError: operation not permitted when stream is capturing")
    assert "(then RuntimeError: CUDA error" in text
