"""Checkpoint reading: safetensors files (single or sharded with an index) and name mapping."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open

# Fused-shard loading lives on the layer shelf; these names stay importable from here.
from pagefold.layers.linear import FusedShards, fuse, load_into  # noqa: F401


def safetensors_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
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
    for f in safetensors_files(model_dir):
        with safe_open(str(f), framework="pt") as fh:
            for name in fh.keys():
                yield name, fh.get_tensor(name)
