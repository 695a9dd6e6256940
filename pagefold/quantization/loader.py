"""Loading quantized weights into a model: a quantized checkpoint's layers converted as
their tensors arrive (:class:`Quantizer`), or a plain model's linears quantized once loaded
(:func:`quantize_loaded`).

``load_into`` (``layers/linear.py``) hands every checkpoint tensor to
:meth:`Quantizer.before_load` first. When a tensor is one of the format's (a ``qweight``, an
fp8 ``weight``, ...) and its layer is still a plain ``nn.Linear``, the layer is replaced by a
:class:`~.linear.QuantLinear` with the same output shards (a fused ``qkv_proj`` places
``q_proj``'s tensors at its rows), the original bias parameter and the tensor-parallel split
of the layer it replaces; the tensor then loads into it. A per-expert tensor of stacked MoE
experts converts every expert of that block (``quantization.experts``). Layers the checkpoint
keeps plain (``lm_head``, a config's ignore list) stay ``nn.Linear``. ``quantize_loaded``
quantizes the plain linears and MoE experts of a loaded model (``--quantization fp8`` /
``int8`` / ``int4`` on a bf16 checkpoint), every linear but the lm_head.
"""

from __future__ import annotations

import re

import torch
from torch import nn

from pagefold.layers.linear import RowParallelLinear
from pagefold.layers.moe import MoEExperts
from pagefold.quantization.config import QuantPlan
from pagefold.quantization.experts import convert_experts, quantize_experts
from pagefold.quantization.formats import QuantizationError
from pagefold.quantization.linear import QuantLinear, quantize_weight
from pagefold.quantization.tp import split_of

__all__ = ["Quantizer", "quantize_loaded"]

_EXPERT = re.compile(r"^(?P<mod>.+\.experts)\.(?P<e>\d+)\.(gate_up_proj|down_proj)$")


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
            return self._experts(model, path, name)
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
        new = QuantLinear(method, mod.in_features, mod.out_features, _shards(mod), mod.bias,
                          path, split_of(mod, path))
        if name not in new.specs:
            raise QuantizationError(f"{target}: not a tensor of the {method.name} format "
                                    f"(expected {', '.join(new.specs)})")
        _swap(model, path, new)
        self.converted += 1
        return "reload"

    def _experts(self, model: nn.Module, path: str, name: str) -> str | None:
        """A per-expert tensor (``...experts.3.gate_up_proj.<name>``) of stacked experts not
        converted yet: every expert of that module becomes a pair of quantized layers."""
        m = _EXPERT.match(path)
        if m is None or not self.is_format_tensor(name):
            return None
        try:
            mod = model.get_submodule(m["mod"])
        except AttributeError:
            return None
        if not isinstance(mod, MoEExperts) or mod.quantized is not None:
            return None
        convert_experts(mod, self.plan.checkpoint, m["mod"])
        self.converted += mod.num_experts
        return "reload"


def quantize_loaded(model: nn.Module, kind: str) -> int:
    """Replace every plain linear of a loaded model but its lm_head by a per-channel fp8 or
    grouped int8 / int4 :class:`QuantLinear`; returns how many were replaced. Under tensor
    parallelism each rank quantizes its part as the one-rank model would (see
    ``quantize_weight``): the same codes and scales. MoE experts are quantized too, each
    expert's products as such layers (``quantization.experts``)."""
    todo = [(p, m) for p, m in model.named_modules()
            if type(m) in (nn.Linear, RowParallelLinear) and not getattr(m, "pf_logits", False)
            and not p.endswith("lm_head")]
    for path, mod in todo:
        split = split_of(mod, path)
        full_k = split.full_in if split is not None and split.row else mod.in_features
        if kind != "fp8" and full_k % (32 // (8 if kind == "int8" else 4)):
            continue  # a width the packing cannot take stays as stored
        method, tensors = quantize_weight(mod.weight, kind, full_k, path)
        new = QuantLinear(method, mod.in_features, mod.out_features, _shards(mod), mod.bias,
                          path, split)
        for name, t in tensors.items():
            for shard, (off, n) in new.shards.items():
                spec = new.specs[name]
                part = t if spec.out_dim is None else t.narrow(spec.out_dim, off, n)
                new.place(name, part, shard)
        new.finalize()
        _swap(model, path, new)
    experts = [(p, m) for p, m in model.named_modules()
               if isinstance(m, MoEExperts) and m.quantized is None]
    for path, mod in experts:
        quantize_experts(mod, kind, path)
    return len(todo) + sum(m.num_experts for _, m in experts)


