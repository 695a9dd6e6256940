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
* :func:`write_eagle_head`: a random EAGLE or EAGLE-3 head folder for a target, in the public
  checkpoints' layout (EAGLE: ``fc.weight``, ``layers.{i}.*`` without the first layer's input
  norm; EAGLE-3: ``midlayer.*``, ``fc.weight``, ``norm.weight``, ``lm_head.weight`` over a
  draft vocabulary, ``d2t`` and ``t2d``), its attention shaped like the target's KV pages.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

__all__ = ["add_mtp_weights", "perturbed_copy", "write_eagle_head"]


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


def _head_geometry(text) -> tuple[int, int, int]:
    """(query heads, KV heads, head_dim) of an EAGLE head whose attention pages have the
    target's page size: the target's own attention shape; for an MLA target (one latent of
    ``kv_lora_rank + qk_rope_head_dim`` per token) one KV head of half that width; for a
    target without attention (pure Mamba) two heads over the hidden size."""
    h = text.hidden_size
    if getattr(text, "kv_lora_rank", None):
        width = text.kv_lora_rank + text.qk_rope_head_dim
        return text.num_attention_heads, 1, width // 2
    heads = getattr(text, "num_attention_heads", None)
    if not heads:
        return 2, 2, h // 2
    kv = getattr(text, "num_key_value_heads", None) or heads
    return heads, kv, getattr(text, "head_dim", None) or h // heads


def write_eagle_head(target_dir: str | Path, dst: str | Path, method: str, *, seed: int = 0,
                     std: float = 0.1, num_layers: int = 1, draft_vocab: int | None = None,
                     aux_layer_ids: list[int] | None = None, intermediate_size: int | None = None,
                     tensors: dict[str, torch.Tensor] | None = None) -> Path:
    """Write a random ``method`` ("eagle" / "eagle3") head for the model at ``target_dir``
    into ``dst`` (see the module docstring). Its attention pages have the target's page size
    (:func:`_head_geometry`); ``draft_vocab`` (EAGLE-3): a draft vocabulary of that
    many target ids (a seeded random subset, ``d2t`` / ``t2d`` written); ``aux_layer_ids``:
    the config's ``eagle_aux_hidden_state_layer_ids``; ``intermediate_size``: the MLP's
    width (default twice the hidden size); ``tensors`` replace the random ones
    (same names)."""
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(str(target_dir))
    text = getattr(cfg, "text_config", None) or cfg
    h, vocab = text.hidden_size, text.vocab_size
    heads, kv, d = _head_geometry(text)
    inter = intermediate_size or 2 * h
    g = torch.Generator().manual_seed(seed)

    def rand(*shape: int) -> torch.Tensor:
        return (std * torch.randn(*shape, generator=g)).contiguous()

    def norm() -> torch.Tensor:
        return (1.0 + rand(h)).contiguous()

    def layer(prefix: str, attn_in: int, input_norm: bool) -> dict[str, torch.Tensor]:
        out = {f"{prefix}.self_attn.q_proj.weight": rand(heads * d, attn_in),
               f"{prefix}.self_attn.k_proj.weight": rand(kv * d, attn_in),
               f"{prefix}.self_attn.v_proj.weight": rand(kv * d, attn_in),
               f"{prefix}.self_attn.o_proj.weight": rand(h, heads * d),
               f"{prefix}.mlp.gate_proj.weight": rand(inter, h),
               f"{prefix}.mlp.up_proj.weight": rand(inter, h),
               f"{prefix}.mlp.down_proj.weight": rand(h, inter),
               f"{prefix}.post_attention_layernorm.weight": norm()}
        if input_norm:
            out[f"{prefix}.input_layernorm.weight"] = norm()
        return out

    config = {"model_type": "llama", "hidden_size": h, "intermediate_size": inter,
              "num_attention_heads": heads, "num_key_value_heads": kv, "head_dim": d,
              "rms_norm_eps": 1e-5, "vocab_size": vocab, "hidden_act": "silu",
              "max_position_embeddings": 4096, "rope_theta": 10000.0,
              "tie_word_embeddings": False, "torch_dtype": "float32"}
    w: dict[str, torch.Tensor] = {}
    if method == "eagle":
        config |= {"architectures": ["EagleLlamaForCausalLM"], "num_hidden_layers": num_layers}
        w["fc.weight"] = rand(h, 2 * h)
        for i in range(num_layers):
            w |= layer(f"layers.{i}", h, input_norm=i > 0)
    elif method == "eagle3":
        dv = draft_vocab or vocab
        config |= {"architectures": ["LlamaForCausalLMEagle3"], "num_hidden_layers": 1,
                   "draft_vocab_size": dv}
        if aux_layer_ids is not None:
            config["eagle_aux_hidden_state_layer_ids"] = list(aux_layer_ids)
        w |= layer("midlayer", 2 * h, input_norm=True)
        w["midlayer.hidden_norm.weight"] = norm()
        w["fc.weight"] = rand(h, 3 * h)
        w["norm.weight"] = norm()
        w["lm_head.weight"] = rand(dv, h)
        ids = torch.randperm(vocab, generator=g)[:dv].sort().values
        w["d2t"] = (ids - torch.arange(dv)).to(torch.int64)
        t2d = torch.zeros(vocab, dtype=torch.bool)
        t2d[ids] = True
        w["t2d"] = t2d
    else:
        raise ValueError(f"unknown EAGLE method {method!r}")
    w |= tensors or {}
    dst = Path(dst)
    dst.mkdir(parents=True, exist_ok=True)
    (dst / "config.json").write_text(json.dumps(config, indent=2))
    save_file({k: v.contiguous() for k, v in w.items()}, str(dst / "model.safetensors"),
              metadata={"format": "pt"})
    return dst
