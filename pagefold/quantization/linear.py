"""Quantized linear layers: converted while a checkpoint loads, or quantized once loaded.

:class:`QuantLinear` holds a linear's weight as its format stores it (:mod:`.formats`) and
multiplies by decoding one tile of output rows at a time into the activations' dtype (the
reference every compiled kernel of a format is tested against): the weight is never kept
decoded, so a 4-bit layer holds about a quarter of its bf16 bytes.

Loading: ``load_into`` (``layers/linear.py``) hands every checkpoint tensor to
:meth:`Quantizer.before_load` first. When a tensor is one of the format's (a ``qweight``, an
fp8 ``weight``, ...) and its layer is still a plain ``nn.Linear``, the layer is replaced by a
:class:`QuantLinear` with the same output shards (a fused ``qkv_proj`` places ``q_proj``'s
tensors at its rows) and the original bias parameter; the tensor then loads into it. Layers
the checkpoint keeps plain (``lm_head``, a config's ignore list) stay ``nn.Linear``.
``quantize_loaded`` quantizes the plain linears of a loaded model (``--quantization fp8`` /
``int8`` / ``int4`` on a bf16 checkpoint), every one but the lm_head.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn

from pagefold.distributed.parallel_state import tp_size
from pagefold.layers.linear import FusedShards
from pagefold.quantization.config import ON_LOAD_GROUP, QuantPlan
from pagefold.quantization.formats import (
    FP8,
    FP8_MAX,
    IntFormat,
    PackedInt,
    ParamSpec,
    QuantizationError,
)
from pagefold.quantization.int_kernel import IntWeight

__all__ = ["QuantLinear", "Quantizer", "finalize_all", "quantize_loaded", "weights_summary"]

logger = logging.getLogger("pagefold")

TILE_ROWS = 2048  # output rows decoded at a time: bounds the transient float32 weight


class QuantLinear(nn.Module):
    """A linear layer of ``out_features`` x ``in_features`` stored in ``method``'s format.

    ``shards``: checkpoint sub-name -> (first output row, rows), as ``FusedShards`` gives them
    (``{"": (0, out)}`` for an unfused layer); parameters named as the checkpoint names them.
    """

    def __init__(self, method, in_features: int, out_features: int,
                 shards: dict[str, tuple[int, int]], bias: nn.Parameter | None,
                 layer: str) -> None:
        super().__init__()
        self.method, self.layer = method, layer
        self.in_features, self.out_features = in_features, out_features
        self.shards = dict(shards)
        self.shard_index = {s: i for i, s in enumerate(self.shards)}
        self.specs: dict[str, ParamSpec] = method.params(out_features, in_features, layer)
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
                for s in self.shards:  # the format's default until the checkpoint says else
                    self._place(name, p, method.fill(name, out_features, in_features), s)
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
            rows = self.shards[shard][1]
            want = [rows if int(tensor[0]) != -1 else -1, self.in_features]
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

    def _loader(self, name: str):
        def load(param: torch.Tensor, tensor: torch.Tensor, shard: str | None) -> None:
            key = shard if shard is not None else ""
            if key not in self.shards:
                raise QuantizationError(f"{self.layer}.{name}: no shard {shard!r} "
                                        f"(has {list(self.shards)})")
            self._place(name, param, tensor, key)
        return load

    def finalize(self) -> None:
        """Once loaded: integer formats move into the compiled kernel's layout
        (:class:`IntWeight`; the checkpoint's tensors are dropped)."""
        if self.packed is not None or not isinstance(self.method, IntFormat):
            return
        layout_ok = getattr(self.method, "kernel_layout", None)
        if layout_ok is not None and not layout_ok(self.in_features):
            return  # scale blocks that do not divide the inputs: the reference path
        self.packed = IntWeight(self.method, self.tensors(), self.shards, self.out_features,
                                self.in_features)
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

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is not None:
            y = self.packed.matmul(x)
            return y if self.bias is None else y + self.bias
        t = self.tensors()
        y = x.new_empty((*x.shape[:-1], self.out_features))
        for shard, (off, n) in self.shards.items():
            i = self.shard_index[shard]
            for r0 in range(off, off + n, TILE_ROWS):
                rows = slice(r0, min(off + n, r0 + TILE_ROWS))
                w = self.method.dequantize(t, rows, i, self.out_features, self.in_features)
                y[..., rows] = F.linear(x, w.to(x.dtype))
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        return (f"in={self.in_features}, out={self.out_features}, {self.method.name}, "
                f"shards={list(self.shards)}")


def _shards(lin: nn.Linear) -> dict[str, tuple[int, int]]:
    fused = getattr(lin.weight, "fused", None)
    return dict(fused.shards) if fused is not None else {"": (0, lin.out_features)}


def _swap(model: nn.Module, path: str, new: nn.Module) -> None:
    parent_name, _, child = path.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    setattr(parent, child, new)


class Quantizer:
    """The model-side half of loading a quantized checkpoint (set as ``model.pf_quant``)."""

    def __init__(self, plan: QuantPlan) -> None:
        self.plan = plan
        self.converted = 0
        self.plain: set[str] = set()  # fused layers that took a plain weight shard
        self._names = (plan.checkpoint.tensor_names() if plan.checkpoint is not None
                       else set())

    def is_format_tensor(self, name: str) -> bool:
        return name in self._names

    def before_load(self, model: nn.Module, target: str, tensor: torch.Tensor) -> str | None:
        """Convert ``target``'s layer when ``tensor`` is stored in the checkpoint's format:
        ``"reload"`` (the model's parameters changed), ``"skip"`` (a tensor pagefold does not
        keep: static activation scales, since activations run unquantized) or None."""
        method = self.plan.checkpoint
        if method is None:
            return None
        path, _, name = target.rpartition(".")
        if name == "input_scale":
            return "skip"
        try:
            mod = model.get_submodule(path)
        except AttributeError:
            return None
        if isinstance(mod, QuantLinear) and name == "weight" and name not in mod.specs:
            raise QuantizationError(f"{path}: the checkpoint stores part of this fused layer "
                                    f"plain and part {method.name}-quantized (unsupported)")
        if isinstance(mod, QuantLinear):  # converted already: the tensor loads into it
            return None
        if not isinstance(mod, nn.Linear):
            if name not in ("weight", "bias") and self.is_format_tensor(name):
                raise QuantizationError(f"{target}: {method.name} tensors of a "
                                        f"{type(mod).__name__} (not a linear layer) are not "
                                        "supported yet")
            return None
        if name in ("weight", "bias") and tensor.dtype != torch.float8_e4m3fn:
            if name == "weight" and getattr(mod.weight, "fused", None) is not None:
                self.plain.add(path)  # a shard loaded plain: the layer cannot convert later
            return None
        if path in self.plain:
            raise QuantizationError(f"{path}: the checkpoint stores part of this fused layer "
                                    f"plain and part {method.name}-quantized (unsupported)")
        if tp_size() > 1:
            raise QuantizationError(f"{path}: {self.plan.label} weights under tensor "
                                    "parallelism are not supported yet")
        new = QuantLinear(method, mod.in_features, mod.out_features, _shards(mod), mod.bias,
                          path)
        if name not in new.specs:
            raise QuantizationError(f"{target}: not a tensor of the {method.name} format "
                                    f"(expected {', '.join(new.specs)})")
        _swap(model, path, new)
        self.converted += 1
        return "reload"


def _quantize_weight(w: torch.Tensor, kind: str) -> tuple[object, dict[str, torch.Tensor]]:
    """Per-channel fp8, or symmetric int8 / int4 with groups of ``ON_LOAD_GROUP`` inputs (per
    channel when that does not divide the inputs), of a weight (n, k)."""
    w = w.detach().float()
    n, k = w.shape
    if kind == "fp8":
        scale = (w.abs().amax(dim=1, keepdim=True) / FP8_MAX).clamp(min=1e-12)
        q = (w / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
        return FP8("channel"), {"weight": q, "weight_scale": scale}
    bits = 8 if kind == "int8" else 4
    group = ON_LOAD_GROUP if k % ON_LOAD_GROUP == 0 else -1
    g = k if group == -1 else group
    qmax = (1 << (bits - 1)) - 1
    wg = w.reshape(n, k // g, g)
    scale = (wg.abs().amax(dim=2) / qmax).clamp(min=1e-12)  # (n, groups)
    q = torch.round(wg / scale[..., None]).clamp(-qmax - 1, qmax).reshape(n, k).to(torch.int32)
    u = (q + (1 << (bits - 1))).to(torch.int64).reshape(n, k * bits // 32, 32 // bits)
    shifts = torch.arange(0, 32, bits, dtype=torch.int64)
    packed = (u << shifts).sum(dim=-1)
    packed = torch.where(packed >= 1 << 31, packed - (1 << 32), packed).to(torch.int32)
    return PackedInt(bits, group), {"weight_packed": packed, "weight_scale": scale}


def quantize_loaded(model: nn.Module, kind: str) -> int:
    """Replace every plain linear of a loaded model but its lm_head by a per-channel fp8 or
    grouped int8 / int4 :class:`QuantLinear`; returns how many were replaced."""
    if tp_size() > 1:
        raise QuantizationError(f"quantization {kind!r} on load under tensor parallelism is "
                                "not supported yet")
    todo = [(p, m) for p, m in model.named_modules()
            if type(m) is nn.Linear and not getattr(m, "pf_logits", False)
            and not p.endswith("lm_head")]
    for path, mod in todo:
        if kind != "fp8" and mod.in_features % (32 // (8 if kind == "int8" else 4)):
            continue  # a width the packing cannot take stays as stored
        method, tensors = _quantize_weight(mod.weight, kind)
        new = QuantLinear(method, mod.in_features, mod.out_features, _shards(mod), mod.bias,
                          path)
        for name, t in tensors.items():
            for shard, (off, n) in new.shards.items():
                spec = new.specs[name]
                part = t if spec.out_dim is None else t.narrow(spec.out_dim, off, n)
                new._place(name, getattr(new, name), part, shard)
        new.finalize()
        _swap(model, path, new)
    return len(todo)


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
    for p in model.parameters():
        if id(p) in seen:
            continue
        seen.add(id(p))
        counts[str(p.dtype).removeprefix("torch.")] = counts.get(
            str(p.dtype).removeprefix("torch."), 0) + 1
        total += p.numel() * p.element_size()
    parts = "; ".join(f"{k}: {v} tensors" for k, v in sorted(counts.items()))
    return f"{total / 2**20:.1f} MiB ({parts})"
