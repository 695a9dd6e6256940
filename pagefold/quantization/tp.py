"""Quantized weights under tensor parallelism: each rank's part of a full checkpoint tensor.

A quantized layer replaces a column- or row-parallel linear (``layers/linear.py``) and keeps
that layer's split (:class:`TPSplit`):

* column-parallel: each checkpoint shard keeps this rank's output rows (``RowCut``); a tensor
  whose elements pack several output rows (GPTQ's ``qzeros``, AWQ's words, FP8 block scales)
  is cut in whole elements, so a split inside a word or block is an error naming the layer.
  Tensors without an output dimension (``g_idx``, a per-tensor scale) are whole on every rank.
* row-parallel: this rank's slice of the input features, cut from every tensor along its
  input dimension, group scales with their columns (a split inside a group or block is an
  error naming the layer). Formats with a per-input group index (GPTQ ``g_idx``,
  compressed-tensors act-order) keep every group's scales and zeros and cut the index; once
  loaded, :func:`regroup` keeps the groups this rank's inputs use, and when act-order spreads
  a group unevenly over the ranks pads each group to the same input count with inputs that
  read a zero activation (``in_index``), so the kernel's fixed group size holds and the sums
  are unchanged.

Invariant: a rank's decoded weight equals the corresponding block of the full layer's decoded
weight (same codes, scales and zeros); nothing is re-quantized.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from pagefold.distributed.parallel_state import tp_rank, tp_size
from pagefold.layers.linear import RowParallelLinear
from pagefold.quantization.formats import IntFormat, ParamSpec, QuantizationError, QuantMethod

__all__ = ["TPSplit", "regroup", "split_of"]

# Per-input group index of a format, and the tensors indexed by its groups (kept whole on
# every rank of a row-parallel layer; the index is cut).
GROUP_INDEX = {"g_idx": ("qzeros", "scales"), "weight_g_idx": ("weight_scale",)}


@dataclass
class TPSplit:
    """How a quantized layer's checkpoint tensors are cut on this rank. ``cuts``: checkpoint
    shard -> ``RowCut`` (column-parallel); ``full_in``: the full input features (row-parallel:
    this rank keeps ``[rank * in, (rank + 1) * in)``); ``reduce``: a row-parallel layer sums
    the ranks' outputs itself (else its caller does, bias on rank 0)."""

    cuts: dict | None = None
    full_in: int | None = None
    reduce: bool = True

    @property
    def row(self) -> bool:
        return self.full_in is not None

    def full_rows(self, shard: str, local: int) -> int:
        cut = (self.cuts or {}).get(shard)
        return sum(cut.blocks) if cut is not None else local

    def specs(self, method: QuantMethod, n: int, k: int, layer: str) -> dict[str, ParamSpec]:
        """The local tensors' specs (row-parallel with a group index: its groups' tensors
        whole). A split whose inputs do not hold whole groups or packed words is an error."""
        try:
            local = method.params(n, k, layer)
        except QuantizationError as e:
            if not self.row:
                raise
            raise QuantizationError(f"{e} (tensor parallelism gives each of {tp_size()} ranks "
                                    f"{k} of its {self.full_in} inputs: the split cuts a "
                                    "group or packed word)") from None
        if not self.row:
            return local
        full = method.params(n, self.full_in, layer)
        whole = {t for idx, ts in GROUP_INDEX.items() if idx in local for t in ts}
        out = {}
        for name, spec in local.items():
            if name in whole:
                out[name] = full[name]
                continue
            dim = _in_dim(spec)
            block = getattr(method, "block", None)
            cut = dim is not None and full[name].shape[dim] != spec.shape[dim]
            if cut and (full[name].shape[dim] != tp_size() * spec.shape[dim]
                        or (block is not None and k % block[1])):
                raise QuantizationError(f"{layer}: tensor parallelism splits its "
                                        f"{self.full_in} inputs over {tp_size()} ranks inside "
                                        f"a {method.name} block of {name}")
            out[name] = spec
        return out

    def take(self, name: str, spec: ParamSpec, tensor: torch.Tensor, shard: str,
             layer: str) -> torch.Tensor:
        """This rank's part of the full checkpoint tensor ``name`` of shard ``shard``."""
        if self.row:
            dim = _in_dim(spec)
            if dim is None or tensor.dim() <= dim or tensor.shape[dim] == spec.shape[dim]:
                return tensor  # whole on every rank (per-channel / per-tensor / all groups)
            m = spec.shape[dim]
            if tensor.shape[dim] != m * tp_size():
                return tensor  # a wrong shape: the shape check names it
            return tensor.narrow(dim, tp_rank() * m, m)
        cut = (self.cuts or {}).get(shard)
        if cut is None or spec.out_dim is None:
            return tensor
        d, div = spec.out_dim, spec.out_div
        parts, start = [], 0
        for full, n, pick in zip(cut.blocks, cut.local, cut.picks):
            first = start + pick * n
            if first % div or n % div:
                raise QuantizationError(f"{layer}.{name}: tensor parallelism keeps rows "
                                        f"[{first}, {first + n}) of shard {shard or '(all)'}, "
                                        f"which cut a packed element of {div} rows")
            parts.append(tensor.narrow(d, first // div, n // div))
            start += full
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=d)


def _in_dim(spec: ParamSpec) -> int | None:
    """The dimension along which a tensor's inputs (or input groups) run."""
    if spec.out_dim is None:
        return 0 if len(spec.shape) == 1 and spec.dtype == torch.int32 else None
    if len(spec.shape) != 2:
        return None
    return 1 - spec.out_dim


def split_of(mod: nn.Module, path: str = "?") -> TPSplit | None:
    """The split of the plain layer ``mod`` (at ``path``) a quantized layer replaces (None:
    one rank, or a replicated layer). A layer cut by a model's own loader without a declared
    ``loader_cuts`` is refused."""
    if tp_size() == 1:
        return None
    if isinstance(mod, RowParallelLinear):
        return TPSplit(full_in=mod.in_features * tp_size(), reduce=mod.reduce)
    # ``loader_cuts``: the row cut of a layer its model's own loader splits (Granite-4.0-H's
    # shared ``input_linear``: this rank's gate rows then its up rows), declared for the
    # loaders that cut raw tensors (LoRA, GGUF, these formats).
    cuts = getattr(mod, "tp_cuts", None) or getattr(mod, "loader_cuts", None)
    if cuts:
        return TPSplit(cuts=cuts)
    if getattr(getattr(mod, "weight", None), "tp_loader", None) is not None:
        raise QuantizationError(f"{path}: quantized weights of this layer's tensor-parallel "
                                "split are not supported (use tensor_parallel_size 1)")
    return None


class _Parts(IntFormat):
    """A layer's kernel parts computed already (per shard), as an :class:`IntFormat`."""

    def __init__(self, method: IntFormat, parts: list[tuple]) -> None:
        self.bits, self.fp8, self.name = method.bits, method.fp8, method.name
        self.parts = parts

    def int_parts(self, t, rows, shard, n, k):
        return self.parts[shard]


def regroup(method: IntFormat, tensors: dict[str, torch.Tensor],
            shards: dict[str, tuple[int, int]], n: int, k: int, layer: str
            ) -> tuple[IntFormat, int, torch.Tensor | None]:
    """A row-parallel layer with a group index (all groups' scales kept, the index cut): its
    parts over the groups this rank's inputs use. Returns (format, inputs, ``in_index``): the
    kernel's inputs are ``x`` padded with one zero column, gathered by ``in_index`` (None: as
    they are)."""
    raw = [method.int_parts(tensors, slice(off, off + rows), i, n, k)
           for i, (off, rows) in enumerate(shards.values())]
    g = raw[0][3]
    if any(not torch.equal(p[3], g) for p in raw):
        raise QuantizationError(f"{layer}: {method.name} shards with different group indexes "
                                "under tensor parallelism are not supported")
    used, local, counts = torch.unique(g, sorted=True, return_inverse=True, return_counts=True)
    if bool((counts == counts[0]).all()):
        return _Parts(method, [(q, s[:, used], z[:, used], local) for q, s, z, _ in raw]), k, None
    if len(raw) > 1:
        raise QuantizationError(f"{layer}: act-order groups spread unevenly over the ranks in "
                                "a fused row-parallel layer are not supported")
    width = int(counts.max())
    if (width * len(used)) % 2:
        width += 1  # 4-bit codes pack two to a byte
    index = torch.full((len(used), width), k, dtype=torch.int64)  # k: the zero column
    order = torch.argsort(local, stable=True)
    first = torch.cumsum(counts, 0) - counts
    pos = torch.arange(k) - first[local[order]]
    index[local[order], pos] = order
    index = index.reshape(-1)
    q, s, z, _ = raw[0]
    qp = torch.cat([q, torch.zeros_like(q[:, :1])], dim=1)[:, index]
    gp = torch.arange(index.numel()) // width
    return _Parts(method, [(qp, s[:, used], z[:, used], gp)]), index.numel(), index
