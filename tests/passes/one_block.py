"""A language model around one attention module, for tests of the analysis and the rewrite."""

from __future__ import annotations

from torch import nn


class OneBlockLM(nn.Module):
    """Embedding -> one attention module -> head: enough for the probe forward."""

    def __init__(self, attn: nn.Module, dim: int = 64, vocab: int = 50) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.attn = attn
        self.head = nn.Linear(dim, vocab)

    def forward(self, ids):
        return self.head(self.attn(self.emb(ids)))
