"""Checkpoint reading: safetensors files (single or sharded with an index) and name mapping."""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from torch import nn


def safetensors_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError) as e:
            raise ValueError(f"{index} is not a valid safetensors index ({type(e).__name__}: "
                             f"{e})") from None
        files = sorted({model_dir / f for f in weight_map.values()})
    else:
        files = sorted(model_dir.glob("*.safetensors"))
    missing = [f for f in files if not f.exists()]
    if missing:
        names = [m.name for m in missing]
        raise FileNotFoundError(f"checkpoint shard(s) missing in {model_dir}: {names}")
    if not files:
        raise FileNotFoundError(
            f"no *.safetensors weights in {model_dir}; pagefold loads safetensors checkpoints"
        )
    return files


def iter_weights(model_dir: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor of every shard; a corrupt or truncated file is a ValueError naming it."""
    for f in safetensors_files(model_dir):
        try:
            with safe_open(str(f), framework="pt") as fh:
                for name in fh.keys():
                    tensor = fh.get_tensor(name)
                    yield name, tensor
        except (SafetensorError, OSError) as e:
            raise ValueError(f"cannot read weights from {f}: {e} (is the file truncated or "
                             "corrupt? re-download it)") from None


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
    """
    params = dict(module.named_parameters())
    rename = rename or {}
    loaded: set[str] = set()
    for name, tensor in weights:
        if name.startswith(skip_prefixes) or "rotary_emb.inv_freq" in name:
            continue
        target, shard = name, None
        parts = name.split(".")
        for i, part in enumerate(parts):
            if part in rename:
                target = ".".join(parts[:i] + [rename[part]] + parts[i + 1 :])
                shard = part
                break
        if target not in params:
            raise ValueError(f"checkpoint tensor {name!r} has no place in {type(module).__name__}")
        param = params[target]
        with torch.no_grad():
            if shard is not None:
                off, size = param.fused.shards[shard]
                param.data[off : off + size].copy_(tensor)
            else:
                if param.shape != tensor.shape:
                    raise ValueError(f"{name}: checkpoint shape {tuple(tensor.shape)} != model "
                                     f"shape {tuple(param.shape)}")
                param.data.copy_(tensor)
        loaded.add(target if shard is None else f"{target}:{shard}")
    return loaded
