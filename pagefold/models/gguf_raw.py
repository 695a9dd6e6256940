"""A GGUF file's tensors kept quantized, under Hugging Face names, for the pagefold cache.

transformers maps GGUF tensor names to a model's parameter names and undoes llama.cpp's
layout changes (the Q/K row permutation of Llama-family attention, MoE experts stacked with
gate and up joined) while it dequantizes. :func:`quantized_tensors` runs that same mapping on
row numbers instead of weights: for a quantized tensor transformers is handed one value per
row (``source << 32 | row``, exact in float64), so whatever it does to rows it does to those
numbers, and the raw blocks of the rows it ends up with are gathered in that order. The
result is the file's own blocks, bit for bit, with the rows where transformers' dequantized
weights have them.

Names in the result (what ``pagefold.quantization.gguf`` loads):

* ``<module>.gguf_<type>`` (rows, row_bytes) uint8: a 2-D weight of a linear or embedding
  module, kept quantized (``q4_k`` ...);
* ``<param>.gguf_dequant_<type>`` (..., rows, row_bytes) uint8: any other quantized tensor
  (stacked MoE experts), decoded when it loads;
* everything else (F32 / F16 / BF16 tensors) as float32, values as stored.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from pagefold.quantization.gguf import DEQUANT_PREFIX, KEEP_PREFIX
from pagefold.quantization.gguf_blocks import (
    BLOCK,
    SUPPORTED,
    TYPE_SIZE,
    GGUFTypeError,
    decode_rows,
    dequantize_rows,
)

__all__ = ["quantized_tensors"]

_PLAIN = ("F32", "F16", "BF16")


def _parse_with_row_ids(path: Path, skeleton) -> tuple[dict, list]:
    """transformers' parse of ``path`` with each supported quantized tensor replaced by its
    row ids (float64 (..., rows, 1)); the reader's tensors, in file order."""
    import gguf
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    tensors = gguf.GGUFReader(str(path)).tensors
    real = gguf.dequantize
    order = iter(range(len(tensors)))

    def row_ids(data, qtype):
        i = next(order)
        kind = gguf.GGMLQuantizationType(qtype).name
        if kind in _PLAIN:
            return real(data, qtype)
        if kind not in SUPPORTED:
            raise GGUFTypeError(
                f"{tensors[i].name}: GGUF type {kind} is not supported kept quantized "
                f"(supported: {', '.join(SUPPORTED)}, F32, F16, BF16); load the file with "
                "quantization='none' (--quantization none) to dequantize it")
        lead = data.shape[:-1]
        ids = np.arange(int(np.prod(lead)), dtype=np.float64) + float(i << 32)
        return ids.reshape(*lead, 1)

    gguf.dequantize = row_ids  # transformers imports it from the package on each call
    try:
        parsed = load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=skeleton)
    finally:
        gguf.dequantize = real
    return parsed, tensors


def _gather(name: str, ids: torch.Tensor, tensors: list) -> tuple[str, torch.Tensor]:
    """The raw rows at ``ids`` (any shape) as (stored name, tensor)."""
    flat = ids.reshape(-1).to(torch.int64)
    src, rows = (flat >> 32).numpy(), (flat & 0xFFFFFFFF).numpy()
    kinds = {tensors[s].tensor_type.name for s in np.unique(src)}
    widths = {tensors[s].data.shape[-1] for s in np.unique(src)}
    if len(kinds) != 1 or len(widths) != 1:
        # one parameter from tensors of different types: decoded here, stored float32
        parts = []
        for s, r in zip(src.tolist(), rows.tolist()):
            t = tensors[s]
            raw = torch.from_numpy(np.asarray(t.data).reshape(-1, t.data.shape[-1])[r:r + 1])
            parts.append(dequantize_rows(t.tensor_type.name, raw, int(t.shape[0]), t.name))
        return name, torch.cat(parts).reshape(*ids.shape[:-1], -1)
    kind, width = kinds.pop(), widths.pop()
    out = np.empty((flat.numel(), width), dtype=np.uint8)
    for s in np.unique(src):
        sel = src == s
        out[sel] = np.asarray(tensors[s].data).reshape(-1, width)[rows[sel]]
    k = width // TYPE_SIZE[kind] * BLOCK[kind]
    decode_rows(kind, torch.from_numpy(out), k, name)  # corrupt blocks: refused here, once
    raw = torch.from_numpy(out).reshape(*ids.shape[:-1], width)
    if raw.dim() == 2 and name.endswith(".weight"):
        return f"{name[:-len('.weight')]}.{KEEP_PREFIX}{kind.lower()}", raw
    return f"{name}.{DEQUANT_PREFIX}{kind.lower()}", raw


def quantized_tensors(path: Path, skeleton) -> tuple[dict[str, torch.Tensor], set[str]]:
    """(stored name -> tensor, the Hugging Face names covered) of ``path`` for a model built
    like ``skeleton`` (a meta-device transformers model)."""
    parsed, tensors = _parse_with_row_ids(path, skeleton)
    out: dict[str, torch.Tensor] = {}
    for name, t in parsed["tensors"].items():
        if t.dtype == torch.float64:
            stored, v = _gather(name, t, tensors)
            out[stored] = v.contiguous()
        else:
            out[name] = t.float().contiguous()
    return out, set(parsed["tensors"])
