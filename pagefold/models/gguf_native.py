"""GGUFs of the architectures transformers does not read, read by pagefold itself.

:func:`read_gguf` turns a GGUF of one of :data:`.gguf_archs.ARCHS` (the GDN hybrids, the
Mamba-2 family) into what ``models/gguf_checkpoint.py`` writes for any GGUF: a Hugging Face
config built from the file's metadata, the tokenizer (transformers' GGUF tokenizer reader,
which needs no architecture), a meta-device transformers model of that config (for its
parameter names and class name), and the tensors under Hugging Face names in
``models/gguf_raw.py``'s stored form:

* ``<module>.gguf_<type>`` (rows, row_bytes) uint8: a 2-D linear / embedding weight kept
  quantized, its rows permuted or split as the arch table says (raw block rows: bit for bit
  the file's);
* ``<experts>.<e>.<proj>.gguf_<type>``: expert ``e``'s rows of a stacked ``ffn_*_exps``
  tensor, kept quantized (``quantization/gguf.py`` makes the experts GGUF layers);
* ``<param>.gguf_dequant_<type>`` (..., rows, row_bytes): another quantized tensor (stacked
  experts of which a part is stored as float), decoded when it loads;
* float32 for the rest: F32 / F16 / BF16 tensors and those a transform must decode
  (``A_log``, norms, conv weights, routers).

With ``keep_quantized=False`` every tensor is decoded into ``dtype`` (``quantization="none"``).

Errors: a tensor the table does not know, a block index beyond the config, a quantized type
not kept (:class:`~pagefold.quantization.gguf_blocks.GGUFTypeError`) or a tensor the
model needs that the file lacks: :class:`~.gguf_archs.GGUFConversionError` naming it.
"""

from __future__ import annotations

import logging
import re
from pathlib import Path

import numpy as np
import torch

from pagefold.models.gguf_archs import ARCHS, GGUFConversionError, Meta, Out
from pagefold.quantization.gguf import DEQUANT_PREFIX, KEEP_PREFIX
from pagefold.quantization.gguf_blocks import (
    BLOCK,
    SUPPORTED,
    TYPE_SIZE,
    GGUFTypeError,
    decode_rows,
    dequantize_rows,
)

__all__ = ["native_arch", "read_gguf"]

logger = logging.getLogger("pagefold")

_PLAIN = ("F32", "F16", "BF16")
_BIG = ("tokenizer.ggml.tokens", "tokenizer.ggml.merges", "tokenizer.ggml.token_type",
        "tokenizer.ggml.scores")
_NAME = re.compile(r"^(?:blk\.(?P<bid>\d+)\.)?(?P<short>.+?)(?:\.(?P<suffix>weight|bias))?$")
# Hugging Face tensors that llama.cpp splits: covered when all their parts are read.
_JOINED = {"in_proj_qkvz.weight": ("in_proj_qkv.weight", "in_proj_z.weight"),
           "in_proj_ba.weight": ("in_proj_b.weight", "in_proj_a.weight")}


def native_arch(reader) -> str | None:
    """The file's ``general.architecture`` when pagefold reads it itself, else None."""
    arch = _architecture(reader)
    return arch if arch in ARCHS else None


def _architecture(reader) -> str:
    f = reader.fields.get("general.architecture")
    return str(f.contents()) if f is not None else "?"


def _meta(reader) -> Meta:
    fields = {k: f.contents() for k, f in reader.fields.items()
              if k not in _BIG and not k.startswith("GGUF.")}
    shapes = {t.name: tuple(int(x) for x in reversed(t.shape.tolist())) for t in reader.tensors}
    return Meta(_architecture(reader), fields, shapes)


def _float(t) -> torch.Tensor:
    import gguf

    data = np.asarray(t.data)
    if t.tensor_type.name == "F32":
        return torch.from_numpy(data.astype(np.float32, copy=True))
    return torch.from_numpy(np.ascontiguousarray(gguf.quants.dequantize(data, t.tensor_type)))


def _block_perm(cols: np.ndarray, block: int) -> np.ndarray | None:
    """``cols`` as a permutation of whole blocks of ``block`` columns, or None."""
    if cols.size % block:
        return None
    runs = cols.reshape(-1, block)
    starts = runs[:, 0]
    if (starts % block).any() or not (runs == starts[:, None] + np.arange(block)).all():
        return None
    return starts // block


class _Piece:
    """One Out's tensor: raw block rows (``kind`` set) or float32 values."""

    def __init__(self, out: Out, value: torch.Tensor, kind: str | None) -> None:
        self.out, self.value, self.kind = out, value, kind


def _take(t, out: Out, keep: bool) -> _Piece:
    kind = t.tensor_type.name
    quantized = kind not in _PLAIN
    if quantized and keep and kind not in SUPPORTED:
        raise GGUFTypeError(
            f"{t.name}: GGUF type {kind} is not supported kept quantized (supported: "
            f"{', '.join(SUPPORTED)}, F32, F16, BF16); load the file with quantization='none' "
            "(--quantization none) to dequantize it")
    raw_ok = (quantized and keep and out.value is None and out.shape is None
              and not out.decode)
    perm = None
    if raw_ok and out.cols is not None:
        perm = _block_perm(out.cols, BLOCK[kind])
        if perm is None:
            logger.warning("%s: its columns are reordered in units smaller than a %s block; "
                           "this tensor is decoded to float", t.name, kind)
            raw_ok = False
    if raw_ok:
        raw = torch.from_numpy(np.array(t.data))  # a copy: the reader maps the file
        if out.rows is not None:
            raw = raw[..., torch.from_numpy(out.rows), :]
        if perm is not None:
            lead = raw.shape[:-1]
            raw = raw.reshape(*lead, -1, TYPE_SIZE[kind])[..., torch.from_numpy(perm), :]
            raw = raw.reshape(*lead, -1)
        return _Piece(out, raw.contiguous(), kind)
    w = _float(t)
    if out.rows is not None:
        idx = torch.from_numpy(out.rows)
        w = w[idx] if w.dim() == 1 else w[..., idx, :]
    if out.cols is not None:
        w = w[..., torch.from_numpy(out.cols)]
    if out.value is not None:
        w = out.value(w)
    if out.shape is not None:
        w = w.reshape(out.shape)
    return _Piece(out, w.contiguous(), None)


