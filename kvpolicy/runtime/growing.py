"""A tensor buffer that grows along one dim: the packed segments and positions of a layer."""

from __future__ import annotations

import torch

__all__ = ["Growing"]


class Growing:
    """A tensor that grows at its end and can drop its front along one dim.

    Only ``[start : start + n]`` along ``dim`` is meaningful; ``view()`` is a narrow() of
    the storage. Appends are amortised O(1): they write into spare capacity, and when
    there is none the live part moves to a new buffer 1.25x its size. A dropped front is
    freed at that move, so a buffer whose front keeps being dropped (a sliding-window
    layer) stays bounded by its live size.
    """

    def __init__(self, dim: int) -> None:
        self.dim = dim
        self.data: torch.Tensor | None = None
        self.start = 0
        self.n = 0

    def view(self) -> torch.Tensor | None:
        return None if self.data is None else self.data.narrow(self.dim, self.start, self.n)

    def _like(self, data: torch.Tensor | None, start: int, n: int) -> Growing:
        out = Growing(self.dim)
        out.data, out.start, out.n = data, start, n
        return out

    def appended(self, t: torch.Tensor) -> Growing:
        """A new buffer holding ``self`` then ``t`` (``self`` is left untouched if possible)."""
        add = t.shape[self.dim]
        need = self.n + add
        cap = 0 if self.data is None else self.data.shape[self.dim]
        if self.data is not None and self.start + need <= cap:
            # Writing past `start + n` does not change what `self.view()` returns.
            self.data.narrow(self.dim, self.start + self.n, add).copy_(t)
            return self._like(self.data, self.start, need)
        # NOTE: grow by 1.25x, not 2x: the point of this cache is memory, and copies
        # happen once per chunk (every >= 32 decode steps), not once per token.
        new_cap = max(need, int(need * 1.25) + 1)
        shape = list(t.shape)
        shape[self.dim] = new_cap
        data = t.new_empty(shape)
        if self.data is not None and self.n:
            data.narrow(self.dim, 0, self.n).copy_(self.view())
        data.narrow(self.dim, self.n, add).copy_(t)
        return self._like(data, 0, need)

    def dropped(self, k: int) -> Growing:
        """A new buffer without the first ``k`` entries along ``dim`` (no copy)."""
        if not 0 <= k <= self.n:
            raise ValueError(f"cannot drop {k} of {self.n} entries")
        return self._like(self.data, self.start + k, self.n - k)

    def index_select(self, index: torch.Tensor) -> Growing:
        out = Growing(self.dim)
        if self.data is not None:
            out.data = self.view().index_select(0, index).contiguous()
            out.n = self.n
        return out

    @property
    def nbytes(self) -> int:
        v = self.view()
        return 0 if v is None else v.numel() * v.element_size()

    @property
    def allocated_bytes(self) -> int:
        d = self.data
        return 0 if d is None else d.numel() * d.element_size()
