"""Checkpoint reading: safetensors files (single or sharded with an index) and name mapping."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

# Fused-shard loading lives on the layer shelf; these names stay importable from here.
from pagefold.layers.linear import FusedShards, fuse, load_into  # noqa: F401
from pagefold.ops.attention.kv_quant import KVScales, is_fp8


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


_SCALE_RE = re.compile(r"(?:^|\.)layers\.(\d+)\.self_attn\.(?:attn\.)?([kv])_scale$")


def apply_checkpoint_kv_scales(model_dir: Path, cache) -> int:
    """Take FP8 K/V scales a checkpoint provides (vLLM's convention: ``...layers.N.self_attn
    .k_scale`` / ``v_scale``, a scalar or one per KV head) for the cache's FP8 layers named
    ``layers.N``; no shift. Returns how many layers got them; the others calibrate."""
    found: dict[str, dict[str, torch.Tensor]] = {}
    for f in safetensors_files(model_dir):
        with safe_open(str(f), framework="pt") as fh:
            for name in fh.keys():
                m = _SCALE_RE.search(name)
                if m:
                    found.setdefault(f"layers.{m.group(1)}", {})[m.group(2)] = \
                        fh.get_tensor(name).float().reshape(-1)
    n = 0
    for layer, kv in found.items():
        view = cache.attn.get(layer)
        if view is None or not is_fp8(view.dtype) or set(kv) != {"k", "v"}:
            continue
        heads, dim = view.shape[3], view.shape[4]
        k_s, v_s = (kv[c].expand(heads).clone().to(view.device) for c in ("k", "v"))
        cache.kv_scales[layer] = KVScales(k_s, v_s, torch.zeros(heads, dim, device=view.device),
                                          "checkpoint")
        n += 1
    return n
