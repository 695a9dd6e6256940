"""Checkpoint reading: safetensors files (single or sharded with an index) and name mapping."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

# Fused-shard loading lives on the layer shelf; these names stay importable from here.
from pagefold.layers.linear import FusedShards, fuse, load_into  # noqa: F401


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

