"""Tiny models for speculative-decoding tests: draft models derived from a target, and
multi-token-prediction (``mtp.*``) weights written into a checkpoint.

* :func:`perturbed_copy`: the target's weights plus Gaussian noise (``noise`` times each
  tensor's standard deviation). ``noise=0`` is an exact copy: a draft that agrees with the
  target on every greedy token unless its caches are wrong, so a test can demand (almost)
  full acceptance; a small ``noise`` gives partial acceptance (every accepted length occurs).
* :func:`add_mtp_weights`: random ``mtp.*`` tensors in the published Qwen3.5 / Qwen3-Next
  layout (``fc``, ``pre_fc_norm_embedding``, ``pre_fc_norm_hidden``, ``norm``, and
  ``layers.{i}.*`` of one full-attention decoder layer each) plus ``mtp_num_hidden_layers``
  in ``config.json``. transformers ignores these tensors (``_keys_to_ignore_on_load_unexpected``).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

__all__ = ["add_mtp_weights", "perturbed_copy"]


def _single_file(model_dir: Path) -> Path:
    f = model_dir / "model.safetensors"
    if not f.is_file():
        raise ValueError(f"{model_dir}: expected one model.safetensors (build unsharded)")
    return f


def perturbed_copy(src: str | Path, dst: str | Path, noise: float, seed: int = 0) -> Path:
    """Copy the model folder ``src`` to ``dst`` with noisy weights (see the module doc)."""
    src, dst = Path(src), Path(dst)
    if dst.exists():
        shutil.rmtree(dst)
    shutil.copytree(src, dst)
    tensors = load_file(str(_single_file(src)))
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, t in sorted(tensors.items()):
        if noise and t.is_floating_point() and t.numel() > 1:
            std = float(t.float().std()) or 1.0
            t = t + noise * std * torch.randn(t.shape, generator=g, dtype=torch.float32).to(
                t.dtype)
        out[name] = t.contiguous()
    save_file(out, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


def add_mtp_weights(model_dir: str | Path, num_layers: int = 1, seed: int = 0,
                    std: float = 0.1) -> Path:
    """Add random ``mtp.*`` tensors for a tiny Qwen3.5 or Qwen3-Next model in place (the MTP
    layer's MLP as the config makes the layer after the last one: Qwen3-Next's is MoE,
    written with stacked experts as transformers holds them)."""
    from transformers import AutoConfig
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5DecoderLayer
    from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextDecoderLayer

    model_dir = Path(model_dir)
    cfg_path = model_dir / "config.json"
    raw = json.loads(cfg_path.read_text())
    cfg = AutoConfig.from_pretrained(str(model_dir))
    text = getattr(cfg, "text_config", None) or cfg
    h = text.hidden_size
    n = text.num_hidden_layers
    text.layer_types = list(text.layer_types[:n]) + ["full_attention"] * num_layers
    g = torch.Generator().manual_seed(seed)
    tensors = load_file(str(_single_file(model_dir)))

    def rand(*shape: int) -> torch.Tensor:
        return (std * torch.randn(*shape, generator=g)).contiguous()

    for i in range(num_layers):
        cls = Qwen3NextDecoderLayer if text.model_type == "qwen3_next" else Qwen3_5DecoderLayer
        layer = cls(text, n + i)
        for name, p in layer.state_dict().items():
            tensors[f"mtp.layers.{i}.{name}"] = rand(*p.shape)
    tensors["mtp.fc.weight"] = rand(h, 2 * h)
    for norm in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
        tensors[f"mtp.{norm}.weight"] = rand(h)
    save_file(tensors, str(model_dir / "model.safetensors"), metadata={"format": "pt"})
    target = raw.get("text_config", raw)
    target["mtp_num_hidden_layers"] = num_layers
    cfg_path.write_text(json.dumps(raw, indent=2))
    return model_dir