def _join(name: str, parts: list[_Piece]) -> _Piece:
    """Pieces of one tensor (``part`` order) joined along the rows: raw when all share one
    type, else decoded."""
    parts = sorted(parts, key=lambda p: p.out.part)
    kinds = {p.kind for p in parts}
    if len(kinds) == 1 and None not in kinds and len({p.value.shape[-1] for p in parts}) == 1:
        return _Piece(parts[0].out, torch.cat([p.value for p in parts], dim=-2), parts[0].kind)
    vals = [p.value if p.kind is None else _decode(p) for p in parts]
    return _Piece(parts[0].out, torch.cat(vals, dim=-2), None)


def _decode(p: _Piece) -> torch.Tensor:
    raw = p.value
    k = raw.shape[-1] // TYPE_SIZE[p.kind] * BLOCK[p.kind]
    w = dequantize_rows(p.kind, raw.reshape(-1, raw.shape[-1]), k, p.out.hf)
    return w.reshape(*raw.shape[:-1], k)


def _stored(p: _Piece, keep: bool, dtype: torch.dtype) -> tuple[str, torch.Tensor]:
    hf = p.out.hf
    if p.kind is None:
        return hf, p.value.to(dtype if not keep else torch.float32)
    raw = p.value
    k = raw.shape[-1] // TYPE_SIZE[p.kind] * BLOCK[p.kind]
    decode_rows(p.kind, raw.reshape(-1, raw.shape[-1]), k, hf)  # corrupt blocks: refused here
    if raw.dim() == 2 and hf.endswith(".weight"):
        return f"{hf[:-len('.weight')]}.{KEEP_PREFIX}{p.kind.lower()}", raw
    return f"{hf}.{DEQUANT_PREFIX}{p.kind.lower()}", raw


def _per_expert(key: str, parts: list[_Piece]) -> dict[str, torch.Tensor]:
    """Stacked experts kept quantized: expert ``e``'s raw rows as the per-expert weight
    ``<experts>.<e>.<proj>.gguf_<type>`` (``quantization/gguf.py`` makes each expert's
    products GGUF layers)."""
    base = key.rpartition(".")[0]
    out = {}
    for p in parts:
        for e in range(p.value.shape[0]):
            piece = _Piece(Out(f"{base}.{e}.{p.out.expert}.weight"), p.value[e].contiguous(),
                           p.kind)
            name, raw = _stored(piece, True, torch.float32)
            out[name] = raw
    return out


def _tokenizer(path: Path):
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast.from_pretrained(path.parent, gguf_file=path.name)


def read_gguf(path: Path, reader, dtype: torch.dtype, keep_quantized: bool):
    """(config, tokenizer, meta-device transformers model, stored name -> tensor, Hugging Face
    names covered) of ``path`` (its ``gguf.GGUFReader`` ``reader``); see the module
    docstring."""
    from transformers import AutoConfig, AutoModelForCausalLM

    meta = _meta(reader)
    spec = ARCHS[meta.arch]
    kwargs = spec.config(meta)
    config = AutoConfig.for_model(spec.model_type, **kwargs)
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(config)
    plan_cfg = dict(config.to_dict(), _gguf_arch=meta.arch)
    pieces: dict[str, list[_Piece]] = {}
    for t in reader.tensors:
        m = _NAME.match(t.name)
        bid = int(m["bid"]) if m["bid"] is not None else None
        if bid is not None and bid >= config.num_hidden_layers:
            continue  # llama.cpp's multi-token-prediction blocks: not served
        outs = spec.plan(m["short"], m["suffix"] or "", bid, plan_cfg)
        if not outs:
            raise GGUFConversionError(f"{path.name}: tensor {t.name} is not one pagefold "
                                      f"reads for the {meta.arch} architecture")
        for out in outs:
            key = out.hf
            if key in pieces and out.part is None:
                raise GGUFConversionError(f"{path.name}: two tensors map to {key}")
            pieces.setdefault(key, []).append(_take(t, out, keep_quantized))
    tensors: dict[str, torch.Tensor] = {}
    names: set[str] = set()
    # an experts module is split per expert only when all its stacked tensors are kept
    # quantized (its stacked parameters go when the first per-expert tensor loads)
    plain_experts = {k.rpartition(".")[0] for k, ps in pieces.items()
                     if any(q.out.expert and q.kind is None for q in ps)}
    for key, ps in pieces.items():
        names.add(key)
        if keep_quantized and key.rpartition(".")[0] not in plain_experts and all(
                q.kind is not None and q.out.expert for q in ps):
            tensors.update(_per_expert(key, ps))
            continue
        p = _join(key, ps) if ps[0].out.part is not None else ps[0]
        if not keep_quantized and p.kind is not None:
            p = _Piece(p.out, _decode(p), None)
        stored, v = _stored(p, keep_quantized, dtype)
        tensors[stored] = v
    for whole, parts in _JOINED.items():
        for n in list(names):
            if n.endswith(parts[0]):
                head = n[: -len(parts[0])]
                if all(head + q in names for q in parts):
                    names.add(head + whole)
    return config, _tokenizer(path), skeleton, tensors, names
