"""Progress bars only where they redraw (kvpolicy/progress.py)."""

from __future__ import annotations

import io

import pytest
import torch

from kvpolicy import progress
from kvpolicy.evaluation import decode_perplexity
from kvpolicy.zoo.tiny import tiny_model


class _Stream(io.StringIO):
    """A text stream that says whether it is a terminal."""

    def __init__(self, tty: bool) -> None:
        super().__init__()
        self.tty = tty

    def isatty(self) -> bool:
        return self.tty


class _Closed(io.StringIO):
    def isatty(self) -> bool:
        raise ValueError("I/O operation on closed file")


@pytest.fixture
def no_notebook(monkeypatch):
    monkeypatch.setattr(progress, "_NOTEBOOK", False)


@pytest.mark.usefixtures("no_notebook")
@pytest.mark.parametrize("tty", [True, False])
def test_bar_is_drawn_on_a_terminal_only(tty):
    stream = _Stream(tty)
    bar = progress.progress_bar(10, desc="fp", unit="step", file=stream)
    assert bar.disable is not tty
    for _ in range(10):
        bar.update(1)
    bar.close()
    written = stream.getvalue()
    if tty:
        assert "fp" in written and "10/10" in written, written
    else:
        assert written == "", f"a non-terminal stream got {written!r}"


@pytest.mark.usefixtures("no_notebook")
def test_bar_off_when_not_enabled_even_on_a_terminal():
    stream = _Stream(True)
    bar = progress.progress_bar(3, enabled=False, file=stream)
    bar.update(3)
    bar.close()
    assert bar.disable and stream.getvalue() == ""


@pytest.mark.usefixtures("no_notebook")
def test_streams_without_a_terminal():
    assert not progress.interactive(_Closed())
    assert not progress.interactive(object())  # no isatty at all
    assert progress.interactive(_Stream(True))


def test_a_notebook_widget_is_always_drawn(monkeypatch):
    monkeypatch.setattr(progress, "_NOTEBOOK", True)
    assert progress.interactive(_Stream(False))


@pytest.mark.usefixtures("no_notebook")
def test_decode_loop_writes_one_line_to_a_non_terminal(monkeypatch, capsys):
    """The decode loop (``kvpolicy eval``) draws through the helper: under pytest stderr is
    captured, not a terminal, so the loop draws no bar and says in one line what it did."""
    model = tiny_model("llama")
    ids = torch.randint(3, 128, (1, 12))
    res = decode_perplexity(model, ids, context=8, steps=4, desc="fp", progress=True)
    assert res.tokens == 4
    err = capsys.readouterr().err
    assert "\r" not in err and err.count("\n") == 1
    assert err.startswith(f"fp: perplexity {res.perplexity:.3f} over 4 scored tokens in ")
    decode_perplexity(model, ids, context=8, steps=4, desc="fp", progress=False)
    assert capsys.readouterr().err == ""
