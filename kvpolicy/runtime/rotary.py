"""RoPE rows for pre-RoPE keys, computed from positions instead of held per token.

Keys are cached before their rotation (docs/design.md §2), so attention needs the cos/sin
rows of every cached token. A compiled block hands over the rows it multiplied the new
keys with; a ``RotaryGroup`` (one per rotation of a model: all layers of a Llama share one)
turns them into *positions* and recomputes rows from them when attention needs them:

- **computed** (the usual case): the rows are ``cos(p * inv_freq) * scale`` in the model's
  layout and dtype, for an ``inv_freq`` that is one of the model's own 1-D buffers (found at
  compile time, matched here by value: the rows must be reproduced bit for bit) and a
  ``scale`` read off the rows. Positions of new tokens are the layer's next ones, checked
  against the rows the block was given; if those differ (a left-padded prompt, positions
  chosen by the caller) they are solved from the rows' angles and checked again. The group
  holds no per-token data: a step builds the rows of positions ``lo .. max`` once for all
  its layers (a transient, dropped when every layer has read it), ``lo`` the least
  position its layers read the step before: 0 for global layers, about the last window
  for a group of sliding-window layers (``RotarySpec.offset``).
- **stored** (fallback): rows no buffer reproduces (a table the model precomputed in its
  own way, dynamic NTK or longrope once the model switches frequencies mid-sequence) are
  appended to a growing table, and "positions" index it. Rows computed so far are written
  into the table once when a group falls back, so earlier tokens keep their rotation.
"""

from __future__ import annotations

import math
import weakref
from dataclasses import dataclass
from typing import Any

import torch

from ..kernels.layout import RotarySpec
from .checks import data_checks
from .growing import Growing
from .positions import Positions, TokenPositions

__all__ = ["RotaryGroup", "rotary_sources"]

# Elements of one step's rows kept to compare later layers' rows against (a decode step's
# are tiny; a prefill's are recomputed instead of held).
_KEEP_ROWS = 1 << 12


def rotary_sources(model: torch.nn.Module) -> tuple[tuple[torch.nn.Module, str], ...]:
    """Where a model may keep RoPE frequencies: every 1-D floating buffer, as
    ``(module, name)`` so that the current tensor is read when a cache binds (a model moved
    or cast after compiling keeps working). Matched by value at run time, never by name."""
    out = []
    for module in model.modules():
        for name, buf in module.named_buffers(recurse=False):
            if (buf is not None and buf.dim() == 1 and buf.is_floating_point()
                    and buf.numel() <= 4096):
                out.append((module, name))
    return tuple(out)


def _layout(x: torch.Tensor, style: str) -> torch.Tensor:
    """Per-frequency ``[..., r/2]`` -> the model's ``[..., r]`` layout (``cat(x, x)`` for
    rotate_half, ``repeat_interleave(x, 2)`` for interleaved)."""
    # NOTE: one copy from a broadcast view; torch.cat along the last dim took 2.2x as long
    # (8K x 32 fp32, one thread: 3.5 ms against 0.5 ms for the copy, loaded machine).
    dim = -2 if style == "rotate_half" else -1
    src = x.unsqueeze(dim)
    out = x.new_empty(*(x.shape[:-1] + (2, x.shape[-1]) if dim == -2 else x.shape + (2,)))
    out.copy_(src.expand_as(out))
    return out.flatten(-2)


