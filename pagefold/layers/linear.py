"""Linear layers' loading: fused parameters built from several checkpoint tensors.

A fused parameter (``qkv_proj`` from ``q_proj``/``k_proj``/``v_proj``, ``gate_up_proj`` from
``gate_proj``/``up_proj``) carries ``FusedShards``: the rows each checkpoint tensor fills.
``load_into`` copies a checkpoint into a module by name, through those shards.

Tensor parallelism (``distributed/parallel_state.py``): ``column_linear`` keeps this rank's
rows of every shard (heads, channels, experts' rows), ``RowParallelLinear`` this rank's input
columns and sums the ranks' outputs. A parameter with a ``tp_loader`` cuts its rank's part out
of each full checkpoint tensor, so checkpoints load unchanged. With one rank both are plain
``nn.Linear`` layers with the usual loading.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from pagefold.distributed.parallel_state import all_reduce, tp_rank, tp_size


class FusedShards:
    """Marks a parameter built from several checkpoint tensors stacked along dim 0.

    ``shards`` maps the checkpoint's sub-name (e.g. ``"q_proj"``) to (offset, size) rows.
    """

    def __init__(self, shards: dict[str, tuple[int, int]]) -> None:
        self.shards = shards


def fuse(linear: nn.Linear, sizes: dict[str, int]) -> nn.Linear:
    offsets, pos = {}, 0
    for name, size in sizes.items():
        offsets[name] = (pos, size)
        pos += size
    assert pos == linear.out_features, (pos, linear.out_features)
    for p in linear.parameters():
        p.fused = FusedShards(offsets)  # type: ignore[attr-defined]
    return linear


def load_into(
    module: nn.Module,
    weights: Iterable[tuple[str, torch.Tensor]],
    rename: dict[str, str] | None = None,
    skip_prefixes: tuple[str, ...] = (),
) -> set[str]:
    """Copy checkpoint tensors into ``module``'s parameters; returns the names loaded.

    ``rename`` maps a checkpoint sub-module name to the fused parameter's name
    (e.g. ``{"q_proj": "qkv_proj"}``); the fused parameter's ``FusedShards`` gives the rows.
    Unknown checkpoint tensors raise, so a mismatched architecture is caught at load time.
    Tensors under a part another pipeline stage holds (a module with ``pf_absent``, see
    ``layers/decoder_stack.py``) are skipped.
    """
    params = dict(module.named_parameters())
    absent = tuple(f"{n}." for n, m in module.named_modules() if getattr(m, "pf_absent", False))
    # ``pf_quant`` (set by the model loader for a quantized checkpoint; duck-typed, so the
    # layer shelf does not import the quantization package): converts layers to their format.
    quant = getattr(module, "pf_quant", None)
    rename = rename or {}
    loaded: set[str] = set()
    for name, tensor in weights:
        if name.startswith(skip_prefixes) or "rotary_emb.inv_freq" in name:
            continue
        if absent and name.startswith(absent):
            continue
        if name.endswith((".k_scale", ".v_scale")):  # FP8 KV scales: the cache takes them
            continue
        target, shard = name, None
        parts = name.split(".")
        for i, part in enumerate(parts):
            if part in rename:
                target = ".".join(parts[:i] + [rename[part]] + parts[i + 1 :])
                shard = part
                break
        if quant is not None:  # a quantized checkpoint: its layers convert as their tensors come
            act = quant.before_load(module, target, tensor)
            if act == "skip":
                continue
            if act == "reload":
                params = dict(module.named_parameters())
        if target not in params:
            raise ValueError(f"checkpoint tensor {name!r} has no place in {type(module).__name__}")
        param = params[target]
        with torch.no_grad():
            loader = getattr(param, "tp_loader", None)
            if loader is not None:
                loader(param, tensor, shard)
            elif shard is not None:
                off, size = param.fused.shards[shard]
                param.data[off : off + size].copy_(tensor)
            else:
                if param.shape != tensor.shape:
                    raise ValueError(f"{name}: checkpoint shape {tuple(tensor.shape)} != model "
                                     f"shape {tuple(param.shape)}")
                param.data.copy_(tensor)
        loaded.add(target if shard is None else f"{target}:{shard}")
    return loaded


def _split(full: int, parts: int, what: str) -> int:
    if parts < 1 or full % parts:
        raise ValueError(f"{what} ({full}) cannot be split in {parts} equal parts for "
                         f"tensor_parallel_size {tp_size()}")
    return full // parts


def column_linear(in_features: int, sizes: dict[str, int | list[int]] | int, *, bias: bool,
                  parts: dict[str, int | list[int]] | None = None,
                  what: str = "output features"
                  ) -> nn.Linear:
    """A linear layer keeping this rank's rows of each shard of its output.

    ``sizes``: the full output rows of each fused shard (checkpoint sub-name -> rows), or one
    count for an unfused layer. A shard given as a list of row counts is several blocks (Gated
    DeltaNet's q | k | v), each cut separately. ``parts[name]`` (default: the rank count) is
    how many equal parts the shard is cut into (a list: per block); rank ``r`` keeps part
    ``r * parts // ranks``, so a shard cut in fewer parts than ranks is replicated (KV heads
    fewer than ranks)."""
    fused = isinstance(sizes, dict)
    full = sizes if fused else {"": sizes}
    tp = tp_size()
    if tp == 1:
        flat = {k: sum(v) if isinstance(v, list) else v for k, v in full.items()}
        lin = nn.Linear(in_features, sum(flat.values()), bias=bias)
        return fuse(lin, flat) if fused else lin
    parts = parts or {}
    cuts: dict[str, RowCut] = {}
    for name, n in full.items():
        cuts[name] = RowCut(n if isinstance(n, list) else [n], parts.get(name, tp),
                            f"{what} {name}".strip())
    local = {name: c.local_rows for name, c in cuts.items()}
    lin = nn.Linear(in_features, sum(local.values()), bias=bias)
    offsets, pos = {}, 0
    for name, n in local.items():
        offsets[name] = (pos, n)
        pos += n

    def loader(param: torch.Tensor, tensor: torch.Tensor, shard: str | None) -> None:
        key = shard if shard is not None else ""
        if key not in offsets:
            raise ValueError(f"no shard {shard!r} in a column-parallel layer ({list(offsets)})")
        off, n = offsets[key]
        param.data[off : off + n].copy_(cuts[key].take(tensor))

    for prm in lin.parameters():
        if fused:
            prm.fused = FusedShards(offsets)  # type: ignore[attr-defined]
        prm.tp_loader = loader  # type: ignore[attr-defined]
    lin.tp_cuts = cuts  # a quantized layer replacing this one cuts its tensors the same way
    return lin


class RowCut:
    """This rank's rows of a tensor made of ``blocks`` row blocks, each cut in ``parts`` (one
    count for every block, or one per block: a block cut in fewer parts than ranks is shared,
    rank ``r`` keeping part ``r * parts // ranks``, as Mamba-2's single B/C group is)."""

    def __init__(self, blocks: list[int], parts: int | list[int], what: str) -> None:
        self.blocks = blocks
        per_block = parts if isinstance(parts, list) else [parts] * len(blocks)
        self.local = [_split(b, p, what) for b, p in zip(blocks, per_block, strict=True)]
        self.picks = [tp_rank() * p // tp_size() for p in per_block]

    @property
    def local_rows(self) -> int:
        return sum(self.local)

    def take(self, tensor: torch.Tensor, dim: int = 0) -> torch.Tensor:
        out, start = [], 0
        for full, n, pick in zip(self.blocks, self.local, self.picks):
            out.append(tensor.narrow(dim, start + pick * n, n))
            start += full
        return out[0] if len(out) == 1 else torch.cat(out, dim=dim)


def shard_rows(param: torch.Tensor, blocks: list[int], what: str,
               parts: list[int] | None = None, dim: int = 0) -> int:
    """Mark ``param`` (built with this rank's rows) to load its rows of a full checkpoint
    tensor made of ``blocks`` row blocks along ``dim``, each cut evenly over the ranks (or in
    ``parts[i]`` parts, see ``RowCut``). Returns the local row count. With one rank nothing
    changes."""
    if tp_size() == 1:
        return sum(blocks)
    cut = RowCut(blocks, parts or tp_size(), what)

    def loader(p: torch.Tensor, tensor: torch.Tensor, shard: str | None) -> None:
        p.data.copy_(cut.take(tensor, dim))

    param.tp_loader = loader  # type: ignore[attr-defined]
    return cut.local_rows


class RowParallelLinear(nn.Linear):
    """``x`` holds this rank's slice of the input features; the output is the full sum over
    ranks (one all-reduce), bias added once after it. With ``reduce=False`` the output is this
    rank's partial sum (bias on rank 0 only) for a caller that sums several partials with one
    all-reduce (an MoE block: every expert's and the shared expert's down projections)."""

    def __init__(self, in_features: int, out_features: int, *, bias: bool,
                 what: str = "input features", reduce: bool = True) -> None:
        tp = tp_size()
        super().__init__(_split(in_features, tp, what), out_features, bias=bias)
        n, r = self.in_features, tp_rank()
        self.reduce = reduce

        def weight_loader(param: torch.Tensor, tensor: torch.Tensor, shard: str | None) -> None:
            param.data.copy_(tensor.narrow(1, r * n, n))

        def bias_loader(param: torch.Tensor, tensor: torch.Tensor, shard: str | None) -> None:
            param.data.copy_(tensor)

        self.weight.tp_loader = weight_loader  # type: ignore[attr-defined]
        if self.bias is not None:
            self.bias.tp_loader = bias_loader  # type: ignore[attr-defined]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from pagefold.csrc import cpu_ops, gemm

        y = cpu_ops.linear(x, self.weight, None) if x.dim() == 2 else None  # bf16 GEMV rows
        if y is None:
            y = gemm.linear(x, self.weight)  # bf16 GEMM rows via float32 where that is faster
        y = gemm.onednn_linear(x, self.weight) if y is None else y
        if not self.reduce:
            return y if self.bias is None or tp_rank() else y + self.bias
        y = all_reduce(y)
        return y if self.bias is None else y + self.bias


def row_linear(in_features: int, out_features: int, *, bias: bool,
               what: str = "input features", reduce: bool = True) -> nn.Linear:
    """``nn.Linear`` with one rank, else a ``RowParallelLinear`` (``reduce``: see there)."""
    if tp_size() == 1:
        return nn.Linear(in_features, out_features, bias=bias)
    return RowParallelLinear(in_features, out_features, bias=bias, what=what, reduce=reduce)
