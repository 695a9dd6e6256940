"""Quantized linear layers (loaded by ``quantization.loader``).

:class:`QuantLinear` holds a linear's weight as its format stores it (:mod:`.formats`) and
multiplies by decoding one tile of output rows at a time into the activations' dtype (the
reference every compiled kernel of a format is tested against): the weight is never kept
decoded, so a 4-bit layer holds about a quarter of its bf16 bytes.

``quantize_weight`` is the rule of ``--quantization fp8 | int8 | int4`` on load.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn

from pagefold.distributed.parallel_state import all_reduce, all_reduce_max, tp_rank
from pagefold.layers.linear import FusedShards
from pagefold.quantization.config import ON_LOAD_GROUP
from pagefold.quantization.formats import (
    FP8,
    FP8_MAX,
    IntFormat,
    PackedInt,
    ParamSpec,
    QuantizationError,
)
from pagefold.quantization.int_kernel import IntWeight
from pagefold.quantization.native_matrix import record_matrix
from pagefold.quantization.tp import GROUP_INDEX, TPSplit, regroup

__all__ = ["QuantLinear", "finalize_all", "quantize_weight", "weights_summary"]

logger = logging.getLogger("pagefold")

TILE_ROWS = 2048  # output rows decoded at a time: bounds the transient float32 weight


class QuantLinear(nn.Module):
    """A linear layer of ``out_features`` x ``in_features`` stored in ``method``'s format.

    ``shards``: checkpoint sub-name -> (first output row, rows), as ``FusedShards`` gives them
    (``{"": (0, out)}`` for an unfused layer); parameters named as the checkpoint names them.
    ``split``: the tensor-parallel split of the layer it replaces (``quantization.tp``): the
    loaders cut each full checkpoint tensor to this rank's part, and a row-parallel layer sums
    the ranks' outputs as ``RowParallelLinear`` does.
    """

    def __init__(self, method, in_features: int, out_features: int,
                 shards: dict[str, tuple[int, int]], bias: nn.Parameter | None,
                 layer: str, split: TPSplit | None = None) -> None:
        super().__init__()
        self.method, self.layer, self.split = method, layer, split
        self.in_features, self.out_features = in_features, out_features
        self.shards = dict(shards)
        self.shard_index = {s: i for i, s in enumerate(self.shards)}
        self.in_index: torch.Tensor | None = None  # row-parallel act-order: padded inputs
        self.specs: dict[str, ParamSpec] = (
            split.specs(method, out_features, in_features, layer) if split is not None
            else method.params(out_features, in_features, layer))
        for name, spec in self.specs.items():
            if spec.out_div > 1:
                bad = [s for s, (off, n) in self.shards.items()
                       if off % spec.out_div or n % spec.out_div]
                if bad:
                    raise QuantizationError(f"{layer}: {method.name} packs {spec.out_div} "
                                            f"output rows per element of {name}; shard(s) "
                                            f"{bad} do not align")
            shape = spec.shape if spec.out_dim is not None else (len(self.shards), *spec.shape)
            p = nn.Parameter(torch.zeros(shape, dtype=spec.dtype), requires_grad=False)
            p.tp_loader = self._loader(name)  # type: ignore[attr-defined]
            if len(self.shards) > 1 or "" not in self.shards:
                p.fused = FusedShards(self.shards)  # type: ignore[attr-defined]
            if spec.optional:
                p.optional = True  # type: ignore[attr-defined]
                full_in = split.full_in if split is not None and split.row else in_features
                for s in self.shards:  # the format's default until the checkpoint says else
                    self._place(name, p, self._cut(name, method.fill(name, out_features,
                                                                     full_in), s), s)
            self.register_parameter(name, p)
        self.bias = bias
        self.packed: IntWeight | None = None

    # ------------------------------------------------------------------ loading
    def _place(self, name: str, p: torch.Tensor, tensor: torch.Tensor, shard: str) -> None:
        spec = self.specs[name]
        what = f"{self.layer}.{name}" + (f" ({shard})" if shard else "")
        if spec.out_dim is None:
            dst = p.data[self.shard_index[shard]]
        else:
            off, n = self.shards[shard]
            d = spec.out_div
            dst = p.data.narrow(spec.out_dim, off // d, n // d)
        if name == "weight_shape":  # the shard's (rows, in) as stored: checked, not kept
            rows, k = self.shards[shard][1], self.in_features
            if self.split is not None:
                rows = self.split.full_rows(shard, rows)
                k = self.split.full_in or k
            want = [rows if int(tensor[0]) != -1 else -1, k]
            if [int(v) for v in tensor.reshape(-1).tolist()] != want:
                raise QuantizationError(f"{what}: stored shape {tensor.tolist()} != "
                                        f"({rows}, {self.in_features})")
        if tuple(tensor.shape) != tuple(dst.shape):
            raise QuantizationError(f"{what}: {self.method.name} tensor of shape "
                                    f"{tuple(tensor.shape)}, expected {tuple(dst.shape)} "
                                    "(truncated or corrupt checkpoint, or another layout)")
        if tensor.dtype != spec.dtype and not (tensor.is_floating_point()
                                               and spec.dtype.is_floating_point
                                               and spec.dtype != torch.float8_e4m3fn):
            raise QuantizationError(f"{what}: {self.method.name} tensor of dtype {tensor.dtype}, "
                                    f"expected {spec.dtype}")
        dst.copy_(tensor)

    def place(self, name: str, tensor: torch.Tensor, shard: str = "") -> None:
        """Copy this rank's part ``tensor`` (already cut) of tensor ``name`` of ``shard``."""
        self._place(name, getattr(self, name), tensor, shard)

    def _cut(self, name: str, tensor: torch.Tensor, shard: str) -> torch.Tensor:
        """This rank's part of a full checkpoint tensor (itself with one rank)."""
        if self.split is None:
            return tensor
        return self.split.take(name, self.specs[name], tensor, shard, self.layer)

    def _loader(self, name: str):
        def load(param: torch.Tensor, tensor: torch.Tensor, shard: str | None) -> None:
            key = shard if shard is not None else ""
            if key not in self.shards:
                raise QuantizationError(f"{self.layer}.{name}: no shard {shard!r} "
                                        f"(has {list(self.shards)})")
            self._place(name, param, self._cut(name, tensor, key), key)
        return load

    def finalize(self) -> None:
        """Once loaded: integer formats move into the compiled kernel's layout
        (:class:`IntWeight`; the checkpoint's tensors are dropped)."""
        if self.packed is not None or not isinstance(self.method, IntFormat):
            return
        layout_ok = getattr(self.method, "kernel_layout", None)
        if layout_ok is not None and not layout_ok(self.in_features):
            return  # scale blocks that do not divide the inputs: the reference path
        method, k = self.method, self.in_features
        if self.split is not None and self.split.row and GROUP_INDEX.keys() & self.specs.keys():
            method, k, self.in_index = regroup(self.method, self.tensors(), self.shards,
                                               self.out_features, self.in_features, self.layer)
        self.packed = IntWeight(method, self.tensors(), self.shards, self.out_features, k)
        for name in self.specs:
            delattr(self, name)
        self.specs = {}

    @property
    def nbytes(self) -> int:
        if self.packed is not None:
            return self.packed.nbytes
        return sum(t.numel() * t.element_size() for t in self.tensors().values())

    # ------------------------------------------------------------------ compute
    def tensors(self) -> dict[str, torch.Tensor]:
        return {n: getattr(self, n) for n in self.specs}

    def dequantized(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The whole weight decoded (out, in) from the checkpoint's tensors (before
        :meth:`finalize`)."""
        t = self.tensors()
        out = torch.empty((self.out_features, self.in_features), dtype=dtype)
        for shard, (off, n) in self.shards.items():
            i = self.shard_index[shard]
            for r0 in range(off, off + n, TILE_ROWS):
                rows = slice(r0, min(off + n, r0 + TILE_ROWS))
                out[rows] = self.method.dequantize(t, rows, i, self.out_features,
                                                   self.in_features)
        return out

    def native_matrix(self) -> tuple[int, int, int, int] | None:
        """For the native decode driver (``layers.native_record``, one rank only): (descriptor
        address, bias address or 0, its GEMV's address, most rows), the product
        :meth:`forward` makes on bf16 rows; None before :meth:`finalize` packed the weight,
        with act-order inputs, or a bias not bf16."""
        if self.packed is None or self.in_index is not None:
            return None
        return record_matrix(self.packed, self.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self._product(x)
        if self.split is None or not self.split.row:
            return y if self.bias is None else y + self.bias
        if not self.split.reduce:  # the caller sums the ranks' partials: bias once
            return y if self.bias is None or tp_rank() else y + self.bias
        y = all_reduce(y)
        return y if self.bias is None else y + self.bias

    def _product(self, x: torch.Tensor) -> torch.Tensor:
        """``x @ w.T`` of this rank's weight (no bias, no reduction)."""
        if self.packed is not None:
            if self.in_index is not None:
                x = F.pad(x, (0, 1))[..., self.in_index]
            return self.packed.matmul(x)
        t = self.tensors()
        y = x.new_empty((*x.shape[:-1], self.out_features))
        for shard, (off, n) in self.shards.items():
            i = self.shard_index[shard]
            for r0 in range(off, off + n, TILE_ROWS):
                rows = slice(r0, min(off + n, r0 + TILE_ROWS))
                w = self.method.dequantize(t, rows, i, self.out_features, self.in_features)
                y[..., rows] = F.linear(x, w.to(x.dtype))
        return y

    def extra_repr(self) -> str:
        return (f"in={self.in_features}, out={self.out_features}, {self.method.name}, "
                f"shards={list(self.shards)}")


def quantize_weight(w: torch.Tensor, kind: str, full_k: int | None = None, layer: str = "?"
                     ) -> tuple[object, dict[str, torch.Tensor]]:
    """Per-channel fp8, or symmetric int8 / int4 with groups of ``ON_LOAD_GROUP`` inputs (per
    channel when that does not divide the inputs), of a weight (n, k). ``full_k``: the full
    layer's inputs when ``w`` is a row-parallel rank's slice of them: groups follow the full
    layer's (a slice cutting one is an error), and a scale over the whole row takes the
    maximum over the ranks, so every rank holds exactly its block of the one-rank weight."""
    w = w.detach().float()
    n, k = w.shape
    full_k = full_k or k
    amax_all = all_reduce_max if full_k != k else (lambda t: t)
    if kind == "fp8":
        scale = (amax_all(w.abs().amax(dim=1, keepdim=True)) / FP8_MAX).clamp(min=1e-12)
        q = (w / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
        return FP8("channel"), {"weight": q, "weight_scale": scale}
    bits = 8 if kind == "int8" else 4
    group = ON_LOAD_GROUP if full_k % ON_LOAD_GROUP == 0 else -1
    if group != -1 and k % group:
        raise QuantizationError(f"{layer}: tensor parallelism splits its {full_k} inputs "
                                f"inside a group of {group} (int{bits} on load)")
    g = k if group == -1 else group
    qmax = (1 << (bits - 1)) - 1
    wg = w.reshape(n, k // g, g)
    amax = wg.abs().amax(dim=2)
    scale = ((amax_all(amax) if group == -1 else amax) / qmax).clamp(min=1e-12)  # (n, groups)
    q = torch.round(wg / scale[..., None]).clamp(-qmax - 1, qmax).reshape(n, k).to(torch.int32)
    u = (q + (1 << (bits - 1))).to(torch.int64).reshape(n, k * bits // 32, 32 // bits)
    shifts = torch.arange(0, 32, bits, dtype=torch.int64)
    packed = (u << shifts).sum(dim=-1)
    packed = torch.where(packed >= 1 << 31, packed - (1 << 32), packed).to(torch.int32)
    return PackedInt(bits, group), {"weight_packed": packed, "weight_scale": scale}


def finalize_all(model: nn.Module) -> None:
    """Every quantized layer of a loaded model into its kernel layout."""
    for mod in model.modules():
        if isinstance(mod, QuantLinear):
            mod.finalize()


def weights_summary(model: nn.Module) -> str:
    """``N MiB (gptq int4 g128: 28 tensors; bfloat16: 61 tensors)``: the weight bytes held and
    what holds them, quantized layers counted once each under their format."""
    counts: dict[str, int] = {}
    total = 0
    seen: set[int] = set()
    for mod in model.modules():
        if isinstance(mod, QuantLinear):
            key = mod.method.label
            counts[key] = counts.get(key, 0) + 1
            for t in mod.tensors().values():
                seen.add(id(t))
            total += mod.nbytes
        elif hasattr(mod, "pf_weight_bytes"):  # other quantized holders (GGUF layers)
            kinds, nbytes, ident = mod.pf_weight_bytes()
            if ident not in seen:  # a tied head shares its embedding's weight
                seen.add(ident)
                total += nbytes
                for key, v in kinds.items():
                    counts[key] = counts.get(key, 0) + v
    for name, p in model.named_parameters():
        if id(p) in seen:
            continue
        seen.add(id(p))
        key = str(p.dtype).removeprefix("torch.")
        if name.endswith("_blocks") and p.dtype == torch.uint8:
            key = "mxfp4"  # gpt-oss experts' codes (their scales count as uint8)
        counts[key] = counts.get(key, 0) + 1
        total += p.numel() * p.element_size()
    parts = "; ".join(f"{k}: {v} tensors" for k, v in sorted(counts.items()))
    return f"{total / 2**20:.1f} MiB ({parts})"
