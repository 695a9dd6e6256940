"""Vocabulary-parallel input embedding and lm_head.

With several ranks each holds ``ceil(vocab / ranks)`` rows (the last rank's tail is padding):
an embedding lookup zeroes the ids another rank owns and the ranks' rows are summed; the
lm_head's logits are gathered along the vocabulary and the padding dropped. With one rank
these are a plain ``nn.Embedding`` / ``nn.Linear``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagefold.distributed.parallel_state import all_gather_last, all_reduce, tp_rank, tp_size


def _rows_per_rank(vocab: int) -> int:
    return -(-vocab // tp_size())


def _row_loader(rows: int, vocab: int):
    start = tp_rank() * rows

    def loader(param: torch.Tensor, tensor: torch.Tensor, shard: str | None) -> None:
        n = max(0, min(rows, vocab - start))
        param.data.zero_()
        param.data[:n].copy_(tensor.narrow(0, start, n))

    return loader


class VocabParallelEmbedding(nn.Embedding):
    def __init__(self, vocab: int, hidden: int) -> None:
        rows = _rows_per_rank(vocab)
        super().__init__(rows, hidden)
        self.start = tp_rank() * rows
        self.weight.tp_loader = _row_loader(rows, vocab)  # type: ignore[attr-defined]

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.start
        outside = (local < 0) | (local >= self.num_embeddings)
        x = F.embedding(local.masked_fill(outside, 0), self.weight)
        x = x.masked_fill(outside.unsqueeze(-1), 0)
        return all_reduce(x)


def vocab_embedding(vocab: int, hidden: int) -> nn.Embedding:
    return nn.Embedding(vocab, hidden) if tp_size() == 1 else VocabParallelEmbedding(vocab, hidden)


def lm_head_linear(hidden: int, vocab: int) -> nn.Linear:
    """lm_head with this rank's vocabulary rows (``gather_logits`` joins the ranks'). Marked
    ``pf_logits``: ``cpu_ops.use_fast_linears`` gives it float32 logits where the CPU's bf16
    products are pagefold's own (``cpu_ops.float_logits``)."""
    rows = vocab if tp_size() == 1 else _rows_per_rank(vocab)
    lin = nn.Linear(hidden, rows, bias=False)
    if tp_size() > 1:
        lin.weight.tp_loader = _row_loader(rows, vocab)  # type: ignore[attr-defined]
    lin.pf_logits = True  # type: ignore[attr-defined]
    return lin


def gather_logits(local: torch.Tensor, vocab: int) -> torch.Tensor:
    if tp_size() == 1:
        return local
    return all_gather_last(local)[..., :vocab]
