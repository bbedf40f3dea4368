"""Positions of cached tokens, kept implicit where tokens are contiguous.

A pre-RoPE key is rotated inside attention at its position (docs/design.md §5). Almost
every sequence numbers its tokens ``start, start + 1, ...``, so a layer keeps *runs*: a
contiguous run is a base per batch row (or one base for all rows) and a count; explicit
per-token positions are kept only where a batch row is not contiguous (the padded head of
a left-padded prompt, positions a caller chose freely). The bounds of every run are plain
ints, so checking positions against a rotary table needs no device sync.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..errors import CacheError
from .growing import Growing

__all__ = ["Positions", "Run", "TokenPositions", "least_position"]

# Runs beyond this many are merged into one explicit run (a caller that jumps positions
# at every step would otherwise grow a Python list per token).
_MAX_RUNS = 64


@dataclass(frozen=True)
class Run:
    """Positions of ``n`` consecutive tokens of every batch row.

    Contiguous (``values is None``): row ``b`` holds ``base[b] + 0 .. n - 1`` (``base`` an
    int shared by all rows, or an int64 ``[B]`` tensor). Explicit: ``values`` ``[B, n]``
    (int32), a view of ``buf`` once explicit runs are joined (amortised appends).
    ``lo``/``hi`` bound every position of the run.
    """

    n: int
    lo: int
    hi: int
    base: int | torch.Tensor = 0
    values: torch.Tensor | None = None
    buf: Growing | None = None

    @property
    def contiguous(self) -> bool:
        return self.values is None

    def tensor(self, batch: int, device, a: int = 0, b: int | None = None) -> torch.Tensor:
        """``[batch, b - a]`` int64 positions of tokens ``a .. b - 1`` of the run."""
        b = self.n if b is None else b
        if self.values is not None:
            return self.values[:, a:b].to(device, torch.int64)
        if isinstance(self.base, int):
            return torch.arange(self.base + a, self.base + b, device=device).expand(batch, b - a)
        return self.base.to(device)[:, None] + torch.arange(a, b, device=device)[None]

    def nbytes(self) -> int:
        if self.values is not None:
            return self.values.numel() * self.values.element_size()
        return 0 if isinstance(self.base, int) else self.base.numel() * self.base.element_size()

    def spare(self) -> int:
        return 0 if self.buf is None else self.buf.allocated_bytes - self.buf.nbytes

    def dropped(self, k: int) -> Run:
        """The run without its first ``k`` tokens (a sliding window's eviction); the
        bounds stay valid bounds."""
        if self.values is not None:
            # A fresh tensor: the dropped head is freed (and no shared buffer is written).
            return Run(self.n - k, self.lo, self.hi, values=self.values[:, k:].clone())
        return Run(self.n - k, self.lo + k, self.hi, base=self.base + k)

    def select(self, index: torch.Tensor) -> Run:
        """The run for batch rows ``index`` (beam search); bounds stay valid bounds."""
        if self.values is not None:
            return Run(self.n, self.lo, self.hi, values=self.values.index_select(0, index))
        if isinstance(self.base, int):
            return self
        return Run(self.n, self.lo, self.hi, base=self.base.index_select(0, index))


@dataclass(frozen=True)
class TokenPositions:
    """Positions of ``count`` new tokens of ``batch`` rows, as runs with known bounds.

    What the model-level RoPE bookkeeping (``runtime.rotary``) hands to a layer's
    ``append``: trusted, so the layer checks bounds from ``lo``/``hi`` without a sync.
    ``continues``: ``(base, n)`` of the run the first run continues: a layer whose last
    run has that very base object and count joins them without comparing values.
    """

    batch: int
    runs: tuple[Run, ...]
    continues: tuple[object, int] | None = None

    @property
    def count(self) -> int:
        return sum(r.n for r in self.runs)

    @property
    def lo(self) -> int:
        return min((r.lo for r in self.runs if r.n), default=0)

    @property
    def hi(self) -> int:
        return max((r.hi for r in self.runs if r.n), default=-1)

    def tensor(self, device) -> torch.Tensor:
        """``[batch, count]`` int64."""
        parts = [r.tensor(self.batch, device) for r in self.runs if r.n]
        if not parts:
            return torch.zeros(self.batch, 0, dtype=torch.int64, device=device)
        return parts[0].contiguous() if len(parts) == 1 else torch.cat(parts, dim=1)

    @staticmethod
    def contiguous(batch: int, base: int | torch.Tensor, count: int, lo: int, hi: int,
                   continues: tuple[object, int] | None = None) -> TokenPositions:
        """``base[b] + 0 .. count - 1``; ``lo``/``hi`` bound ``base``."""
        return TokenPositions(batch, (Run(count, lo, hi + count - 1, base=base),), continues)

    @staticmethod
    def checked(
        positions: torch.Tensor | TokenPositions | None, batch: int, count: int, device,
        start: int,
    ) -> TokenPositions:
        """What a layer's ``append`` was given, validated: a ``TokenPositions`` (trusted
        bounds, no sync), a ``[batch, count]`` int tensor (one sync), or None for the
        running index ``start .. start + count - 1``."""
        if positions is None:
            pos = TokenPositions.contiguous(batch, start, count, start, start)
        elif isinstance(positions, TokenPositions):
            if (positions.batch, positions.count) != (batch, count):
                raise CacheError(
                    f"positions for {positions.batch} rows x {positions.count} tokens, the "
                    f"append has {(batch, count)}"
                )
            pos = positions
        else:
            if not isinstance(positions, torch.Tensor) or positions.dtype not in (
                torch.int64, torch.int32
            ):
                raise CacheError("positions must be an int64 tensor [batch, tokens]")
            if positions.shape != (batch, count):
                raise CacheError(
                    f"positions must be [batch, tokens] = {(batch, count)}, got "
                    f"{tuple(positions.shape)}"
                )
            pos = TokenPositions.of(positions.to(device, torch.int64))
        if count and (pos.lo < 0 or pos.hi >= 2**31):
            raise CacheError(f"positions must lie in [0, 2**31), got [{pos.lo}, {pos.hi}]")
        return pos

    @staticmethod
    def of(values: torch.Tensor) -> TokenPositions:
        """Runs for explicit ``[B, T]`` positions: an explicit head where some row is not
        contiguous, then a contiguous tail (one base if every row shares it). Syncs."""
        b, t = values.shape
        values = values.to(torch.int64)
        if t == 0:
            return TokenPositions(b, ())
        # k: first token from which every row counts up by one.
        if t > 1:
            bad = (values[:, 1:] - values[:, :-1] != 1).any(dim=0)
            idx = torch.nonzero(bad)
            k = int(idx[-1]) + 1 if idx.numel() else 0
            if t - k < k:
                k = t  # a short tail after a long irregular head: not worth a run
        else:
            k = 0
        runs = []
        if k:
            head = values[:, :k]
            runs.append(Run(k, int(head.min()), int(head.max()),
                            values=head.to(torch.int32).contiguous()))
        if k < t:
            base = values[:, k]
            lo, hi = int(base.min()), int(base.max())
            shared: int | torch.Tensor = lo if lo == hi else base.clone()
            runs.append(Run(t - k, lo, hi + t - k - 1, base=shared))
        return TokenPositions(b, tuple(runs))


class Positions:
    """The positions of every token a layer holds, ``[B, N]``, as a list of runs."""

    def __init__(self) -> None:
        self.runs: list[Run] = []
        self.n = 0
        self.hi = -1  # largest position held
        self.batch: int | None = None

    def following(self) -> tuple[int | torch.Tensor, int, int, tuple[object, int]] | None:
        """``(base, lo, hi, continues)`` of the tokens that would continue the last run
        (``TokenPositions.contiguous``); None when empty or the last run is explicit."""
        if not self.runs or self.runs[-1].values is not None:
            return None
        last = self.runs[-1]
        base = last.base + last.n
        return base, last.lo + last.n, last.hi + 1, (last.base, last.n)

    def appended(self, new: TokenPositions, device) -> Positions:
        """A new record holding ``self`` then ``new`` (``self`` untouched)."""
        out = Positions()
        out.runs = list(self.runs)
        out.n, out.hi, out.batch = self.n, self.hi, new.batch
        for i, r in enumerate(new.runs):
            if not r.n:
                continue
            last = out.runs[-1] if out.runs else None
            same = (i == 0 and new.continues is not None and last is not None
                    and new.continues[0] is last.base and new.continues[1] == last.n)
            if last is not None and _joins(last, r, same):
                out.runs[-1] = _join(last, r)
            else:
                out.runs.append(r)
            out.n += r.n
            out.hi = max(out.hi, r.hi)
        if len(out.runs) > _MAX_RUNS:
            lo = min(r.lo for r in out.runs)
            vals = out.tensor(device)
            out.runs = [Run(out.n, lo, out.hi, values=vals.to(torch.int32))]
        return out

    def tensor(self, device, a: int = 0, b: int | None = None) -> torch.Tensor:
        """``[B, b - a]`` int64 positions of tokens ``a .. b - 1``."""
        b = self.n if b is None else b
        batch = self.batch or 0
        parts, start = [], 0
        for r in self.runs:
            lo, hi = max(a, start), min(b, start + r.n)
            if lo < hi:
                parts.append(r.tensor(batch, device, lo - start, hi - start))
            start += r.n
        if not parts:
            return torch.zeros(batch, 0, dtype=torch.int64, device=device)
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)

    def dropped(self, k: int) -> Positions:
        """A new record without the first ``k`` tokens (``self`` untouched)."""
        out = Positions()
        out.n, out.hi, out.batch = self.n - k, self.hi, self.batch
        for r in self.runs:
            if k >= r.n:
                k -= r.n
                continue
            out.runs.append(r.dropped(k) if k else r)
            k = 0
        return out

    def select(self, index: torch.Tensor) -> Positions:
        out = Positions()
        out.runs = [r.select(index) for r in self.runs]
        out.n, out.hi, out.batch = self.n, self.hi, index.numel()
        return out

    @property
    def nbytes(self) -> int:
        return sum(r.nbytes() for r in self.runs)

    @property
    def spare_bytes(self) -> int:
        return sum(r.spare() for r in self.runs)


def _joins(last: Run, r: Run, same_base: bool) -> bool:
    """Whether ``r`` directly continues ``last`` (decided without a device sync where the
    bases are ints or known to be the same object)."""
    if last.values is not None and r.values is not None:
        return True  # two explicit runs: one run of values
    if last.values is not None or r.values is not None:
        return False
    if isinstance(last.base, int) and isinstance(r.base, int):
        return r.base == last.base + last.n
    if same_base:
        return True
    if isinstance(last.base, int) or isinstance(r.base, int):
        return False
    return last.base.shape == r.base.shape and bool(torch.equal(r.base, last.base + last.n))


def _join(last: Run, r: Run) -> Run:
    if last.values is not None:
        buf = last.buf
        if buf is None:
            buf = Growing(1).appended(last.values)
        buf = buf.appended(r.values.to(torch.int32))
        return Run(last.n + r.n, min(last.lo, r.lo), max(last.hi, r.hi), values=buf.view(),
                   buf=buf)
    return Run(last.n + r.n, last.lo, max(last.hi, r.hi), base=last.base)


def least_position(*records: Positions | TokenPositions | None) -> float:
    """A lower bound of every position ``records`` hold (exact for contiguous runs):
    where a table of rows must start for them (``RotarySpec.offset``); ``math.inf`` when
    they hold none."""
    return min((r.lo for p in records if p is not None for r in p.runs if r.n),
               default=math.inf)