def _halves(x: torch.Tensor, style: str) -> torch.Tensor:
    """The model's ``[..., r]`` layout -> one column per frequency ``[..., r/2]``."""
    return x[..., : x.shape[-1] // 2] if style == "rotate_half" else x[..., 0::2]


def _same(given: torch.Tensor, want: torch.Tensor) -> bool:
    """``given`` (rows a block was handed) equals ``want`` (fp32, broadcast over rows)."""
    try:
        want = want.expand_as(given)
    except RuntimeError:
        return False
    return bool(torch.equal(given.float(), want))


def _root(t: torch.Tensor) -> torch.Tensor:
    return t if t._base is None else t._base


def _signature(t: torch.Tensor) -> tuple:
    return (t.data_ptr(), tuple(t.shape), t.stride(), t.dtype, t.device)


@dataclass
class _Step:
    """The new tokens of one step, as the first layer of the group resolved them."""

    start: int  # tokens the layers held before the step
    positions: TokenPositions
    roots: tuple[Any, Any]  # weak references to the given rows' base tensors
    sigs: tuple[tuple, tuple]
    rows: tuple[torch.Tensor, torch.Tensor] | None  # fp32 rows, kept when small


class RotaryGroup:
    """The RoPE rows of all layers that rotate with the same angles (see module doc)."""

    def __init__(self, style: str, rotary_dim: int, dtype: torch.dtype) -> None:
        self.style, self.rotary_dim, self.dtype = style, rotary_dim, dtype
        self.inv_freq: torch.Tensor | None = None  # computed mode: fp32 [r/2]
        self.scale = 1.0
        self.cos, self.sin = Growing(0), Growing(0)  # stored mode: fp32 [N, r]
        self.layers = 0  # layers bound to this group
        self.hi = -1  # largest position (computed) or table row (stored) handed out
        self._step: _Step | None = None
        self._steps = 0
        self._spec: tuple[int, RotarySpec] | None = None
        self._reads = 0
        # The least position read in this step and the last (spec's ``lo``), per step.
        self._step_rows, self._floor, self._asked = -1, 0, 0

    @property
    def computed(self) -> bool:
        return self.inv_freq is not None

    # ------------------------------------------------------------------ rows

    def rows(
        self, positions: torch.Tensor, dtype: torch.dtype = torch.float32
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin ``[..., r]`` of int64 ``positions`` exactly as the model computes
        them: ``(cos(p * inv_freq) * scale)`` rounded to the model's dtype, returned in
        ``dtype`` (fp32, or the model's own dtype: the same values)."""
        assert self.inv_freq is not None
        inv = self.inv_freq.to(positions.device)
        f = positions.to(torch.float32)[..., None] * inv
        c, s = f.cos(), f.sin()
        if self.scale != 1.0:
            c, s = c * self.scale, s * self.scale
        if self.dtype != torch.float32:
            c, s = c.to(self.dtype), s.to(self.dtype)
            if dtype != self.dtype:
                c, s = c.to(dtype), s.to(dtype)
        return _layout(c, self.style), _layout(s, self.style)

    def spec(self, dtype: torch.dtype = torch.float32, lo: int = 0) -> RotarySpec:
        """A table every position handed out so far indexes (see module doc): in
        ``dtype`` when the rows are computed and ``dtype`` is the model's own (exact);
        fp32 otherwise (stored rows are kept in fp32).

        ``lo``: the least position the caller reads. Computed rows start at the least
        position any layer of the group read in the step before (positions a layer holds
        only move forward: a sliding window's layers hold the last ``window`` of them), so
        a group of local layers builds about a window of rows per step, not every position
        (``RotarySpec.offset``)."""
        if not self.computed:
            key = self.cos.n
            if self._spec is None or self._spec[0] != key:
                self._spec = (key, RotarySpec(self.style, self.rotary_dim, self.cos.view(),
                                              self.sin.view()))
            return self._spec[1]
        rows = self.hi + 1
        dtype = dtype if dtype == self.dtype else torch.float32
        if rows != self._step_rows:  # a new step: start where the last one's reads did
            self._step_rows, self._floor, self._asked = rows, self._asked, lo
        self._asked = min(self._asked, lo)
        cached = self._spec
        if (cached is None or cached[0] != rows or cached[1].cos.dtype != dtype
                or cached[1].offset > lo):
            # NOTE: rebuilt once per step for all layers. SmolLM2 shapes (rotary_dim 64),
            # one thread, loaded machine: 0.3 / 1.0 / 2.0 / 6.3 ms at 1K / 4K / 8K / 16K
            # positions, against 0.05 / 0.26 / 0.75 / 1.8 ms for the torch.cat onto a held
            # fp32 table that this replaces (per step, not per layer). That table (2 x
            # rotary_dim values per token) with int32 positions per layer held SmolLM2's
            # 8K compression at 4.33x (now 4.92x), and a one-layer, one-KV-head model's
            # 16K compression at 0.45x (now 5.11x).
            start = min(lo, self._floor)
            pos = torch.arange(start, rows, device=self.inv_freq.device)
            self._spec = (rows, RotarySpec(self.style, self.rotary_dim, *self.rows(pos, dtype),
                                           offset=start))
        spec = self._spec[1]
        self._reads += 1
        if self._steps > 1 and self._reads >= self.layers:
            self._spec = None  # every layer has its reference for this step
        return spec

    # ------------------------------------------------------------------ positions

    def resolve(
        self, held: Positions, cos: torch.Tensor, sin: torch.Tensor, start: int, batch: int,
        *, joining: bool = False,
    ) -> TokenPositions | None:
        """Positions of the new tokens whose rows are ``cos``/``sin`` ``[b_rows, T, r]``.

        ``held``: the layer's positions so far (its next positions are the first guess).
        ``joining``: a layer not bound yet asks whether it belongs here; None if not (the
        group is left unchanged). A bound layer always gets positions: if the rows can no
        longer be computed, the group falls back to storing them.
        """
        step = self._step
        if (step is not None and step.start == start and step.positions.batch == batch
                and step.positions.count == cos.shape[1]):
            if self._is_step_rows(step, cos, sin):
                return step.positions
        if self.computed:
            pos = self._computed_positions(held, cos, sin, start, batch)
            if pos is not None:
                self._new_step(start, pos, cos, sin)
                return pos
            if joining:
                return None
            self._fall_back()
        elif joining:
            return None
        pos = self._store(cos, sin, batch)
        self._new_step(start, pos, cos, sin)
        return pos

    def _is_step_rows(self, step: _Step, cos: torch.Tensor, sin: torch.Tensor) -> bool:
        roots = (step.roots[0](), step.roots[1]())
        if (roots[0] is _root(cos) and roots[1] is _root(sin)
                and step.sigs == (_signature(cos), _signature(sin))):
            return True  # the very rows the step was resolved from (alive, so unchanged)
        if not data_checks(cos.device, cos.shape[1]):
            return True  # a decode step on a GPU: same start and shape, rows trusted
        if step.rows is not None:
            want = step.rows
        elif self.computed:
            want = self.rows(step.positions.tensor(cos.device))
        else:
            want = self._table_rows(step.positions, cos.device)
        return _same(cos, want[0]) and _same(sin, want[1])

    def _table_rows(self, pos: TokenPositions, device) -> tuple[torch.Tensor, torch.Tensor]:
        idx = pos.tensor(device)
        return self.cos.view()[idx], self.sin.view()[idx]

    def _computed_positions(
        self, held: Positions, cos: torch.Tensor, sin: torch.Tensor, start: int, batch: int
    ) -> TokenPositions | None:
        t = cos.shape[1]
        nxt = held.following()
        if nxt is not None:
            base, lo, hi, cont = nxt
            guess = TokenPositions.contiguous(batch, base, t, lo, hi, cont)
        elif held.n == 0:
            guess = TokenPositions.contiguous(batch, start, t, start, start)
        else:
            guess = None
        if guess is not None:
            if not data_checks(cos.device, t):
                # A decode step on a GPU: the next positions are trusted (comparing the
                # rows is a host read); KVPOLICY_CHECKS=1 verifies them every step.
                return guess
            vals = guess.tensor(cos.device)
            if isinstance(guess.runs[0].base, int):
                vals = vals[:1]
            c, s = self.rows(vals)
            if _same(cos, c) and _same(sin, s):
                return guess
            hint = vals
        else:
            hint = None
        found = _solve(cos, sin, self.inv_freq, self.style, hint)
        if found is None:
            return None
        c, s = self.rows(found)
        if not (_same(cos, c) and _same(sin, s)):
            return None
        return TokenPositions.of(found.expand(batch, t))

    def _new_step(self, start: int, pos: TokenPositions, cos, sin) -> None:
        small = cos.numel() <= _KEEP_ROWS
        self._step = _Step(
            start, pos, (weakref.ref(_root(cos)), weakref.ref(_root(sin))),
            (_signature(cos), _signature(sin)),
            (cos.float().clone(), sin.float().clone()) if small else None,
        )
        self.hi = max(self.hi, pos.hi)
        self._steps += 1
        self._reads = 0

    # ------------------------------------------------------------------ stored mode

    def _fall_back(self) -> None:
        """Computed -> stored: rows of every position handed out become table rows."""
        rows = self.hi + 1
        if rows > 0:
            c, s = self.rows(torch.arange(rows, device=self.inv_freq.device))
            self.cos, self.sin = self.cos.appended(c), self.sin.appended(s)
        self.inv_freq = None
        self._spec = None
        self._step = None

    def _store(self, cos: torch.Tensor, sin: torch.Tensor, batch: int) -> TokenPositions:
        """Append ``[b_rows, T, r]`` rows, row-major by batch row: row ``b``'s tokens are
        contiguous table rows ``off + b * T + j``."""
        b_rows, t, r = cos.shape
        off = self.cos.n
        # NOTE: fp32 rows: the C++ decode kernel reads fp32 rotate-half tables in place
        # and would copy a half-precision table on every call.
        self.cos = self.cos.appended(cos.reshape(b_rows * t, r).float())
        self.sin = self.sin.appended(sin.reshape(b_rows * t, r).float())
        if b_rows == 1:
            return TokenPositions.contiguous(batch, off, t, off, off)
        base = off + torch.arange(batch, device=cos.device) * t
        return TokenPositions.contiguous(batch, base, t, off, off + (batch - 1) * t)

    # ------------------------------------------------------------------ fitting

    @staticmethod
    def fit(
        cos: torch.Tensor, sin: torch.Tensor, style: str, held: Positions, start: int,
        batch: int, sources: tuple[tuple[torch.nn.Module, str], ...],
    ) -> tuple[RotaryGroup, TokenPositions]:
        """A group for rows no existing group explains: computed from one of ``sources``
        (``rotary_sources``) if it reproduces them exactly, else stored."""
        r = cos.shape[-1]
        seen: list[torch.Tensor] = []
        for module, name in sources:
            buf = getattr(module, name, None)
            if not isinstance(buf, torch.Tensor) or buf.dim() != 1 or buf.numel() != r // 2:
                continue
            inv = buf.detach().to(cos.device, torch.float32).clone()
            if any(torch.equal(inv, x) for x in seen):
                continue
            seen.append(inv)
            for scale in _scales(cos, sin, style):
                group = RotaryGroup(style, r, cos.dtype)
                group.inv_freq, group.scale = inv, scale
                pos = group._computed_positions(held, cos, sin, start, batch)
                if pos is not None:
                    group._new_step(start, pos, cos, sin)
                    return group, pos
        group = RotaryGroup(style, r, cos.dtype)
        pos = group._store(cos, sin, batch)
        group._new_step(start, pos, cos, sin)
        return group, pos

    # ------------------------------------------------------------------ memory

    def memory(self) -> dict[str, int]:
        """Bytes held: ``bytes`` (frequencies, stored rows, the step's positions and
        rows), ``spare`` (unused capacity of the stored table), ``transient`` (the step's
        table of rows, while held)."""
        held = 0 if self.inv_freq is None else self.inv_freq.numel() * 4
        held += self.cos.nbytes + self.sin.nbytes
        step = self._step
        if step is not None:
            held += sum(r.nbytes() for r in step.positions.runs)
            if step.rows is not None:
                held += sum(x.numel() * x.element_size() for x in step.rows)
        spare = self.cos.allocated_bytes + self.sin.allocated_bytes
        spare -= self.cos.nbytes + self.sin.nbytes
        transient = 0
        if self.computed and self._spec is not None:
            spec = self._spec[1]
            transient = 2 * spec.cos.numel() * spec.cos.element_size()
        return {"bytes": held, "spare": spare, "transient": transient}


def _scales(cos: torch.Tensor, sin: torch.Tensor, style: str) -> list[float]:
    """Candidate ``attention_scaling`` factors: 1, then the fp32 values around the rows'
    magnitude (exactly the scale when a row sits at position 0 of an fp32 model)."""
    c, s = _halves(cos, style).double(), _halves(sin, style).double()
    est = float(torch.sqrt(c * c + s * s).median()) if c.numel() else 1.0
    out = [1.0]
    x = torch.tensor(est, dtype=torch.float32)
    near = [x]
    for direction in (math.inf, -math.inf):
        y = x
        for _ in range(2):
            y = torch.nextafter(y, torch.tensor(direction, dtype=torch.float32))
            near.append(y)
    for v in near:
        f = float(v)
        if f > 0 and f not in out:
            out.append(f)
    return out


def _solve(
    cos: torch.Tensor, sin: torch.Tensor, inv_freq: torch.Tensor, style: str,
    hint: torch.Tensor | None,
) -> torch.Tensor | None:
    """Integer positions ``[b_rows, T]`` whose angles the rows show, or None.

    Each frequency's angle is known modulo 2π; starting from the slowest (whose period spans
    the whole context) every faster one refines the estimate, so the result is exact to
    well under one position even for half-precision rows. The caller verifies it.
    """
    ang = torch.atan2(_halves(sin, style).double(), _halves(cos, style).double())
    theta = inv_freq.double().to(ang.device)
    p = torch.zeros(ang.shape[:-1], dtype=torch.float64, device=ang.device)
    if hint is not None and hint.shape == p.shape:
        p = p + hint.to(ang.device, torch.float64)
    for i in torch.argsort(theta).tolist():
        th = float(theta[i])
        if not th > 0:
            continue
        d = torch.remainder(ang[..., i] - p * th + math.pi, 2 * math.pi) - math.pi
        p = p + d / th
    if not bool(torch.isfinite(p).all()):
        return None
    pos = torch.round(p).to(torch.int64)
    if pos.numel() and int(pos.min()) < 0:
        return None
    return pos
