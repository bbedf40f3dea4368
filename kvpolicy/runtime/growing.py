"""A tensor buffer that grows along one dim: the packed segments and positions of a layer."""

from __future__ import annotations

import torch

__all__ = ["Growing"]


class Growing:
    """A tensor that grows along one dim with spare capacity (amortised O(1) appends).

    Only ``[:n]`` along ``dim`` is meaningful; ``view()`` is a narrow() of the storage.
    """

    def __init__(self, dim: int) -> None:
        self.dim = dim
        self.data: torch.Tensor | None = None
        self.n = 0

    def view(self) -> torch.Tensor | None:
        return None if self.data is None else self.data.narrow(self.dim, 0, self.n)

    def appended(self, t: torch.Tensor) -> Growing:
        """A new buffer holding ``self`` then ``t`` (``self`` is left untouched if possible)."""
        out = Growing(self.dim)
        add = t.shape[self.dim]
        need = self.n + add
        cap = 0 if self.data is None else self.data.shape[self.dim]
        if self.data is not None and need <= cap:
            # Writing past `n` does not change what `self.view()` returns.
            self.data.narrow(self.dim, self.n, add).copy_(t)
            out.data = self.data
        else:
            # NOTE: grow by 1.25x, not 2x: the point of this cache is memory, and copies
            # happen once per chunk (every >= 32 decode steps), not once per token.
            new_cap = max(need, int(cap * 1.25) + 1)
            shape = list(t.shape)
            shape[self.dim] = new_cap
            data = t.new_empty(shape)
            if self.data is not None and self.n:
                data.narrow(self.dim, 0, self.n).copy_(self.view())
            data.narrow(self.dim, self.n, add).copy_(t)
            out.data = data
        out.n = need
        return out

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
