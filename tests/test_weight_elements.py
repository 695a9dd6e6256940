"""``model_runner.weight_elements``: the per-token work the CPU runner weighs when it picks one
thread for a small step. A layer holding its weight outside parameters (a kept-quantized GGUF
layer's raw blocks) counts its logical ``out x in``; a plain model counts its parameters, a
tied weight once. (Before, a kept-quantized SmolLM2 counted 35,136 elements, every decode step
looked small, and it ran on one thread.)"""

from __future__ import annotations

import torch
from torch import nn

from pagefold.executor.model_runner import weight_elements


class _RawLinear(nn.Module):
    """A weight held as raw bytes in a plain attribute, as GGUF layers hold theirs."""

    def __init__(self, n: int, k: int) -> None:
        super().__init__()
        self.out_features, self.in_features = n, k
        self.raw = torch.zeros(n * k // 2, dtype=torch.uint8)
        self.bias = nn.Parameter(torch.zeros(n))


class _RawEmbedding(nn.Module):
    def __init__(self, rows: int, dim: int) -> None:
        super().__init__()
        self.num_embeddings, self.embedding_dim = rows, dim


def test_plain_model_counts_its_parameters_a_tied_weight_once() -> None:
    emb = nn.Embedding(50, 8)
    head = nn.Linear(8, 50, bias=False)
    head.weight = emb.weight
    model = nn.ModuleList([emb, nn.Linear(8, 6), nn.LayerNorm(6), head])
    assert weight_elements(model) == 50 * 8 + (8 * 6 + 6) + (6 + 6)


def test_raw_held_weights_count_their_logical_shape() -> None:
    model = nn.ModuleList([_RawEmbedding(50, 8), _RawLinear(6, 8), nn.LayerNorm(6)])
    # 400 (table) + 48 (6 x 8: the bias's 6 elements are part of what the layer holds, not
    # extra) + 12 (norm)
    assert weight_elements(model) == 50 * 8 + 6 * 8 + (6 + 6)
    # the one-row step of a 135M kept-quantized model is not a small step any more
    big = nn.ModuleList([_RawLinear(49152, 576), _RawLinear(3072, 576)])
    assert weight_elements(big) == 49152 * 576 + 3072 * 576
