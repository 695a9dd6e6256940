"""GGUF weights kept quantized under tensor parallelism: each rank's part of a GGUF tensor.

A GGUF quantized tensor is stored as rows of whole blocks (``gguf_blocks``: ``BLOCK[kind]``
inputs in ``TYPE_SIZE[kind]`` bytes), so a rank's part is cut from the raw rows without
decoding anything, following the split of the plain layer the GGUF layer replaces:

* column-parallel (``column_linear``: ``tp_cuts``; or a model's own row loader that names
  its cut as ``loader_cuts``): this rank's output rows of each fused shard (``RowCut``),
  whole rows of raw bytes;
* row-parallel (``RowParallelLinear``): this rank's input columns, the bytes of the blocks
  that hold them. A rank's inputs must be whole blocks (32 inputs for Q4_0 / Q4_1 / Q8_0, a
  super-block of 256 for Q4_K / Q5_K / Q6_K); a split inside a block is an error naming the
  layer, the type and the widths (no fallback: the file loads with tensor_parallel_size 1, or
  dequantized with ``quantization="none"``);
* vocabulary-parallel (``VocabParallelEmbedding``, a vocabulary-split lm_head: ``layers.vocab``):
  rows ``[rank * rows, (rank + 1) * rows)`` of the table, the last rank's tail padded with
  all-zero blocks (every supported type decodes zero bytes to weight 0), so a tied lm_head's
  logits have the same width on every rank.

Any other split (a model's own row loader) is refused naming the layer. Invariant: a rank's
decoded weight equals the corresponding block of the full decoded weight; the products sum
(row-parallel) or gather (column / vocabulary) to the one-rank layer's.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from pagefold.distributed.parallel_state import tp_rank, tp_size
from pagefold.layers.linear import RowParallelLinear
from pagefold.layers.vocab import VocabParallelEmbedding
from pagefold.quantization.formats import QuantizationError
from pagefold.quantization.gguf_blocks import BLOCK, TYPE_SIZE

__all__ = ["GGUFSplit", "gguf_split"]


@dataclass
class GGUFSplit:
    """How this rank cuts a GGUF layer's full tensors. ``cuts``: shard -> ``RowCut``
    (column-parallel); ``full_in``: the full inputs (row-parallel, ``reduce`` as
    ``RowParallelLinear``'s); ``vocab_rows``: rows a rank holds (vocabulary-parallel)."""

    layer: str
    cuts: dict | None = None
    full_in: int | None = None
    reduce: bool = True
    vocab_rows: int | None = None

    @property
    def row(self) -> bool:
        return self.full_in is not None

    @property
    def start(self) -> int:
        """The first vocabulary row this rank holds (vocabulary-parallel)."""
        return tp_rank() * (self.vocab_rows or 0)

    def take(self, kind: str, raw: torch.Tensor, shard: str) -> torch.Tensor:
        """This rank's raw rows (rows, row_bytes) of the full GGUF tensor ``raw`` of type
        ``kind`` (shard ``shard`` of the layer)."""
        what = f"{self.layer}{' (' + shard + ')' if shard else ''}"
        if raw.dim() != 2:
            raise QuantizationError(f"{what}: GGUF {kind} tensor of shape {tuple(raw.shape)} "
                                    "(truncated or corrupt file)")
        if self.cuts is not None:
            cut = self.cuts.get(shard)
            if cut is None:
                raise QuantizationError(f"{what}: no shard {shard!r} (has {list(self.cuts)})")
            if raw.shape[0] != sum(cut.blocks):
                raise QuantizationError(f"{what}: GGUF {kind} tensor of {raw.shape[0]} rows, "
                                        f"expected {sum(cut.blocks)} (truncated or corrupt "
                                        "file)")
            return cut.take(raw).contiguous()
        if self.vocab_rows is not None:
            if -(-raw.shape[0] // tp_size()) != self.vocab_rows:
                raise QuantizationError(f"{what}: GGUF {kind} table of {raw.shape[0]} rows, "
                                        f"expected {self.vocab_rows} a rank over {tp_size()} "
                                        "ranks (truncated or corrupt file)")
            n = max(0, min(self.vocab_rows, raw.shape[0] - self.start))
            out = torch.zeros((self.vocab_rows, raw.shape[1]), dtype=raw.dtype)
            out[:n] = raw[self.start:self.start + n]
            return out
        return self._take_inputs(kind, raw, what)

    def _take_inputs(self, kind: str, raw: torch.Tensor, what: str) -> torch.Tensor:
        block, size = BLOCK[kind], TYPE_SIZE[kind]
        local = self.full_in // tp_size()
        if local % block:
            raise QuantizationError(f"{what}: tensor parallelism gives each of {tp_size()} "
                                    f"ranks {local} of its {self.full_in} inputs, which cuts a "
                                    f"GGUF {kind} block of {block} inputs (load the file with "
                                    "tensor_parallel_size 1, or quantization='none')")
        if raw.shape[1] != self.full_in // block * size:
            raise QuantizationError(f"{what}: GGUF {kind} rows of {raw.shape[1]} bytes, "
                                    f"expected {self.full_in // block * size} for "
                                    f"{self.full_in} inputs (truncated or corrupt file)")
        width = local // block * size
        return raw.narrow(1, tp_rank() * width, width).contiguous()


def gguf_split(mod: nn.Module, path: str) -> GGUFSplit | None:
    """The split of the plain layer ``mod`` (at ``path``) a GGUF layer replaces; None with one
    rank or a replicated layer."""
    if tp_size() == 1:
        return None
    if isinstance(mod, RowParallelLinear):
        return GGUFSplit(path, full_in=mod.in_features * tp_size(), reduce=mod.reduce)
    # ``loader_cuts``: the same row cut of a layer its model's own loader splits
    cuts = getattr(mod, "tp_cuts", None) or getattr(mod, "loader_cuts", None)
    if cuts:
        return GGUFSplit(path, cuts=cuts)
    if isinstance(mod, VocabParallelEmbedding):
        return GGUFSplit(path, vocab_rows=mod.num_embeddings)
    loader = getattr(getattr(mod, "weight", None), "tp_loader", None)
    if loader is not None and getattr(mod, "pf_logits", False) and isinstance(mod, nn.Linear):
        return GGUFSplit(path, vocab_rows=mod.out_features)  # lm_head_linear's vocab rows
    if loader is not None:
        raise QuantizationError(f"{path}: GGUF weights kept quantized in this layer's "
                                "tensor-parallel split are not supported (load the file with "
                                "tensor_parallel_size 1, or quantization='none')")
    return None
