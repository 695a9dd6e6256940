"""GGUF checkpoints kept quantized: layers that hold a GGUF file's blocks, and their loading.

A kept-quantized GGUF conversion (``models/gguf_checkpoint.py``, ``models/gguf_raw.py``,
``models/gguf_native.py``) stores each quantized linear or embedding weight as
``<module>.gguf_<type>`` (rows, row_bytes) uint8, rows in the model's order (llama.cpp's Q/K
permutation undone), MoE experts that pagefold's reader splits per expert as
``<experts>.<e>.<proj>.gguf_<type>``, and every other quantized tensor (stacked experts of
transformers' reader) as ``<param>.gguf_dequant_<type>``.

* :func:`gguf_weights` wraps the checkpoint's tensor stream: ``gguf_dequant_`` tensors are
  decoded into float32 under their parameter's name (the experts' stacked parameters load
  them as any float tensor, in the model's dtype); everything else passes as stored.
* :class:`GGUFQuantizer` (``model.pf_quant``, called by ``layers.linear.load_into`` before each
  tensor loads) replaces the module of a ``gguf_<type>`` tensor: a plain ``nn.Linear`` by a
  :class:`GGUFLinear` with the same output shards (``q_proj`` fills its rows of a fused
  ``qkv_proj``) and bias, an ``nn.Embedding`` by a :class:`GGUFEmbedding`. The tensor then
  loads into a placeholder parameter of that type, whose loader keeps the raw rows;
  :meth:`GGUFQuantizer.finalize` builds each layer's :class:`~.gguf_kernel.GGUFWeight` (the
  raw rows and placeholders are dropped) and points a tied lm_head at the embedding's
  weight, so the file's blocks are held once. The first per-expert tensor of an
  ``MoEExperts`` makes each of its experts a pair of GGUF layers (``gate_up_proj`` with
  shards ``gate_proj`` / ``up_proj``, ``down_proj``; ``quantization/experts.py``): under
  tensor parallelism each cut as a column- / row-parallel layer (the intermediate rows of
  gate and up, the down inputs in whole blocks; partial sums the MoE block all-reduces),
  under expert parallelism this rank's whole experts, another rank's tensors skipped.

Invariants: a fused layer takes every shard from the file's quantized tensors or none (a
plain shard beside quantized ones is refused, naming the layer); every shard of a layer is
filled before it finalizes; off the CPU GGUF layers are refused. Under tensor parallelism
each layer keeps its rank's part of the file's blocks (:mod:`.gguf_tp`: output rows,
vocabulary rows, or input columns in whole blocks), and a row-parallel layer sums the ranks'
products as ``RowParallelLinear`` does; a vocabulary-parallel embedding zeroes the ids
another rank holds and sums the ranks' rows.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch
from torch import nn

from pagefold.distributed.parallel_state import all_reduce, tp_rank
from pagefold.layers.linear import RowParallelLinear
from pagefold.layers.vocab import VocabParallelEmbedding
from pagefold.quantization.experts import (
    ExpertLinears,
    expert_splits,
    experts_holder,
    install_experts,
)
from pagefold.quantization.formats import QuantizationError
from pagefold.quantization.gguf_blocks import BLOCK, TYPE_SIZE, dequantize_rows
from pagefold.quantization.gguf_kernel import GGUFWeight
from pagefold.quantization.gguf_tp import GGUFSplit, gguf_split
from pagefold.quantization.native_matrix import record_matrix

__all__ = ["DEQUANT_PREFIX", "KEEP_PREFIX", "GGUFEmbedding", "GGUFLinear", "GGUFQuantizer",
           "gguf_weights"]

KEEP_PREFIX = "gguf_"  # <module>.gguf_<type>: a linear / embedding weight kept quantized
DEQUANT_PREFIX = "gguf_dequant_"  # <param>.gguf_dequant_<type>: decoded as it loads


def _kind(name: str, prefix: str = KEEP_PREFIX) -> str | None:
    """``gguf_q4_k`` -> ``Q4_K``; None for another name."""
    if not name.startswith(prefix) or (prefix == KEEP_PREFIX
                                       and name.startswith(DEQUANT_PREFIX)):
        return None
    return name[len(prefix):].upper()


def gguf_weights(weights: Iterable[tuple[str, torch.Tensor]]
                 ) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint's tensors with ``gguf_dequant_`` ones decoded (float32)."""
    for name, t in weights:
        head, _, last = name.rpartition(".")
        kind = _kind(last, DEQUANT_PREFIX)
        if kind is None:
            yield name, t
            continue
        if kind not in TYPE_SIZE or t.dim() < 2:
            raise QuantizationError(f"{head}: GGUF tensor of type {kind} and shape "
                                    f"{tuple(t.shape)} cannot be decoded")
        k = t.shape[-1] // TYPE_SIZE[kind] * BLOCK[kind]
        w = dequantize_rows(kind, t.reshape(-1, t.shape[-1]), k, head)
        yield head, w.reshape(*t.shape[:-1], k)


