"""The sequences of one engine step (:class:`SeqBatch`): what a paged cache
(:mod:`kvpolicy.runtime.paged`) is handed per step, with the index tensors every layer of
the step shares."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..errors import CacheError

__all__ = ["SeqBatch"]


@dataclass
class SeqBatch:
    """The sequences of one engine step, in the order of their query tokens.

    ``query_start`` ``[n + 1]`` (cumulative query tokens), ``seq_lens`` ``[n]`` (tokens of
    each sequence after this step), ``block_table`` ``[n, max_blocks]`` (block ids;
    entries past a sequence's blocks are ignored). Held on the CPU as lists too.
    """

    query_start: list[int]
    seq_lens: list[int]
    block_table: torch.Tensor
    # Index tensors derived from the batch, shared by every layer of the step (keyed by
    # what they depend on: a layer's block size, chunk, sinks, window ...).
    memo: dict = field(default_factory=dict, repr=False, compare=False)

    @property
    def n(self) -> int:
        return len(self.seq_lens)

    def cached(self, key: tuple, make):
        """``make()`` once per ``key`` for this batch."""
        if key not in self.memo:
            self.memo[key] = make()
        return self.memo[key]

    def query_len(self, i: int) -> int:
        return self.query_start[i + 1] - self.query_start[i]

    @property
    def decoding(self) -> bool:
        """Whether every sequence adds one token (a decode step)."""
        return self.cached(("decoding",), lambda: self.n > 0
                           and self.query_start[-1] - self.query_start[0] == self.n
                           and all(self.query_len(i) == 1 for i in range(self.n)))

    def step_tensors(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``seq_lens`` and ``block_table`` as contiguous int64 CPU tensors (what the
        fused step reads), made once per step."""
        return self.cached(("step", ), lambda: (
            torch.tensor(self.seq_lens, dtype=torch.int64),
            self.block_table.to("cpu", torch.int64).contiguous()))

    def positions(self, device: torch.device) -> torch.Tensor:
        """``[num_tokens]`` int64: each query token's position in its sequence."""
        def make() -> torch.Tensor:
            parts = [torch.arange(s - self.query_len(i), s)
                     for i, s in enumerate(self.seq_lens)]
            return torch.cat(parts).to(device) if parts else torch.zeros(0, dtype=torch.long)
        return self.cached(("positions", device), make)

    def groups(self, device: torch.device) -> tuple:
        """``(rows, sub)`` of the sequences adding one token (rows: their query rows,
        sub: them as one batch; ``(None, None)`` without any), and ``(i, start, n, sub)``
        for each sequence adding several."""
        def make() -> tuple:
            single = [i for i in range(self.n) if self.query_len(i) == 1]
            rows = sub = None
            if single:
                rows = (slice(None) if len(single) == self.n else  # all decoding: views
                        torch.tensor([self.query_start[i] for i in single], device=device))
                sub = SeqBatch(list(range(len(single) + 1)),
                               [self.seq_lens[i] for i in single],
                               self.block_table[torch.tensor(single, device=device)])
            many = [(i, self.query_start[i], self.query_len(i),
                     SeqBatch([0, self.query_len(i)], [self.seq_lens[i]],
                              self.block_table[i : i + 1]))
                    for i in range(self.n) if self.query_len(i) > 1]
            return rows, sub, many
        return self.cached(("groups", device), make)

    def rounds(self, block_size: int) -> list[tuple[torch.Tensor, SeqBatch]] | None:
        """Where a sequence of this step reads, as its cached prefix, a block another
        sequence fills in this step: the step split into rounds, in order, each as ``(its
        query rows, it as a batch)``, so that a block is written before it is read; None
        where no sequence does (every step without a prefix cache).

        A prefix cache (vLLM's) lists a block for later requests in the step that
        allocates it, before its tokens exist, so that requests scheduled together share
        it; an engine that writes the cache before attending reads it written. The paged
        cache attends first and appends after (as ``compile_model``'s cache does), so the
        sequences filling such a block run, attend and append, before those reading it.
        """
        return self.cached(("rounds", block_size), lambda: self._rounds(block_size))

    def _rounds(self, bs: int) -> list[tuple[torch.Tensor, SeqBatch]] | None:
        prev = [s - self.query_len(i) for i, s in enumerate(self.seq_lens)]
        # Blocks that become full in this step (only full blocks are shared), by row
        fills = [range(p // bs, s // bs) for p, s in zip(prev, self.seq_lens, strict=True)]
        if not any(fills):
            return None
        table = self.block_table.tolist()
        filler = {table[j][b]: j for j, blocks in enumerate(fills) for b in blocks}
        needs = [{filler[x] for x in table[i][: prev[i] // bs] if filler.get(x, i) != i}
                 for i in range(self.n)]
        if not any(needs):
            return None
        done: set[int] = set()
        out = []
        while len(done) < self.n:
            now = [i for i in range(self.n) if i not in done and needs[i] <= done]
            if not now:  # a block filled by two sequences that read each other's
                raise CacheError("the step's block tables share blocks in a cycle: two "
                                 "sequences each read a block the other fills")
            done.update(now)
            rows = torch.cat([torch.arange(self.query_start[i], self.query_start[i + 1])
                              for i in now])
            starts = [0]
            for i in now:
                starts.append(starts[-1] + self.query_len(i))
            out.append((rows.to(self.block_table.device),
                        SeqBatch(starts, [self.seq_lens[i] for i in now],
                                 self.block_table[torch.tensor(now,
                                                               device=self.block_table.device)])))
        return out
