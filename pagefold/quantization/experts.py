"""Quantized MoE experts: each expert's two products as quantized linears.

An :class:`~pagefold.layers.moe.MoEExperts` module holds its experts stacked
(``gate_up_proj`` (E, 2I, H), ``down_proj`` (E, H, I)). Quantized, expert ``e`` becomes an
:class:`ExpertLinears` registered as the module's child ``"e"``: ``gate_up_proj`` (a
:class:`QuantLinear` of 2I rows, shards ``gate_proj`` / ``up_proj``) and ``down_proj``, so a
quantized checkpoint's per-expert tensors (``mlp.experts.3.gate_proj.qweight``, renamed by the
model's fused names to ``experts.3.gate_up_proj`` shard ``gate_proj``) load by name. The
stacked parameters are dropped; ``MoEExperts.quantized`` lists the experts, and its forward
runs the routed tokens of each expert through them (the product per routed expert).

Under tensor parallelism an expert splits as the stacked weights do: this rank's rows of the
gate and up shards (column-parallel), its columns of ``down_proj`` (row-parallel, partial sums
that the MoE block all-reduces). Under expert parallelism the module holds only this rank's
experts, whole: quantizing them on load works unchanged; per-expert tensors of a quantized
checkpoint (global expert ids) are refused, except a GGUF's (``install_experts``: children
named by global id, each rank loading its own experts' blocks; under tensor parallelism
each expert's GGUF layers cut the file's blocks as ``gguf_tp`` does, ``expert_splits``).
"""

from __future__ import annotations

from collections.abc import Callable

from torch import nn

from pagefold.distributed.parallel_state import tp_size
from pagefold.layers.linear import RowCut
from pagefold.layers.moe import MoEExperts
from pagefold.quantization.formats import QuantizationError, QuantMethod
from pagefold.quantization.linear import QuantLinear, quantize_weight
from pagefold.quantization.tp import TPSplit

__all__ = ["ExpertLinears", "convert_experts", "expert_splits", "experts_holder",
           "install_experts", "quantize_experts"]


class ExpertLinears(nn.Module):
    """One expert's ``gate_up_proj`` and ``down_proj`` quantized linears (``QuantLinear``, or
    ``GGUFLinear`` for a GGUF's experts)."""

    def __init__(self, gate_up_proj: nn.Module, down_proj: nn.Module) -> None:
        super().__init__()
        self.gate_up_proj, self.down_proj = gate_up_proj, down_proj


def experts_holder(model: nn.Module, where: str, stacked: bool = True) -> nn.Module | None:
    """The experts block whose quantized experts are to live at ``where`` (an
    ``MoEExperts`` there, or a block with ``experts_path`` naming ``where``'s last part below
    it); with ``stacked``, only while its experts are still stacked. None otherwise."""
    head, _, tail = where.rpartition(".")
    for path, rest in ((where, ""), (head, tail)):
        try:
            mod = model.get_submodule(path)
        except AttributeError:
            continue
        if callable(getattr(mod, "install_quantized", None)) and mod.experts_path == rest:
            return mod if mod.quantized is None or not stacked else None
    return None


def _splits(mod: MoEExperts) -> tuple[TPSplit | None, TPSplit | None]:
    cuts, full_in = expert_splits(mod)
    if cuts is None:  # one rank, or whole experts (expert parallel)
        return None, None
    return TPSplit(cuts=cuts), TPSplit(full_in=full_in, reduce=False)


def _install(mod: MoEExperts, experts: list[ExpertLinears]) -> None:
    mod.install_quantized(experts)


def install_experts(mod: nn.Module, make: Callable[[int], ExpertLinears], path: str) -> None:
    """Make every local expert ``e`` of ``mod`` (an ``MoEExperts``, or a model's experts block
    with the same ``expert_dims`` / ``install_quantized``) the layers ``make(e)``. Under expert
    parallelism the children are named by global expert id (``first + e``, the checkpoint's
    per-expert names: another rank's experts have no place here); ``make`` builds the layers
    with :func:`expert_splits`' cuts."""
    first = mod.ep.first if mod.ep is not None else 0
    mod.install_quantized([make(e) for e in range(mod.expert_dims()[0])], first)


def expert_splits(mod: nn.Module) -> tuple[dict | None, int | None]:
    """How one expert's full tensors split on this rank: (the ``gate_proj`` / ``up_proj``
    output-row cuts of ``gate_up_proj``, the full inputs of the row-parallel ``down_proj``),
    or (None, None) with one rank or whole experts (expert parallelism)."""
    if tp_size() == 1 or mod.ep is not None:
        return None, None
    cuts = {s: RowCut([mod.full_inter], tp_size(), "moe_intermediate_size")
            for s in ("gate_proj", "up_proj")}
    return cuts, mod.full_inter


def _layers(mod: MoEExperts, methods: tuple[QuantMethod, QuantMethod], path: str, e: int
            ) -> ExpertLinears:
    hidden, inter = mod.gate_up_proj.shape[2], mod.inter
    gu_split, dn_split = _splits(mod)
    gu = QuantLinear(methods[0], hidden, 2 * inter,
                     {"gate_proj": (0, inter), "up_proj": (inter, inter)}, None,
                     f"{path}.{e}.gate_up_proj", gu_split)
    dn = QuantLinear(methods[1], inter, hidden, {"": (0, hidden)}, None,
                     f"{path}.{e}.down_proj", dn_split)
    return ExpertLinears(gu, dn)


def convert_experts(mod: MoEExperts, method: QuantMethod, path: str) -> None:
    """Make every expert of ``mod`` a pair of ``method`` layers, to load a quantized
    checkpoint's per-expert tensors into. Not under expert parallelism (the checkpoint's
    per-expert names carry global expert ids): a QuantizationError naming the layer."""
    if mod.ep is not None:
        raise QuantizationError(f"{path}: experts stored quantized in the checkpoint are not "
                                "supported with enable_expert_parallel (use tensor "
                                "parallelism, or quantize a plain checkpoint on load)")
    _install(mod, [_layers(mod, (method, method), path, e) for e in range(mod.num_experts)])


def quantize_experts(mod: MoEExperts, kind: str, path: str) -> None:
    """``quantization=fp8|int8|int4`` on load: every expert of a loaded ``mod`` quantized as
    the linears are (``quantize_weight``), each rank its part as the one-rank model would."""
    experts = []
    for e in range(mod.num_experts):
        m_gu, t_gu = quantize_weight(mod.gate_up_proj[e], kind, layer=f"{path}.{e}.gate_up_proj")
        m_dn, t_dn = quantize_weight(mod.down_proj[e], kind, mod.full_inter,
                                     f"{path}.{e}.down_proj")
        ex = _layers(mod, (m_gu, m_dn), path, e)
        for lin, tensors in ((ex.gate_up_proj, t_gu), (ex.down_proj, t_dn)):
            for name, t in tensors.items():
                for shard, (off, n) in lin.shards.items():
                    spec = lin.specs[name]
                    part = t if spec.out_dim is None else t.narrow(spec.out_dim, off, n)
                    lin.place(name, part, shard)
            lin.finalize()
        experts.append(ex)
    _install(mod, experts)