class _RawHolder(nn.Module):
    """The loading half of a GGUF layer: placeholder parameters per type whose loaders keep
    each shard's raw rows until :meth:`build`."""

    def _init_raw(self, layer: str, rows: int, cols: int,
                  shards: dict[str, tuple[int, int]], split: GGUFSplit | None) -> None:
        self.layer, self.rows, self.cols, self.split = layer, rows, cols, split
        self.shards = dict(shards)
        self.raw: dict[str, tuple[str, torch.Tensor]] = {}
        self.packed: GGUFWeight | None = None

    def add_raw_param(self, name: str, kind: str) -> None:
        p = nn.Parameter(torch.empty(0, dtype=torch.uint8), requires_grad=False)
        p.optional = True  # type: ignore[attr-defined]  # completeness: checked in build

        def load(param: torch.Tensor, tensor: torch.Tensor, shard: str | None) -> None:
            key = shard if shard is not None else ""
            if key not in self.shards:
                raise QuantizationError(f"{self.layer}: no shard {shard!r} "
                                        f"(has {list(self.shards)})")
            if key in self.raw:
                raise QuantizationError(f"{self.layer}: shard {key!r} given twice")
            if self.split is not None:
                tensor = self.split.take(kind, tensor, key)
            n = self.shards[key][1]
            if tensor.dim() != 2 or tensor.shape[0] != n:
                raise QuantizationError(f"{self.layer}{' (' + key + ')' if key else ''}: GGUF "
                                        f"{kind} tensor of shape {tuple(tensor.shape)}, "
                                        f"expected {n} rows (truncated or corrupt file)")
            self.raw[key] = (kind, tensor)

        p.tp_loader = load  # type: ignore[attr-defined]
        self.register_parameter(name, p)

    def build(self) -> None:
        """The kernel weight from every shard's rows, in row order; placeholders dropped."""
        if self.packed is not None:
            return
        missing = [s or self.layer for s in self.shards if s not in self.raw]
        if missing:
            raise QuantizationError(f"{self.layer}: the GGUF file lacks {missing} of this "
                                    "layer (truncated or corrupt file)")
        order = sorted(self.shards, key=lambda s: self.shards[s][0])
        self.packed = GGUFWeight([self.raw[s] for s in order], self.cols, self.layer)
        self.raw = {}
        for name in [n for n, _ in self.named_parameters(recurse=False)
                     if _kind(n) is not None]:
            delattr(self, name)

    def pf_weight_bytes(self) -> tuple[dict[str, int], int, int]:
        """(tensors per format label, bytes held, identity of the held weight): for the load
        log (``weights_summary``), counting a weight shared by a tied head once."""
        w = self.packed
        if w is None:
            return {}, 0, id(self)
        return {f"gguf {k}": v for k, v in w.kinds.items()}, w.nbytes, id(w)


class GGUFLinear(_RawHolder):
    """A linear layer (``out_features`` x ``in_features``) holding GGUF blocks; ``shards`` as
    ``FusedShards`` gives them (``{"": (0, out)}`` unfused); ``float_out``: float32 outputs
    (an lm_head's logits)."""

    def __init__(self, in_features: int, out_features: int,
                 shards: dict[str, tuple[int, int]], bias: nn.Parameter | None, layer: str,
                 float_out: bool = False, split: GGUFSplit | None = None) -> None:
        super().__init__()
        self._init_raw(layer, out_features, in_features, shards, split)
        self.in_features, self.out_features = in_features, out_features
        self.bias = bias
        self.float_out = float_out

    @classmethod
    def sharing(cls, weight: GGUFWeight, layer: str, float_out: bool) -> GGUFLinear:
        """A bias-free linear over an existing weight (an lm_head tied to the embedding)."""
        lin = cls(weight.k, weight.n, {"": (0, weight.n)}, None, layer, float_out)
        lin.packed = weight
        return lin

    def native_matrix(self) -> tuple[int, int, int, int] | None:
        """For the native decode driver (``layers.native_record``): (descriptor address, bias
        address or 0, its GEMV's address, most rows), the product :meth:`forward` makes on
        bf16 rows; None for logits (``float_out``), a bias not bf16, or a weight the few-row
        kernel does not take, or a row-parallel layer (its sum over the ranks)."""
        if (self.packed is None or self.float_out
                or (self.split is not None and self.split.row)):
            return None
        return record_matrix(self.packed, self.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is None:
            raise RuntimeError(f"{self.layer}: GGUF layer used before its weights loaded")
        y = self.packed.matmul(x, self.float_out)
        b = None if self.bias is None else self.bias.to(y.dtype)
        if self.split is None or not self.split.row:
            return y if b is None else y + b
        if not self.split.reduce:  # the caller sums the ranks' partials: bias once
            return y if b is None or tp_rank() else y + b
        y = all_reduce(y)
        return y if b is None else y + b

    def extra_repr(self) -> str:
        kinds = self.packed.kinds if self.packed is not None else {}
        return (f"in={self.in_features}, out={self.out_features}, gguf {kinds}, "
                f"shards={list(self.shards)}")


class GGUFEmbedding(_RawHolder):
    """An embedding table holding GGUF blocks; a lookup decodes the rows it gathers into
    ``dtype`` (the model's)."""

    def __init__(self, num_embeddings: int, dim: int, dtype: torch.dtype, layer: str,
                 split: GGUFSplit | None = None) -> None:
        super().__init__()
        self._init_raw(layer, num_embeddings, dim, {"": (0, num_embeddings)}, split)
        self.num_embeddings, self.embedding_dim, self.dtype = num_embeddings, dim, dtype

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.packed is None:
            raise RuntimeError(f"{self.layer}: GGUF embedding used before its weights loaded")
        if self.split is None:
            return self.packed.rows(ids).to(self.dtype)
        local = ids - self.split.start  # vocabulary-parallel: this rank's rows, summed
        outside = (local < 0) | (local >= self.num_embeddings)
        x = self.packed.rows(local.masked_fill(outside, 0)).to(self.dtype)
        return all_reduce(x.masked_fill(outside.unsqueeze(-1), 0))


# The plain layers a GGUF layer replaces (one rank, and their tensor-parallel forms).
LINEARS = (nn.Linear, RowParallelLinear)
EMBEDDINGS = (nn.Embedding, VocabParallelEmbedding)


def _swap(model: nn.Module, path: str, new: nn.Module) -> None:
    parent_name, _, child = path.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    setattr(parent, child, new)


def _shards(lin: nn.Linear) -> dict[str, tuple[int, int]]:
    fused = getattr(lin.weight, "fused", None)
    return dict(fused.shards) if fused is not None else {"": (0, lin.out_features)}


def _gguf_experts(model: nn.Module, path: str) -> str | None:
    """``path`` = ``<experts>.<e>.gate_up_proj|down_proj`` of an ``MoEExperts`` (or a model's
    experts block, ``experts.experts_holder``): with its experts still stacked, every local
    expert made a pair of GGUF layers (the file's per-expert rows load into them, cut for
    tensor parallelism), ``"reload"``; ``"skip"`` for an expert another rank holds (expert
    parallelism); None for another path."""
    parent, _, proj = path.rpartition(".")
    where, _, e = parent.rpartition(".")
    if proj not in ("gate_up_proj", "down_proj") or not e.isdigit():
        return None
    mod = experts_holder(model, where, stacked=False)
    if mod is None:
        return None
    if mod.quantized is not None:
        return "skip" if mod.ep is not None and not mod.ep.owns(int(e)) else None
    _, hidden, inter = mod.expert_dims()
    cuts, full_in = expert_splits(mod)

    def make(i: int) -> ExpertLinears:
        layer = f"{where}.{i + (mod.ep.first if mod.ep is not None else 0)}"
        gu = None if cuts is None else GGUFSplit(f"{layer}.gate_up_proj", cuts=cuts)
        dn = None if cuts is None else GGUFSplit(f"{layer}.down_proj", full_in=full_in,
                                                 reduce=False)
        return ExpertLinears(
            GGUFLinear(hidden, 2 * inter, {"gate_proj": (0, inter), "up_proj": (inter, inter)},
                       None, f"{layer}.gate_up_proj", split=gu),
            GGUFLinear(inter, hidden, {"": (0, hidden)}, None, f"{layer}.down_proj",
                       split=dn))

    install_experts(mod, make, where)
    return "skip" if mod.ep is not None and not mod.ep.owns(int(e)) else "reload"


class GGUFQuantizer:
    """The model-side half of loading a kept-quantized GGUF (set as ``model.pf_quant``)."""

    def __init__(self) -> None:
        self.plain: set[str] = set()  # fused linears that took a plain weight shard
        self.embedding_weights: dict[int, GGUFEmbedding] = {}  # replaced table -> new module

    def before_load(self, model: nn.Module, target: str, tensor: torch.Tensor) -> str | None:
        """Convert ``target``'s module when ``tensor`` is GGUF blocks: ``"reload"`` (the
        model's parameters changed) or None."""
        path, _, name = target.rpartition(".")
        kind = _kind(name)
        try:
            mod = model.get_submodule(path)
        except AttributeError:
            act = _gguf_experts(model, path) if kind is not None else None
            if act != "reload":
                return act
            mod = model.get_submodule(path)
        if kind is None:
            if name == "weight" and isinstance(mod, GGUFLinear):
                raise QuantizationError(f"{path}: the GGUF file stores part of this fused "
                                        "layer plain and part quantized (unsupported)")
            if (name == "weight" and type(mod) in LINEARS
                    and getattr(mod.weight, "fused", None) is not None):
                self.plain.add(path)
            return None
        if kind not in TYPE_SIZE:
            raise QuantizationError(f"{target}: GGUF type {kind} is not supported")
        dev = getattr(getattr(mod, "weight", None), "device", torch.device("cpu"))
        if dev.type != "cpu":
            raise QuantizationError(f"{path}: GGUF weights kept quantized run on the CPU only "
                                    f"(this model is on {dev}); load the file with "
                                    "quantization='none'")
        new = mod
        if type(mod) in EMBEDDINGS:
            new = GGUFEmbedding(mod.num_embeddings, mod.embedding_dim, mod.weight.dtype, path,
                                gguf_split(mod, path))
            self.embedding_weights[id(mod.weight)] = new
        elif type(mod) in LINEARS:
            if path in self.plain:
                raise QuantizationError(f"{path}: the GGUF file stores part of this fused "
                                        "layer plain and part quantized (unsupported)")
            new = GGUFLinear(mod.in_features, mod.out_features, _shards(mod), mod.bias, path,
                             float_out=bool(getattr(mod, "pf_logits", False)),
                             split=gguf_split(mod, path))
        elif not isinstance(mod, (GGUFLinear, GGUFEmbedding)):
            raise QuantizationError(f"{target}: a GGUF {kind} tensor of a "
                                    f"{type(mod).__name__} (not a linear or embedding) cannot "
                                    "be kept quantized; load the file with "
                                    "quantization='none'")
        if new is not mod:
            _swap(model, path, new)
        if name not in new._parameters:
            new.add_raw_param(name, kind)
            return "reload"
        return "reload" if new is not mod else None

    def finalize(self, model: nn.Module) -> int:
        """Every GGUF layer into its kernel layout; a head tied to a replaced embedding table
        shares its weight. Returns how many layers hold GGUF weights."""
        held = [m for m in model.modules() if isinstance(m, _RawHolder)]
        for m in held:
            m.build()
        for path, mod in list(model.named_modules()):
            emb = (self.embedding_weights.get(id(mod.weight))
                   if type(mod) is nn.Linear else None)
            if emb is not None:
                _swap(model, path, GGUFLinear.sharing(
                    emb.packed, path, bool(getattr(mod, "pf_logits", False))))
        return len(held)
